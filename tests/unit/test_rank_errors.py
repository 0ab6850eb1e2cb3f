"""A failed rank's own words (ranklogs.rank_error) and the OOM killer's count in its cgroup (oomkills.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rkit.run import oomkills
from rkit.run.ranklogs import PEER_FAILED, injected_exit, jax_silent_tasks, rank_error


def log(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rank-1.log"
    path.write_text(text)
    return path


def test_the_last_traceback_gives_the_exception_line(tmp_path):
    text = ("I1201 starting\nTraceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n"
            "KeyError: 'old'\n\nTraceback (most recent call last):\n  File \"pyconfig.py\", line 271\n"
            "    raise ValueError(...)\n"
            "ValueError: 'learning_rat' not in 'learning_rate', 'steps'.\nE1201 00:00 client.cc:1] shutdown\n")
    assert rank_error(log(tmp_path, text)) == "ValueError: 'learning_rat' not in 'learning_rate', 'steps'."


def test_a_finaliser_failing_at_shutdown_does_not_hide_the_ranks_own_error(tmp_path):
    # as a rank's log ended when MaxText refused a Grain position saved by 2 processes on 1: its loader's __del__
    # then failed as the interpreter went
    text = ("Traceback (most recent call last):\n  File \"grain_utility.py\", line 267, in for_restore\n"
            "AssertionError: 2 processes found in Grain checkpoint directory /r/10/iter, but only 1 jax processes\n"
            "I1203 21:38:25.566187 6694 service.cc:114] Jax service shutting down\n"
            "Exception ignored in: <function MultiHostDataLoadIterator.__del__ at 0x7f98374ffa60>\n"
            "Traceback (most recent call last):\n  File \"multihost_dataloading.py\", line 262, in __del__\n"
            "ImportError: sys.meta_path is None, Python is likely shutting down\n")
    assert rank_error(log(tmp_path, text)) == ("AssertionError: 2 processes found in Grain checkpoint directory "
                                               "/r/10/iter, but only 1 jax processes")


def test_a_message_on_several_lines_keeps_its_first_lines(tmp_path):
    text = ("Traceback (most recent call last):\n  File \"pyconfig.py\"\n"
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for MaxTextConfig\n"
            "ici_parallelism\n  Input should be a valid list [type=list_type, input_value='abc', input_type=str]\n"
            "    For further information visit https://errors.pydantic.dev/2.11/v/list_type\nI1201 exiting\n")
    assert rank_error(log(tmp_path, text)) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for MaxTextConfig | ici_parallelism | "
        "Input should be a valid list [type=list_type, input_value='abc', input_type=str]")


def test_a_dotted_exception_and_a_runtime_line_without_a_traceback(tmp_path):
    dotted = "Traceback (most recent call last):\n  x\njax.errors.JaxRuntimeError: INTERNAL: boom\n"
    assert rank_error(log(tmp_path, dotted)) == "jax.errors.JaxRuntimeError: INTERNAL: boom"
    fatal = "I1201 fine\nF1201 12:00:00.1 1 pjrt.cc:9] Check failed: buffer != nullptr\nI1201 dying\n"
    assert rank_error(log(tmp_path, fatal)) == "F1201 12:00:00.1 1 pjrt.cc:9] Check failed: buffer != nullptr"
    assert rank_error(log(tmp_path, "I1201 all fine\nstep 3\n")) is None
    assert rank_error(tmp_path / "missing.log") is None


def test_an_injected_fault_is_the_ranks_words_and_a_broken_collective_is_a_peers(tmp_path):
    from rkit.run.ranklogs import PEER_FAILED

    injected = "I1203 completed step: 14\nrkit: injected fault 'exit:rank=0,step=15,code=3' fires at step 15\n"
    said = rank_error(log(tmp_path, injected))
    assert said == "rkit: injected fault 'exit:rank=0,step=15,code=3' fires at step 15" and not PEER_FAILED.search(said)
    gloo = ("Traceback (most recent call last):\n  x\njax.errors.JaxRuntimeError: UNKNOWN: Gloo AllGather failed: "
            "[gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:57546: Connection reset by peer\n")
    assert PEER_FAILED.search(rank_error(log(tmp_path, gloo)))
    for own in ("ValueError: 'learning_rat' not in config", "jax.errors.JaxRuntimeError: INTERNAL: boom",
                "F1201 pjrt.cc:9] Check failed: buffer != nullptr"):
        assert not PEER_FAILED.search(own)


def test_an_abort_after_jaxs_fatal_line_says_the_fatal_line_and_names_the_silent_tasks(tmp_path):
    """LOG(FATAL) then abort(): Python's "Fatal Python error: Aborted" is the consequence, the fatal line before it
    the reason (a peer gone silent: a peer's words); the tasks JAX names are read as ranks."""
    from .test_attempt_loop import JAX_ABORT

    path = log(tmp_path, f"I1207 completed step: 54\n{JAX_ABORT}")
    said = rank_error(path)
    assert said.startswith("F1207 18:30:31.946840      33 client.h:86] Terminating process because the JAX "
                           "distributed service detected fatal errors") and PEER_FAILED.search(said)
    assert jax_silent_tasks(path) == {1}
    # a task name, several of them, and a log that names none
    named = log(tmp_path, "E1207 x] UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n"
                          "/job:jax_worker/replica:0/task:3\n/job:jax_worker/replica:0/task:12\nThe tasks have "
                          "crashed.\nF1207 y] Terminating process\n")
    assert jax_silent_tasks(named) == {3, 12}
    assert jax_silent_tasks(log(tmp_path, "F1207 x] Check failed: a == b\nFatal Python error: Aborted\n")) == set()
    # the coordination service itself (process 0's) left this process's heartbeats unanswered: process 0 is silent
    from .test_attempt_loop import LEADER_ABORT

    assert jax_silent_tasks(log(tmp_path, LEADER_ABORT)) == {0}
    assert PEER_FAILED.search(rank_error(log(tmp_path, LEADER_ABORT)))
    other = LEADER_ABORT.replace("DEADLINE_EXCEEDED: Deadline Exceeded", "INTERNAL: boom")
    assert jax_silent_tasks(log(tmp_path, other)) == set()
    assert rank_error(log(tmp_path, "I1207 x\nFatal Python error: Aborted\n")) == "Fatal Python error: Aborted"
    # Gloo's collectives with a hyphen in their name break the same way (a crashed node's peer, the campaign)
    assert PEER_FAILED.search("ValueError: UNKNOWN: Gloo all-reduce failed: [gloo/transport/tcp/pair.cc:538] Read "
                              "error [127.0.0.1]:4 Connection reset by peer".replace("Connection reset by peer", ""))


def test_credentials_in_the_error_are_masked(tmp_path):
    text = "Traceback (most recent call last):\nOSError: cannot open gs://alice:hunter2@bucket/data\n"
    said = rank_error(log(tmp_path, text))
    assert "hunter2" not in said and said.startswith("OSError: cannot open gs://alice:")


def fake_cgroup(tmp_path: Path, version: int, kills: int, limit: str) -> Path:
    """A memory cgroup tree at tmp_path that holds this process's own cgroup path, as /proc/self/cgroup says."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    memory = next((ln.split(":", 2)[2] for ln in lines if "memory" in ln.split(":", 2)[1].split(",")), None)
    unified = next((ln.split(":", 2)[2] for ln in lines if ln.split(":", 2)[1] == ""), "/")
    if version == 1 and memory is not None:
        cg = tmp_path / "memory" / memory.lstrip("/")
        cg.mkdir(parents=True, exist_ok=True)
        (cg / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n")
        (cg / "memory.limit_in_bytes").write_text(limit)
    else:
        cg = tmp_path / unified.lstrip("/")
        cg.mkdir(parents=True, exist_ok=True)
        (cg / "memory.events").write_text(f"low 0\nhigh 0\nmax 9\noom 2\noom_kill {kills}\n")
        (cg / "memory.max").write_text(limit)
    return cg


def test_oom_kills_since_the_start_are_reported_with_the_limit(tmp_path):
    for version, limit in ((1, str(3 << 29)), (2, str(3 << 29))):
        root = tmp_path / f"v{version}"
        cg = fake_cgroup(root, version, 4, limit)
        assert oomkills.memory_cgroup(os.getpid(), root) == cg
        watch = oomkills.OomWatch({cg: oomkills.oom_kills(cg)})
        assert watch.killed() is None
        fake_cgroup(root, version, 6, limit)
        assert watch.killed() == (f"the kernel's OOM killer killed 2 process(es) in memory cgroup {cg} "
                                  "(memory limit 1.50 GiB)")
    unlimited = fake_cgroup(tmp_path / "max", 2, 0, "max")
    assert oomkills.memory_limit(unlimited) is None


def test_no_memory_controller_says_nothing(tmp_path):
    assert oomkills.memory_cgroup(os.getpid(), tmp_path) is None
    assert oomkills.oom_kills(tmp_path) is None and oomkills.memory_limit(tmp_path) is None
    assert oomkills.OomWatch({}).killed() is None


def test_a_fifo_in_place_of_a_rank_log_says_nothing_and_never_waits(tmp_path):
    from rkit.run.ranklogs import LogScan, last_error_lines

    fifo = tmp_path / "rank-1.log"
    os.mkfifo(fifo)  # no writer: a blocking open would wait forever
    assert rank_error(fifo) is None and last_error_lines(fifo) == []
    assert LogScan([fifo], clock=lambda: 0.0).scan(force=True) == {}


def test_a_ranks_own_word_on_its_restore_is_read_before_its_tracebacks(tmp_path):
    from rkit.run.ranklogs import LogScan

    damaged, broken, plain = (tmp_path / f"rank-{r}.log" for r in range(3))
    damaged.write_text("Traceback (most recent call last):\nValueError: DATA_LOSS: Error reading shard\n"
                       "rkit: Failed to restore step 24 from the local tier (ValueError); this process exits now\n")
    broken.write_text("rkit: the restore of step 24 from the local tier was broken off by JaxRuntimeError: Gloo "
                      "broadcast failed (the step's files check whole: it stays); this process exits now\n"
                      "Traceback (most recent call last):\nValueError: DATA_LOSS: Error reading shard\n")
    plain.write_text("E1130 ValueError: DATA_LOSS: Error reading shard entry d/7f3a: file missing\n")
    scan = LogScan([broken], clock=lambda: 0.0)
    assert scan.restore_failed(force=True) is None and scan.restore_verdict() is None
    scan = LogScan([broken, damaged], clock=lambda: 0.0)
    assert scan.restore_failed(force=True)[1] == damaged and scan.restore_verdict() == (24, "local")
    scan = LogScan([plain], clock=lambda: 0.0)  # MaxText's own restore: no verdict, the run directory's step
    assert scan.restore_failed(force=True)[1] == plain and scan.restore_verdict() is None


def test_the_error_lines_of_a_failed_restore_are_the_errors_not_the_tracebacks_source(tmp_path):
    from rkit.run.ranklogs import last_error_lines

    log = tmp_path / "rank-0.log"
    log.write_text(
        "I1206 12:00:00 restoring step 39\nTraceback (most recent call last):\n"
        '  File "/opt/venv/lib/python3.13/site-packages/orbax/checkpoint/_src/serialization/ts_utils.py", line 412, '
        "in read\n    raise Exception(  # pylint: disable=broad-exception-raised\n"
        "Exception: Encountered error while reading array index (0,) in checkpoints/39/items/params: DATA_LOSS: "
        'Error reading "params.zarray"\n')
    assert last_error_lines(log) == ["Exception: Encountered error while reading array index (0,) in "
                                     'checkpoints/39/items/params: DATA_LOSS: Error reading "params.zarray"']


@pytest.mark.parametrize("said, code", [
    ("rkit: injected fault 'kill:rank=1,step=7' fires at step 7", -9),
    ("rkit: injected fault 'lose_local:rank=1,step=103' fires at step 103", -9),
    ("rkit: injected fault 'kill_restore:rank=1' fires at step 160", -9),
    ("rkit: injected fault 'exit:rank=0,step=78,code=92' fires at step 78", 92),
    ("rkit: injected fault 'exit:rank=0,step=78' fires at step 78", 1),
    ("rkit: injected fault 'hang:rank=0,step=117' fires at step 117", None),
    ("ValueError: rkit: injected fault 'kill:rank=1,step=7' fires", None),
    (None, None),
])
def test_the_exit_a_rank_gave_itself_through_inject_is_read_from_its_own_line(said, code):
    assert injected_exit(said) == code
