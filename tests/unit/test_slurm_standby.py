"""The Slurm standby steps' protocol (backends/slurm/standby.py: one step per healthy node, the spares too) against
a stand-in srun: a real process whose "tasks" connect back with the token as rkit.runtime.standby's
do. The real steps on
the test bed: test_slurm.py and test_slurm_liveness.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from rkit.backends.slurm.launcher import StepRequest
from rkit.backends.slurm.standby import MAX_DEATHS, SlurmStandbyPool, shape, standby_argv
from rkit.contract.rundir import RunDir

# Each task connects with the token (FAKE=die: the step dies at once; FAKE=one: on c2 one task never does), waits
# for the order and writes it to order-<task>.json beside its step's logs.
FAKE_SRUN = """#!{python}
import json, os, socket, sys, threading
from rkit.runtime import standby
if os.environ.get("FAKE") == "die":
    sys.exit(1)
host, _, port = os.environ["RKIT_STANDBY_ADDRESS"].rpartition(":")
token = os.environ["RKIT_STANDBY_TOKEN"]
out = os.path.dirname(next(a for a in sys.argv if a.startswith("--output="))[len("--output="):])
def task(t):
    with socket.create_connection((host, int(port))) as conn:
        said = conn.makefile("rb").readline()
        conn.sendall(standby.hello_line(token, said.split()[1].decode(), t, 1000 + t, 1.5, f"n{{t}}"))
        line = conn.makefile("rb").readline()
    order = standby.check_order(token, f"n{{t}}", line) if line else None
    if order is not None:
        open(os.path.join(out, f"order-{{t}}.json"), "w").write(json.dumps(order))
node = next(a for a in sys.argv if a.startswith("--nodelist="))[len("--nodelist="):]
ntasks = int(next(a for a in sys.argv if a.startswith("--ntasks="))[len("--ntasks="):])
tasks = [threading.Thread(target=task, args=(t,))
         for t in range(ntasks - 1 if os.environ.get("FAKE") == "one" and node == "c2" else ntasks)]
