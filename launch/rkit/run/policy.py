"""Pure policy: run states, attempt causes, budgets and what to do after an attempt (`decide`). How an attempt
ended (`classify`) is in ending.py. No I/O, no clock: every rule here is tested exhaustively without processes or
sleeping.

The supervisor (supervisor.py) applies it; `rkit status` reads its states.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, replace

from rkit.contract.events import EV

NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")


class RunState(enum.Enum):
    PENDING = "pending"  # submitted (a Slurm job in the queue), no attempt yet
    RUNNING = "running"  # a supervisor is training it
    FINISHED = "finished"  # the final step is committed
    GAVE_UP = "gave up"  # stopped with a diagnosis: a budget spent, a crash loop, a full disk, out of memory ...
    INTERRUPTED = "interrupted"  # the user stopped it (Ctrl-C, SIGTERM to rkit, rkit cancel): resumable
    REQUEUED = "requeued"  # the batch job goes back to the queue and the run continues when it restarts
    STOPPED = "stopped"  # the supervisor went away without saying why (killed, machine lost)

    def is_terminal(self) -> bool:
        """Nothing more will happen to the run without a new `rkit run --resume`."""
        return self in (RunState.FINISHED, RunState.GAVE_UP)

    def is_final(self) -> bool:
        """No supervisor is working on the run (it may still be resumed)."""
        return self in (RunState.FINISHED, RunState.GAVE_UP, RunState.INTERRUPTED, RunState.STOPPED)

    def exit_code(self) -> int:
        """`rkit run`'s exit status when it leaves the run in this state: 0 finished, 1 gave up (or any other
        ending), 130 interrupted (as a shell reports SIGINT)."""
        return {RunState.FINISHED: 0, RunState.GAVE_UP: 1, RunState.INTERRUPTED: 130}.get(self, 1)


# The event that ends a run, and the state it leaves the run in.
FINAL_EVENTS = {EV.RUN_FINISHED: RunState.FINISHED, EV.RUN_GAVE_UP: RunState.GAVE_UP,
                EV.RUN_INTERRUPTED: RunState.INTERRUPTED}


class Cause(enum.Enum):
    """How an attempt ended."""

    COMPLETED = "completed"          # every rank exited 0 and the final step is committed
    TASK_EXIT = "task_exit"          # a rank exited non-zero
    TASK_SIGNAL = "task_signal"      # a rank was killed by a signal
    PREEMPTED = "preempted"          # we asked for a save (SIGTERM) on a preemption / time-limit signal
    NODE_FAIL = "node_fail"          # a node of the step died (Slurm's view of the step)
    HANG = "hang"                    # a rank made no step progress within the hang timeout
    INCOMPLETE = "incomplete"        # every rank exited 0 but the final step is not committed
    INTERRUPTED = "interrupted"      # the user stopped the run (Ctrl-C)
    LAUNCH_ERROR = "launch_error"    # the processes could not be started
    LOST = "lost"                    # the attempt's supervisor died with it (batch host lost, machine lost)
    DISK_FULL = "disk_full"          # a write failed for space (a checkpoint save): no restart into a full disk
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"  # the step resumed from could not be restored: quarantined
    PORT_IN_USE = "port_in_use"      # jax.distributed's coordinator could not listen: the next attempt gets another
    OUT_OF_MEMORY = "out_of_memory"  # a rank ran out of memory (the OOM killer in its cgroup, or its own words):
                                     # the same config would again; not retried
    CHECK_SUSPECT = "check_suspect"  # every committed step failed rkit's integrity check the same way: the check is
                                     # suspect, not the saves; nothing quarantined, nothing started
    STEP_FAILED = "step_failed"      # the launcher could not start the ranks (Slurm refused the step, a node did
                                     # not take its tasks, the step ended before any rank's agent began)
    OUT_OF_DATA = "out_of_data"      # a rank's training data ran out before the final step (MaxText's words): a
                                     # new attempt resumes at the same place in the data; not retried

    @property
    def infrastructure(self) -> bool:
        return self in (Cause.PREEMPTED, Cause.NODE_FAIL, Cause.HANG, Cause.LOST, Cause.CORRUPT_CHECKPOINT,
                        Cause.PORT_IN_USE, Cause.STEP_FAILED)


@dataclass(frozen=True)
class Budgets:
    max_restarts: int
    max_infra_restarts: int
    crash_loop_limit: int
    # Committed steps trained since the last charged failure that refill both budgets (a week-long run that
    # fails once a day is not a crash loop); None: the counts are for the run's whole life.
    window_steps: int | None = None

    def within(self) -> str:
        return "" if self.window_steps is None else (f", each within {self.window_steps} committed steps of the one "
                                                     "before (resilience.budget_window_steps)")


@dataclass(frozen=True)
class Outcome:
    cause: Cause
    committed_before: int | None
    committed_after: int | None
    detail: str = ""
    requeue: bool = False  # the allocation cannot go on: a time-limit/preemption signal, or too few healthy nodes
    # What identifies the failure, for the crash-loop rule: the failing rank, its exit code (negative: the
    # signal), the step it last completed, the nodes lost.
    rank: int | None = None
    code: int | None = None
    step: int | None = None
    nodes: tuple[str, ...] = ()
    error: str | None = None  # the failing rank's own words (ranklogs.rank_error)
    # A planned end: a time-limit or preemption signal answered by a committed save at or after the step it was
    # asked at. Counted (Tally.planned_ends), never charged to a budget.
    planned: bool = False

    @property
    def progressed(self) -> bool:
        return self.committed_after is not None and (self.committed_before is None
                                                     or self.committed_after > self.committed_before)

    @property
    def signature(self) -> str | None:
        """Two attempts with the same signature failed the same way. Preemptions, lost supervisors and steps the
        launcher could not start are events of the cluster, not of the job: they have none and never make a crash
        loop."""
        step = "?" if self.step is None else str(self.step)
        if self.cause in (Cause.TASK_EXIT, Cause.TASK_SIGNAL) and self.error:
            # The rank's own words, with their numbers (addresses, ports, times) left out, rather than its exit
            # code: srun may end the failing rank before its own exit is seen (--kill-on-bad-exit).
            return f"rank_failed rank={self.rank} step={step} error={NUMBERS.sub('#', self.error)}"
        if self.cause in (Cause.TASK_EXIT, Cause.TASK_SIGNAL):
            return f"{self.cause.value} rank={self.rank} code={self.code} step={step}"
        if self.cause is Cause.HANG:
            return f"hang rank={self.rank} step={step}"
        if self.cause is Cause.NODE_FAIL and self.nodes:
            return f"node_fail nodes={','.join(sorted(self.nodes))}"
        if self.cause is Cause.INCOMPLETE:
            return f"incomplete committed={self.committed_after}"
        return None


@dataclass(frozen=True)
class Tally:
    """What earlier attempts used of the budgets."""

    training_failures: int = 0
    infra_failures: int = 0  # node failures, preemptions, requeues
    stalled: int = 0  # consecutive failed attempts without a new committed checkpoint
    stalled_details: tuple[str, ...] = ()
    signature: str | None = None  # the last failure's signature
    repeats: int = 0  # consecutive failures with that signature
    planned_ends: int = 0  # time limits and preemptions answered by a committed save: never charged
    last_failure_at: int | None = None  # the committed step after the last training failure (-1: none committed)
    refills: int = 0  # times a stretch of Budgets.window_steps without a failure refilled a budget
    last_infra_at: int | None = None  # the committed step after the last infrastructure failure

    def as_dict(self) -> dict:
        return {"training_failures": self.training_failures, "infra_failures": self.infra_failures,
                "stalled": self.stalled, "stalled_details": list(self.stalled_details),
                "signature": self.signature, "repeats": self.repeats, "planned_ends": self.planned_ends,
                "last_failure_at": self.last_failure_at, "refills": self.refills,
                "last_infra_at": self.last_infra_at}

    @classmethod
    def from_dict(cls, t: dict) -> Tally:
        return cls(t["training_failures"], t["infra_failures"], t["stalled"], tuple(t["stalled_details"]),
                   t.get("signature"), t.get("repeats", 0), t.get("planned_ends", 0), t.get("last_failure_at"),
                   t.get("refills", 0), t.get("last_infra_at"))


class Action(enum.Enum):
    RESTART = "restart"
    REQUEUE = "requeue"
    FINISH = "finish"
    GIVE_UP = "give_up"
    STOP = "stop"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


def _repeat(tally: Tally, outcome: Outcome) -> Tally:
    sig = outcome.signature
    repeats = tally.repeats + 1 if sig is not None and sig == tally.signature else (0 if sig is None else 1)
    return replace(tally, signature=sig, repeats=repeats)


def _crash_loop(tally: Tally, outcome: Outcome, budgets: Budgets) -> Decision | None:
    """The same failure (Outcome.signature) `crash_loop_limit` times in a row is a crash
    loop, whether or not a checkpoint was committed in between (an async save may land during any attempt)."""
    if tally.repeats < budgets.crash_loop_limit:
        return None
    last = "none" if outcome.committed_after is None else str(outcome.committed_after)
    return Decision(Action.GIVE_UP, f"crash loop: {tally.repeats} consecutive attempts failed the same way "
                                    f"(resilience.crash_loop_limit={budgets.crash_loop_limit}): {outcome.detail}; "
                                    f"last committed step {last}. This looks deterministic: fix the cause and run "
                                    "again with --resume")


def _charge(tally: Tally, outcome: Outcome, budgets: Budgets) -> Tally:
    """Before a failure is charged to its budget: a stretch of `window_steps` committed steps since that budget's
    last failure refills it (failures are counted against progress, not over the run's life; a node lost now and
    then does not keep the training budget from refilling); then this failure's committed step starts the next."""
    at = outcome.committed_after if outcome.committed_after is not None else outcome.committed_before
    here = -1 if at is None else at
    infra = outcome.cause.infrastructure
    last = tally.last_infra_at if infra else tally.last_failure_at
    if budgets.window_steps is not None and last is not None and here - last >= budgets.window_steps:
        tally = replace(tally, refills=tally.refills + 1, **{"infra_failures" if infra else "training_failures": 0})
    return replace(tally, **{"last_infra_at" if infra else "last_failure_at": here})


