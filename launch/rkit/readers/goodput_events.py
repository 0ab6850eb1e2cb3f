"""What goodput (readers/goodput.py) reads of a run's events, folded in one event at a time: its sessions, its
attempts' times (AttemptTimes), the queue and requeue waits; and AttemptSteps, what it needs of one attempt's
metrics lines. rkit.readers.digest keeps an EventFold between `rkit status` calls and feeds it only new events."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from rkit.contract.events import EV

SESSION_START = (EV.RUN_SUBMITTED, EV.RUN_RESUMED)
SESSION_END = (EV.RUN_FINISHED, EV.RUN_GAVE_UP, EV.RUN_INTERRUPTED)


@dataclass
class AttemptTimes:
    """One attempt's times, as its events give them (EventFold)."""

    number: int
    started: float
    ended: float | None = None
    first_step: float | None = None
    failed: float | None = None
    cause: str | None = None
    hangs: list[tuple[float, float]] = field(default_factory=list)
    last_seen: float | None = None
    agents_started: float | None = None  # the slowest rank's agent.started
    agents_ready: float | None = None  # the slowest rank's agent.ready
    distributed_seconds: float = 0.0  # the slowest rank's
    restore: tuple[float, float] | None = None  # Orbax's restore, the first rank's start to the last's end
    detect_seconds: float = 0.0  # a node failure: from the dead node's last heartbeat to attempt.failed


@dataclass(frozen=True)
class AttemptSteps:
    """What goodput needs of one attempt's metrics lines: on its reference rank (_reference_lines) the first
    line's time, the newest real (not estimated) time and the split of its step times (_step_shares); over
    every rank, the newest time. `attempt_steps` makes it from placed lines, `rkit.readers.digest` from its columns."""

    first_t: float | None
    last_timed_t: float | None
    shares: dict[str, float]
    newest_t: float | None


class Fold:
    """Events fed in one at a time (`feed`); `of` feeds a whole list to a new one."""

    def feed(self, e: dict) -> None:
        raise NotImplementedError

    @classmethod
    def of(cls, events: Iterable[dict]) -> Any:
        fold = cls()
        for e in events:
            fold.feed(e)
        return fold


@dataclass
class EventFold(Fold):
    """What goodput reads of the events, folded in one event at a time (`feed`), so that a reader that keeps one
    (rkit.readers.digest, for `rkit status`) feeds it only the events appended since: the sessions, the attempts, the
    queue and requeue waits and the newest time. Events without a numeric `t` count for none of them."""

    spans: list[tuple[float, float]] = field(default_factory=list)
    start: float | None = None  # the open session's
    attempts: dict[int, AttemptTimes] = field(default_factory=dict)
    waits: list[tuple[float, float, str]] = field(default_factory=list)
    waiting: tuple[float, str] | None = None
    previous_t: float | None = None
    newest_t: float | None = None
    agents: dict[int, dict[str, float]] = field(default_factory=dict)  # attempt -> agent times (before its start too)

    def feed(self, e: dict) -> None:
        kind, t = e.get("event"), e.get("t")
        if not isinstance(t, (int, float)):
            return
        self.newest_t = t if self.newest_t is None else max(self.newest_t, t)
        # sessions
        if kind in SESSION_START:
            if self.start is not None:  # the previous supervisor died without a final word: its gap is lost time
                self.spans.append((self.start, t))
            self.start = t
        elif kind in SESSION_END and self.start is not None:
            self.spans.append((self.start, t))
            self.start = None
        elif self.start is None and not self.spans:  # a log without run.submitted (a partial copy): start here
            self.start = t
        # attempts
        n = e.get("attempt")
        if n is not None and kind in (EV.AGENT_STARTED, EV.AGENT_READY):
            # A standby takes its rank before the supervisor records attempt.started: kept apart, by attempt.
            mine = self.agents.setdefault(n, {})
            key = "started" if kind == EV.AGENT_STARTED else "ready"
            mine[key] = max(mine.get(key, t), t)
            if kind == EV.AGENT_READY:
                mine["distributed"] = max(mine.get("distributed", 0.0), float(e.get("distributed_seconds") or 0.0))
        elif n is not None:
            if kind == EV.ATTEMPT_STARTED:
                self.attempts[n] = AttemptTimes(number=n, started=t, last_seen=t)
            elif (a := self.attempts.get(n)) is not None:
                a.last_seen = max(a.last_seen or t, t)
                if kind == EV.ATTEMPT_FIRST_STEP and a.first_step is None:
                    a.first_step = t
                    started, seconds = e.get("restore_started"), e.get("restore_seconds")
                    if isinstance(started, (int, float)) and isinstance(seconds, (int, float)) and seconds > 0:
                        a.restore = (float(started), float(started) + float(seconds))
                elif kind == EV.ATTEMPT_FAILED and a.failed is None:
                    a.failed = t
                    if isinstance(detect := e.get("detect_seconds"), (int, float)) and detect > 0:
                        a.detect_seconds = float(detect)
                elif kind == EV.ATTEMPT_ENDED:
                    a.ended, a.cause = t, e.get("cause")
                elif kind == EV.ATTEMPT_HANG:
                    a.hangs.append((t, float(e.get("seconds_silent") or 0.0)))
        # queue and requeue waits
        if kind == EV.JOB_SUBMITTED:
            self.waiting = (t, "queue")
        elif kind == EV.JOB_REQUEUED:
            self.waiting = (t, "requeue")
        elif kind == EV.JOB_STARTED:
            if self.waiting is not None:
                self.waits.append((self.waiting[0], t, self.waiting[1]))
            elif (e.get("restart_count") or 0) > 0 and self.previous_t is not None:
                self.waits.append((self.previous_t, t, "requeue"))  # Slurm requeued the job itself: no event said so
            self.waiting = None
        self.previous_t = t

    def sessions(self, now: float | None, last_record: float | None) -> tuple[list[tuple[float, float]], bool]:
        """The sessions' spans, the open one ending `now` (a live run) or at the last record; and whether live."""
        spans = list(self.spans)
        live = self.start is not None and now is not None
        if self.start is not None:
            end = now if now is not None else (last_record if last_record is not None else self.start)
            spans.append((self.start, max(self.start, end)))
        return spans, live

    def attempt_list(self, steps: dict[int, AttemptSteps]) -> list[AttemptTimes]:
        """The attempts by number (copies), last seen at their newest metrics line too."""
        out = []
        for number in sorted(self.attempts):
            a = replace(self.attempts[number])
            agents = self.agents.get(number, {})
            a.agents_started, a.agents_ready = agents.get("started"), agents.get("ready")
            a.distributed_seconds = agents.get("distributed", 0.0)
            mine = steps.get(number)
            if mine is not None and mine.newest_t is not None:
                a.last_seen = max(a.last_seen or mine.newest_t, mine.newest_t)
            out.append(a)
        return out

    def queue_intervals(self) -> list[tuple[float, float, str]]:
        # still in the queue: the session's end clips it
        return self.waits + ([(self.waiting[0], float("inf"), self.waiting[1])] if self.waiting is not None else [])
