"""runtime/rankexit.py: a rank ends as `sys.exit` would for everything another process can see (its status, the
threads that are not daemons joined, the atexit handlers run, the standard streams flushed), and without the
interpreter's teardown of its own memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROGRAM = textwrap.dedent("""
    import atexit, sys, threading
    from pathlib import Path
    from rkit.runtime.rankexit import exit_without_teardown

    out = Path(sys.argv[1])
    release = threading.Event()

    def worker():  # not a daemon: the interpreter joins it before the atexit handlers
        release.wait()
        (out / "thread").write_text("joined")

    threading.Thread(target=worker).start()
    threading._register_atexit(release.set)  # as concurrent.futures tells its workers to end
    atexit.register(lambda: (out / "atexit").write_text((out / "thread").read_text()))

    class Torn:  # collected only by the interpreter's teardown
        def __del__(self):
            (out / "teardown").write_text("ran")

    kept = Torn()
    sys.stdout.write("buffered, not flushed")
    exit_without_teardown({code})
""")


@pytest.mark.parametrize(("code", "status", "said"), [(None, 0, ""), (3, 3, ""), ("'stopped: why'", 1, "stopped: why")])
def test_a_rank_ends_with_its_status_threads_and_handlers_and_no_teardown(tmp_path: Path, code: str | int | None,
                                                                          status: int, said: str):
    done = subprocess.run([sys.executable, "-c", PROGRAM.format(code=code), str(tmp_path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == status, done.stderr
    assert done.stdout == "buffered, not flushed"
    assert said in done.stderr
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "atexit").read_text() == "joined"  # after the thread, as the interpreter orders them
    assert not (tmp_path / "teardown").exists()  # the teardown is what it skips
    # the same program ended by sys.exit tears down: the difference is only that
    plain = PROGRAM.replace("exit_without_teardown({code})", "sys.exit({code})").format(code=code)
    (tmp_path / "thread").unlink()
    done = subprocess.run([sys.executable, "-c", plain, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == status and done.stdout == "buffered, not flushed"
    assert (tmp_path / "teardown").read_text() == "ran"
