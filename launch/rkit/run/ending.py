"""Pure policy, how an attempt ends: one poll of a running attempt as the supervisor saw it (`Observation`) in,
its ending (`classify`: the cause, who and where, and how to stop the ranks) out, or None while it runs on. No
I/O, no clock; `policy.decide` then says what follows.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rkit.run.policy import Cause

if TYPE_CHECKING:
    from rkit.backends.base import RankExit
    from rkit.run.watchdog import Hang


@dataclass(frozen=True)
class Observation:
    """One poll of a running attempt, as the supervisor saw it: the whole input of `classify`."""

    processes: int
    exits: tuple[RankExit, ...] = ()  # the ranks that exited so far, in the order noticed
    last_steps: Mapping[int, int | None] = field(default_factory=dict)  # each rank's newest step
    step: int | None = None  # the attempt's furthest step
    failed_nodes: tuple[str, ...] = ()  # nodes the launcher reported dead with the attempt
    dead_nodes: Mapping[str, str] = field(default_factory=dict)  # nodes rkit's liveness confirmed dead: why
    launch_failed: str | None = None  # the launcher could not start the ranks: what it said
    jax_peer_lost: str | None = None  # a rank's log: JAX's coordination service declared a process dead
    down_nodes: tuple[str, ...] = ()  # the attempt's nodes the scheduler reports dead (asked on a stop signal)
    interrupted: bool = False  # Ctrl-C, or SIGTERM to the supervisor
    preempt: str | None = None  # the scheduler's time-limit or preemption signal, by name
    inject_sigterm: str | None = None  # an injected preemption whose step was reached (its spec)
    hang: Hang | None = None
    disk_full: str | None = None  # a rank's log line saying a write failed for space, with the file system
    restore_failed: str | None = None  # before the first step of a resumed attempt: the rank's restore errors
    culprit: int | None = None  # the failed rank whose failure explains the others' (AttemptWatch.culprit)
    rank_error: str | None = None  # the culprit's own last error line (its log)
    out_of_memory: str | None = None  # the culprit ran out of memory: where and how it was seen
    port_in_use: str | None = None  # before the first step: rank 0's log says the coordinator could not listen
    out_of_data: str | None = None  # a rank's log: MaxText stopped training because its data ran out (the line)
    resumed_from: int | None = None
    stopped: tuple[int, ...] = ()  # ranks in the stopped state (asked when a hang is seen)
    silent_peers: tuple[int, ...] = ()  # running ranks JAX's coordination service named silent to the failed ones
    silent_seconds: float | None = None  # how long the first of them has made no step progress
    final_step: int = 0
    final_committed: bool = False  # read once every rank has exited


class Stop(enum.Enum):
    """How the supervisor ends the attempt's processes."""

    NOW = "now"  # SIGKILL at once: a peer is gone and the others would wait in a collective
    GRACE = "grace"  # SIGTERM, resilience.signal_grace_seconds, SIGKILL: the user's stop
    SAVE = "save"  # ask every rank to save and stop; SIGKILL what is left at the end of the grace
    HANG = "hang"  # stack dumps, a short grace, SIGKILL
    NONE = "none"  # every rank has exited


@dataclass(frozen=True)
class Ending:
    cause: Cause
    detail: str
    stop: Stop
    rank: int | None = None
    code: int | None = None
    step: int | None = None
    nodes: tuple[str, ...] = ()
    requeue: bool = False  # the allocation cannot go on (a node failure Slurm ended the job for, a preemption)
    exclude: tuple[str, ...] = ()  # nodes to keep out of every later attempt
    error: str | None = None  # the failed rank's own words (ranklogs.rank_error)


def _after(step: int | None) -> str:
    """Where a rank stood when it failed: the last step whose metrics it wrote (MaxText writes a step's line once
    the next is dispatched, so an injection at step=S fires `after step S-1`)."""
    return "before its first step" if step is None else f"after step {step}"


def _fmt(step: int | None) -> str:
    return "?" if step is None else str(step)


