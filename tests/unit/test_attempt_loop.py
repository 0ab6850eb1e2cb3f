"""The attempt loop (Supervisor.run_attempt / run_to_end) driven by a fake backend through every ending: rank
exit, rank signal, hang, lost node, preemption, user stop, completion. No processes, no sleeping: the fake
backend advances one training step per poll and the clock one second per poll."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rkit.backends.base import Backend, Handle, NotEnoughNodes, RankExit
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir
from rkit.images.identity import ImageIdentity
from rkit.images.store import sha256_file
from rkit.readers import outcome
from rkit.readers.outcome import chronicle
from rkit.recipe.load import load_recipe
from rkit.run.attemptwatch import PEER_GRACE_SECONDS
from rkit.run.policy import Cause, Progress, RunState
from rkit.run.supervisor import Supervisor
from rkit.runtime.trainers import maxtext

from ..conftest import TINY

STEPS = 12
PERIOD = 4


@dataclass
class FakeRequest:
    attempt: int
    processes: int
    trainer_args: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"fake attempt {self.attempt}"

    def as_record(self, root: Path) -> dict:
        return {"fake": True, "processes": self.processes}


@dataclass
class FakeHandle(Handle):
    attempt: int = 0
    step: dict[int, int] = field(default_factory=dict)  # each live rank's last completed step
    silent: set[int] = field(default_factory=set)  # hung ranks: alive, no progress
    saving: bool = False
    polled: bool = False
    late: dict[int, list] = field(default_factory=dict)  # rank -> [polls until its exit is seen, the exit]

    def pids(self) -> dict[str, int]:
        return {str(r): 10_000 + r for r in self.step}


class Script:
    """What happens in which attempt at which step: rank exits, signals, node losses, hangs, a user's stop."""

    def __init__(self, **faults):
        self.faults = faults  # name -> (attempt or None for every attempt, step, ...)

    def at(self, kind: str, attempt: int, step: int):
        fault = self.faults.get(kind)
        if fault is None:
            return None
        when, at_step, *rest = fault
        return rest or True if (when in (None, attempt) and at_step == step) else None


class FakeBackend:
    """Implements the Backend protocol; trains one step per poll, commits every PERIOD steps."""

    name = "fake"
    standby = None
    liveness = None

    def __init__(self, run: RunDir, sup_ref: list, script: Script, nodes: tuple[str, ...] = ("n1", "n2", "n3"),
                 per_step: int = 2):
        self.run, self.sup_ref, self.script = run, sup_ref, script
        self.all_nodes, self.per_step = list(nodes), per_step
        self.exclude: list[str] = []
        self.saves_requested = 0
        self.saves_on_request = True  # False: the trainer stops at the sync point without saving
        self.stops: list[float] = []
        self.gpu_checks: list[str] = []
        self.requests: list[FakeRequest] = []
        self.rechecked: list[list[str]] = []

    def prepare(self, *, attempt, processes, trainer_args, base_env, attempt_dir, cwd, port=None, host_env=None):
        if len(self.healthy_nodes()) < processes:  # one process per node
            raise NotEnoughNodes(self.healthy_nodes(), self.exclude)
        assert any(a.startswith("checkpoint_period=") for a in trainer_args)
        assert "enable_autocheckpoint=true" in trainer_args  # a SIGTERM saves at the sync point
        self.requests.append(FakeRequest(attempt, processes, list(trainer_args)))
        return self.requests[-1]

    def submit(self, request: FakeRequest) -> FakeHandle:
        start = maxtext.latest_committed_step(self.run)
        return FakeHandle(attempt=request.attempt, step={r: -1 if start is None else start
                                                         for r in range(request.processes)})

    def _train(self, handle: FakeHandle, rank: int) -> None:
        step = handle.step[rank] + 1
        handle.step[rank] = step
        line = {"step": step, "loss": 10.0 - step * 0.1, "step_time": 1.0, "attempt": handle.attempt,
                "rank": rank, "node": self.healthy_nodes()[rank % self.per_step]}
        with open(self.run.metrics_file(rank), "a") as fh:
            fh.write(json.dumps(line) + "\n")
        if rank == 0 and (step % PERIOD == 0 or step == STEPS - 1 or handle.saving):
            commit(self.run, step)

    def poll(self, handle: FakeHandle) -> dict[int, RankExit]:
        if not handle.polled:
            handle.polled = True
            if said := self.script.at("restorefail", handle.attempt, -1):  # rank 0 logs the restore error
                log = self.run.rank_log(handle.attempt, 0)
                log.parent.mkdir(parents=True, exist_ok=True)
                error = "E1130 ValueError: DATA_LOSS: Error reading shard entry d/7f3a: file missing\n"
                step = maxtext.latest_committed_step(self.run)
                if said is True:  # MaxText's own restore (no local tier): the error, then it waits
                    log.write_text(f"I1130 restoring\n{error}")
                    handle.silent.add(0)
                else:  # the local tier's hook says what it found first (emergency.py), then exits
                    verdict = {"local": f"{error}rkit: Failed to restore step {step} from the local tier "
                                        "(ValueError); this process exits now\n",
                               "broken": f"rkit: the restore of step {step} from the local tier was broken off by "
                                         "JaxRuntimeError: Gloo broadcast failed (the step's files check whole: it "
                                         f"stays); this process exits now\nTraceback (most recent call last):\n"
                                         f"{error}"}[said[0]]
                    log.write_text(f"I1130 restoring\n{verdict}")
                    handle.exits[0] = RankExit(0, 1, "n1")
                    handle.silent.add(1)
            if self.script.at("portinuse", handle.attempt, -1):  # rank 0 cannot listen and exits; rank 1 waits
                log = self.run.rank_log(handle.attempt, 0)
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text("E1201 add_port.cc:83] Failed to add port to server: No address added out of total 1 "
                               "resolved for '127.0.0.1:34713' (Error in bind ...: Address already in use)\n"
                               "jax.errors.JaxRuntimeError: UNKNOWN: Failed to start RPC server\n")
                handle.exits[0] = RankExit(0, 1)
                handle.silent.add(1)
        for rank, due in list(handle.late.items()):
            due[0] -= 1
            if due[0] <= 0:
                handle.exits[rank] = due[1]
                del handle.late[rank]
        for rank in list(handle.step):
            if rank in handle.exits or handle.silent:  # a silent rank blocks its peers in the next collective
                continue
            if handle.saving:  # the preemption path: save where it is and exit 0
                if self.saves_on_request:
                    commit(self.run, handle.step[rank])
                handle.exits[rank] = RankExit(rank, 0)
                continue
            self._train(handle, rank)
            step = handle.step[rank]
            if rank == 0 and (code := self.script.at("exit", handle.attempt, step)):
                handle.exits[rank] = RankExit(rank, code[0], "n1")
            elif rank == 0 and (raced := self.script.at("peerrace", handle.attempt, step)):
                peer_race(self.run, handle, step, raced[0])
            elif rank == 0 and (inj := self.script.at("injrace", handle.attempt, step)):
                injected_race(self.run, handle, step, inj[0])
            elif rank == 0 and (lag := self.script.at("peerlag", handle.attempt, step)):
                peer_lag(self.run, handle, step, lag[0])
                self.peer_failed_at = self.sup_ref[0].clock.now
            elif rank == 0 and self.script.at("gloobreak", handle.attempt, step):
                log = self.run.rank_log(handle.attempt, 0)
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text("Traceback (most recent call last):\njax.errors.JaxRuntimeError: UNKNOWN: Gloo "
                               "all-reduce failed: [gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:57000\n")
                handle.exits[0] = RankExit(0, 1, "n1")
                handle.exits[1] = RankExit(1, -signal.SIGKILL, ended_by_launcher=True)
            elif rank == 0 and (how := self.script.at("jaxabort", handle.attempt, step)):
                jax_abort(self.run, handle, step, srun_ends_it=how is not True)
                self.peer_failed_at = self.sup_ref[0].clock.now
            elif rank == 1 and (how := self.script.at("leaderhang", handle.attempt, step)):
                jax_abort(self.run, handle, step, srun_ends_it=how is not True, stopped=0)
                self.peer_failed_at = self.sup_ref[0].clock.now
            elif rank == 0 and self.script.at("peeronly", handle.attempt, step):
                peer_race(self.run, handle, step, (handle.attempt,), silent=True)
            elif rank == 1 and (said := self.script.at("raise", handle.attempt, step)):
                log = self.run.rank_log(handle.attempt, 1)  # the rank's own traceback, then exit 1
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text("I1201 step\nTraceback (most recent call last):\n  File \"train.py\", line 9\n"
                               f"{said[0]}\nE1201 later noise\n")
                handle.exits[rank] = RankExit(rank, 1, "n2")
            elif rank == 1 and self.script.at("kill", handle.attempt, step):
                handle.exits[rank] = RankExit(rank, -signal.SIGKILL, "n2")
            elif rank == 0 and self.script.at("nodepeer", handle.attempt, step):
                handle.exits[0] = RankExit(0, 1, "n1")  # rank 0's collective broke; rank 1's exit not seen yet
                handle.failed_nodes.append("n2")
                handle.silent.add(1)
            elif rank == 1 and self.script.at("node", handle.attempt, step):
                handle.exits[rank] = RankExit(rank, -signal.SIGKILL, "n2")
                handle.failed_nodes.append("n2")
            elif rank == 1 and self.script.at("hang", handle.attempt, step):
                handle.silent.add(rank)
            elif rank == 0 and (where := self.script.at("diskfull", handle.attempt, step)):
                # Orbax's async save fails for space; the trainer logs it and sits (it does not exit).
                log = self.run.rank_log(handle.attempt, 0)
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text("I1130 step 8\nE1130 RESOURCE_EXHAUSTED: Error writing local file "
                               "checkpoints/8.orbax-checkpoint-tmp/d/0: No space left on device\n" if where is True
                               else f"I1207 step 8\n{where[0]}\n")
                handle.silent.add(rank)
            elif rank == 0 and self.script.at("interrupt", handle.attempt, step):
                self.sup_ref[0].request_stop()
            elif rank == 0 and self.script.at("preempt", handle.attempt, step):
                self.sup_ref[0].request_preempt(signal.SIGUSR1)
            elif step >= STEPS - 1:
                handle.exits[rank] = RankExit(rank, 0)
        return handle.exits

    def running(self, handle: FakeHandle) -> list[int]:
        return [r for r in handle.step if r not in handle.exits]

    def request_save(self, handle: FakeHandle) -> None:
        self.saves_requested += 1
        handle.saving = True

    def stop(self, handle: FakeHandle, grace: float) -> None:
        self.stops.append(grace)
        for rank in self.running(handle):
            handle.exits[rank] = RankExit(rank, -signal.SIGKILL if grace == 0 else -signal.SIGTERM)

    def nodes(self, handle: FakeHandle) -> list[str]:
        return self.healthy_nodes()[: self.per_step if handle is None else len(handle.step)]

    def lose_node(self, handle: FakeHandle, rank: int) -> str | None:
        node = self.nodes(handle)[rank]
        handle.exits[rank] = RankExit(rank, -signal.SIGKILL, node)
        handle.failed_nodes.append(node)
        return node

    def healthy_nodes(self) -> list[str]:
        return [n for n in self.all_nodes if n not in self.exclude]

    def recheck(self, nodes: list[str]) -> dict[str, str | None]:
        self.rechecked.append(list(nodes))
        answers = (self.script.faults.get("answers") or ((),))[0]  # (nodes that answer when asked again,)
        return {n: None if n in answers else "still down" for n in nodes}

    def unseen_paths(self, paths: list[str]) -> tuple[dict[str, list[str]], str | None]:
        blind = self.script.faults.get("unseen")  # (node, ...): nodes that see none of the paths
        return {node: list(paths) for node in blind[0]} if blind else {}, None

    def unfit_gpus(self, vendor: str) -> tuple[dict[str, str], str | None]:
        self.gpu_checks.append(vendor)
        unfit = self.script.faults.get("gpus")  # ((node, why), ...): nodes whose GPUs fail the check
        return {node: why for node, why in unfit if node not in self.exclude} if unfit else {}, None

    def down_nodes(self, handle: FakeHandle) -> list[str]:
        return []

    def stopped_ranks(self, handle: FakeHandle) -> list[int]:
        return sorted(handle.silent)

    def dump_stacks(self, handle: FakeHandle, out_dir: Path, stopped: list[int]) -> str:
        out_dir.mkdir(parents=True, exist_ok=True)
        for rank in stopped:
            (out_dir / f"rank-{rank}.txt").write_text("Thread 0x0 (most recent call first):\n")
        return "fake"


