"""Ending an attempt the way its `Ending` says (run/ending.py decides how; this acts for the supervisor): the
attempt.failed record, the stop at once or after a grace, a hung attempt's stack dumps, a preemption's save."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rkit.backends.base import Backend, Handle
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir
from rkit.run.ending import Ending, Observation, Stop
from rkit.run.liveness import detection
from rkit.run.policy import Cause
from rkit.runtime.inject import Injection

# The causes recorded as attempt.failed: a rank, a node or the step failed (not a hang, a stop or a preemption).
FAILED = (Cause.TASK_EXIT, Cause.TASK_SIGNAL, Cause.NODE_FAIL, Cause.DISK_FULL, Cause.STEP_FAILED,
          Cause.OUT_OF_MEMORY)


@dataclass
class AttemptEnd:
    run: RunDir
    backend: Backend
    clock: Callable[[], float]
    grace: float  # resilience.signal_grace_seconds

    def end(self, ending: Ending, observed: Observation, handle: Handle, attempt: int, nodes: list[str], *,
            preempt: str | None, sigterm_at: Injection | None) -> float | None:
        """Record how the attempt ends and end its processes that way; a save returns its SIGKILL deadline.
        `preempt`: the signal from Slurm that asked for the save, if any; else `sigterm_at`, the injected one."""
        stopped = ending.cause is Cause.DISK_FULL and ending.stop is Stop.NOW
        if stopped:  # first: the events below may not be writable either
            self.backend.stop(handle, grace=0)
        if ending.cause in FAILED:
            self._record_failure(ending, observed, handle, attempt, nodes)
        if ending.stop is Stop.NOW and not stopped:
            self.backend.stop(handle, grace=0)
        elif ending.stop is Stop.GRACE:
            self.run.emit(EV.STOP_REQUESTED, attempt=attempt, reason="interrupt (Ctrl-C / SIGTERM)",
                          grace_seconds=self.grace)
            self.backend.stop(handle, grace=self.grace)
        elif ending.stop is Stop.HANG:
            self._end_hung(handle, attempt, ending, observed, nodes)
        elif ending.stop is Stop.SAVE:
            if preempt:
                return self.request_save(handle, attempt, ending.step, reason="signal from Slurm", received=preempt)
            self.run.emit(EV.INJECT_FIRED, index=sigterm_at.index, kind="sigterm", step=ending.step,
                          attempt=attempt, spec=sigterm_at.spec)
            return self.request_save(handle, attempt, ending.step, reason="injected")
        return None

    def _record_failure(self, ending: Ending, observed: Observation, handle: Handle, attempt: int,
                        nodes: list[str]) -> None:
        """attempt.failed: the rank (its own exit, where the supervisor's observation restored it), the node, how
        the node's loss was detected; the lost nodes join the handle's."""
        first = next((e for e in observed.exits if e.rank == ending.rank), None)
        detected = {} if ending.cause is not Cause.NODE_FAIL else detection(
            self.backend.liveness, ending.nodes, self.clock(), by_rkit=bool(observed.dead_nodes),
            launcher="slurm" if self.backend.name == "slurm" else "the launcher", jax=observed.jax_peer_lost)
        self.run.emit(EV.ATTEMPT_FAILED, attempt=attempt, cls=ending.cause.value, rank=ending.rank,
                      exit_code=first.returncode if first and first.returncode >= 0 else None,
                      signal=first.signal_name if first else ("SIGTERM" if ending.nodes else None),
                      last_step=ending.step,
                      node=first.node if first and first.node else
                      (ending.nodes[0] if first is None and ending.nodes else nodes[0]),
                      lost_nodes=list(ending.nodes), **({"error": ending.error} if ending.error else {}),
                      **({"ended_by_launcher": True} if first and first.ended_by_launcher else {}),
                      **detected)
        handle.failed_nodes.extend(n for n in ending.nodes if n not in handle.failed_nodes)

    def _end_hung(self, handle: Handle, attempt: int, ending: Ending, observed: Observation,
                  nodes: list[str]) -> None:
        """Stack dumps where possible, then SIGKILL."""
        hang, stopped = observed.hang, list(observed.stopped)
        # Seen by the hang watch, or named by JAX's coordination service to the ranks it aborted (silent_peers)
        ranks = hang.ordered(stopped) if hang is not None else list(observed.silent_peers)
        silent = hang.seconds_silent if hang is not None else observed.silent_seconds
        self.run.emit(EV.ATTEMPT_HANG, attempt=attempt, rank=ending.rank, ranks=ranks, stopped_ranks=stopped,
                      node=nodes[0] if len(nodes) == 1 else None, last_step=ending.step,
                      seconds_silent=silent, timeout=hang.timeout if hang is not None else None)
        dumps = self.backend.dump_stacks(handle, self.run.stacks_dir(attempt), stopped)
        self.run.emit(EV.ATTEMPT_STACKS_DUMPED, attempt=attempt, how=dumps)
        # Killed at once: a hung collective does not save, and a SIGTERM with the SIGCONT a stopped rank needs to
        # act on it would let that rank train on (a tiny run finished and saved its final step in that grace).
        self.backend.stop(handle, grace=0)

    def request_save(self, handle: Handle, attempt: int, step: int | None, *, reason: str,
                     **fields: object) -> float:
        """The preemption path: ask every rank to save and stop; returns the SIGKILL deadline."""
        self.run.emit(EV.PREEMPT_REQUESTED, attempt=attempt, step=step, signal="SIGTERM",
                      grace_seconds=self.grace, reason=reason, **fields)
        self.backend.request_save(handle)
        return self.clock() + self.grace
