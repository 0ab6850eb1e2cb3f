"""Goodput: where a run's wall time went, from events.jsonl and metrics/<rank>.jsonl alone.

Wall time is the sum of the run's sessions: a session opens at `run.submitted` / `run.resumed` and closes at the
run's final word (`run.finished`, `run.gave_up`, `run.interrupted`); a session still open ends `now` when the
caller says the run is live, else at the last record. The time between a final word and a later `--resume` is
nobody's loss and is not counted; a supervisor that died without a final word leaves its gap to "other".

Every second of the wall time goes to exactly one category, so the categories sum to the wall time:

- an attempt's start-up, `attempt.started` -> `attempt.first_step`, in five parts when its ranks' agents said
  when they started and were ready (agent.started, agent.ready; the slowest rank's times): startup (processes
  and containers start, or standbys take the ranks) -> import (MaxText and what it imports; ~0 for a warm rank)
  and distributed (jax.distributed's set-up, its share of agent.started -> agent.ready) -> compile (MaxText's
  set-up and compilation: agent.ready -> the first step, whose own time is mostly compilation) and restore (the
  checkpoint's restore inside it: from Orbax's own record in the ranks' logs, the first rank's start to the last
  rank's end, which attempt.first_step carries as restore_started and restore_seconds). Without the agents'
  events all of it is startup.
- productive, checkpoint, recompute: from the first step to the attempt's last step, split by the times of the
  steps after the first on one rank (rank 0, or the lowest rank with lines in that attempt). A step's time is the
  gap between its line's `t` and the previous one's (gaps tile the window; MaxText's own step_time carries
  compilation into the second or third step after a start), else MaxText's step_time for lines without `t`.
  * checkpoint: the excess over the attempt's median step time of the steps next to a save (s - 1, s, s + 1 for
    `s % checkpoint.period == 0`: where a save's blocking part shows depends on where it is measured, see
    _near_save); a step without a save adds ~0, since only the excess counts. The last save of a run happens
    after its last step and is in teardown.
  * recompute: the rest of the time of steps that were trained before (a restart went back to a checkpoint).
  * productive: the rest. Window time not covered by step times is "other".
- hang: from each `attempt.hang` event, `seconds_silent` back from the event.
- detect: a node failure found by rkit's liveness: from the dead node's last heartbeat to `attempt.failed`
  (its `detect_seconds`), the time the survivors waited for a peer that was gone.
- teardown: a failed attempt's last step (or its failure, when it never stepped) -> `attempt.ended`.
- shutdown: a completed attempt's last step -> `attempt.ended` (the final save and the processes' exit): the cost
  of ending well, not a failure's.
- queue: `job.submitted` -> the next `job.started`; requeue: `job.requeued` -> the next `job.started`, or, when
  Slurm requeued the job itself (a node died with the batch host), the last record before that `job.started`.
- other: whatever is left: the supervisor's own work between attempts, the step in flight of a live attempt.

Where intervals overlap (clocks of different hosts, late events) the more specific one wins (PRIORITY).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from rkit.contract.rundir import EV, RunDir
from rkit.runtime.telemetry import metrics

CATEGORIES = {
    "productive": "productive training",
    "startup": "start-up (processes, containers)",
    "failed_startup": "failed start-ups (attempts that failed before their first step)",
    "import": "imports (Python, JAX, MaxText)",
    "distributed": "jax.distributed set-up",
    "restore": "checkpoint restore",
    "compile": "compilation and MaxText's set-up",
    "checkpoint": "checkpoint saves",
    "recompute": "recomputed steps",
    "hang": "hang waits",
    "detect": "node failure detection",
    "queue": "queue wait",
    "requeue": "requeue wait",
    "teardown": "failure and teardown",
    "shutdown": "final save and shutdown",
    "other": "other",
}
PRIORITY = ("hang", "detect", "teardown", "shutdown", "failed_startup", "startup", "import", "distributed", "restore",
            "compile", "steps", "requeue", "queue")
SESSION_START = (EV.RUN_SUBMITTED, EV.RUN_RESUMED)
SESSION_END = (EV.RUN_FINISHED, EV.RUN_GAVE_UP, EV.RUN_INTERRUPTED)


@dataclass(frozen=True)
class Goodput:
    """Seconds per category (every key of CATEGORIES; they sum to wall_seconds)."""

    wall_seconds: float
    seconds: dict[str, float]
    in_progress: bool = False

    @property
    def goodput(self) -> float | None:
        return self.seconds["productive"] / self.wall_seconds if self.wall_seconds > 0 else None

    def top_losses(self, n: int | None = None) -> list[tuple[str, float]]:
        """Categories other than productive training, largest first (zero ones left out)."""
        losses = sorted(((c, s) for c, s in self.seconds.items() if c != "productive" and s > 0),
                        key=lambda item: (-item[1], item[0]))
        return losses if n is None else losses[:n]

    def as_dict(self, top: int | None = None) -> dict[str, Any]:
        # Rounded per category first, then summed, so that the printed numbers add up exactly.
        seconds = {c: round(self.seconds[c], 3) for c in CATEGORIES}
        wall = round(sum(seconds.values()), 3)
        return {"wall_seconds": wall, "seconds": seconds, "in_progress": self.in_progress,
                "goodput": round(seconds["productive"] / wall, 4) if wall > 0 else None,
                "top_losses": [{"category": c, "label": CATEGORIES[c], "seconds": round(s, 3)}
                               for c, s in self.top_losses(top)]}


@dataclass
class _Attempt:
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


def run_goodput(run: RunDir, now: float | None = None, *, events: list[dict] | None = None,
                lines: list[dict[str, Any]] | None = None) -> Goodput:
    """Goodput of a run directory; pass `now` while the run is live (its open session ends now). `events`
    (run.events()) and `lines` (run_lines): what the caller has read already, so that no file is read twice."""
    period = run.config().checkpoint.period
    events = run.events() if events is None else events
    lines = run_lines(run, events) if lines is None else lines
    return compute(events, lines, checkpoint_period=period, now=now)


def run_lines(run: RunDir, events: list[dict], rank0: list[dict[str, Any]] | None = None,
              every_rank: dict[int, list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """Placed metrics lines (see place_lines) enough for goodput and plots: rank 0's, plus every rank's only when
    some attempt that stepped has no rank-0 line (reading every rank of a large run costs). `rank0`: rank 0's
    lines (metrics.lines) when the caller has read them already; `every_rank`: every rank's, by rank (rank 0's
    included) when the caller has read them all."""
    if rank0 is None and every_rank is not None:
        rank0 = every_rank.get(0, [])
    placed = place_lines(events, _rank_lines(run, 0, rank0))
    stepped = {e.get("attempt") for e in events if e.get("event") == EV.ATTEMPT_FIRST_STEP}
    if stepped - {line["attempt"] for line in placed}:
        ranks = metrics.ranks(run) if every_rank is None else sorted(every_rank)
        placed = place_lines(events, [line for rank in ranks for line in
                                      _rank_lines(run, rank, None if every_rank is None else every_rank[rank])])
    return placed


def _rank_lines(run: RunDir, rank: int, read: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    # MaxText's raw lines carry no rank: the file name is the rank.
    return [{**line, "rank": rank if line.get("rank") is None else line["rank"]}
            for line in (metrics.lines(run, rank) if read is None else read)]


def place_lines(events: list[dict], lines: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics lines with `attempt`, `t` and `recomputed` filled in, in file order per rank.

    Lines written by rkit's agent carry `t` and `attempt`. MaxText's raw lines carry neither: their attempts are
    found by the step going back (a restart), matched newest-first to the attempts that reached a first step, and
    their time is that attempt's `attempt.first_step` plus the step times that follow (`t_estimated`).
    `recomputed`: the rank trained this step before, in an earlier line."""
    stepped = [(e["attempt"], e["t"]) for e in events if e.get("event") == EV.ATTEMPT_FIRST_STEP
               and e.get("attempt") is not None and e.get("t") is not None]
    anchors = dict(stepped)
    by_rank: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        by_rank[line.get("rank")].append(line)
    out: list[dict[str, Any]] = []
    for rank_lines in by_rank.values():
        segments: list[list[dict[str, Any]]] = []
        previous: dict[str, Any] | None = None
        for line in rank_lines:
            new = previous is None or (line.get("attempt") != previous.get("attempt") if line.get("attempt") is not None
                                       else line["step"] <= previous["step"])
            if new:
                segments.append([])
            segments[-1].append(line)
            previous = line
        # Newest segment <-> newest attempt that stepped: a restart from scratch may have truncated older lines.
        guesses = [n for n, _ in stepped][-len(segments):] if stepped else []
        guesses = [None] * (len(segments) - len(guesses)) + guesses
        seen: set[int] = set()
        for index, segment in enumerate(segments):
            attempt = segment[0].get("attempt")
            if attempt is None:
                attempt = guesses[index] if guesses[index] is not None else index + 1
            clock = anchors.get(attempt)
            for position, line in enumerate(segment):
                placed = {**line, "attempt": attempt, "recomputed": line["step"] in seen, "t_estimated": False}
                seen.add(line["step"])
                if placed.get("t") is None:
                    if clock is not None and position > 0 and isinstance(line.get("step_time"), (int, float)):
                        clock += line["step_time"]
                    placed.update(t=None if clock is None else round(clock, 3), t_estimated=clock is not None)
                out.append(placed)
    return out


