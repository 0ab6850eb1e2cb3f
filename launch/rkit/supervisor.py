"""The attempt loop: start an attempt, watch it, classify how it ended, decide restart / finish / stop.

The policy (`decide`) is a pure function of the tally so far and one attempt's outcome, so it can be
tested exhaustively; `Supervisor` does the I/O: the backend, the run directory's events, the clock.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .backends.local import LocalBackend, RankExit
from .backends.slurm import NotEnoughNodes
from .errors import RkitError
from .image import ImageIdentity
from .inject import Injection, pending
from .policy import Action, Budgets, Cause, Decision, Outcome, Progress, RunState, Tally, decide, tally_from_events
from .rundir import RunDir, write_json_atomic
from .telemetry.metrics import MetricsTail, repair_tail
from .telemetry.stragglers import find_stragglers
from .trainers import maxtext
from .watchdog import HangPolicy, HangWatch


@dataclass
class Supervisor:
    run: RunDir
    resolved: dict
    injections: list[Injection]
    backend: LocalBackend
    base_env: dict[str, str]
    jax_cache_dir: str
    host_env: dict[str, str] = field(default_factory=dict)
    image: ImageIdentity | None = None
    on_progress: Callable[[Progress], None] = lambda p: None
    poll_seconds: float = 0.1
    clock: Callable[[], float] = time.monotonic
    _interrupted: bool = field(default=False, init=False)
    _preempt: str | None = field(default=None, init=False)
    _step_times: list[float] = field(default_factory=list, init=False)  # the run's, for hang_timeout: auto

    # ------------------------------------------------------------ signals

    def request_stop(self, signum: int = signal.SIGINT, frame: object = None) -> None:
        self._interrupted = True

    def request_preempt(self, signum: int = signal.SIGUSR1, frame: object = None) -> None:
        """Time limit or preemption (Slurm's --signal=B:USR1@lead): save, stop, requeue."""
        self._preempt = signal.Signals(signum).name

    def excluded(self) -> list[str]:
        return list(getattr(self.backend, "exclude", []))

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGTERM, self.request_stop)

    # ------------------------------------------------------------ loop

    @property
    def processes(self) -> int:
        res = self.resolved["resources"]
        return res["nodes"] * res["processes_per_node"]

    def final_committed(self) -> bool:
        latest = maxtext.latest_committed_step(self.run)
        return latest is not None and latest >= maxtext.final_step(self.resolved)

    def next_attempt_number(self) -> int:
        return max(self.run.attempt_numbers(), default=0) + 1

    def run_to_end(self) -> RunState:
        r = self.resolved["resilience"]
        budgets = Budgets(r["max_restarts"], r["max_infra_restarts"], r["crash_loop_limit"])
        events = self.run.events()
        tally = tally_from_events(events)
        progress = Progress(total_steps=int(self.resolved["trainer"]["steps"]))
        progress.committed = maxtext.latest_committed_step(self.run)
        if self.final_committed():
            self.run.emit("run.finished", reason="the final step was already committed; nothing to run",
                          committed_step=progress.committed)
            return RunState.FINISHED
        lost = self._lost_attempt(events)
        if lost is not None:
            decision, tally = decide(tally, lost[1], budgets, False)
            self._record_end(lost[0], lost[1], decision, tally)
            if decision.action is Action.GIVE_UP:
                self.run.emit("run.gave_up", reason=decision.reason, committed_step=lost[1].committed_after)
                return RunState.GAVE_UP
        while True:
            self.check_image()
            outcome = self.run_attempt(progress, pending(self.injections, self.run.events()))
            final = self.final_committed()
            decision, tally = decide(tally, outcome, budgets, final)
            self._record_end(progress.attempt, outcome, decision, tally)
            if decision.action is Action.FINISH:
                self.run.emit("run.finished", reason=decision.reason, committed_step=outcome.committed_after)
                return RunState.FINISHED
            if decision.action is Action.GIVE_UP:
                self.run.emit("run.gave_up", reason=decision.reason, committed_step=outcome.committed_after)
                return RunState.GAVE_UP
            if decision.action is Action.STOP:
                self.run.emit("run.interrupted", reason=decision.reason, committed_step=outcome.committed_after)
                return RunState.INTERRUPTED
            if decision.action is Action.REQUEUE:
                self.run.emit("job.requeue_requested", reason=decision.reason,
                              committed_step=outcome.committed_after, excluded=list(self.excluded()))
                return RunState.REQUEUED

    def _record_end(self, attempt: int, outcome: Outcome, decision: Decision, tally: Tally) -> None:
        self.run.emit("attempt.ended", attempt=attempt, cause=outcome.cause.value, detail=outcome.detail,
                      committed_step=outcome.committed_after, decision=decision.action.value, reason=decision.reason,
                      tally=tally.as_dict())

    def _lost_attempt(self, events: list[dict]) -> tuple[int, Outcome] | None:
        """An attempt that started and never ended: its supervisor died with it (Slurm requeued the job after
        the batch host failed, or the machine was lost). It counts against the infrastructure budget."""
        started = [e for e in events if e.get("event") == "attempt.started"]
        if not started:
            return None
        attempt = started[-1]["attempt"]
        if any(e.get("event") == "attempt.ended" and e.get("attempt") == attempt for e in events):
            return None
        restarts = os.environ.get("SLURM_RESTART_COUNT", "0") or "0"
        how = (f"node failure: Slurm requeued the job (SLURM_RESTART_COUNT={restarts})" if restarts != "0"
               else "the supervisor was killed or its machine was lost")
        return attempt, Outcome(Cause.LOST, started[-1].get("resume_from_step"),
                                maxtext.latest_committed_step(self.run),
                                f"attempt {attempt} ended with its supervisor ({how})")

    def check_image(self) -> None:
        """The SIF must be the one the run was stamped with: never silently run different software."""
        if self.image is None:
            return
        try:
            self.image.check_unchanged()
        except RkitError as exc:
            self.run.emit("run.gave_up", reason=f"image check failed before attempt "
                                                f"{self.next_attempt_number()}: {exc}")
            raise

    def run_attempt(self, progress: Progress, injections: list[Injection]) -> Outcome:
        attempt = self.next_attempt_number()
        attempt_dir = self.run.attempt_dir(attempt)
        attempt_dir.mkdir(parents=True, exist_ok=False)
        committed_before = maxtext.latest_committed_step(self.run)
        progress.attempt, progress.committed, progress.step = attempt, committed_before, committed_before
        progress.message = f"attempt {attempt}: starting"
        self.on_progress(progress)

        self.run.metrics_dir.mkdir(exist_ok=True)
        for rank in range(self.processes):
            repair_tail(self.run.metrics_file(rank))
        tails = {rank: MetricsTail(self.run.metrics_file(rank)) for rank in range(self.processes)}
        for tail in tails.values():
            tail.skip_existing()
        in_trainer = [i for i in injections if i.in_trainer]
        sigterm_at = min((i for i in injections if i.kind == "sigterm"), key=lambda i: i.step, default=None)

        env = dict(self.base_env)
        env.update({"RKIT_RUN_DIR": str(self.run.path.resolve()), "RKIT_ATTEMPT": str(attempt),
                    "RKIT_BASE_CONFIG": self.resolved["trainer"]["base_config"],
                    "RKIT_INJECT": _json([i.as_dict() for i in in_trainer])})
        args = maxtext.maxtext_overrides(self.resolved, self.run, self.jax_cache_dir)
        try:
            request = self.backend.prepare(attempt=attempt, processes=self.processes, trainer_args=args,
                                           base_env=env, attempt_dir=attempt_dir, cwd=Path.cwd(),
                                           host_env=self.host_env)
        except NotEnoughNodes as exc:
            self.run.emit("attempt.no_nodes", attempt=attempt, healthy=exc.healthy, excluded=exc.excluded)
            return Outcome(Cause.NODE_FAIL, committed_before, committed_before, str(exc), requeue=True)
        started = time.time()
        info = {"attempt": attempt, "started": started, "backend": self.backend.name,
                "excluded_nodes": self.excluded(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                "image": None if self.image is None else {"path": self.image.path, "sha256": self.image.sha256},
                "resume_from_step": committed_before, "injections": [i.spec for i in injections],
                "launch": _describe_request(request, self.run)}
        try:
            handle = self.backend.submit(request)
        except OSError as exc:
            return Outcome(Cause.LAUNCH_ERROR, committed_before, committed_before, f"{exc}")
        info["nodes"] = self.backend.nodes(handle)
        procs = getattr(handle, "procs", None)
        info["pids"] = {r: p.pid for r, p in procs.items()} if procs is not None else {"srun": handle.proc.pid}
        write_json_atomic(attempt_dir / "attempt.json", info)
        self.run.emit("attempt.started", attempt=attempt, resume_from_step=committed_before,
                      nodes=info["nodes"], processes=self.processes, injections=info["injections"])

        first_step_seen = False
        watch = HangWatch(HangPolicy.from_resolved(self.resolved), ranks=list(range(self.processes)),
                          started=self.clock(), step_times=self._step_times)
        stragglers = StragglerWatch(self.run, attempt, float(self.resolved["observability"]["straggler_factor"]),
                                    self.clock)
        requeue = False
        sig: dict = {}  # what identifies a failure (Outcome.signature)
        cause: Cause | None = None
        detail = ""
        preempt_deadline: float | None = None
        while True:
            for rank, tail in tails.items():
                for m in tail.poll():
                    watch.progress(rank, m.step, m.step_time, self.clock())
                    stragglers.add(m)
                    progress.step = m.step if rank == 0 or progress.step is None else max(progress.step, m.step)
                    if rank == 0 and m.tokens_per_sec_per_device:
                        progress.tokens_per_sec = m.tokens_per_sec_per_device * self.processes
                    if not first_step_seen:
                        first_step_seen = True
                        self.run.emit("attempt.first_step", attempt=attempt, step=m.step, rank=rank,
                                      seconds_since_start=round(time.time() - started, 3))
            stragglers.check()
            progress.committed = maxtext.latest_committed_step(self.run)
            progress.message = f"attempt {attempt}"
            self.on_progress(progress)

            exits = self.backend.poll(handle)
            failed = [e for e in exits.values() if e.returncode != 0]
            if self._interrupted and cause is None and (down := self.backend.down_nodes(handle)):
                # Slurm ends a job (without --no-kill) when one of its nodes dies, and requeues it: a node failure
                # (recorded, the node excluded from this job for good), not the user's interrupt.
                cause = Cause.NODE_FAIL
                detail = f"node failure on {', '.join(down)}: Slurm ended the job (at step {_fmt(progress.step)})"
                self.run.emit("attempt.failed", attempt=attempt, cls=cause.value, rank=None, exit_code=None,
                              signal="SIGTERM", last_step=progress.step, node=down[0], lost_nodes=down)
                self._exclude(down)
                requeue, sig = True, {"nodes": tuple(down)}
                self.backend.stop(handle, grace=0)
                break
            if self._interrupted and cause is None:
                cause, detail = Cause.INTERRUPTED, "interrupted by the user"
                self.run.emit("stop.requested", attempt=attempt, reason="interrupt (Ctrl-C / SIGTERM)",
                              grace_seconds=self._grace)
                self.backend.stop(handle, grace=self._grace)
                break
            if self._preempt and cause is None:
                cause = Cause.PREEMPTED
                detail = f"{self._preempt} at step {_fmt(progress.step)} (time limit or preemption)"
                requeue = True
                preempt_deadline = self._request_save(handle, attempt, progress.step, reason="signal from Slurm",
                                                      received=self._preempt)
            if (sigterm_at is not None and cause is None and progress.step is not None
                    and progress.step >= sigterm_at.step):
                cause, detail = Cause.PREEMPTED, f"SIGTERM at step {progress.step} (injected {sigterm_at.spec})"
                self.run.emit("inject.fired", index=sigterm_at.index, kind="sigterm", step=progress.step,
                              attempt=attempt, spec=sigterm_at.spec)
                preempt_deadline = self._request_save(handle, attempt, progress.step, reason="injected")
            hang = watch.check(self.clock()) if cause is None and not failed else None
            if hang is not None:
                cause = Cause.HANG
                detail, rank = self._end_hung_attempt(handle, attempt, hang, info["nodes"])
                sig = {"rank": rank, "step": hang.last_steps.get(rank)}
                break
            if failed and cause is None:
                first = failed[0]
                for m in tails[first.rank].poll():  # its last lines may have landed after this round's read
                    watch.progress(first.rank, m.step, m.step_time, self.clock())
                last = tails[first.rank].last.step if tails[first.rank].last else None
                sig = {"rank": first.rank, "code": first.returncode, "step": last}
                node = first.node or info["nodes"][0]
                lost = list(getattr(handle, "failed_nodes", []))
                if lost:
                    cause = Cause.NODE_FAIL
                    detail = f"node failure on {', '.join(lost)} (rank {first.rank} lost at step {_fmt(last)})"
                    requeue = self._exclude(lost)
                    sig["nodes"] = tuple(lost)
                else:
                    cause = Cause.TASK_SIGNAL if first.returncode < 0 else Cause.TASK_EXIT
                    detail = f"rank {first.rank} {first.describe()} at step {_fmt(last)}"
                self.run.emit("attempt.failed", attempt=attempt, cls=cause.value, rank=first.rank,
                              exit_code=first.returncode if first.returncode >= 0 else None,
                              signal=first.signal_name, last_step=last, node=node, lost_nodes=lost)
                # One rank is gone: its peers would hang in a collective; end the attempt now.
                self.backend.stop(handle, grace=0)
                break
            if len(exits) == self.processes:
                break
            if preempt_deadline is not None and self.clock() >= preempt_deadline:
                self.run.emit("preempt.escalated", attempt=attempt, signal="SIGKILL",
                              still_running=self.backend.running(handle))
                self.backend.stop(handle, grace=0)
                break
            time.sleep(self.poll_seconds)

        committed_after = maxtext.latest_committed_step(self.run)
        if cause is None:
            cause = Cause.COMPLETED if self.final_committed() else Cause.INCOMPLETE
            if cause is Cause.INCOMPLETE:
                detail = f"all ranks exited 0 but step {maxtext.final_step(self.resolved)} is not committed"
        if cause is Cause.PREEMPTED:
            self.run.emit("preempt.saved" if committed_after != committed_before else "preempt.unsaved",
                          attempt=attempt, committed_step=committed_after, step=progress.step)
        info.update({"ended": time.time(), "cause": cause.value, "detail": detail,
                     "committed_step": committed_after,
                     "exits": {str(r): _exit_info(e) for r, e in sorted(handle.exits.items())}})
        write_json_atomic(attempt_dir / "attempt.json", info)
        return Outcome(cause, committed_before, committed_after, detail, requeue=requeue, **sig)

    def _end_hung_attempt(self, handle: object, attempt: int, hang: object, nodes: list[str]) -> tuple[str, int]:
        """Stack dumps where possible, then SIGTERM, a short grace, SIGKILL. Returns the failure detail and the
        rank it names (a stopped one first)."""
        stopped = self.backend.stopped_ranks(handle)
        ranks = sorted(hang.ranks, key=lambda r: (r not in stopped, hang.ranks.index(r)))
        rank = ranks[0]
        self.run.emit("attempt.hang", attempt=attempt, rank=rank, ranks=ranks, stopped_ranks=stopped,
                      node=nodes[0] if len(nodes) == 1 else None, last_step=hang.last_steps.get(rank),
                      seconds_silent=hang.seconds_silent, timeout=hang.timeout)
        dumps = self.backend.dump_stacks(handle, self.run.attempt_dir(attempt) / "stacks", stopped)
        self.run.emit("attempt.stacks_dumped", attempt=attempt, how=dumps)
        # A hung collective does not save: a short grace, not the preemption one.
        self.backend.stop(handle, grace=min(self._grace, HANG_GRACE_SECONDS))
        return (f"hang: rank {rank} made no step progress for {hang.seconds_silent:.0f} s (timeout "
                f"{hang.timeout:.0f} s, last step {_fmt(hang.last_steps.get(rank))})"), rank

    def _request_save(self, handle: object, attempt: int, step: int | None, *, reason: str,
                      **fields: object) -> float:
        """The preemption path: ask every rank to save and stop (SIGTERM); returns the SIGKILL deadline."""
        self.run.emit("preempt.requested", attempt=attempt, step=step, signal="SIGTERM",
                      grace_seconds=self._grace, reason=reason, **fields)
        self.backend.signal_all(handle, signal.SIGTERM)
        return self.clock() + self._grace

    def _exclude(self, nodes: list[str]) -> bool:
        """Keep failed nodes out of the next step; True when too few healthy nodes are left (requeue)."""
        exclude = getattr(self.backend, "exclude", None)
        if exclude is None:
            return False
        exclude.extend(n for n in nodes if n not in exclude)
        healthy = self.backend.healthy_nodes()
        needed = self.resolved["resources"]["nodes"]
        self.run.emit("nodes.excluded", nodes=nodes, excluded=list(exclude), healthy=healthy,
                      reason="implicated in a node failure")
        return len(healthy) < needed

    @property
    def _grace(self) -> float:
        return float(self.resolved["resilience"]["signal_grace_seconds"])


HANG_GRACE_SECONDS = 10.0


@dataclass
class StragglerWatch:
    """Per-node step times of one attempt (a recent window); every `every` seconds, nodes well above the others
    are flagged with a `node.straggler` event (once per node and attempt)."""

    run: RunDir
    attempt: int
    factor: float
    clock: Callable[[], float]
    every: float = 15.0
    window: int = 2000
    lines: list[dict] = field(default_factory=list)
    flagged: set[str] = field(default_factory=set)
    first_step: int | None = None
    _next: float = 0.0

    def add(self, m: object) -> None:
        if m.node is None or m.step_time is None:
            return
        if self.first_step is None:
            self.first_step = m.step
        self.lines.append({"node": m.node, "step": m.step, "step_time": m.step_time, "attempt": self.attempt})
        del self.lines[:-self.window]

    def check(self) -> None:
        now = self.clock()
        if now < self._next:
            return
        self._next = now + self.every  # also when there is one node: this runs on every poll of the supervisor
        if len({line["node"] for line in self.lines}) < 2:
            return
        for s in find_stragglers(self.lines, self.factor, start_step=self.first_step):
            if s.node not in self.flagged:
                self.flagged.add(s.node)
                self.run.emit("node.straggler", **s.as_dict(), factor=self.factor,
                              reason=f"median step time {s.median:.3f} s is {s.ratio:.2f}x the other nodes' "
                                     f"{s.others_median:.3f} s")


def _exit_info(e: RankExit) -> dict:
    return {"exit_code": e.returncode if e.returncode >= 0 else None, "signal": e.signal_name, "node": e.node}


def _describe_request(request: object, run: RunDir) -> dict:
    ranks = getattr(request, "ranks", None)
    if ranks is not None:
        return {"ranks": [{"rank": r.rank, "argv": r.argv, "log": str(r.log.relative_to(run.path))} for r in ranks]}
    return {"argv": request.argv, "nodes": request.nodes, "log": str(request.log.relative_to(run.path))}


def _fmt(step: int | None) -> str:
    return "?" if step is None else str(step)


def _json(value: object) -> str:
    import json

    return json.dumps(value)


def default_jax_cache_dir() -> str:
    return os.environ.get("RKIT_JAX_CACHE_DIR") or str(Path.home() / ".cache" / "rkit" / "jax")