# What the CI's Slurm run showed (stop 35): rank 0 fails by itself and its peer's collective breaks with it.
OWN_WORDS = "ValueError: the batch of step {step} holds no tokens"
PEER_WORDS = ("jax.errors.JaxRuntimeError: UNKNOWN: Gloo AllGather failed: [gloo/transport/tcp/pair.cc:538] Read "
              "error [127.0.0.1]:{port}: Connection reset by peer")


def peer_race(run: RunDir, handle: FakeHandle, step: int, raced: tuple[int, ...], silent: bool = False) -> None:
    """Rank 0 exits 3 by itself; rank 1 aborts (134) when its Gloo pair breaks. In a `raced` attempt srun hears
    rank 1's abort first and ends rank 0 itself (SIGTERM, its exit code lost), as under load on the test bed; in
    the others rank 0's own exit is first and srun kills rank 1. `silent`: rank 0 says nothing and srun's kill of
    it is a SIGKILL (a task it did not name)."""
    for rank, said in ((0, "" if silent else "Traceback (most recent call last):\n" + OWN_WORDS.format(step=step + 1)),
                       (1, "Traceback (most recent call last):\n  File \"train.py\", line 9\n"
                           + PEER_WORDS.format(port=57000 + handle.attempt))):
        log = run.rank_log(handle.attempt, rank)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"I1203 completed step: {step}\n{said}\n")
    if handle.attempt in raced:
        handle.exits[1] = RankExit(1, 134, "n2")
        handle.exits[0] = RankExit(0, -(signal.SIGKILL if silent else signal.SIGTERM), "n1", ended_by_launcher=True)
    else:
        handle.exits[0] = RankExit(0, 3, "n1")
        handle.exits[1] = RankExit(1, -signal.SIGKILL, "n2", ended_by_launcher=True)


def injected_race(run: RunDir, handle: FakeHandle, step: int, spec: str) -> None:
    """Chaos seed 3 (2026-12-07): rank 1 ends itself through `--inject` (its line, then its SIGKILL or exit), yet
    srun hears rank 0's exit first (its Gloo pair closed by the peer) and reports rank 1 as its own kill
    ("task 1: Terminated" after "Terminating StepId"): rank 1's own exit is lost from srun's report."""
    for rank, said in ((1, f"rkit: injected fault {spec!r} fires at step {step + 1}"),
                       (0, "Traceback (most recent call last):\n" + PEER_WORDS.format(port=57000))):
        log = run.rank_log(handle.attempt, rank)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"I1207 completed step: {step}\n{said}\n")
    handle.exits[0] = RankExit(0, 1, "n1")
    handle.exits[1] = RankExit(1, -signal.SIGTERM, "n2", ended_by_launcher=True)


def peer_lag(run: RunDir, handle: FakeHandle, step: int, polls: int) -> None:
    """Rank 1 is SIGKILLed after saying why; rank 0's collective breaks and it exits 1 blaming a peer, and its
    exit is seen first: rank 1's (through a container runtime, under load) only `polls` polls later."""
    broke = f"Traceback (most recent call last):\n{PEER_WORDS.format(port=57000)}"
    killed = f"rkit: injected fault 'kill:rank=1,step={step + 1}' fires at step {step + 1}"
    for rank, said in ((0, broke), (1, killed)):
        log = run.rank_log(handle.attempt, rank)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"I1203 completed step: {step}\n{said}\n")
    handle.exits[0] = RankExit(0, 1, "n1")
    handle.silent.add(1)
    handle.late[1] = [polls, RankExit(1, -signal.SIGKILL, "n2")]