@dataclass(frozen=True)
class AttemptSteps:
    """What goodput needs of one attempt's metrics lines: on its reference rank (_reference_lines) the first
    line's time, the newest real (not estimated) time and the split of its step times (_step_shares); over
    every rank, the newest time. `attempt_steps` makes it from placed lines, `rkit.readers.digest` from its columns."""

    first_t: float | None
    last_timed_t: float | None
    shares: dict[str, float]
    newest_t: float | None


def attempt_steps(lines: Iterable[dict[str, Any]], checkpoint_period: int | None) -> dict[int, AttemptSteps]:
    """AttemptSteps of every attempt that placed lines (place_lines) name."""
    by_attempt: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        by_attempt[line["attempt"]].append(line)
    out: dict[int, AttemptSteps] = {}
    for number, group in by_attempt.items():
        ref = _reference_lines(group)
        timed = [x["t"] for x in ref if x.get("t") is not None and not x.get("t_estimated")]
        out[number] = AttemptSteps(
            first_t=next((x["t"] for x in ref if x.get("t")), None), last_timed_t=max(timed) if timed else None,
            shares=_step_shares(ref, checkpoint_period),
            newest_t=max((x["t"] for x in group if isinstance(x.get("t"), (int, float))), default=None))
    return out


def compute(events: Iterable[dict] | EventFold, lines: list[dict[str, Any]] | None = None, *,
            checkpoint_period: int | None = None, now: float | None = None,
            steps: dict[int, AttemptSteps] | None = None) -> Goodput:
    """Goodput from the events (or their EventFold) and placed metrics lines (place_lines), or their `steps`
    (attempt_steps) when the caller has them; pure, so tests give it synthetic runs."""
    fold = events if isinstance(events, EventFold) else EventFold.of(events)
    steps = attempt_steps(lines or [], checkpoint_period) if steps is None else steps
    records = [s.newest_t for s in steps.values() if s.newest_t is not None]
    records += [fold.newest_t] if fold.newest_t is not None else []
    sessions, live = fold.sessions(now, max(records, default=None))
    attempts = fold.attempt_list(steps)
    intervals: list[tuple[float, float, str]] = []
    steps_shares: list[dict[str, float]] = []
    for index, a in enumerate(attempts):
        is_live = live and index == len(attempts) - 1 and a.ended is None
        end = a.ended if a.ended is not None else (now if is_live else max(a.last_seen or a.started, a.started))
        mine = steps.get(a.number)
        first = a.first_step if a.first_step is not None else (mine.first_t if mine else None)
        if first is None:
            # Ended without a step for a reason of its own (not the user's stop, not a preemption): not start-up
            # time of a run that then trained, but a start-up that failed (a bad setting, a node, memory).
            failed = a.ended is not None and a.cause not in (None, "completed", "interrupted", "preempted")
            intervals.append((a.started, a.failed if a.failed is not None else end,
                              "failed_startup" if failed else "startup"))
            if a.ended is not None and a.failed is not None:
                intervals.append((a.failed, end, "teardown"))
        else:
            first = min(max(first, a.started), end)
            shares = dict(mine.shares) if mine else {"productive": 0.0, "checkpoint": 0.0, "recompute": 0.0}
            last = mine.last_timed_t if mine and mine.last_timed_t is not None else first + sum(shares.values())
            last = min(max(last, first), end)
            intervals.extend(_startup(a, first))
            shares["other"] = max(0.0, (last - first) - sum(shares.values()))
            intervals.append((first, last, f"steps:{len(steps_shares)}"))
            steps_shares.append(shares)
            if a.ended is not None:
                intervals.append((last, end, "shutdown" if a.cause == "completed" else "teardown"))
        intervals.extend((max(t - silent, a.started), t, "hang") for t, silent in a.hangs)
        if a.failed is not None and a.detect_seconds:
            intervals.append((max(a.failed - a.detect_seconds, a.started), a.failed, "detect"))
    intervals.extend(fold.queue_intervals())
    covered, other, wall = _paint(intervals, sessions)
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    seconds["other"] += other
    for kind, amount in covered.items():
        if kind.startswith("steps:"):
            shares = steps_shares[int(kind.split(":")[1])]
            total = sum(shares.values())
            for category, share in shares.items():
                seconds[category] += amount * share / total if total > 0 else 0.0
            if total <= 0:
                seconds["other"] += amount
        else:
            seconds[kind] += amount
    return Goodput(wall_seconds=wall, seconds=seconds, in_progress=live)


