"""What a run came out as: outcome.json, written when a run ends (finished, gave up, interrupted), read by
`rkit compare`, `rkit reproduce`, `rkit bench` and `rkit status`.

Everything in it comes from the run directory: rank 0's per-step metrics (merged: the newest attempt's line of
each step), the events, and Orbax's own save timings in the rank logs.

    {"version", "run", "state", "config_hash", "image_sha256",
     "loss": {"per_step": {"<step>": loss}, "sha256", "first_step", "last_step", "count", "final"},
     "data": {"per_step": {"<step>": fingerprint}, "count"} (a host-side loader's runs: Grain, TFDS, HF),
     "step_time" / "tokens_per_sec_per_device" / "host_rss_bytes": {"samples", "n", "median", "p10", "p90"},
     "warmup_steps_excluded", "mfu_median", "device_memory_peak_bytes", "host_rss_peak_bytes",
     "time_to_first_step_seconds", "checkpoint_save_seconds": {"median", "n"},
     "checkpoint_blocking_seconds": {"median", "n"}, "goodput"}

The loss checksum is sha256 over the float32 bytes (little-endian) of the losses in step order: two runs whose
losses agree bit for bit have the same checksum.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rkit.contract.errors import RkitError
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir, write_json_atomic
from rkit.readers import goodput
from rkit.readers.digest import keep_in_run
from rkit.readers.status import StatusFold
from rkit.run.policy import FINAL_EVENTS
from rkit.run.ranklogs import save_seconds
from rkit.runtime.telemetry import metrics
from rkit.runtime.telemetry.metrics import WARMUP_STEPS, steady_state

if TYPE_CHECKING:
    from rkit.contract.config import Config

VERSION = 1


def loss_checksum(losses: list[float]) -> str:
    """sha256 over the float32 bytes of the losses, in step order."""
    return "sha256:" + hashlib.sha256(struct.pack(f"<{len(losses)}f", *losses)).hexdigest()


def float32_hex(value: float) -> str:
    return struct.pack(">f", value).hex()


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summary(samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    if not ordered:
        return {"samples": [], "n": 0, "median": None, "p10": None, "p90": None}
    return {"samples": samples, "n": len(samples), "median": quantile(ordered, 0.5),
            "p10": quantile(ordered, 0.1), "p90": quantile(ordered, 0.9)}


def _median(values: list[float]) -> dict[str, Any]:
    s = summary(values)
    return {"median": s["median"], "n": s["n"]}


def compute(run: RunDir, events: list[dict] | None = None, config: Config | None = None) -> dict[str, Any]:
    """The outcome record of a run directory, as it stands (`events`, `config`: what the caller has read)."""
    events = run.events() if events is None else events
    stamp = run.load_manifest()
    rank0 = metrics.lines(run, 0)
    view = metrics.merge(rank0)
    losses = {step: float(line["loss"]) for step, line in view.items() if isinstance(line.get("loss"), (int, float))}
    ordered = [losses[s] for s in sorted(losses)]
    state = next((FINAL_EVENTS[e["event"]].value for e in reversed(events) if e.get("event") in FINAL_EVENTS), None)
    # One attempt.first_step per attempt, from whichever rank's line the supervisor read first (rank 1 under load).
    first_steps = [e.get("seconds_since_start") for e in events if e.get("event") == EV.ATTEMPT_FIRST_STEP]
    mfu = steady_state(rank0, "mfu")
    whole, blocking = save_seconds([run.rank_log(n, 0) for n in run.attempt_numbers()])
    period = goodput.checkpoint_period(run.config() if config is None else config, events)
    good = goodput.compute(events, goodput.run_lines(run, events, rank0), checkpoint_period=period).as_dict()
    data = metrics.step_fingerprints([rank0, *(metrics.lines(run, r) for r in metrics.ranks(run) if r != 0)])
    return {
        "version": VERSION,
        "run": run.name,
        "state": state,
        "config_hash": stamp.get("config_hash"),
        "image_sha256": (stamp.get("image") or {}).get("sha256"),
        "loss": {"per_step": {str(s): losses[s] for s in sorted(losses)},
                 "sha256": loss_checksum(ordered) if ordered else None,
                 "first_step": min(losses) if losses else None, "last_step": max(losses) if losses else None,
                 "count": len(losses), "final": ordered[-1] if ordered else None},
        "data": {"per_step": {str(s): fp for s, fp in data.items()}, "count": len(data)} if data else None,
        "warmup_steps_excluded": WARMUP_STEPS,
        "step_time": summary(steady_state(rank0, "step_time")),
        "tokens_per_sec_per_device": summary(steady_state(rank0, "tokens_per_sec_per_device")),
        "host_rss_bytes": summary(steady_state(rank0, "host_rss_bytes")),
        "mfu_median": summary(mfu)["median"],
        "device_memory_peak_bytes": max((line["device_memory_peak_bytes"] for line in rank0
                                         if isinstance(line.get("device_memory_peak_bytes"), int)), default=None),
        "host_rss_peak_bytes": max((line["host_rss_bytes"] for line in rank0
                                    if isinstance(line.get("host_rss_bytes"), int)), default=None),
        "time_to_first_step_seconds": first_steps[0] if first_steps else None,
        "checkpoint_save_seconds": _median(whole),
        "checkpoint_blocking_seconds": _median(blocking),
        "goodput": good["goodput"],
    }


def chronicle(run: RunDir, config: Config, final: bool) -> None:
    """What the supervisor leaves for the readers (run/supervisor.Chronicle): status's digest of the run so far
    (<run>/digest/, readers/digest.keep_in_run) after each attempt's end, and outcome.json with it after the final
    word."""
    if final:
        write(run, config)
    keep_in_run(run, StatusFold)


def write(run: RunDir, config: Config | None = None) -> dict[str, Any]:
    record = compute(run, config=config)
    write_json_atomic(run.outcome_file, record)
    return record


def load(path: Path) -> dict[str, Any]:
    """A run's outcome: its outcome.json, or computed now from its files (a run from before outcome.json, or one
    still running). Bad input is an RkitError (exit 2)."""
    run = RunDir(path).require()
    if os.path.lexists(run.outcome_file):
        record = run.load_outcome()
        if record.get("version") != VERSION or not isinstance(record.get("loss"), dict):
            raise RkitError(f"{run.outcome_file}: not an rkit outcome record (version {record.get('version')!r}); "
                            "delete it and rkit computes the outcome again from the run's files")
        if (why := shape_problem(record)) is not None:
            raise RkitError(f"{run.outcome_file}: damaged ({why}); delete it and rkit computes the outcome again "
                            "from the run's files")
        return record
    return compute(run)


FLOAT32_MAX = 3.4028234663852886e38  # a loss is compared as float32 (float32_hex)


def _number(value: Any, nan: bool = False) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and (
        math.isfinite(value) or (nan and math.isnan(value)))


def shape_problem(record: dict[str, Any]) -> str | None:
    """What in an outcome record (outcome.json, or a saved benchmark's) is not as rkit writes it: the loss per
    step ({"<step>": float, NaN allowed}), each metric's samples and median (finite numbers); None when fine."""
    per_step = record["loss"].get("per_step")
    if not isinstance(per_step, dict):
        return "loss.per_step is not a mapping of step to loss"
    for step, loss in per_step.items():
        if not (step.isdigit() and len(step) < 19) or not _number(loss, nan=True) or abs(loss) > FLOAT32_MAX:
            return f"loss.per_step has {step!r}: {loss!r}, not a step and its loss"
    data = record.get("data")
    if data is not None and not (isinstance(data, dict) and isinstance(data.get("per_step"), dict) and all(
            isinstance(s, str) and s.isdigit() and len(s) < 19 and isinstance(f, str) and len(f) == 16
            and all(c in metrics.HEX for c in f) for s, f in data["per_step"].items())):
        return "data.per_step is not a mapping of step to a 16-digit fingerprint"
    for key in ("step_time", "tokens_per_sec_per_device", "host_rss_bytes", "device_memory_peak_bytes"):
        metric = record.get(key)
        if metric is None:
            continue
        if not isinstance(metric, dict):  # a peak is one number
            if not _number(metric):
                return f"{key} is neither a number nor a summary"
            continue
        samples, n, median = metric.get("samples"), metric.get("n"), metric.get("median")
        if not isinstance(samples, list) or not all(_number(v) for v in samples):
            return f"{key}.samples is not a list of numbers"
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0) or (n and not samples):
            return f"{key}.n does not count its samples"
        if median is not None and not _number(median):
            return f"{key}.median is not a number"
    return None