def classify(obs: Observation) -> Ending | None:
    """How the attempt ends, or None while it runs on. First match wins: the user and the scheduler come first,
    then a hang (unless a rank already failed: its peers then wait on it), a failed rank, the end of training."""
    failed = [e for e in obs.exits if e.returncode != 0]
    if obs.interrupted and obs.down_nodes:
        # Slurm ends a job (without --no-kill) when one of its nodes dies, and requeues it: a node failure, not
        # the user's interrupt.
        down = tuple(obs.down_nodes)
        return Ending(Cause.NODE_FAIL, f"node failure on {', '.join(down)}: Slurm ended the job ("
                                       f"{_after(obs.step)})", Stop.NOW, step=obs.step, nodes=down, requeue=True,
                      exclude=down)
    if obs.interrupted:
        return Ending(Cause.INTERRUPTED, "interrupted by the user", Stop.GRACE)
    if obs.dead_nodes:  # its peers wait in a collective; Slurm would see it only after SlurmdTimeout
        dead = tuple(sorted(obs.dead_nodes))
        why = "; ".join(f"{node}: {obs.dead_nodes[node]}" for node in dead)
        return Ending(Cause.NODE_FAIL, f"node failure on {', '.join(dead)} ({_after(obs.step)}): {why}",
                      Stop.NOW, step=obs.step, nodes=dead, exclude=dead)
    if obs.disk_full:  # a save that failed for space never succeeds on retry, and its trainer may sit forever
        return Ending(Cause.DISK_FULL, f"disk full: {obs.disk_full}", Stop.NOW, step=obs.step)
    if obs.restore_failed:  # its peers would wait in jax.distributed's shutdown barrier for minutes
        return Ending(Cause.CORRUPT_CHECKPOINT, f"the checkpoint of step {_fmt(obs.resumed_from)} could not be "
                                                f"restored: {obs.restore_failed}", Stop.NOW, step=obs.resumed_from)
    if obs.port_in_use:  # the other ranks would wait out jax.distributed's initialization timeout
        return Ending(Cause.PORT_IN_USE, f"jax.distributed's coordinator could not listen: {obs.port_in_use}",
                      Stop.NOW, step=obs.step)
    if obs.out_of_data and not obs.final_committed:
        # One process's data ends first: it stops, and its peers wait for it in the next collective (a hang).
        return Ending(Cause.OUT_OF_DATA, f"out of training data {_after(obs.step)}: {obs.out_of_data}", Stop.NOW,
                      step=obs.step)
    if obs.preempt:
        return Ending(Cause.PREEMPTED, f"{obs.preempt} {_after(obs.step)} (time limit or preemption)",
                      Stop.SAVE, step=obs.step, requeue=True)
    if obs.inject_sigterm:
        return Ending(Cause.PREEMPTED, f"SIGTERM {_after(obs.step)} (injected {obs.inject_sigterm})",
                      Stop.SAVE, step=obs.step)
    if obs.hang is not None and not failed:
        hang = obs.hang
        rank = hang.ordered(obs.stopped)[0]
        last = hang.last_steps.get(rank, obs.last_steps.get(rank))
        return Ending(Cause.HANG, f"hang: rank {rank} made no step progress for {hang.seconds_silent:.0f} s "
                                  f"(timeout {hang.timeout:.0f} s, last step {_fmt(last)})", Stop.HANG,
                      rank=rank, step=last)
    if failed and obs.silent_peers and not obs.failed_nodes and not obs.launch_failed:
        # The failed ranks only say that JAX's coordination service lost a peer's heartbeats, and that peer still
        # runs: it is hung (stopped or frozen); the ranks JAX aborted for it are not to blame.
        rank = obs.silent_peers[0]
        ended = next((e for e in failed if e.rank == obs.culprit), failed[0])
        last = obs.last_steps.get(rank)
        silent = ("stopped sending heartbeats to JAX's coordination service" if rank else
                  "stopped answering its peers' heartbeats (it hosts JAX's coordination service)")
        return Ending(Cause.HANG, f"hang: rank {rank} {silent} and "
                                  f"did not exit (last step {_fmt(last)}); rank {ended.rank} {ended.describe()} on "
                                  f"it{': ' + obs.rank_error if obs.rank_error else ''}", Stop.HANG, rank=rank,
                      step=last)
    if failed and obs.launch_failed:  # never a rank's exit code, never a crash loop: the nodes it names are left out
        lost = tuple(obs.failed_nodes)
        on = f" on {', '.join(lost)}" if lost else ""
        return Ending(Cause.STEP_FAILED, f"the job step could not start its ranks{on}: {obs.launch_failed}",
                      Stop.NOW, step=obs.step, nodes=lost, exclude=lost)
    if failed:
        first = next((e for e in failed if e.rank == obs.culprit), failed[0])
        last = obs.last_steps.get(first.rank)
        if obs.failed_nodes:
            lost = tuple(obs.failed_nodes)
            on_lost = next((e for e in failed if e.node in lost), None)  # a rank of the lost node, if seen yet
            if on_lost is None:  # only a survivor's failure seen (its collective broke): named as such
                return Ending(Cause.NODE_FAIL, f"node failure on {', '.join(lost)} ({_after(obs.step)}; rank "
                                               f"{first.rank} on {first.node or '?'} failed with it)", Stop.NOW,
                              step=obs.step, nodes=lost, exclude=lost)
            last = obs.last_steps.get(on_lost.rank)
            return Ending(Cause.NODE_FAIL, f"node failure on {', '.join(lost)} (rank {on_lost.rank} lost "
                                           f"{_after(last)})", Stop.NOW, rank=on_lost.rank, code=on_lost.returncode,
                          step=last, nodes=lost, exclude=lost)
        said = f": {obs.rank_error}" if obs.rank_error else ""
        if obs.out_of_memory:
            return Ending(Cause.OUT_OF_MEMORY, f"out of memory: rank {first.rank} {first.describe()} "
                                               f"{_after(last)}: {obs.out_of_memory}", Stop.NOW, rank=first.rank,
                          code=first.returncode, step=last, error=obs.rank_error)
        cause = Cause.TASK_SIGNAL if first.returncode < 0 and not first.ended_by_launcher else Cause.TASK_EXIT
        how = first.describe()
        before = next((e for e in failed if e is not first and not e.ended_by_launcher), None)
        if first.ended_by_launcher and before is not None:  # its own exit lost: srun ended it (AttemptWatch.culprit)
            how = f"failed (the launcher ended it with {first.signal_name} once rank {before.rank} {before.describe()})"
        return Ending(cause, f"rank {first.rank} {how} {_after(last)}{said}", Stop.NOW,
                      rank=first.rank, code=first.returncode, step=last, error=obs.rank_error)
    if len(obs.exits) >= obs.processes:
        if obs.final_committed:
            return Ending(Cause.COMPLETED, "", Stop.NONE, step=obs.step)
        return Ending(Cause.INCOMPLETE, f"all ranks exited 0 but step {obs.final_step} is not committed",
                      Stop.NONE, step=obs.step)
    return None