def _startup(a: _Attempt, first: float) -> list[tuple[float, float, str]]:
    """An attempt's start -> its first step, in its parts (see the module's docstring)."""
    if a.agents_started is None or a.agents_ready is None:
        return [(a.started, first, "startup")]
    launched = min(max(a.agents_started, a.started), first)
    ready = min(max(a.agents_ready, launched), first)
    distributed = min(a.distributed_seconds, ready - launched)
    parts = [(a.started, launched, "startup"), (launched, ready - distributed, "import"),
             (ready - distributed, ready, "distributed"), (ready, first, "compile")]
    if a.restore is not None:  # painted over compile (PRIORITY), inside it only
        parts.append((max(a.restore[0], ready), min(a.restore[1], first), "restore"))
    return parts


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
    attempts: dict[int, _Attempt] = field(default_factory=dict)
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
                self.attempts[n] = _Attempt(number=n, started=t, last_seen=t)
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

    def attempt_list(self, steps: dict[int, AttemptSteps]) -> list[_Attempt]:
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


def _reference_lines(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One rank's lines of an attempt (rank 0 when it has any): step times of one rank tile the attempt's time,
    those of several ranks would count it several times."""
    ranks = {line.get("rank") for line in lines}
    if not ranks:
        return []
    rank = 0 if 0 in ranks else min(ranks, key=lambda r: (r is None, r if r is not None else 0))
    return [line for line in lines if line.get("rank") == rank]


def _step_shares(ref: list[dict[str, Any]], period: int | None) -> dict[str, float]:
    """Seconds of the steps after an attempt's first, split into productive / checkpoint / recompute.

    A step's time is the gap since the previous line when both carry a real `t` (these gaps tile the window
    exactly; MaxText's own step_time puts compilation in the second or third step after a start, whose lines are
    written together only after it), else MaxText's step_time."""
    times: list[tuple[dict[str, Any], float]] = []
    for previous, line in zip(ref, ref[1:], strict=False):
        timed = all(x.get("t") is not None and not x.get("t_estimated") for x in (previous, line))
        if timed:
            times.append((line, max(0.0, line["t"] - previous["t"])))
        elif isinstance(line.get("step_time"), (int, float)):
            times.append((line, max(0.0, float(line["step_time"]))))
    shares = {"productive": 0.0, "checkpoint": 0.0, "recompute": 0.0}
    if not times:
        return shares
    median = statistics.median(t for _, t in times)
    for line, t in times:
        excess = max(0.0, t - median) if _near_save(int(line["step"]), period) else 0.0
        shares["checkpoint"] += excess
        shares["recompute" if line.get("recomputed") else "productive"] += t - excess
    return shares


