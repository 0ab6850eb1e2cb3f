"""Shared fixtures: the CLI as a subprocess, the gate for tests that need the real training stack, and small
helpers (a free port, waiting for a condition)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny-cpu.yaml"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing_test_bed(message: str) -> None:
    """Integration tests skip with a reason on a laptop without a part of the test bed, and fail in CI (CI=true)."""
    if in_ci():
        pytest.fail(f"CI=true and the test bed is missing: {message}")
    pytest.skip(message)


def require_maxtext() -> None:
    if importlib.util.find_spec("maxtext") is None or importlib.util.find_spec("jax") is None:
        missing_test_bed("MaxText/JAX are not installed in this Python; run `make test` (it installs the CPU stack)")


def require_program(name: str, env_var: str, installer: str) -> str:
    """The path of a real program of the test bed (`env_var` may name another); make test installs it as root."""
    found = shutil.which(os.environ.get(env_var, name))
    if not found:
        missing_test_bed(f"{name} is not installed; run `sudo {installer}` (make test does it as root)")
    return found


def require_apptainer() -> str:
    return require_program("apptainer", "RKIT_APPTAINER", "ci/install-apptainer.sh")


def require_prometheus() -> str:
    return require_program("prometheus", "RKIT_PROMETHEUS", "ci/install-prometheus.sh")


def rkit(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600,
         check: int | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (exit codes, stdout and stderr as a user sees them)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    done = subprocess.run([sys.executable, "-m", "rkit.cli", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    if check is not None and done.returncode != check:
        raise AssertionError(f"rkit {' '.join(args)} exited {done.returncode}, expected {check}\n"
                             f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    return done


@pytest.fixture(scope="session", autouse=True)
def status_cache(tmp_path_factory) -> Path:
    """rkit status keeps its digests (rkit.readers.digest) in a folder of the test session, not in the user's cache;
    the CLI subprocesses inherit it."""
    path = tmp_path_factory.mktemp("status-cache")
    os.environ["RKIT_STATUS_CACHE"] = str(path)
    return path


@pytest.fixture
def cli():
    return rkit


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, timeout: float, what: str, every: float = 0.5, *, alive: subprocess.Popen | None = None,
               log=None):
    """Call `predicate` every `every` s until it returns something true, and return that; AssertionError after
    `timeout` s, or as soon as the process `alive` (if given) has ended. `log`: a callable whose text goes into
    the error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"{what}: the process ended (exit {alive.returncode})\n{log() if log else ''}")
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}" + (f"\n{log()}" if log else ""))


# The image tests use the plain Debian mirror (the one reachable here), not the dated snapshot default.
MIRROR = ["--build-arg", "MIRROR=http://deb.debian.org/debian"]


# make test runs the suite in three pytest-xdist workers where the machine has two cores or more (-n 3 --dist
# loadscope), each taking one group of modules whole, so that each group's session fixtures (the image, the
# cluster, one clean run per recipe) are made once:
# - "slurm": the Slurm test bed's tests, which spend about half their time waiting on Slurm (a 156 s USR1 requeue
#   test kept the machine's 2 cores 58 % busy, a 174 s batch-host crash 44 %), so a third worker fills those
#   waits with the other groups' computing. They need the cpu image, which the image group builds first
#   (cpu_image below: one build, the other worker waits for it);
# - "image": the cpu image's build and what runs in it, the base image's two builds, the report's, Prometheus' and
#   real data's runs, the speed gate's (quiet) runs;
# - "host": MaxText on the host (the fault tests).
# Measured beside a CPU hog in a fresh clone with two workers (image + Slurm in one, 3,400 s; host 3,950 s), the
# Slurm modules' 2,420 s held a worker that was idle half the time. With real data in the Slurm group (quiet, three
# workers) the image group reached its quiet tests 1,420 s in, which then held the Slurm group (half done) back:
# real data went to the image group, whose other work ends first. (xdist's own --dist loadgroup cannot do it under
# pytest 9: it renames items through Item._nodeid, which pytest 9 no longer reads; the scheduler below groups by
# module instead.)
#
# The unit modules are not grouped: each is a scope of its own, which xdist hands to the first worker whose own work
# runs low (it takes a scope once two or fewer of its tests are pending). Beside a CPU hog at 4756822 the static
# split left the host worker done at 2,310 s with the image worker at 3,077 s, which also held two unit modules
# (352 s) that any worker could have run.
XDIST_GROUPS = {
    "slurm": ("test_slurm.py", "test_slurm_liveness.py"),
    "image": ("test_images.py", "test_image_bytes.py", "test_report.py", "test_prometheus.py", "test_real_data.py",
              "test_bench.py"),
}


CPU_IMAGE_BUILDER = "test_images.py"  # its first test's set-up builds the cpu image (the cpu_image fixture)