def decide(tally: Tally, outcome: Outcome, budgets: Budgets, final_committed: bool) -> tuple[Decision, Tally]:
    """Pure policy: classify first, then spend the matching budget. A planned end (a time limit or preemption
    answered by its save) spends none; a failure spends one of a budget that a stretch of progress refills."""
    if final_committed:
        return Decision(Action.FINISH, "the final step is committed"), tally
    if outcome.cause is Cause.INTERRUPTED:
        return Decision(Action.STOP, "stopped by the user; resume with `rkit run RECIPE --resume`"), tally
    if outcome.cause is Cause.LAUNCH_ERROR:
        return Decision(Action.GIVE_UP, f"the processes could not be started: {outcome.detail}"), tally
    if outcome.cause is Cause.OUT_OF_MEMORY:
        return Decision(Action.GIVE_UP, f"{outcome.detail}. A new attempt with the same config would run out the "
                                        "same way: give the job more memory (a larger cap, slurm --mem) and continue "
                                        "with `rkit run RECIPE --resume`, or start a new run (-o name=NEW) with a "
                                        "smaller trainer.overrides.per_device_batch_size"), tally
    if outcome.cause is Cause.CHECK_SUSPECT:
        return Decision(Action.GIVE_UP, f"{outcome.detail}. rkit suspects its own check, not every save of the run: "
                                        "nothing was quarantined and no attempt started (one would start over from "
                                        "scratch). Report it with the step's files listed; to train on, move the "
                                        "steps aside yourself and continue with `rkit run RECIPE --resume`"), tally
    if outcome.cause is Cause.OUT_OF_DATA:
        return Decision(Action.GIVE_UP, f"{outcome.detail}. The data set ends before trainer.steps: a new attempt "
                                        "would resume at the same place in the data and run out again. Add data "
                                        "(more files in trainer.overrides.grain_train_files), let MaxText repeat it "
                                        "(trainer.overrides.num_epoch), or lower trainer.steps; then continue with "
                                        "`rkit run RECIPE --resume`"), tally
    if outcome.cause is Cause.DISK_FULL:
        return Decision(Action.GIVE_UP, f"{outcome.detail}. A new attempt would fail the same way: free space "
                                        "(or raise the quota), then continue with `rkit run RECIPE --resume`"), tally
    tally = _repeat(tally, outcome)
    if outcome.cause is Cause.PREEMPTED and outcome.planned:
        tally = replace(tally, planned_ends=tally.planned_ends + 1, stalled=0, stalled_details=())
        then = "requeueing the job" if outcome.requeue else "restarting"
        return Decision(Action.REQUEUE if outcome.requeue else Action.RESTART,
                        f"{outcome.detail}; a planned end, saved at step {outcome.committed_after} (no budget "
                        f"spent); {then}, it resumes from that step"), tally
    tally = _charge(tally, outcome, budgets)
    if outcome.cause.infrastructure:
        tally = replace(tally, infra_failures=tally.infra_failures + 1, stalled=0, stalled_details=())
        if (loop := _crash_loop(tally, outcome, budgets)) is not None:
            return loop, tally
        if tally.infra_failures > budgets.max_infra_restarts:
            return Decision(Action.GIVE_UP, f"infrastructure budget exhausted: {tally.infra_failures} failures"
                                            f"{budgets.within()}, {budgets.max_infra_restarts} allowed "
                                            f"(resilience.max_infra_restarts); last: {outcome.detail}"), tally
        if outcome.requeue:
            return Decision(Action.REQUEUE, f"{outcome.detail}; requeueing the job, it resumes from the last "
                                            "checkpoint"), tally
        return Decision(Action.RESTART, f"{outcome.detail}; resuming from the last checkpoint"), tally
    stalled = 0 if outcome.progressed else tally.stalled + 1
    details = () if outcome.progressed else tally.stalled_details + (outcome.detail,)
    tally = replace(tally, training_failures=tally.training_failures + 1, stalled=stalled, stalled_details=details)
    if (loop := _crash_loop(tally, outcome, budgets)) is not None:
        return loop, tally
    if stalled >= budgets.crash_loop_limit:
        last = "none" if outcome.committed_after is None else str(outcome.committed_after)
        same = len(set(details)) == 1
        how = (f"each failed the same way: {details[0]}. This looks deterministic: fix the cause and "
               "run again with --resume" if same else "failures: " + "; ".join(details))
        return Decision(Action.GIVE_UP, f"crash loop: {stalled} consecutive attempts failed without a new "
                                        f"committed checkpoint (last committed step {last}); {how}"), tally
    if tally.training_failures > budgets.max_restarts:
        return Decision(Action.GIVE_UP, f"restart budget exhausted: {tally.training_failures} training failures"
                                        f"{budgets.within()}, {budgets.max_restarts} restarts allowed "
                                        f"(resilience.max_restarts); last: {outcome.detail}"), tally
    return Decision(Action.RESTART, f"{outcome.detail}; restarting from the last committed checkpoint"), tally


def tally_from_events(events: list[dict]) -> Tally:
    """Budgets carry over when a run is resumed: replay the recorded decisions."""
    tally = Tally()
    for e in events:
        if e.get("event") == EV.ATTEMPT_ENDED and "tally" in e:
            tally = Tally.from_dict(e["tally"])
    return tally


@dataclass
class Progress:
    """What the display needs; updated by the supervisor as the run moves."""

    total_steps: int
    attempt: int = 0
    step: int | None = None
    committed: int | None = None
    tokens_per_sec: float | None = None
    message: str = ""
