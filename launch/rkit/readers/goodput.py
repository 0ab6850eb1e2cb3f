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

import heapq
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rkit.contract.config import Config
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir
from rkit.readers.goodput_events import AttemptSteps, AttemptTimes, EventFold
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





def run_goodput(run: RunDir, now: float | None = None, *, events: list[dict] | None = None,
                lines: list[dict[str, Any]] | None = None) -> Goodput:
    """Goodput of a run directory; pass `now` while the run is live (its open session ends now). `events`
    (run.events()) and `lines` (run_lines): what the caller has read already, so that no file is read twice."""
    events = run.events() if events is None else events
    period = checkpoint_period(run.config(), events)
    lines = run_lines(run, events) if lines is None else lines
    return compute(events, lines, checkpoint_period=period, now=now)


def checkpoint_period(config: Config, events: list[dict]) -> int | None:
    """The recipe's period, or with checkpoint.period auto the one the newest attempt started with (where a save
    shows in the step times: an earlier attempt's saves may have had another period)."""
    if config.checkpoint.fixed_period is not None:
        return config.checkpoint.fixed_period
    return next((e["checkpoint_period"] for e in reversed(events) if e.get("event") == EV.ATTEMPT_STARTED
                 and e.get("checkpoint_period")), None)


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


def _startup(a: AttemptTimes, first: float) -> list[tuple[float, float, str]]:
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
    interval kind, seconds covered by none ("other"), and the wall time (the sessions' union). One sweep over the
    sorted ends (the intervals open at each moment in a heap by priority): a month's attempts cost n log n."""
    def rank(kind: str) -> int:
        return PRIORITY.index(kind.split(":")[0])

    usable = [(a, b, k) for a, b, k in intervals if b > a]
    edges: dict[float, list[tuple[int, int]]] = defaultdict(list)  # point -> (+1 open / -1 close, which)
    for i, (a, b, _) in enumerate(usable):
        edges[a].append((1, i))
        if b != float("inf"):
            edges[b].append((-1, i))
    for j, (a, b) in enumerate(sessions):
        if b <= a:  # empty, or reversed by a clock step: covers nothing
            continue
        edges[a].append((1, -1 - j))
        edges[b].append((-1, -1 - j))
    points = sorted(edges)
    open_now: list[tuple[int, int]] = []  # (priority, index) of the intervals open, lazily pruned
    is_open: set[int] = set()
    in_session = 0
    covered: dict[str, float] = defaultdict(float)
    other = wall = 0.0
    for lo, hi in zip(points, points[1:], strict=False):
        for change, which in edges[lo]:
            if which < 0:
                in_session += change
            elif change > 0:
                is_open.add(which)
                heapq.heappush(open_now, (rank(usable[which][2]), which))
            else:
                is_open.discard(which)
        while open_now and open_now[0][1] not in is_open:
            heapq.heappop(open_now)
        if in_session <= 0:
            continue
        wall += hi - lo
        if open_now:
            covered[usable[open_now[0][1]][2]] += hi - lo
        else:
            other += hi - lo
    return dict(covered), other, wall