# Rank 0's log when rank 1 was stopped (SIGSTOP) on the test bed (the fault campaign, tests/benchmarks/chaos.py):
# JAX's coordination service stopped hearing rank 1, told rank 0, and rank 0 aborted (LOG(FATAL), then abort()).
JAX_ABORT = ("E1207 18:30:31.946216      22 coordination_service.cc:1518] [4913097329315690653] Use error polling to "
             "propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped "
             "sending heartbeats):\n1\nThe tasks have crashed. Check the task logs for an earlier error, or scheduler "
             "events (e.g. preemption, eviction) to debug further.\n"
             "F1207 18:30:31.946840      33 client.h:86] Terminating process because the JAX distributed service "
             "detected fatal errors. This most likely indicates that another task died; see the other task logs for "
             "more details. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending "
             "heartbeats):\n1\nThe tasks have crashed.\nFatal Python error: Aborted\n\nThread 0x00007faa2bca8780 "
             "(most recent call first):\n  File \"multihost_utils.py\", line 121 in _handle_array_process_allgather\n")


# Rank 1's log when rank 0, which hosts JAX's coordination service, was stopped (the campaign's seed 2, hang of
# rank 0): rank 1's heartbeats to the service timed out, and JAX aborted rank 1 naming no task.
LEADER_ABORT = ("F1207 21:04:11.201562      29 client.h:86] Terminating process because the JAX distributed service "
                "detected fatal errors. This most likely indicates that another task died; see the other task logs "
                "for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous "
                "output. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: "
                "/tensorflow.CoordinationService/Heartbeat\nFatal Python error: Aborted\n\nThread 0x00007f1e "
                "(most recent call first):\n  File \"train.py\", line 9 in train_loop\n")


def jax_abort(run: RunDir, handle: FakeHandle, step: int, srun_ends_it: bool = False, stopped: int = 1) -> None:
    """Rank `stopped` stops (it never exits); JAX's coordination service aborts the other rank for it (SIGABRT in its
    container: 134): rank 0 with JAX_ABORT when rank 1 stopped, rank 1 with LEADER_ABORT when rank 0 (the service's
    host) did. `srun_ends_it`: srun (--kill-on-bad-exit) then kills the stopped rank at once, as on the test bed."""
    aborted = 1 - stopped
    log = run.rank_log(handle.attempt, aborted)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"I1207 completed step: {step}\n{LEADER_ABORT if stopped == 0 else JAX_ABORT}")
    nodes = ("n1", "n2")
    handle.exits[aborted] = RankExit.in_container(aborted, 134, nodes[aborted])
    if srun_ends_it:
        handle.exits[stopped] = RankExit(stopped, -signal.SIGTERM, nodes[stopped], ended_by_launcher=True)
    else:
        handle.silent.add(stopped)


def commit(run: RunDir, step: int) -> None:
    path = run.orbax_dir / str(step)
    path.mkdir(parents=True, exist_ok=True)
    (path / "commit_success.txt").write_text("ok")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0  # every look at the clock is a second later: hangs show without waiting
        return self.now


def make(tmp_path: Path, script: Script, *overrides: str, nodes=("n1", "n2", "n3"),
         image: ImageIdentity | None = None, backend_class: type = None) -> tuple[Supervisor, FakeBackend]:
    recipe = load_recipe(TINY, [f"trainer.steps={STEPS}", f"checkpoint.period={PERIOD}", "launcher=slurm",
                                "resources.nodes=2", "resources.processes_per_node=1",
                                "resilience.hang_timeout=5", "resilience.signal_grace_seconds=3", *overrides])
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.resolved.write_text(json.dumps(recipe.resolved))  # what `rkit run` stamps first
    ref: list = []
    backend = (backend_class or FakeBackend)(run, ref, script, nodes=nodes)
    missing = [m for m in vars(Backend) if not m.startswith("_") and not hasattr(backend, m)]
    assert not missing, f"the fake backend lacks {missing} of the Backend protocol"
    sup = Supervisor(run=run, config=recipe.config, injections=[], backend=backend, base_env={},
                     jax_cache_dir=str(tmp_path / "jax"), poll_seconds=0, clock=Clock(), image=image,
                     chronicle=chronicle)
    ref.append(sup)
    return sup, backend


def events(run: RunDir, name: str) -> list[dict]:
    return [e for e in run.events() if e["event"] == name]


def attempt(sup: Supervisor):
    return sup.run_attempt(Progress(total_steps=STEPS), [])


def test_completion(tmp_path):
    sup, backend = make(tmp_path, Script())
    outcome = attempt(sup)
    assert outcome.cause is Cause.COMPLETED and outcome.committed_after == STEPS - 1 and outcome.detail == ""
    record = json.loads(sup.run.attempt_record(1).read_text())
    assert record["cause"] == "completed" and record["launch"] == {"fake": True, "processes": 2}
    assert record["exits"] == {"0": {"exit_code": 0, "signal": None, "node": None},
                               "1": {"exit_code": 0, "signal": None, "node": None}}
    assert len(events(sup.run, EV.ATTEMPT_FIRST_STEP)) == 1 and backend.stops == []


def test_rank_exit(tmp_path):
    sup, backend = make(tmp_path, Script(exit=(1, 6, 3)))
    outcome = attempt(sup)
    assert outcome.cause is Cause.TASK_EXIT and outcome.detail == "rank 0 exited with code 3 after step 6"
    assert (outcome.rank, outcome.code, outcome.step) == (0, 3, 6) and outcome.committed_after == 4
    failed = events(sup.run, EV.ATTEMPT_FAILED)[0]
    assert failed["cls"] == "task_exit" and failed["exit_code"] == 3 and failed["node"] == "n1"
    assert backend.stops == [0]  # the peers are stopped at once, not left in a collective


def test_a_failed_ranks_last_step_is_read_when_it_fails_between_two_scans(tmp_path, monkeypatch):
    # The metrics files are scanned at most once a poll; the poll that sees the exit came within one of the last
    # scan (CI, stop 36: "after step 13" in one attempt, "after step 14" in the next, and the crash loop a turn
    # late). Here the scans are 60 s apart and the polls do not sleep: only a forced read sees step 6.
    monkeypatch.setattr("rkit.run.supervisor.time.sleep", lambda seconds: None)
    sup, _ = make(tmp_path, Script(exit=(1, 6, 3)))
    sup.poll_seconds = 60
    outcome = attempt(sup)
    assert outcome.detail == "rank 0 exited with code 3 after step 6" and outcome.step == 6


def test_rank_signal(tmp_path):
    sup, backend = make(tmp_path, Script(kill=(1, 5)))
    outcome = attempt(sup)
    assert outcome.cause is Cause.TASK_SIGNAL and outcome.detail == "rank 1 killed by SIGKILL after step 5"
    assert events(sup.run, EV.ATTEMPT_FAILED)[0]["signal"] == "SIGKILL" and backend.stops == [0]


def test_hang(tmp_path):
    sup, backend = make(tmp_path, Script(hang=(1, 6)))
    outcome = attempt(sup)
    assert outcome.cause is Cause.HANG and outcome.rank == 1 and outcome.step == 6
    assert outcome.detail.startswith("hang: rank 1 made no step progress")
    hang = events(sup.run, EV.ATTEMPT_HANG)[0]
    assert hang["rank"] == 1 and hang["stopped_ranks"] == [1] and hang["timeout"] == 5
    assert events(sup.run, EV.ATTEMPT_STACKS_DUMPED)[0]["how"] == "fake"
    # killed at once (no grace): a continued stopped rank would train on in a grace
    assert (sup.run.stacks_dir(1) / "rank-1.txt").exists() and backend.stops == [0]


def test_lost_node_is_excluded(tmp_path):
    sup, backend = make(tmp_path, Script(node=(1, 7)))
    outcome = attempt(sup)
    assert outcome.cause is Cause.NODE_FAIL and outcome.nodes == ("n2",) and not outcome.requeue
    assert outcome.detail == "node failure on n2 (rank 1 lost after step 7)"
    assert backend.exclude == ["n2"] and events(sup.run, EV.NODES_EXCLUDED)[0]["healthy"] == ["n1", "n3"]
    assert backend.nodes(None) == ["n1", "n3"]  # the next attempt runs on the spare


