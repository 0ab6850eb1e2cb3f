"""`checkpoint.period: auto` (or a time, `10m`): the save period chosen from what rkit measured, before every attempt.

Young's and Daly's first-order optimum: checkpoint every sqrt(2 x C x M) seconds of training, C the time a save
stalls training and M the mean time between failures; a failure then loses on average half that interval and the
saves cost C per interval, about sqrt(2 C / M) of the time in all. rkit measures both:

- C: Orbax's blocking part of each save (async; the whole save when synchronous), from the ranks' logs of this
  run and of earlier runs alike in cost in the same runs directory: the same config but for the length of the run
  and the checkpoint period (cost_key: the same model, mesh, image and file system save the same bytes);
- M: the cluster's failures (a node lost, a hang, a lost supervisor, a step Slurm could not start, a corrupt step,
  a rank that failed after training began) over the node-hours attempts trained (from their first step: queue
  waits and start-ups are not exposure), in the runs of the runs directory, scaled to this run's node count (a
  2-node run's reliability applied to a 512-node job is 256 times worse per job hour); a config error (a rank that
  failed before its first step, the processes not started, out of memory, a full disk) is not the cluster's. A
  stated prior of one failure per PRIOR_MTBF_HOURS of a job this size counts as one more observation, so that a
  new cluster is not taken as failure-free;
- the step time (steady state, from the same runs as C) turns the interval into MaxText's checkpoint_period.

`checkpoint.period: 10m` (a time: s, m or h) asks for that much training between saves instead; the measured step
time turns it into steps the same way.

MaxText's checkpoint_period is fixed for an attempt, so the period is chosen again when each attempt starts (with
what the previous attempts measured), within checkpoint.min_period and max_period. Every save lands on a step
MaxText saves and restores as usual. `choose` is pure; `measure` reads the runs directory: the tails of its files
(events, rank 0's metrics and the newest attempts' logs), so that a month-old run costs what a new one does.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rkit.contract.config import Config
from rkit.contract.errors import RkitError
from rkit.contract.events import EV, valid_event
from rkit.contract.rundir import RunDir
from rkit.contract.safeio import tail_jsonl
from rkit.contract.stamp import config_hash, hashed_config
from rkit.run.ranklogs import save_seconds
from rkit.runtime.telemetry import metrics
from rkit.runtime.telemetry.metrics import steady_state

PRIOR_MTBF_HOURS = 24.0  # one failure a day: a small cluster's job-level rate when nothing has been seen yet
DEFAULT_PERIOD = 100  # before any save or step has been measured (the schema's default period)
# The cluster's failures (policy.Cause values): at any time, or only once training began (before it, a rank's
# failure is a config error or a broken image: not the cluster's).
FAILURES = {"node_fail", "hang", "lost", "step_failed", "corrupt_checkpoint", "port_in_use"}
FAILURES_ONCE_TRAINING = {"task_exit", "task_signal"}
MOST_RUNS = 200  # the newest run directories read for the failure rate
MOST_ALIKE = 6  # this run and the newest runs alike in cost read for the save stall and the step time
EVENTS_TAIL = 256 << 10  # of each run's events.jsonl: its recent attempts (a 512-rank one's: dozens)
METRICS_TAIL = 256 << 10  # of rank 0's metrics: about a thousand steps
NEWEST_LOGS = 3  # attempts whose rank-0 log is read for save stalls
LOG_TAIL = 256 << 10  # of each of those logs: its newest saves
# what _failures_and_hours reads (a sieve before parsing: a 512-rank attempt's agent.* lines are most of its bytes)
ATTEMPT_EVENTS = tuple(f'"{e}"'.encode() for e in (EV.ATTEMPT_STARTED, EV.ATTEMPT_FIRST_STEP, EV.ATTEMPT_ENDED))


@dataclass(frozen=True)
class Measured:
    """What the period is chosen from; None where nothing was measured yet."""

    save_seconds: float | None  # median stall per save
    saves: int
    step_seconds: float | None  # median steady-state step time
    failures: int
    hours: float  # node-hours of training observed (the runs of the runs directory)
    nodes: int = 1  # this run's node count: the job fails `nodes` times as often as one node


@dataclass(frozen=True)
class Choice:
    period: int
    interval_seconds: float | None
    mtbf_seconds: float
    why: str

    def as_event(self, m: Measured) -> dict[str, Any]:
        return {"period": self.period, "interval_seconds": self.interval_seconds, "mtbf_seconds": self.mtbf_seconds,
                "save_seconds": m.save_seconds, "saves": m.saves, "step_seconds": m.step_seconds,
                "failures": m.failures, "hours": round(m.hours, 3), "node_count": m.nodes, "reason": self.why}


def bounded(config: Config, steps: int) -> tuple[int, str]:
    """`steps` within checkpoint.min_period (default 1) and max_period, and what the bound did (for the reason)."""
    ckpt = config.checkpoint
    low = int(ckpt.min_period) if ckpt.min_period is not None else 1
    high = int(ckpt.max_period) if ckpt.max_period is not None else None
    period = max(low, steps if high is None else min(high, steps))
    clipped = "" if period == steps else f", bounded to {period} by checkpoint." + (
        "min_period" if period == low else "max_period")
    return period, clipped


def choose(config: Config, m: Measured) -> Choice:
    """The period for the next attempt (pure)."""
    nodes = max(1, m.nodes)
    mtbf = (m.hours + PRIOR_MTBF_HOURS * nodes) / (m.failures + 1) / nodes * 3600.0
    if (every := config.checkpoint.every_seconds) is not None:
        return _every(config, every, m, mtbf)
    seen = (f"{m.failures} failure(s) in {m.hours:.2f} node-hours of training, for {nodes} node(s), with a prior "
            f"of 1 in {PRIOR_MTBF_HOURS:g} h")
    if m.save_seconds is None or m.step_seconds is None or m.step_seconds <= 0:
        period, _ = bounded(config, DEFAULT_PERIOD)
        return Choice(period, None, mtbf, f"no save or step measured yet: {period} steps until one is (MTBF "
                                          f"{mtbf / 3600:.1f} h: {seen})")
    interval = math.sqrt(2.0 * m.save_seconds * mtbf)
    steps = max(1, round(interval / m.step_seconds))
    period, clipped = bounded(config, steps)
    return Choice(period, round(interval, 3), mtbf,
                  f"Young/Daly: sqrt(2 x save {m.save_seconds:.3f} s x MTBF {mtbf / 3600:.2f} h) = {interval:.0f} s "
                  f"= {steps} steps of {m.step_seconds:.4f} s{clipped} (MTBF from {seen}; save stall: median of "
                  f"{m.saves})")


def _every(config: Config, every: float, m: Measured, mtbf: float) -> Choice:
    """The time form (period: 10m): that much training between saves, in steps of the measured step time."""
    if m.step_seconds is None or m.step_seconds <= 0:
        period, _ = bounded(config, DEFAULT_PERIOD)
        return Choice(period, None, mtbf, f"no step time measured yet: {period} steps until one is (every "
                                          f"{config.checkpoint.period})")
    steps = max(1, round(every / m.step_seconds))
    period, clipped = bounded(config, steps)
    return Choice(period, every, mtbf, f"every {config.checkpoint.period} = {every:.0f} s = {steps} steps "
                                       f"of {m.step_seconds:.4f} s{clipped}")


# What changes neither a save's stall nor a step's time: a longer run, or another period, measures the same.
COST_FREE = ("trainer.steps", "checkpoint.period", "checkpoint.min_period", "checkpoint.max_period", "checkpoint.keep")


def cost_key(resolved: dict) -> str:
    """The config hash's part that decides what a save and a step cost (the hashed config less COST_FREE)."""
    config = hashed_config(resolved)
    for dotted in COST_FREE:
        section, _, key = dotted.partition(".")
        if isinstance(config.get(section), dict):
            config[section] = {k: v for k, v in config[section].items() if k != key}
    return config_hash(config)


