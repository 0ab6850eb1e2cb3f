"""Hang detection: how long a rank may go without a new step before its attempt counts as hung.

Pure and clock-driven (the supervisor passes `now`), so the policy is tested without sleeping.

    hang_timeout: auto   before an attempt's first step: hang_startup_seconds (imports, compilation, restore);
                         after it: max(hang_floor_seconds, hang_factor x the running median step time),
                         doubled around checkpoint steps (a synchronous save or the wait for the previous
                         async save happens there)
    hang_timeout: 120    120 s after the first step (still the start-up allowance before it)
    hang_timeout: null   no hang detection
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rkit.contract.config import Config


@dataclass(frozen=True)
class HangPolicy:
    explicit: float | None  # seconds, or None for auto
    enabled: bool
    floor: float
    factor: float
    startup: float
    checkpoint_period: int
    final_step: int | None = None  # after it: the final save and the shutdown (jax.distributed's barrier)

    @classmethod
    def from_config(cls, config: Config, checkpoint_period: int | None = None) -> HangPolicy:
        """`checkpoint_period`: the attempt's (period: auto chooses one per attempt)."""
        r = config.resilience  # defaults come from the schema, as for Budgets
        value = r.hang_timeout
        return cls(explicit=None if value in ("auto", None) else float(value), enabled=value is not None,
                   floor=float(r.hang_floor_seconds), factor=float(r.hang_factor),
                   startup=float(r.hang_startup_seconds),
                   checkpoint_period=int(checkpoint_period or config.checkpoint.fixed_period or 0),
                   final_step=config.trainer.final_step)


@dataclass(frozen=True)
class Hang:
    ranks: list[int]  # the ranks silent for longer than the timeout (all of them when a collective blocks)
    last_steps: dict[int, int | None]
    seconds_silent: float
    timeout: float

    def ordered(self, stopped: tuple[int, ...] | list[int] = ()) -> list[int]:
        """The hung ranks, the stopped ones first: a stopped rank is hung for sure, even one whose silence has not
        yet passed the timeout (its peers' last lines may have been read before its own)."""
        return [*stopped, *(r for r in self.ranks if r not in stopped)]


@dataclass
class HangWatch:
    """Per-rank progress of one attempt. `step_times` carries over between attempts of a run (the median is
    the run's, so a resumed attempt starts with what was learned)."""

    policy: HangPolicy
    ranks: list[int]
    started: float
    step_times: list[float] = field(default_factory=list)
    last_progress: dict[int, float] = field(default_factory=dict)  # from the attempt's start (`started`) on
    last_step: dict[int, int | None] = field(default_factory=dict)
    stepped: dict[int, float] = field(default_factory=dict)  # the ranks that made a step: when their latest was

    def __post_init__(self) -> None:
        for rank in self.ranks:
            self.last_progress.setdefault(rank, self.started)
            self.last_step.setdefault(rank, None)

    def progress(self, rank: int, step: int, step_time: float | None, now: float) -> None:
        previous = self.last_step.get(rank)
        if previous is None or step > previous:
            self.last_step[rank] = step
            self.last_progress[rank] = self.stepped[rank] = now
            if step_time is not None and step_time > 0 and rank == self.ranks[0]:
                self.step_times.append(float(step_time))
                del self.step_times[:-1000]  # a window: the median of the recent steps

    def timeout_for(self, rank: int) -> float:
        step = self.last_step.get(rank)
        if step is None:
            return self.policy.startup
        if self.policy.explicit is not None:
            base = self.policy.explicit
        else:
            median = statistics.median(self.step_times) if self.step_times else 0.0
            base = max(self.policy.floor, self.policy.factor * median)
        # MaxText writes a step's line after the next step ran, so a save at step s (s % period == 0) delays
        # the line of step s or s+1.
        period = self.policy.checkpoint_period
        if self.policy.explicit is None and period > 0 and (step + 1) % period in (0, 1):
            base *= 2
        # The last line comes after the last step, its synchronous save and the shutdown barrier: the start-up
        # allowance there, not a step's (a loaded machine took over 10 s for it).
        final = self.policy.final_step
        if final is not None and step >= final - 1:
            base = max(base, self.policy.startup)
        return base

    def check(self, now: float) -> Hang | None:
        if not self.policy.enabled:
            return None
        silent = {rank: now - t for rank, t in self.last_progress.items()}
        hung = [rank for rank in self.ranks if silent[rank] > self.timeout_for(rank)]
        if not hung:
            return None
        # A stopped rank blocks its peers in the next collective: they all go silent; the one silent longest
        # (or that stopped earliest) comes first.
        hung.sort(key=lambda r: (-silent[r], r))
        return Hang(ranks=hung, last_steps={r: self.last_step[r] for r in hung},
                    seconds_silent=round(silent[hung[0]], 3), timeout=round(self.timeout_for(hung[0]), 3))