def test_a_lost_node_seen_first_through_a_survivors_failure_names_the_survivor_as_such(tmp_path):
    """The campaign (seed 2): srun reported rank 0's failure (its collective broke) with c2 lost, and the attempt read
    "node failure on c2 (rank 0 lost after step 347)", though rank 0 ran on c1, which lived."""
    sup, _ = make(tmp_path, Script(nodepeer=(1, 7)))
    outcome = attempt(sup)
    assert outcome.cause is Cause.NODE_FAIL and outcome.nodes == ("n2",)
    assert outcome.detail == "node failure on n2 (after step 7; rank 0 on n1 failed with it)", outcome.detail
    assert outcome.rank is None


def test_lost_node_without_a_spare_requeues(tmp_path):
    sup, backend = make(tmp_path, Script(node=(1, 7)), nodes=("n1", "n2"))
    outcome = attempt(sup)
    assert outcome.cause is Cause.NODE_FAIL and outcome.requeue
    nxt = attempt(sup)  # no healthy pair left: the allocation cannot go on
    assert nxt.cause is Cause.NODE_FAIL and nxt.requeue and events(sup.run, EV.ATTEMPT_NO_NODES)


def test_a_lost_node_without_a_spare_shrinks_the_run_with_the_same_global_batch(tmp_path):
    # resources.min_nodes=1: the second attempt trains on n1 alone, with twice the accumulation (the recipe's
    # per_device_batch_size stays), restoring the last committed step; no requeue, no wait.
    sup, backend = make(tmp_path, Script(node=(1, 7)), "resources.min_nodes=1", nodes=("n1", "n2"))
    assert sup.run_to_end() is RunState.FINISHED
    first, second = backend.requests
    assert first.processes == 2 and not [a for a in first.trainer_args if a.startswith("gradient_accumulation")]
    assert second.processes == 1 and "gradient_accumulation_steps=2" in second.trainer_args
    assert "per_device_batch_size=1" in second.trainer_args
    assert [e["decision"] for e in events(sup.run, EV.ATTEMPT_ENDED)] == ["restart", "finish"]
    resized = events(sup.run, EV.RUN_RESIZED)
    assert [(r["attempt"], r["node_count"], r["gradient_accumulation_steps"]) for r in resized] == [(2, 1, 2)]
    assert resized[0]["reason"].startswith("shrunk")
    shape = json.loads(sup.run.attempt_record(2).read_text())["shape"]
    assert shape == {"nodes": 1, "full_nodes": 2, "processes": 1, "gradient_accumulation_steps": 2,
                     "per_device_batch_size": 1.0}
    assert events(sup.run, EV.ATTEMPT_STARTED)[1]["nodes"] == ["n1"]
    assert not events(sup.run, EV.ATTEMPT_NO_NODES) and not events(sup.run, EV.JOB_REQUEUE_REQUESTED)


def test_a_shrunk_run_grows_back_when_a_requeue_brings_the_nodes(tmp_path):
    sup, backend = make(tmp_path, Script(node=(1, 7)), "resources.min_nodes=1", nodes=("n1", "n2"))
    attempt(sup)
    shrunk = attempt(sup)
    assert shrunk.cause is Cause.COMPLETED and backend.requests[-1].processes == 1
    # The requeued job's supervisor, two healthy nodes again: full size, said as such.
    again = Supervisor(run=sup.run, config=sup.config, injections=[], backend=FakeBackend(sup.run, [], Script(),
                       nodes=("n1", "n3")), base_env={}, jax_cache_dir=sup.jax_cache_dir, poll_seconds=0,
                       clock=Clock(), chronicle=chronicle)
    again._resize(3)
    assert again.processes == 2 and events(sup.run, EV.RUN_RESIZED)[-1]["reason"] == "grown back to the full size"


def test_when_short_wait_requeues_for_the_full_size(tmp_path):
    sup, backend = make(tmp_path, Script(node=(1, 7)), "resources.min_nodes=1", "resources.when_short=wait",
                        nodes=("n1", "n2"))
    outcome = attempt(sup)
    assert outcome.cause is Cause.NODE_FAIL and outcome.requeue and not events(sup.run, EV.RUN_RESIZED)


def test_a_job_started_on_fewer_nodes_trains_shrunk_from_its_first_attempt(tmp_path):
    # sbatch --nodes=1-2: Slurm started the job on the one node it had free.
    sup, backend = make(tmp_path, Script(), "resources.min_nodes=1", nodes=("n1",))
    assert attempt(sup).cause is Cause.COMPLETED
    assert backend.requests[0].processes == 1 and "gradient_accumulation_steps=2" in backend.requests[0].trainer_args
    assert events(sup.run, EV.RUN_RESIZED)[0]["attempt"] == 1


def test_period_auto_chooses_each_attempts_period_and_says_why(tmp_path):
    # Attempt 1: nothing measured, the default bounded to max_period. Attempt 2: what attempt 1's rank 0 logged.
    sup, backend = make(tmp_path, Script(kill=(1, 6)), "checkpoint.period=auto", "checkpoint.max_period=50")
    attempt(sup)
    log = sup.run.rank_log(1, 0)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("I1202 x.py:1] [async] Finished blocking save in 0.002 seconds\n")
    attempt(sup)
    chosen = events(sup.run, EV.CHECKPOINT_PERIOD)
    assert [(e["attempt"], e["period"]) for e in chosen][0] == (1, 50) and chosen[1]["save_seconds"] == 0.002
    assert chosen[1]["reason"].startswith("Young/Daly") and chosen[1]["step_seconds"] == 1.0
    assert [e["checkpoint_period"] for e in events(sup.run, EV.ATTEMPT_STARTED)] == [e["period"] for e in chosen]
    assert f"checkpoint_period={chosen[1]['period']}" in backend.requests[1].trainer_args


def test_preemption_saves_and_requeues(tmp_path):
    sup, backend = make(tmp_path, Script(preempt=(1, 6)))
    outcome = attempt(sup)
    assert outcome.cause is Cause.PREEMPTED and outcome.requeue and backend.saves_requested == 1
    # The signal came while rank 0 wrote step 6; the supervisor had read up to step 5.
    assert outcome.detail == "SIGUSR1 after step 5 (time limit or preemption)"
    assert outcome.committed_after is not None and outcome.committed_after >= 6
    requested = events(sup.run, EV.PREEMPT_REQUESTED)[0]
    assert requested["received"] == "SIGUSR1" and events(sup.run, EV.PREEMPT_SAVED)
    assert backend.stops == []  # the ranks saved and exited within the grace
    assert outcome.planned  # answered by its save: a planned end (policy: no budget spent)


def test_a_planned_end_requeues_with_no_infrastructure_budget_and_status_says_so(tmp_path):
    from rkit.readers.status import render_status, status

    sup, _ = make(tmp_path, Script(preempt=(1, 6)), "resilience.max_infra_restarts=0")
    assert sup.run_to_end() is RunState.REQUEUED
    ended = events(sup.run, EV.ATTEMPT_ENDED)[0]
    assert ended["decision"] == "requeue" and ended["planned"] is True
    assert (ended["tally"]["infra_failures"], ended["tally"]["planned_ends"]) == (0, 1)
    text = render_status(status(sup.run))
    assert "preempted, a planned end: saved, no budget spent" in text
    assert f"budgets    training failures 0 of 3, infrastructure 0 of 0; refilled by {10 * PERIOD} committed " \
           "steps without a failure; planned ends 1" in text, text


def test_a_preemption_that_saved_nothing_new_is_unsaved(tmp_path):
    # MaxText without enable_autocheckpoint stopped at the sync point without saving; the period save of step 4
    # committed meanwhile. That is not the preemption save: steps 5 and 6 are recomputed.
    sup, backend = make(tmp_path, Script(preempt=(1, 6)))
    backend.saves_on_request = False
    outcome = attempt(sup)
    assert outcome.cause is Cause.PREEMPTED and outcome.committed_before is None and outcome.committed_after == 4
    assert not events(sup.run, EV.PREEMPT_SAVED)
    unsaved = events(sup.run, EV.PREEMPT_UNSAVED)[0]
    assert unsaved["committed_step"] == 4 and unsaved["requested_at_step"] == 5
    assert not outcome.planned  # an infrastructure failure, charged


