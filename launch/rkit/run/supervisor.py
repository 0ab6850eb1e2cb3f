"""The attempt loop: start an attempt, watch it, classify how it ended, decide restart / finish / stop.

The policy (`decide`) is a pure function of the tally so far and one attempt's outcome, so it can be
tested exhaustively; `Supervisor` does the I/O: the backend, the run directory's events, the clock.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rkit.backends.base import Backend, Handle, NotEnoughNodes, RankExit, Request
from rkit.contract.config import Config
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir, write_json_atomic
from rkit.images.identity import ImageIdentity
from rkit.run import cadence, elastic, preflight
from rkit.run.attempt import attempt_request
from rkit.run.attemptend import AttemptEnd
from rkit.run.attemptrecord import close_record, lost_attempt, refuse_if_alive, started_at
from rkit.run.attemptwatch import AttemptWatch
from rkit.run.ending import Ending, Observation, Stop, classify
from rkit.run.exclusions import Exclusions
from rkit.run.oomkills import OomWatch
from rkit.run.policy import (
    FINAL_EVENTS,
    Action,
    Budgets,
    Cause,
    Decision,
    Outcome,
    Progress,
    RunState,
    Tally,
    decide,
    tally_from_events,
)
from rkit.run.tbmarks import mark_restart
from rkit.runtime.inject import Injection, pending
from rkit.runtime.telemetry.metrics import MetricsTail
from rkit.runtime.trainers import localtier, maxtext

Chronicle = Callable[[RunDir, Config, bool], None]


@dataclass
class Supervisor:
    run: RunDir
    config: Config
    injections: list[Injection]
    backend: Backend[Any, Any]
    base_env: dict[str, str]
    jax_cache_dir: str
    # What the readers get after each attempt's end (False) and after the final word (True): the caller's
    # (readers/outcome.chronicle: outcome.json at the end, status's digest each time); run/ reads nothing of theirs.
    chronicle: Chronicle
    host_env: dict[str, str] = field(default_factory=dict)
    image: ImageIdentity | None = None
    on_progress: Callable[[Progress], None] = lambda p: None
    # Called once, when the first attempt's ranks have started: what the caller loads only for the run's end (the
    # readers' imports) is loaded while the ranks import their trainer, not before they start or after they end.
    on_launched: Callable[[], None] = lambda: None
    poll_seconds: float = 0.1
    clock: Callable[[], float] = time.monotonic
    planned: tuple[int, list[int], Request] | None = None  # the plan's first attempt: (number, injections, request)
    _interrupted: bool = field(default=False, init=False)
    _preempt: str | None = field(default=None, init=False)
    _by_supervisor: list[Injection] = field(default_factory=list, init=False)  # preempt, lose_node: pending
    _exclusions: Exclusions | None = field(default=None, init=False)
    _start_events: list[dict] | None = field(default=None, init=False)  # the newest when this one started
    step_times: list[float] = field(default_factory=list, init=False)  # the run's, for hang_timeout: auto
    shape: elastic.Shape | None = field(default=None, init=False)  # the current attempt's size (run/elastic.py)
    period: int | None = field(default=None, init=False)  # the current attempt's checkpoint period

    # ------------------------------------------------------------ signals

    def request_stop(self, signum: int = signal.SIGINT, frame: object = None) -> None:
        self._interrupted = True

    def request_preempt(self, signum: int = signal.SIGUSR1, frame: object = None) -> None:
        """Time limit or preemption (Slurm's --signal=B:USR1@lead): save, stop, requeue."""
        self._preempt = signal.Signals(signum).name

    def excluded(self) -> list[str]:
        return list(self.backend.exclude)

    @property
    def exclusions(self) -> Exclusions:
        if self._exclusions is None:
            self._exclusions = Exclusions(self.run, self.config, self.backend, clock=self.clock)
        return self._exclusions

    def launch_request(self, attempt: int, in_trainer: list[Injection], attempt_dir: Path) -> Request:
        """What the backend starts for this attempt: the plan's request for the attempt it planned (what
        `rkit run --dry-run` printed), else one made the same way (attempt_request)."""
        planned, self.planned = self.planned, None
        if planned is not None and planned[0] == attempt and planned[1] == [i.index for i in in_trainer] \
                and not (self.shape and self.shape.shrunk) and not self.config.checkpoint.auto:
            return planned[2]
        return attempt_request(self.backend, self.config, self.run, self.image, self.base_env, self.host_env,
                               self.jax_cache_dir, attempt, in_trainer, attempt_dir, self.shape, self.period)

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGTERM, self.request_stop)

    # ------------------------------------------------------------ loop

    @property
    def processes(self) -> int:
        return (self.shape or elastic.shape(self.config)).processes

    def _resize(self, attempt: int) -> bool:
        """The next attempt's size from the healthy nodes (run/elastic.py); a change is an event. False when
        too few are healthy to train here."""
        size = elastic.size_for(self.config, len(self.backend.healthy_nodes()))
        if size is None:
            return False
        if self.shape is not None:
            before = self.shape.nodes
        else:  # this supervisor's first attempt: the size the run's last attempt had (a requeue may grow it back)
            before = next((e["node_count"] for e in reversed(self.start_events()) if e.get("event") in (
                EV.RUN_RESIZED, EV.ATTEMPT_STARTED) and e.get("node_count")), self.config.resources.nodes)
        self.shape = elastic.shape(self.config, size)
        if before != size:
            # hang_timeout auto learned the step time at the old size: a step's work per device scales with the
            # accumulation, so the median it carries over scales too (a shrink by more than hang_factor would
            # otherwise make every shrunk attempt a false hang)
            self.step_times[:] = elastic.rescaled(self.step_times, self.config, before, size)
            self.run.emit(EV.RUN_RESIZED, attempt=attempt, node_count=size, full_nodes=self.shape.full_nodes,
                          processes=self.shape.processes,
                          gradient_accumulation_steps=self.shape.gradient_accumulation_steps,
                          reason="shrunk: nodes lost and no spare left; the global batch is kept by accumulation"
                          if self.shape.shrunk else "grown back to the full size")
        return True

    def start_events(self) -> list[dict]:
        """The newest events when this supervisor started, read once: what the start needs (the newest
        attempt.ended's tally, the newest attempt.started, lost or not, and its size)."""
        if self._start_events is None:
            self._start_events = self.run.recent_events(lambda evs: {EV.ATTEMPT_ENDED, EV.ATTEMPT_STARTED} <= {
                e.get("event") for e in evs})
        return self._start_events

    def final_committed(self) -> bool:
        return maxtext.final_committed(self.run, self.config.trainer.final_step)

    def next_attempt_number(self) -> int:
        return max(self.run.attempt_numbers(), default=0) + 1

    def run_to_end(self) -> RunState:
        try:
            return self._run_to_end()
        finally:
            if self.backend.standby is not None:
                self.backend.standby.dismiss()
            if self.backend.liveness is not None:
                self.backend.liveness.close()

    def _run_to_end(self) -> RunState:
        r = self.config.resilience
        events = self.start_events()
        tally = tally_from_events(events)
        period = next((e.get("checkpoint_period") for e in reversed(events)  # period auto: the last attempt's
                       if e.get("event") == EV.ATTEMPT_STARTED and e.get("checkpoint_period")), None)
        budgets = Budgets(r.max_restarts, r.max_infra_restarts, r.crash_loop_limit,
                          r.window_steps(self.config.checkpoint.fixed_period or period))
        progress = Progress(total_steps=int(self.config.trainer.steps))
        progress.committed = maxtext.latest_committed_step(self.run)
        if self.final_committed():
            return self._final(EV.RUN_FINISHED, reason="the final step was already committed; nothing to run",
                               committed_step=progress.committed)
        lost = lost_attempt(self.run, events)
        if lost is not None:
            refuse_if_alive(self.run, lost[0])
            decision, tally = decide(tally, lost[1], budgets, False)
            self._record_end(lost[0], lost[1], decision, tally)
            close_record(self.run, lost[0], lost[1])
            if decision.action is Action.GIVE_UP:
                return self._final(EV.RUN_GAVE_UP, reason=decision.reason, committed_step=lost[1].committed_after)
        preflight.shared_paths(self.run, self.backend, self.image, self.next_attempt_number())
        vendor = preflight.gpu_vendor(self.config.gpus_per_node, self.image)
        while True:
            number = self.next_attempt_number()
            preflight.no_planted_links(self.run, number)
            self.image = preflight.image_unchanged(self.run, self.image, number)
            if unfit := preflight.gpu_health(self.run, self.backend, vendor, number):
                self.exclusions.add(sorted(unfit), reason="GPU health check: " + "; ".join(
                    f"{node}: {why}" for node, why in sorted(unfit.items())))
            outcome = self.run_attempt(progress, pending(self.injections, self.run.events()) if self.injections else [])
            final = self.final_committed()  # the refill window counts in this attempt's period (period auto)
            decision, tally = decide(tally, outcome, replace(budgets, window_steps=r.window_steps(self.period)), final)
            self._record_end(progress.attempt, outcome, decision, tally)
            if decision.action in FINAL_WORD:
                return self._final(FINAL_WORD[decision.action], reason=decision.reason,
                                   committed_step=outcome.committed_after)
            if decision.action is Action.REQUEUE:
                self.exclusions.readmit(requeue=True)  # the next job's ExcNodeList: only nodes still unfit
                self.run.emit(EV.JOB_REQUEUE_REQUESTED, reason=decision.reason,
                              committed_step=outcome.committed_after, excluded=list(self.excluded()))
                return RunState.REQUEUED

    def _final(self, kind: str, **fields: object) -> RunState:
        """The run's final word, then what it came out as (outcome.json: `rkit compare`, `rkit status`)."""
        self.run.emit(kind, **fields)
        self.chronicle(self.run, self.config, True)
        return FINAL_EVENTS[kind]

    def _record_end(self, attempt: int, outcome: Outcome, decision: Decision, tally: Tally) -> None:
        self.run.emit(EV.ATTEMPT_ENDED, attempt=attempt, cause=outcome.cause.value, detail=outcome.detail,
                      committed_step=outcome.committed_after, decision=decision.action.value, reason=decision.reason,
                      tally=tally.as_dict(), **({"planned": True} if outcome.planned else {}))
        if decision.action not in FINAL_WORD:  # else _final's, right after
            self.chronicle(self.run, self.config, False)

    def run_attempt(self, progress: Progress, injections: list[Injection]) -> Outcome:
        """Start one attempt, watch it until `classify` says how it ends, end it that way, record it."""
        attempt = self.next_attempt_number()
        attempt_dir = self.run.attempt_dir(attempt)
        attempt_dir.mkdir(parents=True, exist_ok=False)
        self.exclusions.readmit(requeue=False)
        sized = self._resize(attempt)
        self.period = cadence.period_for(self.run, self.config, attempt)
        suspect = preflight.checkpoints(self.run)
        if self.config.checkpoint.local_dir:  # a left-out node's local steps are on a disk no attempt reads
            localtier.forget(self.run, self.excluded())
        committed_before = maxtext.latest_committed_step(self.run)
        if suspect is not None:
            return Outcome(Cause.CHECK_SUSPECT, committed_before, committed_before, suspect)
        # Earlier attempts' summaries of the steps this one trains again are dropped by TensorBoard (tbmarks.py).
        restart_step = 0 if committed_before is None else committed_before + 1
        tb_note = mark_restart(self.run.tensorboard_dir, restart_step)
        progress.attempt, progress.committed, progress.step = attempt, committed_before, committed_before
        progress.message = f"attempt {attempt}: starting"
        self.on_progress(progress)

        self.run.metrics_dir.mkdir(exist_ok=True)
        tails = {rank: MetricsTail.at_end(self.run.metrics_file(rank)) for rank in range(self.processes)}
        in_trainer = [i for i in injections if i.in_trainer]
        sigterm_at = min((i for i in injections if i.kind == "sigterm"), key=lambda i: i.step, default=None)
        self._by_supervisor = [i for i in injections if i.kind in ("preempt", "lose_node")]

        try:
            if not sized:
                raise NotEnoughNodes(self.backend.healthy_nodes(), self.excluded())
            request = self.launch_request(attempt, in_trainer, attempt_dir)
        except NotEnoughNodes as exc:
            self.run.emit(EV.ATTEMPT_NO_NODES, attempt=attempt, healthy=exc.healthy, excluded=exc.excluded)
            return Outcome(Cause.NODE_FAIL, committed_before, committed_before, str(exc), requeue=True)
        started = time.time()
        info = {"attempt": attempt, "started": started, "backend": self.backend.name,
                "excluded_nodes": self.excluded(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                "image": None if self.image is None else {"path": self.image.path, "sha256": self.image.sha256},
                "resume_from_step": committed_before, "injections": [i.spec for i in injections],
                "launch": request.as_record(self.run.path), "shape": self.shape.as_record()}
        try:
            handle = self.backend.submit(request)
        except OSError as exc:
            return Outcome(Cause.LAUNCH_ERROR, committed_before, committed_before, f"{exc}")
        try:
            info["nodes"] = self.backend.nodes(handle)
            info["pids"] = handle.pids()
            info["host"] = socket.gethostname()
            info["pid_started"] = {name: started_at(pid) for name, pid in info["pids"].items()}
            write_json_atomic(self.run.attempt_record(attempt), info)
            self.run.emit(EV.ATTEMPT_STARTED, attempt=attempt, resume_from_step=committed_before,
                          nodes=info["nodes"], node_count=self.shape.nodes, processes=self.processes,
                          injections=info["injections"],
                          gradient_accumulation_steps=self.shape.gradient_accumulation_steps,
                          checkpoint_period=self.period,
                          data_position=maxtext.resume_data_position(self.run, committed_before),
                          **({"tensorboard": tb_note} if tb_note else {}))
            self.on_launched()
            self.on_launched = lambda: None
            watch = AttemptWatch(self, attempt, started, tails, progress, resumed_from=committed_before,
                                 oom=OomWatch.of(list(info["pids"].values())))
            if self.backend.liveness is not None:
                self.backend.liveness.watch(attempt, info["nodes"], self.config.resources.processes_per_node)
            ending = self._watch(handle, attempt, watch, info["nodes"], sigterm_at)
        except BaseException:  # the supervisor itself failed (an unwritable run directory): no rank runs on
            self.backend.stop(handle, grace=0)
            raise
        if ending.cause is Cause.CORRUPT_CHECKPOINT and committed_before is not None:
            # The run directory's step, unless a rank said the step it failed on was its local copy (it moved
            # that aside itself: the run directory's step of the same number is not suspect).
            said = watch.logs.restore_verdict()
            if said is None or said[1] == "persistent":
                preflight.quarantine(self.run, committed_before if said is None else said[0], ending.detail)
        committed_after = maxtext.latest_committed_step(self.run)
        too_few = self.exclusions.add(list(ending.exclude)) if ending.exclude else False
        if too_few and not ending.requeue:  # a node excluded earlier may be back: asked before the job is given up
            too_few = not self.exclusions.rescue(list(ending.exclude))
        requeue = ending.requeue or too_few
        # Saved means a checkpoint at or after the step the save was asked at: nothing is recomputed (a period
        # save that committed meanwhile is not the preemption save). A saved preemption is a planned end.
        saved = ending.cause is Cause.PREEMPTED and committed_after is not None and \
            committed_after != committed_before and (ending.step is None or committed_after >= ending.step)
        if ending.cause is Cause.PREEMPTED:
            self.run.emit(EV.PREEMPT_SAVED if saved else EV.PREEMPT_UNSAVED, attempt=attempt,
                          committed_step=committed_after, requested_at_step=ending.step, step=progress.step)
        info.update({"ended": time.time(), "cause": ending.cause.value, "detail": ending.detail, "error": ending.error,
                     "committed_step": committed_after,
                     "exits": {str(r): e.as_record() for r, e in sorted(handle.exits.items())}})
        write_json_atomic(self.run.attempt_record(attempt), info)
        return Outcome(ending.cause, committed_before, committed_after, ending.detail, requeue=requeue,
                       rank=ending.rank, code=ending.code, step=ending.step, nodes=ending.nodes, error=ending.error,
                       planned=saved)

    def _watch(self, handle: Handle, attempt: int, watch: AttemptWatch, nodes: list[str],
               sigterm_at: Injection | None) -> Ending:
        """Poll until `classify` says how the attempt ends, end it that way (a save waits for the ranks up to the
        grace), and return the ending."""
        ending: Ending | None = None
        save_deadline: float | None = None
        while True:
            watch.read()
            exits = self.backend.poll(handle)
            if self.backend.standby is not None:
                if watch.first_step_seen:  # after the start-up: a standby's imports would slow it down
                    self.backend.standby.fill()
                for note in self.backend.standby.check():
                    self.run.emit(EV.STANDBY, attempt=attempt, **note)
            dead = self._liveness(attempt, watch) if ending is None else {}
            if ending is None and not (dead or self._interrupted or self._preempt or handle.failed_nodes
                                       or handle.launch_failed) \
                    and watch.culprit_may_lag([e for e in exits.values() if e.returncode != 0],
                                              everyone_exited=len(exits) >= self.processes,
                                              probing=bool(getattr(self.backend.liveness, "probes", None))):
                time.sleep(self.poll_seconds)  # the peer a failed rank blames is about to be seen exiting
                continue
            if ending is None:
                self._fire(handle, attempt, watch.progress.step)
                observed = self._observe(handle, watch, exits, sigterm_at, dead)
                ending = classify(observed)
                if ending is not None:
                    save_deadline = self._end(ending, observed, handle, attempt, nodes, sigterm_at)
            if ending is not None and ending.stop is not Stop.SAVE:
                break
            if ending is not None and len(exits) >= self.processes:
                break  # the ranks saved and stopped
            if save_deadline is not None and self.clock() >= save_deadline:
                self.run.emit(EV.PREEMPT_ESCALATED, attempt=attempt, signal="SIGKILL",
                              still_running=self.backend.running(handle))
                self.backend.stop(handle, grace=0)
                break
            time.sleep(self.poll_seconds)
        return ending

    def _liveness(self, attempt: int, watch: AttemptWatch) -> dict[str, str]:
        """Heartbeats and probes (liveness.py): the nodes confirmed dead in this pass, with why."""
        liveness = self.backend.liveness
        if liveness is None:
            return {}
        notes, dead = liveness.check(watch.hang.stepped)
        for note in notes:
            self.run.emit(note.pop("event"), attempt=attempt, **note)
        return dead

    def _observe(self, handle: Handle, watch: AttemptWatch, exits: dict[int, RankExit],
                 sigterm_at: Injection | None, dead: dict[str, str]) -> Observation:
        failures = [e for e in exits.values() if e.returncode != 0]
        failed, culprit, said, oom = bool(failures), None, None, None
        if failed:
            watch.read(force=True)  # a failed rank's last lines may have landed after this round's read
            culprit, said, oom = watch.culprit(failures)
            exits = {**exits, culprit.rank: culprit}  # its own exit where srun's report lost it (an injected one)
            oom = handle.out_of_memory or oom  # Slurm's cgroup saw it on the rank's node
        step = watch.progress.step
        hang = None if failed else watch.hang.check(self.clock())
        everyone_exited = len(exits) >= self.processes
        return Observation(
            processes=self.processes, exits=tuple(exits.values()), last_steps=watch.last_steps(), step=step,
            failed_nodes=tuple(handle.failed_nodes), dead_nodes=dead, launch_failed=handle.launch_failed,
            jax_peer_lost=watch.jax_peer_lost(force=bool(dead)),
            down_nodes=tuple(self.backend.down_nodes(handle)) if self._interrupted else (),
            interrupted=self._interrupted, preempt=self._preempt,
            inject_sigterm=(sigterm_at.spec if sigterm_at is not None and step is not None
                            and step >= sigterm_at.step else None),
            hang=hang, disk_full=watch.disk_full(force=failed or hang is not None),
            restore_failed=watch.restore_failed(force=failed or hang is not None), resumed_from=watch.resumed_from,
            culprit=culprit.rank if culprit else None, rank_error=said, out_of_memory=oom,
            port_in_use=watch.port_in_use(force=failed),
            out_of_data=watch.out_of_data(force=failed or hang is not None or everyone_exited),
            stopped=tuple(self.backend.stopped_ranks(handle)) if hang is not None else (),
            silent_peers=(silent := watch.silent_peers(failures, [r for r in range(self.processes) if r not in exits])),
            silent_seconds=round(self.clock() - watch.hang.last_progress[silent[0]], 3)
            if silent and silent[0] in watch.hang.last_progress else None,
            final_step=self.config.trainer.final_step,
            final_committed=everyone_exited and not failed and self.final_committed())

    def _end(self, ending: Ending, observed: Observation, handle: Handle, attempt: int, nodes: list[str],
             sigterm_at: Injection | None) -> float | None:
        """Record how the attempt ends and end its processes that way; a save returns its SIGKILL deadline."""
        return AttemptEnd(self.run, self.backend, self.clock, self._grace).end(
            ending, observed, handle, attempt, nodes, preempt=self._preempt, sigterm_at=sigterm_at)

    def _fire(self, handle: Handle, attempt: int, step: int | None) -> None:
        """The supervisor's own injections at their step: preempt (Slurm's USR1, as request_preempt) and
        lose_node (the local launcher's node crash)."""
        for inj in [i for i in self._by_supervisor if step is not None and step >= i.step]:
            self._by_supervisor.remove(inj)
            node = self.backend.lose_node(handle, inj.rank) if inj.kind == "lose_node" else None
            self.run.emit(EV.INJECT_FIRED, index=inj.index, kind=inj.kind, step=step, attempt=attempt,
                          spec=inj.spec, **({"node": node} if node else {}))
            if inj.kind == "preempt":
                self._preempt = "SIGUSR1 (injected)"

    @property
    def _grace(self) -> float:
        return float(self.config.resilience.signal_grace_seconds)


# The decisions that end the run, and the event that says so.
FINAL_WORD = {Action.FINISH: EV.RUN_FINISHED, Action.GIVE_UP: EV.RUN_GAVE_UP, Action.STOP: EV.RUN_INTERRUPTED}