[t.start() for t in tasks]
[t.join() for t in tasks]
"""


def request(tmp_path: Path, attempt: int, nodes=("c1", "c2"), fake: str = "", **env: str) -> StepRequest:
    srun = tmp_path / "srun"
    if not srun.exists():
        srun.write_text(FAKE_SRUN.format(python=sys.executable))
        srun.chmod(0o755)
    attempt_dir = RunDir(tmp_path).attempt_dir(attempt)
    argv = [str(srun), "--kill-on-bad-exit=1", f"--nodes={len(nodes)}", f"--ntasks={2 * len(nodes)}",
            "--ntasks-per-node=2", f"--nodelist={','.join(nodes)}",
            f"--output={attempt_dir / 'rank-%t.log'}", f"--job-name=attempt-{attempt}", "/opt/venv/bin/python",
            "-m", "rkit.runtime.agent", "steps=40", f"run_name=a{attempt}"]
    env = {"RKIT_RUN_DIR": str(tmp_path), "RKIT_ATTEMPT": str(attempt), "FAKE": fake,
           "RKIT_COORDINATOR": f"c1:{2000 + attempt}", "HF_HOME": "/h", **env}
    return StepRequest(attempt=attempt, argv=argv, nodes=list(nodes), log=attempt_dir / "srun.log", cwd=tmp_path,
                       processes=2 * len(nodes), env=env)


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
    def cancel(steps: dict[str, subprocess.Popen]) -> None:
        for name, proc in steps.items():
            calls.append(name)
            proc.kill()
            proc.wait()
    return cancel


def make_pool(calls: list[str], healthy: list[str]) -> SlurmStandbyPool:
    return SlurmStandbyPool(cancelled(calls), "127.0.0.1", lambda: list(healthy), tasks_per_node=2)


def orders(tmp_path: Path, k: int) -> dict[int, dict]:
    out = tmp_path / "standby" / f"step-{k}"
    return {t: json.loads((out / f"order-{t}.json").read_text()) for t in (0, 1)}


def test_a_standby_step_is_the_attempt_on_one_node_and_its_shape_leaves_placement_out(tmp_path: Path):
    req = request(tmp_path, 1)
    argv = standby_argv(req.argv, tmp_path / "standby" / "step-3", "standby-3", "c3", 2)
    assert argv[1] == "--overlap" and argv[-3:] == ["/opt/venv/bin/python", "-m", "rkit.runtime.standby"]
    assert f"--output={tmp_path / 'standby' / 'step-3' / 'rank-%t.log'}" in argv and "--job-name=standby-3" in argv
    assert {"--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--nodelist=c3"} <= set(argv)
    assert "steps=40" not in argv and "--kill-on-bad-exit=1" in argv
    # What changes with every attempt, and where it runs, leave the shape alone; the rest of the environment not.
    assert shape(req.argv, req.env) == shape(request(tmp_path, 2, nodes=("c1", "c3")).argv,
                                             request(tmp_path, 2).env)
    changed = request(tmp_path, 2, HF_HOME="/elsewhere")
    assert shape(req.argv, req.env) != shape(changed.argv, changed.env)


def test_the_spare_is_warm_too_and_an_attempt_on_it_gets_each_tasks_rank(tmp_path: Path):
    calls: list[str] = []
    healthy = ["c1", "c2", "c3"]
    pool = make_pool(calls, healthy)
    first = request(tmp_path, 1, RKIT_INJECT="[{}]")
    pool.remember(first)
    pool.fill()
    # A stranger's connection (no token) is closed and never counts as a task.
    stranger = socket.create_connection(("127.0.0.1", pool.listener.getsockname()[1]))
    stranger.sendall(b"hello 0 1 1\n")
    seen: list[dict] = []
    while len([n for n in seen if n["what"] == "ready"]) < 3:
        seen += pool_until(pool, "ready")
    assert sorted(n["nodes"][0] for n in seen if n["what"] == "started") == ["c1", "c2", "c3"]
    healthy.remove("c2")  # c2 died: the next attempt runs on c1 and the spare c3
    second = request(tmp_path, 2, nodes=("c1", "c3"))
    steps = pool.take(second)
    assert steps is not None and [s.node for s in steps] == ["c1", "c3"] and list(pool.steps) == ["c2"]
    stranger.settimeout(30)
    said = stranger.makefile("rb").read()  # the challenge, then the pool closed it
    assert said.startswith(b"rkit-sb2 ") and said.count(b"\n") == 1
    pool.hand_over(steps, second, second.log.parent)
    assert all(step.proc.wait(timeout=30) == 0 for step in steps) and not calls
    k = {step.node: int(step.name.split("-")[1]) for step in steps}
    for index, node in enumerate(("c1", "c3")):
        for task, order in orders(tmp_path, k[node]).items():
            assert order["env"]["RKIT_RANK"] == str(2 * index + task) and order["env"]["RKIT_NODE_INDEX"] == str(index)
            assert order["argv"] == ["steps=40", "run_name=a2"] and order["attempt_dir"] == str(second.log.parent)
            assert order["env"]["RKIT_ATTEMPT"] == "2" and order["env"]["RKIT_COORDINATOR"] == "c1:2002"
            assert order["env"]["RKIT_INJECT"] is None  # attempt 1's injection is unset, not inherited
            assert "HF_HOME" not in order["env"]  # the rest the step already has from srun
    assert [n["what"] for n in pool.check()] == ["taken", "taken"]
    pool.fill()  # c2 is not healthy: its step goes; c1 and c3 get new ones
    notes = pool.check()
    assert notes[0]["what"] == "discarded" and notes[0]["node"] == "c2"
    assert notes[0]["reason"] == "its node left the healthy nodes"
    assert sorted(n["nodes"][0] for n in notes if n["what"] == "started") == ["c1", "c3"]
    pool.dismiss()


def test_a_later_jobs_standby_steps_never_share_an_earlier_jobs_folder_and_srun_log(tmp_path: Path):
    """The fault campaign (seed 2): each job's supervisor numbered its standby steps from 1 again, so a requeued job's
    step wrote on into an earlier job's srun log; its attempt read the earlier step's lines ("task 0: Killed", a
    node's loss) as its own, and a rank's exit 85 became a node failure on a healthy node."""
    calls: list[str] = []
    steps_dirs = []
    for job in (1, 2):  # one supervisor per job of the run
        pool = make_pool(calls, ["c1", "c2"])
        pool.remember(request(tmp_path, job))
        pool.fill()
        seen = pool_until(pool, "started")
        steps_dirs.append({n["step"] for n in seen if n["what"] == "started"})
        pool.dismiss()
    assert len(steps_dirs[0]) == len(steps_dirs[1]) == 2 and not steps_dirs[0] & steps_dirs[1], steps_dirs
    logs = sorted((tmp_path / "standby").glob("step-*/" + RunDir.launcher_log_name))
    assert len(logs) == 4


def test_a_standby_step_not_ready_or_of_another_environment_is_cancelled_and_the_attempt_starts_cold(tmp_path):
    calls: list[str] = []
    pool = make_pool(calls, ["c1", "c2"])
    pool.remember(request(tmp_path, 1, fake="one"))  # on c2 one task never gets ready
    pool.fill()
    pool_until(pool, "ready")
    assert pool.take(request(tmp_path, 2, fake="one")) is None
    assert calls == ["standby-2"] and list(pool.steps) == ["c1"]  # the ready one waits for the next attempt
    assert pool.check()[-1] == {"what": "discarded", "step": "standby-2", "node": "c2", "reason": "not ready"}
    assert pool.take(request(tmp_path, 3, fake="one", HF_HOME="/elsewhere", nodes=("c1",))) is None
    assert calls == ["standby-2", "standby-1"] and pool.steps == {}
    assert pool.check()[-1]["reason"] == "another environment (the attempt starts cold)"
    pool.dismiss()


def test_a_standby_step_that_dies_is_replaced_and_after_three_in_a_row_standbys_stop(tmp_path: Path):
    pool = make_pool([], ["c1"])
    pool.remember(request(tmp_path, 1, fake="die", nodes=("c1",)))
    pool.fill()
    notes = pool_until(pool, "off")
    assert [n["what"] for n in notes] == ["started", "died", "replaced", "died", "replaced", "died", "off"]
    assert f"{MAX_DEATHS} standby steps died in a row" in notes[-1]["reason"]
    pool.fill()
    assert pool.steps == {} and pool.check() == []  # no more standby steps for this job
    assert pool.take(request(tmp_path, 2, nodes=("c1",))) is None
    pool.dismiss()


def test_a_flood_of_idle_slow_and_forged_connections_never_stalls_the_watch_loop(tmp_path: Path):
    """The listener never waits on a peer: 100 idle connections, a slow one, forged and replayed hellos cost each
    pass a few non-blocking calls, and the real tasks still get ready."""
    from rkit.backends.slurm import standby as slurm_standby
    from rkit.runtime import standby as protocol

    pool = make_pool([], ["c1"])
    now = [0.0]
    pool.clock = lambda: now[0]
    port = pool._listen().getsockname()[1]
    passes: list[float] = []

    def timed_check() -> list[dict]:
        started = time.perf_counter()
        notes = pool.check()
        passes.append(time.perf_counter() - started)
        return notes

    idle = []
    for _ in range(5):  # 100 idle connections, 20 at a time (beyond the listen backlog a connect would wait)
        idle += [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(20)]
        timed_check()
    slow = socket.create_connection(("127.0.0.1", port), timeout=30)
    forged = socket.create_connection(("127.0.0.1", port), timeout=30)
    timed_check()
    assert len(pool.pending) == slurm_standby.MAX_PENDING  # the oldest went first
    challenge = forged.makefile("rb").readline().split()[1].decode()
    forged.sendall(protocol.hello_line("not-the-token", challenge, 0, 1, 1.0, "n"))
    pool.remember(request(tmp_path, 1, nodes=("c1",)))
    pool.fill()
    seen: list[dict] = []
    deadline = time.monotonic() + 60
    while not any(n["what"] == "ready" for n in seen) and time.monotonic() < deadline:
        try:
            slow.send(b"x")  # a byte a pass, never a line: closed after protocol.MAX_LINE bytes
        except OSError:
            pass
        seen += timed_check()
    assert any(n["what"] == "ready" for n in seen), seen
    step = pool.steps["c1"]
    assert sorted(step.conns) == [0, 1] and step.pids == {0: 1000, 1: 1001}
    forged.settimeout(30)
    assert forged.recv(10) == b""  # a hello under another token is closed
    # Past its deadline (measured in the loop, not waited for) a connection that said no hello is closed.
    now[0] += slurm_standby.HELLO_SECONDS
    timed_check()
    assert pool.pending == []
    passes.sort()
    assert passes[len(passes) // 2] < 0.1 and passes[-1] < 1.0, passes
    for conn in [*idle, slow, forged]:
        conn.close()
    pool.dismiss()


def test_a_standby_task_applies_only_an_order_the_supervisor_made_that_sets_what_changes_per_attempt():
    from rkit.runtime import standby

    order = {"env": {"RKIT_RANK": "3", "RKIT_INJECT": None}, "argv": ["steps=4"], "attempt_dir": "/r/a"}
    line = standby.order_line("tok", "nonce", order)
    assert standby.check_order("tok", "nonce", line) == order
    assert standby.check_order("other", "nonce", line) is None  # not made with the step's token
    assert standby.check_order("tok", "replayed", line) is None  # made for another hello
    assert standby.check_order("tok", "nonce", line.replace(b"steps=4", b"steps=5")) is None
    widened = standby.order_line("tok", "nonce", {**order, "env": {"LD_PRELOAD": "/tmp/x.so"}})
    assert standby.check_order("tok", "nonce", widened) is None  # only what changes with every attempt
    hello = standby.hello_line("tok", "c1", 2, 77, 1.25, "n")
    assert standby.check_hello(["x", "tok"], "c1", hello.strip()) == ("tok", 2, 77, 1.25, "n")
    assert standby.check_hello(["tok"], "c2", hello.strip()) is None  # a replay under another challenge
    assert standby.check_hello(["tok"], "c1", b"tok 0 1 1.0") is None  # the old line: the token in clear


def test_many_steps_are_cancelled_with_one_squeue_and_one_scancel_per_256(tmp_path, monkeypatch):
    """issue 40: a 512-node job's standbys dismissed within the requeue's signal lead: not a squeue and an scancel
    each."""
    from rkit.backends.slurm import launcher

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    names = [f"standby-{k}" for k in range(600)]
    (bin_dir / "squeue").write_text("#!/bin/sh\necho squeue >> " + str(log) + "\n" + "".join(
        f"echo '77.{k + 3}|{n}'\n" for k, n in enumerate(names[:-1])))  # the last is not listed yet
    (bin_dir / "scancel").write_text(f"#!/bin/sh\necho scancel $# >> {log}\n")
    for tool in ("squeue", "scancel"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    unlisted = subprocess.Popen(["sleep", "60"], start_new_session=True)
    procs = {n: unlisted for n in names}
    launcher.SlurmStepBackend._cancel_steps(procs)
    assert log.read_text().split("\n")[:-1] == ["squeue", "scancel 256", "scancel 256", "scancel 87"]
    assert unlisted.wait(timeout=10) == -9  # not listed by squeue: its srun's process group was killed