def _runs(run: RunDir) -> list[RunDir]:
    """This run and the newest other run directories beside it."""
    try:
        entries = [e for e in os.scandir(run.path.parent) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return [run]
    others = sorted((e for e in entries if Path(e.path) != run.path and os.path.isfile(Path(e.path) / "events.jsonl")),
                    key=lambda e: e.stat(follow_symlinks=False).st_mtime, reverse=True)[:MOST_RUNS]
    return [run, *(RunDir(e.path) for e in others)]


def _failures_and_hours(events: list[dict]) -> tuple[int, float]:
    """The cluster's failures and the node-hours trained (each attempt from its first step to its end, times its
    nodes) in these events."""
    nodes = {e.get("attempt"): len(e.get("nodes") or ()) or 1 for e in events if e.get("event") == EV.ATTEMPT_STARTED}
    trained = {e.get("attempt"): e["t"] for e in events if e.get("event") == EV.ATTEMPT_FIRST_STEP}
    failures, seconds = 0, 0.0
    for e in events:
        if e.get("event") != EV.ATTEMPT_ENDED:
            continue
        n, cause = e.get("attempt"), e.get("cause")
        if n in trained:
            seconds += max(0.0, e["t"] - trained[n]) * nodes.get(n, 1)
        failures += cause in FAILURES or (cause in FAILURES_ONCE_TRAINING and n in trained)
    return failures, seconds / 3600.0


def measure(run: RunDir, resolved: dict | None, nodes: int = 1) -> Measured:
    """The runs directory's measurements: save stalls and step times of this run (its resolved recipe) and of the
    runs alike in cost (cost_key), failures and node-hours of every run (a damaged or foreign directory adds
    nothing), for a run of `nodes` nodes."""
    key = cost_key(resolved) if resolved is not None else None
    stalls: list[float] = []
    steps: list[float] = []
    failures, hours, alike = 0, 0.0, 0
    for other in _runs(run):
        try:
            events = tail_jsonl(other.events_file, EVENTS_TAIL, valid_event, having=ATTEMPT_EVENTS)
        except (OSError, ValueError, RkitError):  # a damaged run directory tells nothing
            continue
        f, h = _failures_and_hours(events)
        failures, hours = failures + f, hours + h
        if alike >= MOST_ALIKE:
            continue
        try:
            same = other is run or (key is not None and cost_key(other.load_resolved()) == key)
        except (OSError, ValueError, TypeError, AttributeError, RkitError):  # its failures count, its costs not
            same = False
        if same:
            alike += 1
            newest = other.attempt_numbers()[-NEWEST_LOGS:]
            whole, blocking = save_seconds([other.rank_log(n, 0) for n in newest], LOG_TAIL)
            stalls.extend(blocking or whole)
            steps.extend(steady_state(metrics.lines_tail(other, 0, METRICS_TAIL), "step_time"))
    return Measured(save_seconds=statistics.median(stalls) if stalls else None, saves=len(stalls),
                    step_seconds=statistics.median(steps) if steps else None, failures=failures, hours=hours,
                    nodes=nodes)


def for_attempt(run: RunDir, config: Config, resolved: dict | None) -> tuple[Choice, Measured]:
    """The next attempt's period (period: auto or a time) and what it was chosen from."""
    measured = measure(run, resolved, config.resources.nodes)
    return choose(config, measured), measured


def period_for(run: RunDir, config: Config, attempt: int) -> int | None:
    """The attempt's period: with checkpoint.period auto or a time, from what the runs directory measured, said as
    a checkpoint.period event; the recipe's period otherwise."""
    if not config.checkpoint.auto:
        return config.checkpoint.fixed_period
    choice, measured = for_attempt(run, config, run.load_resolved())
    run.emit(EV.CHECKPOINT_PERIOD, attempt=attempt, **choice.as_event(measured))
    return choice.period