def test_user_stop(tmp_path):
    sup, backend = make(tmp_path, Script(interrupt=(1, 3)))
    outcome = attempt(sup)
    assert outcome.cause is Cause.INTERRUPTED and backend.stops == [3]
    assert events(sup.run, EV.STOP_REQUESTED)[0]["grace_seconds"] == 3


def test_a_node_that_cannot_see_the_run_directory_stops_the_run_before_any_attempt(tmp_path):
    from rkit.contract.errors import RkitError

    sup, backend = make(tmp_path, Script(unseen=(("n2",),)))
    with pytest.raises(RkitError, match="n2 cannot see"):
        sup.run_to_end()
    assert sup.run.attempt_numbers() == []
    (gave_up,) = events(sup.run, EV.RUN_GAVE_UP)
    assert gave_up["reason"].startswith("shared file system check failed before attempt 1: n2 cannot see "
                                        f"{sup.run.path.resolve()}")


def cuda_image(tmp_path: Path) -> ImageIdentity:
    sif = tmp_path / "cuda.sif"
    sif.write_bytes(b"not really an image")
    return ImageIdentity(reference=str(sif), path=str(sif), sha256=sha256_file(sif), flavor="cuda")


def test_a_node_whose_gpus_fail_the_health_check_is_excluded_before_the_attempt(tmp_path):
    why = "uncorrectable ECC errors on GPU 3 (2)"
    sup, backend = make(tmp_path, Script(gpus=(("n1", why),)), "slurm.gpus_per_node=8", image=cuda_image(tmp_path))
    assert sup.run_to_end() is RunState.FINISHED
    (excluded,) = events(sup.run, EV.NODES_EXCLUDED)
    assert excluded["nodes"] == ["n1"] and excluded["reason"] == f"GPU health check: n1: {why}"
    (started,) = events(sup.run, EV.ATTEMPT_STARTED)
    assert "n1" not in started["nodes"] and backend.gpu_checks == ["nvidia"]


def test_unfit_gpus_on_too_many_nodes_requeue_without_them(tmp_path):
    sup, backend = make(tmp_path, Script(gpus=(("n1", "1 process(es) still holding GPUs: pid 7"),
                                                ("n3", "uncorrectable ECC errors on GPU 0 (1)"))),
                        "slurm.gpus_per_node=8", image=cuda_image(tmp_path))
    assert sup.run_to_end() is RunState.REQUEUED
    assert events(sup.run, EV.ATTEMPT_NO_NODES) and backend.exclude == ["n1", "n3"]


def test_no_gpus_in_the_recipe_no_gpu_check(tmp_path):
    sup, backend = make(tmp_path, Script(gpus=(("n1", "would fail"),)), image=cuda_image(tmp_path))
    assert sup.run_to_end() is RunState.FINISHED and backend.gpu_checks == [] and not backend.exclude


def test_run_to_end_resumes_after_each_failure_and_finishes(tmp_path):
    sup, backend = make(tmp_path, Script(kill=(1, 5), hang=(2, 9), node=(3, 10)))
    assert sup.run_to_end() is RunState.FINISHED
    ended = events(sup.run, EV.ATTEMPT_ENDED)
    assert [e["cause"] for e in ended] == ["task_signal", "hang", "node_fail", "completed"]
    starts = [e["resume_from_step"] for e in events(sup.run, EV.ATTEMPT_STARTED)]
    assert starts == [None, 4, 8, 8]
    assert ended[-1]["tally"]["training_failures"] == 1 and ended[-1]["tally"]["infra_failures"] == 2
    # What it came out as: the newest attempt's loss of every step, in outcome.json.
    record = sup.run.load_outcome()
    losses = [10.0 - s * 0.1 for s in range(STEPS)]
    assert record["state"] == "finished" and record["loss"]["count"] == STEPS
    assert record["loss"]["sha256"] == outcome.loss_checksum(losses)


def test_run_to_end_stops_a_crash_loop_on_its_signature(tmp_path):
    sup, _ = make(tmp_path, Script(exit=(None, 6, 3)), "resilience.crash_loop_limit=2")
    assert sup.run_to_end() is RunState.GAVE_UP
    gave_up = events(sup.run, EV.RUN_GAVE_UP)[0]["reason"]
    assert gave_up.startswith("crash loop: 2 consecutive attempts failed the same way")
    assert "rank 0 exited with code 3 after step 6" in gave_up
    assert len(events(sup.run, EV.ATTEMPT_STARTED)) == 2  # attempt 1 committed step 4; the same failure anyway


@pytest.mark.parametrize("raced", [(), (1,), (2,), (1, 2)])
def test_a_crash_loop_is_seen_whichever_of_two_failing_ranks_srun_names_first(tmp_path, raced):
    sup, _ = make(tmp_path, Script(peerrace=(None, 6, raced)), "resilience.crash_loop_limit=2")
    assert sup.run_to_end() is RunState.GAVE_UP
    failed = events(sup.run, EV.ATTEMPT_FAILED)
    assert [(e["attempt"], e["rank"], e["cls"]) for e in failed] == [(1, 0, "task_exit"), (2, 0, "task_exit")]
    assert all(e["error"] == OWN_WORDS.format(step=7) for e in failed)
    assert [e.get("ended_by_launcher", False) for e in failed] == [a in raced for a in (1, 2)]
    gave_up = events(sup.run, EV.RUN_GAVE_UP)[0]["reason"]
    assert gave_up.startswith("crash loop: 2 consecutive attempts failed the same way")
    last = ("rank 0 failed (the launcher ended it with SIGTERM once rank 1 exited with code 134) after step 6"
            if 2 in raced else "rank 0 exited with code 3 after step 6")
    assert f"{last}: {OWN_WORDS.format(step=7)}" in gave_up


@pytest.mark.parametrize("spec, cause, code, how", [
    ("lose_local:rank=1,step=7", Cause.TASK_SIGNAL, -signal.SIGKILL, "killed by SIGKILL"),
    ("kill:rank=1,step=7", Cause.TASK_SIGNAL, -signal.SIGKILL, "killed by SIGKILL"),
    ("exit:rank=1,step=7,code=42", Cause.TASK_EXIT, 42, "exited with code 42"),
])
def test_a_rank_srun_ended_after_its_own_injected_fault_keeps_its_own_exit(tmp_path, spec, cause, code, how):
    sup, _ = make(tmp_path, Script(injrace=(1, 6, spec)))
    outcome = attempt(sup)
    assert (outcome.cause, outcome.rank, outcome.code) == (cause, 1, code)
    assert outcome.detail.startswith(f"rank 1 {how} after step 5: rkit: injected fault {spec!r}"), outcome.detail
    failed = events(sup.run, EV.ATTEMPT_FAILED)[0]
    assert failed["cls"] == cause.value and "ended_by_launcher" not in failed


def test_a_rank_blaming_its_peer_waits_for_the_peers_own_exit_to_name_the_culprit(tmp_path):
    # The image test on CI (stop 47): rank 0 exited 1 on the broken collective before rank 1's SIGKILL was seen,
    # and the attempt was put down to rank 0 (task_exit) instead of the kill.
    sup, backend = make(tmp_path, Script(peerlag=(1, 6, 3)))
    outcome = attempt(sup)
    assert (outcome.cause, outcome.rank, outcome.step) == (Cause.TASK_SIGNAL, 1, 5)  # its own last step
    assert outcome.error == "rkit: injected fault 'kill:rank=1,step=7' fires at step 7"
    assert backend.stops == [0]


def test_a_peer_that_never_exits_holds_the_verdict_only_for_the_grace(tmp_path):
    sup, backend = make(tmp_path, Script(peerlag=(1, 6, 10_000)))
    outcome = attempt(sup)  # rank 1 never seen to exit: after PEER_GRACE_SECONDS the verdict is rank 0's
    assert (outcome.cause, outcome.rank) == (Cause.TASK_EXIT, 0) and "Connection reset by peer" in outcome.error
    waited = sup.clock.now - backend.peer_failed_at
    assert PEER_GRACE_SECONDS <= waited < 3 * PEER_GRACE_SECONDS, waited


