"""Stragglers: nodes whose step time is well above the rest of their attempt, from metrics lines alone.

A node's median step time (over the lines of all its ranks) is compared with the median of the per-node medians
of the OTHER nodes of the same attempt; each node weighs once however many ranks it runs. Medians, not means, so
that one checkpoint save or one slow step does not flag a node.

The first steps of an attempt are left out: they include compilation (tens of seconds to minutes on a real
model) and the first steps after it still warm up caches and autotuning, so their times say nothing about the
node. `skip_steps` counts from the attempt's first step (its lowest step in the lines, or `start_step` when the
caller passes lines of a recent window only).

Note that in synchronous data-parallel training a slow node slows every rank at the next collective; what
differs per node is the host-side part (input pipeline, host memory pressure, a noisy neighbour), which is what
this catches. A node that is slow on the device shows as low throughput for all, not as a straggler here.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from rkit.contract.events import EV
from rkit.contract.rundir import RunDir

DEFAULT_FACTOR = 1.5
SKIP_STEPS = 3
MIN_STEPS = 3


@dataclass(frozen=True)
class Straggler:
    node: str
    median: float
    others_median: float
    ratio: float
    attempt: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_stragglers(lines: Iterable[dict[str, Any]], factor: float = DEFAULT_FACTOR, *, skip_steps: int = SKIP_STEPS,
                    min_steps: int = MIN_STEPS, start_step: int | None = None) -> list[Straggler]:
    """Nodes whose median step time is at least `factor` x the median of the other nodes of their attempt,
    slowest first. Lines need `node`, `step` and `step_time` (others are ignored); they are grouped by `attempt`.
    A node with fewer than `min_steps` usable lines is not judged and does not count among the others: a median
    of one or two steps is noise. Fewer than two judged nodes: no stragglers."""
    by_attempt: dict[int | None, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        if line.get("node") is None or not isinstance(line.get("step_time"), (int, float)) or line.get("step") is None:
            continue
        by_attempt[line.get("attempt")].append(line)
    found: list[Straggler] = []
    for attempt, group in by_attempt.items():
        first = min(int(line["step"]) for line in group) if start_step is None else start_step
        times: dict[str, list[float]] = defaultdict(list)
        for line in group:
            if int(line["step"]) >= first + skip_steps:
                times[str(line["node"])].append(float(line["step_time"]))
        medians = {node: statistics.median(ts) for node, ts in times.items() if len(ts) >= min_steps}
        if len(medians) < 2:
            continue
        for node, median in medians.items():
            others = statistics.median(m for n, m in medians.items() if n != node)
            if others > 0 and median >= factor * others:
                found.append(Straggler(node=node, median=median, others_median=others,
                                       ratio=round(median / others, 3), attempt=attempt))
    return sorted(found, key=lambda s: -s.ratio)


def straggler_events(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `node.straggler` events the supervisor emitted while the run was live, oldest first."""
    return [{"attempt": e.get("attempt"), "node": e.get("node"), "ratio": e.get("ratio"),
             "median": e.get("median"), "others_median": e.get("others_median"), "t": e.get("t")}
            for e in events if e.get("event") == EV.NODE_STRAGGLER]


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
                self.run.emit(EV.NODE_STRAGGLER, **s.as_dict(), factor=self.factor,
                              reason=f"median step time {s.median:.3f} s is {s.ratio:.2f}x the other nodes' "
                                     f"{s.others_median:.3f} s")