def module_name(nodeid: str) -> str:
    return nodeid.split("::")[0].rsplit("/", 1)[-1]


def xdist_scope(nodeid: str) -> str:
    """The worker's share a test belongs to: its integration group (XDIST_GROUPS, else "host": MaxText on the host),
    or, for a unit test, its own module (taken by whichever worker runs low first)."""
    path = nodeid.split("::")[0]
    if path.startswith("tests/unit/"):
        return path
    module = module_name(nodeid)
    return next((group for group, modules in XDIST_GROUPS.items() if module in modules), "host")


if importlib.util.find_spec("xdist") is not None:
    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(config, log):
        """--dist loadscope with three scopes (xdist_scope): each worker takes one whole."""
        if config.getvalue("dist") != "loadscope":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class ByGroup(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return xdist_scope(nodeid)

        # In the order collected (the groups first), not xdist's default of the scopes with most tests first, which
        # handed a worker the unit modules' hundreds of cases and left the Slurm group for whoever ran low.
        config.option.loadscopereorder = False
        return ByGroup(config, log)


# The tests that measure speed (marked `quiet`: the bench gate's) must not share the machine's cores with the
# other xdist workers' image builds and training: a burst of that load during one side's rounds makes an identical
# candidate "slower". Each test holds a lock on the whole of its protocol (setup, call, teardown, so the session
# fixtures built in its setup too): shared for every test, exclusive for a quiet one, which therefore starts when
# the other workers' current tests end and keeps the other workers waiting until it is done. A turnstile taken
# before either gives the quiet test priority over the other workers' next tests.
LOCKS = "RKIT_TEST_LOCKS"  # the folder of the lock files: made by the controller, inherited by the workers


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist), before any worker starts
        os.environ[LOCKS] = tempfile.mkdtemp(prefix="rkit-test-locks-")


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and os.environ.get(LOCKS):
        shutil.rmtree(os.environ.pop(LOCKS), ignore_errors=True)


def _lock_path(name: str) -> Path:
    return Path(os.environ[LOCKS]) / name


def _cpu_busy() -> float:
    """The machine's busy CPU seconds so far (/proc/stat; every process, the test bed's nodes too)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _timeline(item, started: float, busy: float) -> None:
    """RKIT_TEST_TIMELINE=FILE: one JSON line per test (worker, start, end, the machine's busy CPU seconds
    meanwhile), for the suite's budget (which tests wait, which compute, which overlap)."""
    path = os.environ.get("RKIT_TEST_TIMELINE")
    if not path:
        return
    import json

    line = {"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "start": started,
            "end": time.time(), "busy_cpu": round(_cpu_busy() - busy, 1)}
    with open(path, "a") as out:
        out.write(json.dumps(line) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started, busy = time.time(), _cpu_busy()
    try:
        yield from _locked(item)
    finally:
        _timeline(item, started, busy)


def _locked(item):
    import fcntl

    quiet = item.get_closest_marker("quiet") is not None
    with open(_lock_path("turnstile"), "a") as turnstile, open(_lock_path("room"), "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(room, fcntl.LOCK_EX if quiet else fcntl.LOCK_SH)
        finally:
            if not quiet:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)
            if quiet:
                fcntl.flock(turnstile, fcntl.LOCK_UN)


def pytest_collection_modifyitems(config, items):
    """verify_image tests (a second full cpu image build, 4-40 minutes) run only when asked for by -m. The module
    whose first test builds the cpu image runs first in its group, so that the Slurm group (which needs that image)
    waits for the least (measured with the base image's two builds first: the cpu image was there 986 s into the
    suite, its build alone took 515 s). The modules that hold a `quiet` test run last (in their order): by then
    the other workers are in their shorter tests, not in the image build, so the quiet test waits for little, and
    its module's fixtures stay together."""
    quiet_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("quiet") is not None}

    def order(item) -> tuple[bool, bool]:
        return item.nodeid.split("::")[0] in quiet_modules, module_name(item.nodeid) != CPU_IMAGE_BUILDER

    items.sort(key=order)  # stable: the order otherwise kept
    if "verify_image" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("verify_image") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


@contextlib.contextmanager
def image_build_lock():
    """Held while a test builds an image the other xdist workers use too (the cpu image, the one without rkit):
    the first worker builds it, the others wait and then find it in the cache. (rkit's own image cache does not
    lock: two concurrent builds of one key both build, and the last one's file stays.)"""
    import fcntl

    with open(_lock_path("image-build"), "a") as lock:  # closing the file releases the lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def cpu_image() -> Path:
    """The cpu image, built once per test session from containers/cpu.def (then cached by key)."""
    require_apptainer()
    with image_build_lock():
        done = rkit("image", "build", "cpu", *MIRROR, timeout=3600, check=0)
    return Path(done.stdout.strip().splitlines()[-1])