def test_a_rank_jax_aborted_for_a_silent_peer_is_not_the_culprit_the_stopped_peer_is_hung(tmp_path):
    """The fault campaign (hang:rank=1 on the test bed): rank 1 stopped, JAX's coordination service aborted rank 0
    for it 49 s later, and the attempt was put down to rank 0 ("exited with code 134: Fatal Python error: Aborted")
    instead of the hang of rank 1. Once the grace for rank 1's own exit has run out, rank 1, which JAX named and
    which still runs, is the hang; rank 0's words are JAX's fatal line, not Python's report of the abort."""
    sup, backend = make(tmp_path, Script(jaxabort=(1, 6)))
    outcome = attempt(sup)
    assert (outcome.cause, outcome.rank) == (Cause.HANG, 1), outcome.detail
    assert outcome.detail.startswith("hang: rank 1 stopped sending heartbeats to JAX's coordination service and did "
                                     "not exit (last step 5); rank 0 killed by SIGABRT (exit code 134 from its "
                                     "container) on it: F1207 ")
    assert "Terminating process because the JAX distributed service detected fatal errors" in outcome.detail
    [hang] = events(sup.run, EV.ATTEMPT_HANG)
    assert hang["rank"] == 1 and hang["ranks"] == [1] and hang["seconds_silent"] > 0
    assert sup.clock.now - backend.peer_failed_at >= PEER_GRACE_SECONDS  # rank 1 had its chance to exit


def test_a_crashed_peers_node_srun_ended_is_found_by_liveness_not_blamed_on_the_survivor(tmp_path):
    """The campaign's seed 2: a node crashed mid-step, rank 0's Gloo all-reduce broke (exit 1, a peer's words) and
    srun ended rank 1, whose node was gone: everyone had exited, so the verdict was rank 0's at once (task_exit),
    and the next attempt went back to the dead node (step_failed). The verdict now waits for liveness."""
    sup, backend = make(tmp_path, Script(gloobreak=(1, 6)))

    class Liveness:
        probes: dict = {}
        looks = 0

        def check(self, progress):
            self.looks += 1
            return [], ({"n2": "no heartbeat for 8.1 s and the probe step did not answer"} if self.looks > 4 else {})

        def last_heard(self, node):
            return None

        def watch(self, attempt, nodes, tasks_per_node):
            pass

        def close(self):
            pass

    backend.liveness = Liveness()
    outcome = attempt(sup)
    assert (outcome.cause, outcome.nodes) == (Cause.NODE_FAIL, ("n2",)), outcome.detail


def test_a_silent_peer_srun_ended_at_once_is_still_the_hang(tmp_path):
    """The campaign again, with srun --kill-on-bad-exit: the stopped rank 1 was ended by srun as soon as rank 0
    aborted, so it never "still ran", and the attempt went to rank 0 (task_signal, SIGABRT)."""
    sup, _ = make(tmp_path, Script(jaxabort=(1, 6, "srun")))
    outcome = attempt(sup)
    assert (outcome.cause, outcome.rank) == (Cause.HANG, 1), outcome.detail


@pytest.mark.parametrize("srun_ends_it", [False, True])
def test_a_stopped_rank_0_which_hosts_jaxs_coordination_service_is_the_hang_not_the_rank_jax_aborted(
        tmp_path, srun_ends_it):
    """The campaign's seed 2 (hang:rank=0): rank 1's heartbeats to the coordination service in the stopped rank 0
    timed out, JAX aborted rank 1 with DEADLINE_EXCEEDED naming no task, and the attempt went to rank 1
    (task_signal, SIGABRT). Rank 0, still running after the grace or ended by srun, is the hang."""
    sup, _ = make(tmp_path, Script(leaderhang=(1, 6, "srun") if srun_ends_it else (1, 6)))
    outcome = attempt(sup)
    assert (outcome.cause, outcome.rank) == (Cause.HANG, 0), outcome.detail
    assert outcome.detail.startswith("hang: rank 0 stopped answering its peers' heartbeats (it hosts JAX's "
                                     "coordination service) and did not exit"), outcome.detail
    assert "DEADLINE_EXCEEDED" in outcome.detail


def test_a_sigkill_the_launcher_sent_is_not_read_as_the_oom_killers(tmp_path, monkeypatch):
    # The OOM killer acted in the cgroup this attempt (say, in another job's task), and srun SIGKILLed rank 0 once
    # rank 1 aborted: rank 0 did not run out of memory, and rank 1's words are the only ones there are.
    monkeypatch.setattr("rkit.run.oomkills.OomWatch.killed", lambda self: "the kernel's OOM killer killed 1")
    sup, _ = make(tmp_path, Script(peeronly=(1, 6)))
    outcome = attempt(sup)
    assert outcome.cause is Cause.TASK_EXIT and outcome.rank == 1 and outcome.code == 134
    assert outcome.detail == f"rank 1 exited with code 134 after step 5: {PEER_WORDS.format(port=57001)}"


