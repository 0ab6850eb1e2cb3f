"""The Slurm standby step's protocol (backends/slurm_standby.py) against a stand-in srun: a real process whose
"tasks" connect back with the token as rkit.standby's do. The real step on the test bed: test_slurm.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from rkit.backends.slurm import StepRequest
from rkit.backends.slurm_standby import MAX_DEATHS, SlurmStandbyPool, shape, standby_argv
from rkit.rundir import RunDir

# Two tasks connect with the token (FAKE=die: the step dies at once; FAKE=one: only task 0 connects), wait for
# the order and write it to order-<task>.json beside their logs.
FAKE_SRUN = """#!{python}
import json, os, socket, sys, threading
if os.environ.get("FAKE") == "die":
    sys.exit(1)
host, _, port = os.environ["RKIT_STANDBY_ADDRESS"].rpartition(":")
out = os.path.dirname(next(a for a in sys.argv if a.startswith("--output="))[len("--output="):])
def task(t):
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(f"{{os.environ['RKIT_STANDBY_TOKEN']}} {{t}} {{1000 + t}} 1.5\\n".encode())
        line = conn.makefile("rb").readline()
    if line:
        open(os.path.join(out, f"order-{{t}}.json"), "wb").write(line)
tasks = [threading.Thread(target=task, args=(t,)) for t in range(1 if os.environ.get("FAKE") == "one" else 2)]
[t.start() for t in tasks]
[t.join() for t in tasks]
"""


def request(tmp_path: Path, attempt: int, nodes=("c1", "c2"), fake: str = "", **env: str) -> StepRequest:
    srun = tmp_path / "srun"
    if not srun.exists():
        srun.write_text(FAKE_SRUN.format(python=sys.executable))
        srun.chmod(0o755)
    attempt_dir = RunDir(tmp_path).attempt_dir(attempt)
    argv = [str(srun), "--kill-on-bad-exit=1", f"--nodelist={','.join(nodes)}",
            f"--output={attempt_dir / 'rank-%t.log'}", f"--job-name=attempt-{attempt}", "/opt/venv/bin/python",
            "-m", "rkit.agent", "steps=40", f"run_name=a{attempt}"]
    return StepRequest(attempt=attempt, argv=argv, nodes=list(nodes), log=attempt_dir / "srun.log", cwd=tmp_path,
                       processes=2, env={"RKIT_RUN_DIR": str(tmp_path), "RKIT_ATTEMPT": str(attempt), "FAKE": fake,
                                         "RKIT_COORDINATOR": f"c1:{2000 + attempt}", "HF_HOME": "/h", **env})


def pool_until(pool: SlurmStandbyPool, what: str, timeout: float = 30) -> list[dict]:
    seen: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen += pool.check()
        if any(n["what"] == what for n in seen):
            return seen
        time.sleep(0.02)
    raise AssertionError(f"no {what!r} note: {seen}")


def cancelled(calls: list[str]):
    def cancel(name: str, proc: subprocess.Popen) -> None:
        calls.append(name)
        proc.kill()
        proc.wait()
    return cancel


def test_the_standby_argv_overlaps_the_attempt_and_runs_the_standby_instead_of_the_agent(tmp_path: Path):
    req = request(tmp_path, 1)
    argv = standby_argv(req.argv, tmp_path / "standby" / "step-3", "standby-3")
    assert argv[1] == "--overlap" and argv[-3:] == ["/opt/venv/bin/python", "-m", "rkit.standby"]
    assert f"--output={tmp_path / 'standby' / 'step-3' / 'rank-%t.log'}" in argv and "--job-name=standby-3" in argv
    assert "steps=40" not in argv and "--kill-on-bad-exit=1" in argv
    # What changes with every attempt leaves the shape alone; nodes and the rest of the environment do not.
    assert shape(req.argv, req.env, req.nodes) == shape(request(tmp_path, 2).argv, request(tmp_path, 2).env,
                                                        req.nodes)
    other = request(tmp_path, 2, nodes=("c1", "c3"))
    assert shape(req.argv, req.env, req.nodes) != shape(other.argv, other.env, other.nodes)
    changed = request(tmp_path, 2, HF_HOME="/elsewhere")
    assert shape(req.argv, req.env, req.nodes) != shape(changed.argv, changed.env, changed.nodes)


def test_a_ready_standby_step_becomes_the_next_attempt_with_its_order(tmp_path: Path):
    calls: list[str] = []
    pool = SlurmStandbyPool(cancelled(calls), "127.0.0.1")
    first = request(tmp_path, 1, RKIT_INJECT="[{}]")
    pool.remember(first)
    pool.fill()
    # A stranger's connection (no token) is closed and never counts as a task.
    stranger = socket.create_connection(("127.0.0.1", pool.listener.getsockname()[1]))
    stranger.sendall(b"hello 0 1 1\n")
    notes = pool_until(pool, "ready")
    assert [n["what"] for n in notes] == ["started", "ready"]
    assert notes[1]["pids"] == {"0": 1000, "1": 1001} and notes[1]["import_seconds"] == 1.5
    second = request(tmp_path, 2)
    step = pool.take(second)
    assert step is not None and pool.step is None
    stranger.settimeout(30)
    assert stranger.recv(10) == b""  # closed by the pool
    pool.hand_over(step, second, second.log.parent)
    assert step.proc.wait(timeout=30) == 0 and not calls
    out = tmp_path / "standby" / "step-1"
    for task in (0, 1):
        order = json.loads((out / f"order-{task}.json").read_text())
        assert order["argv"] == ["steps=40", "run_name=a2"] and order["attempt_dir"] == str(second.log.parent)
        assert order["env"]["RKIT_ATTEMPT"] == "2" and order["env"]["RKIT_COORDINATOR"] == "c1:2002"
        assert order["env"]["RKIT_INJECT"] is None  # attempt 1's injection is unset, not inherited
        assert "HF_HOME" not in order["env"]  # the rest the step already has from srun
    assert pool.check() == [{"what": "taken", "step": "standby-1", "pids": {"0": 1000, "1": 1001}}]
    pool.dismiss()


def test_a_standby_step_on_other_nodes_or_not_ready_is_cancelled_and_the_attempt_starts_cold(tmp_path: Path):
    calls: list[str] = []
    pool = SlurmStandbyPool(cancelled(calls), "127.0.0.1")
    pool.remember(request(tmp_path, 1))
    pool.fill()
    pool_until(pool, "ready")
    assert pool.take(request(tmp_path, 2, nodes=("c1", "c3"))) is None  # a node was replaced by the spare
    assert calls == ["standby-1"]
    assert pool.check()[-1] == {"what": "discarded", "step": "standby-1",
                                "reason": "another environment or other nodes (the attempt starts cold)"}
    pool.remember(request(tmp_path, 2, fake="one"))  # one task never gets ready
    pool.fill()
    assert pool.take(request(tmp_path, 3)) is None and calls == ["standby-1", "standby-2"]
    assert pool.check()[-1]["reason"] == "not ready"
    pool.dismiss()


def test_a_standby_step_that_dies_is_replaced_and_after_three_in_a_row_standbys_stop(tmp_path: Path):
    pool = SlurmStandbyPool(cancelled([]), "127.0.0.1")
    pool.remember(request(tmp_path, 1, fake="die"))
    pool.fill()
    notes = pool_until(pool, "off")
    assert [n["what"] for n in notes] == ["started", "died", "replaced", "died", "replaced", "died", "off"]
    assert f"{MAX_DEATHS} standby steps died in a row" in notes[-1]["reason"]
    pool.fill()
    assert pool.step is None and pool.check() == []  # no more standby steps for this job
    assert pool.take(request(tmp_path, 2)) is None
    pool.dismiss()