# An image with Python, JAX and MaxText but without rkit (as AMD's and NVIDIA's MaxText images are): the cpu image
# with rkit removed, so the same lock. Built once per cpu image (cached beside it; the test bed's nodes see it).
WITHOUT_RKIT = """Bootstrap: localimage
From: {base}

%post
    rm -rf /opt/venv/lib/python3*/site-packages/rkit /opt/venv/lib/python3*/site-packages/rkit-*.dist-info \\
        /opt/venv/bin/rkit /etc/rkit
    ! /opt/venv/bin/python -c 'import rkit' 2>/dev/null

%runscript
    exec /opt/venv/bin/python "$@"
"""


@pytest.fixture(scope="session")
def image_without_rkit(cpu_image: Path) -> Path:
    from rkit.images.store import sha256_file

    target = cpu_image.parent / f"test-without-rkit-{sha256_file(cpu_image).split(':')[1][:16]}.sif"
    with image_build_lock():
        if not target.is_file():
            _build_without_rkit(cpu_image, target)
    return target


def _build_without_rkit(cpu_image: Path, target: Path) -> None:
    from rkit.images.store import apptainer

    with tempfile.TemporaryDirectory(prefix="rkit-test-image-", dir=cpu_image.parent) as tmp:
        definition = Path(tmp) / "without-rkit.def"
        definition.write_text(WITHOUT_RKIT.format(base=cpu_image))
        partial = Path(tmp) / "image.sif"
        # lz4: a 50 s build instead of 5 min of gzip (the test image is larger, and never leaves this machine)
        done = subprocess.run([apptainer(), "build", "--fakeroot", "--force", "--mksquashfs-args", "-comp lz4",
                               str(partial), str(definition)], capture_output=True, text=True,
                              timeout=1800, check=False)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        os.replace(partial, target)


# The suite's budget (issue 41): `make test` on a fresh clone within 30 minutes on 2 cores. The summary at the end
# gives the tests' wall time, each xdist worker's share and the ten slowest tests (set-up, call and tear-down
# together), and names every test over SLOW_TEST_SECONDS whose docstring gives no reason for its time (a line
# starting with "Budget:"). It reports; it never fails a test on a duration (the machines are shared and noisy).
SUITE_BUDGET_SECONDS = 1800
SLOW_TEST_SECONDS = float(os.environ.get("RKIT_SLOW_TEST_SECONDS", "150"))
_budget: dict[str, object] = {"start": time.time(), "tests": {}}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "setup":
        doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
        reason = any(line.strip().startswith("Budget:") for line in doc.splitlines())
        outcome.get_result().user_properties.append(("budget_reason", reason))


def pytest_runtest_logreport(report):
    tests: dict = _budget["tests"]  # type: ignore[assignment]
    seen = tests.setdefault(report.nodeid, {"seconds": 0.0, "worker": "main", "reason": True})
    seen["seconds"] += report.duration
    node = getattr(report, "node", None)  # xdist: the worker that ran it
    seen["worker"] = getattr(getattr(node, "gateway", None), "id", seen["worker"])
    for key, value in report.user_properties:
        if key == "budget_reason":
            seen["reason"] = value


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):
        return
    tests: dict = _budget["tests"]  # type: ignore[assignment]
    if not tests:
        return
    wall = time.time() - float(_budget["start"])  # type: ignore[arg-type]
    workers: dict[str, float] = {}
    for seen in tests.values():
        workers[seen["worker"]] = workers.get(seen["worker"], 0.0) + seen["seconds"]
    write = terminalreporter.write_line
    terminalreporter.section("the suite's budget")
    write(f"tests' wall time {wall:.0f} s (the suite's budget: {SUITE_BUDGET_SECONDS} s with set-up, on 2 cores); "
          + ", ".join(f"{w} {s:.0f} s" for w, s in sorted(workers.items())))
    write("the ten slowest (set-up + call + tear-down):")
    for nodeid, seen in sorted(tests.items(), key=lambda kv: -kv[1]["seconds"])[:10]:
        write(f"  {seen['seconds']:7.1f} s  {seen['worker']:4}  {nodeid}")
    unexplained = [(n, s) for n, s in tests.items() if s["seconds"] > SLOW_TEST_SECONDS and not s["reason"]]
    if unexplained:
        write(f"over {SLOW_TEST_SECONDS:.0f} s without a 'Budget:' line in the docstring saying why:", yellow=True)
        for nodeid, seen in sorted(unexplained, key=lambda kv: -kv[1]["seconds"]):
            write(f"  {seen['seconds']:7.1f} s  {nodeid}", yellow=True)