def _near_save(step: int, period: int | None) -> bool:
    """A save at step s blocks the training loop after s is dispatched. MaxText's step_time shows it on s + 1;
    the rkit line of s - 1 is written after it (MaxText writes a step's line one step late); so s - 1, s, s + 1."""
    return bool(period) and period > 0 and any((step + k) % period == 0 for k in (-1, 0, 1))


def _paint(intervals: list[tuple[float, float, str]], sessions: list[tuple[float, float]]
           ) -> tuple[dict[str, float], float, float]:
    """Give each moment inside a session to the highest-priority interval covering it: returns seconds per
    interval kind, seconds covered by none ("other"), and the wall time (the sessions' union)."""
    def rank(kind: str) -> int:
        return PRIORITY.index(kind.split(":")[0])

    usable = sorted(((a, b, k) for a, b, k in intervals if b > a), key=lambda i: rank(i[2]))
    points = sorted({p for a, b, _ in usable for p in (a, b) if p != float("inf")} | {p for s in sessions for p in s})
    covered: dict[str, float] = defaultdict(float)
    other = wall = 0.0
    for lo, hi in zip(points, points[1:], strict=False):
        mid = (lo + hi) / 2
        if not any(a <= mid < b for a, b in sessions):
            continue
        wall += hi - lo
        kind = next((k for a, b, k in usable if a <= mid < b), None)
        if kind is None:
            other += hi - lo
        else:
            covered[kind] += hi - lo
    return dict(covered), other, wall