def test_run_to_end_records_a_lost_attempt_first(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    sup, _ = make(tmp_path, Script())
    sup.run.emit(EV.ATTEMPT_STARTED, attempt=1, resume_from_step=None)
    sup.run.attempt_dir(1).mkdir(parents=True)
    assert sup.run_to_end() is RunState.FINISHED
    ended = events(sup.run, EV.ATTEMPT_ENDED)
    assert [(e["attempt"], e["cause"]) for e in ended] == [(1, "lost"), (2, "completed")]


def test_already_finished_run_starts_nothing(tmp_path):
    sup, backend = make(tmp_path, Script())
    commit(sup.run, STEPS - 1)
    assert sup.run_to_end() is RunState.FINISHED and not events(sup.run, EV.ATTEMPT_STARTED)


def test_disk_full_ends_the_attempt_at_once_and_the_run_stops(tmp_path):
    sup, backend = make(tmp_path, Script(diskfull=(None, 8)), "resilience.hang_timeout=600")
    assert sup.run_to_end() is RunState.GAVE_UP
    ended = events(sup.run, EV.ATTEMPT_ENDED)
    assert [e["cause"] for e in ended] == ["disk_full"]  # no restart into a full disk
    assert sup.run.load_outcome()["state"] == "gave up"
    assert "No space left on device" in ended[0]["detail"] and "bytes free" in ended[0]["detail"]
    assert "file system /" in ended[0]["detail"]
    reason = events(sup.run, EV.RUN_GAVE_UP)[0]["reason"]
    assert reason.startswith("disk full: ") and "free space" in reason and "--resume" in reason
    assert events(sup.run, EV.ATTEMPT_FAILED)[0]["cls"] == "disk_full" and backend.stops == [0]
    assert not events(sup.run, EV.ATTEMPT_HANG)  # found in the log, long before the hang timeout


# A full node-local tier in the ranks' words (the fault campaign): TensorStore's line with the path, and Python's
# bare OSError after Orbax's line naming the step's directory.
TENSORSTORE_FULL = ("E1207 21:19:00.479408 future.py:387] [process=1] _SignalingThread.run() raised an exception: "
                    "RESOURCE_EXHAUSTED: Error writing \"params.params.token_embedder.embedding/c/0/0\" in OCDBT "
                    "database at local file \"/local/nvme/c2/rkit-x/c2-0/258.orbax-checkpoint-tmp/"
                    "state.orbax-checkpoint-tmp/ocdbt.process_1/\": Failed writing: No space left on device")
ORBAX_THEN_OSERROR = ("E1207 21:32:13.608951 140065553540800 async_checkpointer.py:264] [process=1] Failed to run 4 "
                      "Handler Commit operations or the Commit callback in background save thread, directory: "
                      "/local/nvme/c2/rkit-chaos-1/c2-0/126\nTraceback (most recent call last):\n  File "
                      "\"/opt/venv/lib/python3.13/site-packages/etils/epath/abstract_path.py\", line 224, in "
                      "write_text\n    with self.open('w') as f:\nOSError: [Errno 28] No space left on device")


def test_a_traceback_before_a_bare_oserror_is_not_taken_for_where_the_write_went(tmp_path):
    """CI: the run directory's file system full; the bare OSError followed a traceback whose `File "/opt/venv/..."`
    lines were read as the write's path ("outside the run directory"): only a write's own words name it."""
    said = ("Traceback (most recent call last):\n  File \"/opt/venv/lib/python3.13/site-packages/etils/epath/"
            "abstract_path.py\", line 224, in write_text\nOSError: [Errno 28] No space left on device")
    sup, _ = make(tmp_path, Script(diskfull=(None, 8, said)), "resilience.hang_timeout=600")
    outcome = attempt(sup)
    assert outcome.cause is Cause.DISK_FULL and "(file system " in outcome.detail, outcome.detail
    assert "bytes free)" in outcome.detail and "outside the run directory" not in outcome.detail


@pytest.mark.parametrize("said", [TENSORSTORE_FULL, ORBAX_THEN_OSERROR])
def test_a_full_node_local_tier_is_named_as_such_not_as_the_run_directorys_file_system(tmp_path, said):
    """The campaign (seeds 1 and 2): the node-local tier's disk filled; the attempt was rightly disk_full, but its
    line gave the run directory's file system ("file system /: 79858266112 bytes free"), which had room. A line
    with no path of its own (Python's bare OSError) takes it from the lines before."""
    sup, _ = make(tmp_path, Script(diskfull=(None, 8, said)), "resilience.hang_timeout=600",
                  "checkpoint.local_dir=/local/nvme/$SLURMD_NODENAME", "trainer.overrides.ici_data_parallelism=-1",
                  "trainer.overrides.ici_fsdp_parallelism=1")
    outcome = attempt(sup)
    assert outcome.cause is Cause.DISK_FULL
    assert outcome.detail == (f"disk full: {said.splitlines()[-1]} (the node-local tier, checkpoint.local_dir "
                              "/local/nvme/$SLURMD_NODENAME, on the rank's node: free space there)"), outcome.detail


def test_a_rank_failing_on_a_full_file_system_is_disk_full_even_with_a_silent_log(tmp_path, monkeypatch):
    # The whole run directory on the full file system: the rank's log could not take the error either.
    import rkit.run.attemptwatch

    sup, _ = make(tmp_path, Script(exit=(1, 6, 1)))
    monkeypatch.setattr(rkit.run.attemptwatch, "filesystem", lambda path: ("/full", 4096))
    outcome = attempt(sup)
    assert outcome.cause is Cause.DISK_FULL
    assert outcome.detail.startswith("disk full: a rank failed or stopped with no room left on the run directory")
    assert "(file system /full: 4096 bytes free)" in outcome.detail


def test_a_rank_failing_with_room_on_disk_is_not_disk_full(tmp_path, monkeypatch):
    import rkit.run.attemptwatch

    sup, _ = make(tmp_path, Script(exit=(1, 6, 1)))
    monkeypatch.setattr(rkit.run.attemptwatch, "filesystem", lambda path: ("/roomy", 10 << 20))
    assert attempt(sup).cause is Cause.TASK_EXIT


def test_an_unwritable_run_directory_stops_the_attempt_with_one_diagnosis(tmp_path, monkeypatch):
    import os

    from rkit.contract import rundir
    from rkit.contract.errors import RunDirUnwritable

    sup, backend = make(tmp_path, Script())
    real_emit = sup.run.emit

    def emit(name, /, **fields):
        if name == EV.ATTEMPT_FIRST_STEP:  # the events file's file system is full from here on
            monkeypatch.setattr(rundir, "open_for_writing", lambda path: os.open("/dev/full", os.O_WRONLY))
        return real_emit(name, **fields)

    sup.run.emit = emit
    with pytest.raises(RunDirUnwritable) as caught:
        attempt(sup)
    message = str(caught.value)
    assert "events.jsonl: cannot write: No space left on device (file system" in message and "--resume" in message
    assert backend.stops == [0]  # no rank runs on without its supervisor's records
    assert caught.value.exit_code == 1


def test_a_refused_atomic_write_leaves_no_temp_file(tmp_path, monkeypatch):
    import errno

    from rkit.contract import rundir
    from rkit.contract.errors import RunDirUnwritable

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.os, "fsync", full)
    with pytest.raises(RunDirUnwritable, match="No space left on device"):
        rundir.write_json_atomic(tmp_path / "attempt.json", {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_checkpoint_that_fails_to_restore_is_quarantined_and_the_previous_one_used(tmp_path):
    sup, backend = make(tmp_path, Script(kill=(1, 9), restorefail=(2, -1)))
    assert sup.run_to_end() is RunState.FINISHED
    ended = events(sup.run, EV.ATTEMPT_ENDED)
    assert [e["cause"] for e in ended] == ["task_signal", "corrupt_checkpoint", "completed"]
    assert "the checkpoint of step 8 could not be restored: rank-0.log: " in ended[1]["detail"]
    assert "DATA_LOSS: Error reading shard entry" in ended[1]["detail"]
    quarantined = events(sup.run, EV.CHECKPOINT_QUARANTINED)
    assert [(q["step"], q["moved_to"]) for q in quarantined] == [(8, "checkpoints/quarantine/8")]
    assert [e["resume_from_step"] for e in events(sup.run, EV.ATTEMPT_STARTED)] == [None, 8, 4]
    assert not events(sup.run, EV.ATTEMPT_HANG) and (sup.run.checkpoints / "quarantine" / "8").is_dir()


def test_a_local_copy_that_fails_to_restore_leaves_the_run_directorys_step_of_that_number_alone(tmp_path):
    # The rank moved its damaged local copy of step 8 aside itself: the run directory's step 8 is not suspect.
    sup, _ = make(tmp_path, Script(kill=(1, 9), restorefail=(2, -1, "local")))
    assert sup.run_to_end() is RunState.FINISHED
    assert [e["cause"] for e in events(sup.run, EV.ATTEMPT_ENDED)] == ["task_signal", "corrupt_checkpoint",
                                                                       "completed"]
    assert not events(sup.run, EV.CHECKPOINT_QUARANTINED) and (sup.run.orbax_dir / "8").is_dir()
    assert [e["resume_from_step"] for e in events(sup.run, EV.ATTEMPT_STARTED)] == [None, 8, 8]


def test_a_restore_broken_off_by_a_peer_is_a_task_failure_whatever_its_traceback_says(tmp_path):
    sup, _ = make(tmp_path, Script(kill=(1, 9), restorefail=(2, -1, "broken")))
    assert sup.run_to_end() is RunState.FINISHED
    ended = events(sup.run, EV.ATTEMPT_ENDED)
    assert [e["cause"] for e in ended] == ["task_signal", "task_exit", "completed"]
    assert ended[1]["detail"].startswith("rank 0 exited with code 1 before its first step")
    assert not events(sup.run, EV.CHECKPOINT_QUARANTINED) and (sup.run.orbax_dir / "8").is_dir()


def test_a_step_directory_without_its_commit_marker_is_moved_aside_before_the_attempt(tmp_path):
    sup, _ = make(tmp_path, Script())
    commit(sup.run, 4)
    (sup.run.orbax_dir / "8" / "items").mkdir(parents=True)  # the markers are gone: MaxText would still see it
    (sup.run.orbax_dir / "9.orbax-checkpoint-tmp-123").mkdir()  # Orbax's own temporary: not ours to touch
    assert sup.run_to_end() is RunState.FINISHED
    quarantined = events(sup.run, EV.CHECKPOINT_QUARANTINED)
    assert [q["step"] for q in quarantined] == [8] and "no commit marker" in quarantined[0]["reason"]
    assert events(sup.run, EV.ATTEMPT_STARTED)[0]["resume_from_step"] == 4
    assert (sup.run.orbax_dir / "9.orbax-checkpoint-tmp-123").is_dir()


def test_orbax_files_that_a_restore_needs_are_checked(tmp_path):
    from rkit.runtime.trainers.maxtext import step_problem

    step = tmp_path / "20"
    proc = step / "items" / "ocdbt.process_0"
    (proc / "d").mkdir(parents=True)
    (proc / "d" / "a1b9").write_bytes(b"x")
    (proc / "manifest.ocdbt").write_bytes(b"m")
    (step / "items" / "manifest.ocdbt").write_bytes(b"m")
    (step / "items" / "_METADATA").write_text("{}")
    (step / "_CHECKPOINT_METADATA").write_text(json.dumps({"item_handlers": {"items": "PyTreeHandler"}}))
    assert step_problem(step) is None
    (proc / "d" / "a1b9").unlink()
    assert step_problem(step) == "items/ocdbt.process_0/d holds no data files"
    (proc / "manifest.ocdbt").unlink()
    assert step_problem(step) == "items/ocdbt.process_0/manifest.ocdbt is missing"
    (step / "items" / "_METADATA").write_text("")
    assert step_problem(step) == "items/_METADATA is not readable JSON (emptied or cut)"
    (step / "items" / "_METADATA").unlink()
    assert step_problem(step) == "items/_METADATA is missing"
    (step / "_CHECKPOINT_METADATA").write_text("{cut")
    assert step_problem(step) == "_CHECKPOINT_METADATA is unreadable"


def test_a_coordinator_port_in_use_is_infrastructure_and_the_next_attempt_finishes(tmp_path):
    sup, backend = make(tmp_path, Script(portinuse=(1, -1)))
    assert sup.run_to_end() is RunState.FINISHED
    ended = events(sup.run, EV.ATTEMPT_ENDED)
    assert [e["cause"] for e in ended] == ["port_in_use", "completed"]
    assert "coordinator could not listen: rank-0.log: E1201 add_port.cc:83] Failed to add port" in ended[0]["detail"]
    assert ended[0]["decision"] == "restart" and ended[0]["tally"]["infra_failures"] == 1
    assert ended[0]["tally"]["training_failures"] == 0


def test_a_failed_ranks_own_error_is_in_the_ending_the_event_and_the_crash_loop(tmp_path):
    error = "ValueError: 'learning_rat' not in 'learning_rate', 'steps'."
    sup, _ = make(tmp_path, Script(**{"raise": (None, 6, error)}), "resilience.crash_loop_limit=2")
    assert sup.run_to_end() is RunState.GAVE_UP
    failed = events(sup.run, EV.ATTEMPT_FAILED)
    assert [f["error"] for f in failed] == [error, error] and failed[0]["rank"] == 1
    ended = events(sup.run, EV.ATTEMPT_ENDED)
    assert ended[0]["detail"] == f"rank 1 exited with code 1 after step 6: {error}"
    reason = events(sup.run, EV.RUN_GAVE_UP)[0]["reason"]
    assert reason.startswith("crash loop") and error in reason
    assert json.loads(sup.run.attempt_record(1).read_text())["error"] == error


def test_a_rank_out_of_memory_is_named_and_not_retried(tmp_path):
    error = "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.0G"
    sup, _ = make(tmp_path, Script(**{"raise": (None, 6, error)}), "resilience.max_restarts=5")
    assert sup.run_to_end() is RunState.GAVE_UP
    ended = events(sup.run, EV.ATTEMPT_ENDED)
    assert [e["cause"] for e in ended] == ["out_of_memory"]  # one attempt: the same config runs out again
    assert ended[0]["detail"].startswith("out of memory: rank 1 exited with code 1 after step 6: its log says so")
    reason = events(sup.run, EV.RUN_GAVE_UP)[0]["reason"]
    assert "would run out the same way" in reason and "per_device_batch_size" in reason


def test_the_startup_phase_is_named_from_the_agents_events(tmp_path, monkeypatch):
    from rkit.run import attemptwatch
    from rkit.run.attemptwatch import StartupPhase

    events_file = tmp_path / "events.jsonl"
    events_file.write_text(json.dumps({"event": "agent.ready", "attempt": 1, "rank": 0}) + "\n")  # an older attempt
    clock = [0.0]
    monkeypatch.setattr(attemptwatch.time, "monotonic", lambda: clock[0])
    phase = StartupPhase(events_file, attempt=2, ranks=2, resumed_from=20)

    def add(event: str, rank: int, partial: bool = False) -> str:
        with open(events_file, "a") as fh:
            fh.write(json.dumps({"event": event, "attempt": 2, "rank": rank}) + ("" if partial else "\n"))
        clock[0] += 1.0
        phase.read()
        return phase.describe()

    phase.read()
    assert phase.describe() == "starting processes (0/2)"
    assert add("agent.started", 0) == "starting processes (1/2)"
    assert add("agent.started", 1) == "jax.distributed set-up, importing MaxText (0/2 ready)"
    assert add("agent.ready", 1, partial=True) == "jax.distributed set-up, importing MaxText (0/2 ready)"
    with open(events_file, "a") as fh:
        fh.write("\n")
    clock[0] += 1.0
    phase.read()
    assert phase.describe() == "jax.distributed set-up, importing MaxText (1/2 ready)"
    assert add("agent.ready", 0) == "restoring step 20, compiling"


def test_the_progress_message_names_the_phase_then_the_final_save(tmp_path):
    seen: list[str] = []
    sup, _ = make(tmp_path, Script())
    sup.on_progress = lambda p: seen.append(p.message)
    assert sup.run_to_end() is RunState.FINISHED
    assert seen[0] == "attempt 1: starting" and "attempt 1: starting processes (0/2)" in seen
    assert "attempt 1" in seen  # training


def test_every_event_rkit_writes_passes_the_vocabularys_field_types(tmp_path):
    # The readers skip an event whose fields have other types than EVENT_FIELD_TYPES says; the notes rkit itself
    # writes (a standby step's name in `step`, lists of nodes) must never be among them.
    from rkit.contract.events import valid_event

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.emit(EV.STANDBY, attempt=1, what="ready", step="standby-2", nodes=["c2"], pids={"0": 7}, import_seconds=3.2)
    run.emit(EV.ATTEMPT_FAILED, attempt=1, cls="task_exit", rank=1, exit_code=1, signal=None, last_step=6,
             node="n2", lost_nodes=[], error="ValueError: x")
    run.emit(EV.NODES_EXCLUDED, nodes=["c2"], excluded=["c2"], healthy=["c1", "c3"], reason="dead")
    run.emit(EV.JOB_STARTED, job_id="7", restart_count=0, batch_host="h", allocation=["c1"], excluded=[])
    run.emit(EV.INJECT_FIRED, index=0, kind="hang", rank=1, step=15, attempt=1, spec="hang:rank=1,step=15")
    lines = [json.loads(line) for line in run.events_file.read_text().splitlines()]
    assert all(valid_event(e) for e in lines) and len(run.events()) == 5
    (tmp_path / "loop").mkdir()
    sup, _ = make(tmp_path / "loop", Script(exit=(1, 6, 3)))
    assert sup.run_to_end() is RunState.FINISHED
    written = [json.loads(line) for line in sup.run.events_file.read_text().splitlines()]
    assert [e["event"] for e in written if not valid_event(e)] == []


def test_a_time_period_is_turned_into_steps_of_each_attempts_measured_step_time(tmp_path):
    # The fake steps take 1.0 s: 30s is 30 steps once attempt 1 measured them, 100 (bounded to 50) before.
    from rkit.readers.status import render_status, status

    sup, backend = make(tmp_path, Script(kill=(1, 6)), "checkpoint.period=30s", "checkpoint.max_period=50")
    attempt(sup)
    attempt(sup)
    chosen = events(sup.run, EV.CHECKPOINT_PERIOD)
    assert [(e["attempt"], e["period"], e["interval_seconds"]) for e in chosen] == [(1, 50, None), (2, 30, 30.0)]
    assert chosen[1]["reason"] == "every 30s = 30 s = 30 steps of 1.0000 s"
    assert "checkpoint_period=30" in backend.requests[1].trainer_args
    text = render_status(status(sup.run, config=sup.config, stamp={}))
    assert "checkpoint every 30 steps from attempt 2 (period: 30s; every 30s = 30 s = 30 steps of 1.0000 s)" in text
