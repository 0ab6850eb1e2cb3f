"""Rank 0's metrics lines as the status digest's numpy columns (readers/digest.py): step, attempt, time, loss
(and whether it is there), step time, tokens per second, and whether the lines are legacy ones (MetricsDigest).

rkit's own lines are made into columns a column at a time, each check in C over a whole column; a chunk with a
line they cannot take (a damaged field, MaxText's raw keys) goes through metrics.normalize line by line. The
columns are the same either way (tests/unit/test_status_digest.py fuzzes one against the other).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from rkit.runtime.telemetry import metrics

# the metrics fields the columns are made of (metrics.normalize reads only these)
FIELDS = ("step", "attempt", "t", "loss", "step_time", "tokens_per_sec_per_device", "rank")


def columns(raw: list[dict], rank: int) -> tuple[dict[str, np.ndarray], bool] | None:
    """The columns of these parsed lines of `rank`'s file and whether they are legacy lines; None when no line has
    a step."""
    made = _clean_columns(raw, rank)
    if made is not None:
        return made
    rows = [line for value in raw if (line := metrics.normalize(value, FIELDS)) is not None]
    return _normalized_columns(rows, rank) if rows else None


# The float columns and their bounds (metrics.normalize's: finite, below 1e15; a time from 0 to 1e11 s)
_FINITE = {"t": ("t", 1e11), "step_time": ("step_time", 1e15), "tokens": ("tokens_per_sec_per_device", 1e15)}
_NUMBER = {float, int, type(None)}
_INTEGER = {int, type(None)}
_MAXTEXT_KEYS = frozenset(metrics.MAXTEXT_KEYS)


def _getter(key: str) -> Callable[[dict], Any]:
    return operator.methodcaller("get", key)


def _normalized_columns(rows: list[dict[str, Any]], rank: int) -> tuple[dict[str, np.ndarray], bool]:
    """Columns of normalized lines (each field of its type or None; a float column reads None as NaN), and whether
    they are legacy lines (MetricsDigest.legacy)."""
    legacy = any(not isinstance(r["attempt"], int) or not isinstance(r["t"], (int, float))
                 or r["rank"] not in (None, rank) for r in rows)
    return {"step": np.array([r["step"] for r in rows], np.int64),
            "attempt": np.array([-1 if (a := r["attempt"]) is None else a for r in rows], np.int64),
            "t": np.array([r["t"] for r in rows], np.float64),
            "loss": np.array([r["loss"] for r in rows], np.float64),
            "loss_present": np.array([r["loss"] is not None for r in rows], np.bool_),
            "step_time": np.array([r["step_time"] for r in rows], np.float64),
            "tokens": np.array([r["tokens_per_sec_per_device"] for r in rows], np.float64)}, legacy


def _clean_columns(raw: list[dict], rank: int) -> tuple[dict[str, np.ndarray], bool] | None:
    """_normalized_columns of the lines normalized, made a column at a time, for lines as rkit writes them: every
    step a whole number from 0, every field of its type or absent, no MaxText key to translate. None when some
    line is not (`columns` then normalizes line by line): a fast path, never a different result."""
    try:
        return _clean_columns_of(raw, rank)
    except (OverflowError, ValueError):  # an integer too large for a column
        return None


def _clean_columns_of(raw: list[dict], rank: int) -> tuple[dict[str, np.ndarray], bool] | None:
    # Each check runs in C over a whole column (map, set, numpy): a Python loop per line costs as much as the parse.
    steps = list(map(_getter("step"), raw))
    if not steps or set(map(type, steps)) != {int} or not all(map(_MAXTEXT_KEYS.isdisjoint, raw)):
        return None
    out = {"step": np.array(steps, np.int64)}
    if out["step"].min() < 0 or out["step"].max() >= 1 << 62:
        return None
    attempts, ranks = list(map(_getter("attempt"), raw)), list(map(_getter("rank"), raw))
    if not set(map(type, attempts)) | set(map(type, ranks)) <= _INTEGER:
        return None
    attempt = np.array([-1 if x is None else x for x in attempts], np.int64) if None in attempts else \
        np.array(attempts, np.int64)
    ranked = np.array([-1 if x is None else x for x in ranks], np.int64) if None in ranks else np.array(ranks, np.int64)
    if max(attempt.max(), ranked.max()) >= 1 << 62 or min(attempt.min(), ranked.min()) <= -(1 << 62):
        return None
    rank_named = np.array([x is not None for x in ranks], np.bool_) if None in ranks else np.ones(len(ranks), np.bool_)
    legacy = None in attempts or bool((rank_named & (ranked != rank)).any())
    out["attempt"] = attempt
    for name, (key, bound) in _FINITE.items():
        values = list(map(_getter(key), raw))
        if not set(map(type, values)) <= _NUMBER:
            return None
        column = np.array(values, np.float64)
        lower = 0.0 if key == "t" else -bound
        column[~(np.isfinite(column) & (column >= lower) & (column < bound) & (column > -1e15))] = np.nan
        out[name] = column
    legacy = legacy or bool(np.isnan(out["t"]).any())
    losses = list(map(_getter("loss"), raw))
    if not set(map(type, losses)) <= _NUMBER:
        return None
    loss = np.array(losses, np.float64)
    infinite = np.isinf(loss)
    present = np.array([x is not None for x in losses], np.bool_) if None in losses else np.ones(len(losses), np.bool_)
    out["loss_present"] = present & ~infinite
    loss[infinite] = np.nan
    out["loss"] = loss
    return out, legacy
