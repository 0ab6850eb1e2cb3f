"""Per-step metrics, one file per process: metrics/<rank>.jsonl.

The agent reads MaxText's own metrics_file (attempts/<n>/maxtext/<rank>.jsonl) as MaxText writes it and appends
one rkit line per step to metrics/<rank>.jsonl, in one write each (a crash loses at most that line):

    {"t", "attempt", "rank", "node", "step", "loss", "step_time", "tokens_per_sec_per_device",
     "tflops_per_device", "mfu", "device_memory_bytes", "device_memory_peak_bytes", "host_rss_bytes",
     "data_fingerprint", "data_rows"}

`data_fingerprint` (with data read through MaxText's host-side loader: Grain, TFDS, HF) says which tokens the
step consumed on this process: the sum, modulo 2**64, of an 8-byte BLAKE2b of each sequence's token ids (the
batch's `inputs` rows), as 16 hex digits; `data_rows` counts the sequences. A sum does not depend on which process
read which sequence, so the step's fingerprint over all processes (`step_fingerprints`) is the same on 2
processes or 1: a resumed or resized run that consumed the same tokens at the same step says so.

Files are appended attempt after attempt; the merged view keeps one line per step, the newest attempt's, and
marks steps trained more than once. Readers also accept MaxText's raw lines (runs from before this format).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rkit.contract.errors import RkitError
from rkit.contract.rundir import JsonlTail, RunDir, read_jsonl
from rkit.contract.safeio import tail_jsonl

# MaxText's metrics_file keys -> rkit's
MAXTEXT_KEYS = {"learning/loss": "loss", "perf/step_time_seconds": "step_time",
                "perf/per_device_tokens_per_sec": "tokens_per_sec_per_device",
                "perf/per_device_tflops": "tflops_per_device"}
FIELDS = ("t", "attempt", "rank", "node", "step", "loss", "step_time", "tokens_per_sec_per_device",
          "tflops_per_device", "mfu", "device_memory_bytes", "device_memory_peak_bytes", "host_rss_bytes",
          "data_fingerprint", "data_rows")
FINGERPRINT_MOD = 1 << 64

# Dense bf16 peak TFLOP/s per device, for MFU (vendor data sheets). An unknown device gets no MFU rather than
# a guess.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "MI300X": 1307.4, "MI325X": 1307.4, "MI300A": 980.6,
               "MI250X": 383.0, "MI250": 362.1, "MI355X": 2516.6, "B200": 2250.0, "GH200": 989.0}


def peak_tflops(device_kind: str | None) -> float | None:
    """The device's peak from its JAX device_kind ("NVIDIA H200", "AMD Instinct MI300X", ...): longest match."""
    if not device_kind:
        return None
    kind = device_kind.upper()
    hits = [name for name in PEAK_TFLOPS if name in kind]
    return PEAK_TFLOPS[max(hits, key=len)] if hits else None


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float | None
    step_time: float | None
    tokens_per_sec_per_device: float | None
    attempt: int | None = None
    t: float | None = None
    node: str | None = None


INT_FIELDS = ("attempt", "rank", "device_memory_bytes", "device_memory_peak_bytes", "host_rss_bytes", "data_rows")
# the fields that are finite numbers: times, rates
FINITE_FIELDS = frozenset(FIELDS) - {*INT_FIELDS, "node", "data_fingerprint", "loss"}


def normalize(value: dict, fields: tuple[str, ...] = FIELDS) -> dict[str, Any] | None:
    """An rkit line as a dict of FIELDS (a MaxText raw line is translated); None if it has no step (or a step
    that is not a whole number from 0). A field of the wrong type (a damaged or foreign file) reads as absent;
    the loss may be NaN (a run that diverged), times and rates must be finite. `fields`: only these (a reader
    that needs a few of a long file's fields; each reads as it does in the whole line)."""
    step = value.get("step")
    if isinstance(step, float) and math.isfinite(step) and step.is_integer():
        step = int(step)
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 1 << 62:
        return None
    line = {key: value.get(key) for key in fields}
    for raw, key in MAXTEXT_KEYS.items():
        if key in line and line[key] is None and raw in value:
            line[key] = value[raw]
    for key in fields:
        v = line[key]
        if v is None:
            continue
        if type(v) is float and key in FINITE_FIELDS:  # the common case, first
            if not math.isfinite(v) or abs(v) >= 1e15 or (key == "t" and not 0 <= v < 1e11):
                line[key] = None
        elif key == "node":
            line[key] = v if isinstance(v, str) else None
        elif key == "data_fingerprint":
            line[key] = v if isinstance(v, str) and len(v) == 16 and all(c in HEX for c in v) else None
        elif key in INT_FIELDS:
            line[key] = v if isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1 << 62 else None
        elif not isinstance(v, (int, float)) or isinstance(v, bool) or not _in_float_range(v):
            line[key] = None
        elif key == "loss":
            line[key] = None if math.isinf(v) else float(v)
        elif not math.isfinite(v) or abs(v) >= 1e15 or (key == "t" and not 0 <= v < 1e11):
            line[key] = None
    line["step"] = step
    return line


def _in_float_range(v: float) -> bool:
    """An integer beyond a float's range is no time, rate or loss (math.isfinite would raise on it)."""
    try:
        float(v)
    except OverflowError:
        return False
    return True


def enrich(raw: dict, *, t: float, attempt: int, rank: int, node: str, peak: float | None,
           device_memory: tuple[int | None, int | None], host_rss: int | None,
           data: tuple[str, int] | None = None) -> dict[str, Any] | None:
    """The rkit line for one MaxText metrics line (None when the line is not a step's); `data`: the step's batch
    fingerprint and sequence count on this process (`batch_fingerprint`)."""
    line = normalize(raw)
    if line is None:
        return None
    tflops = line.get("tflops_per_device")
    line.update(t=round(t, 3), attempt=attempt, rank=rank, node=node, host_rss_bytes=host_rss,
                device_memory_bytes=device_memory[0], device_memory_peak_bytes=device_memory[1],
                mfu=round(tflops / peak, 6) if peak and isinstance(tflops, (int, float)) else None)
    if data:  # data read on the host (synthetic data has none: its lines carry no data keys)
        line.update(data_fingerprint=data[0], data_rows=data[1])
    else:
        del line["data_fingerprint"], line["data_rows"]
    return line


HEX = frozenset("0123456789abcdef")


def batch_fingerprint(inputs: Any) -> tuple[str, int]:
    """A process's batch (its `inputs`, token ids, one row per sequence, on the host) as (fingerprint, rows):
    the sum of each row's 8-byte BLAKE2b modulo 2**64. Host memory only: nothing is read back from a device."""
    import hashlib

    import numpy as np

    rows = np.ascontiguousarray(inputs).reshape(len(inputs), -1) if len(inputs) else np.zeros((0, 0), np.int32)
    total = 0
    for row in rows:
        total += int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little")
    return f"{total % FINGERPRINT_MOD:016x}", len(rows)


def step_fingerprints(per_rank: list[list[dict[str, Any]]]) -> dict[int, str]:
    """Each step's fingerprint over all processes (every rank's lines, normalized, in file order): the sum of
    the fingerprints of the newest attempt that trained it; a step with a rank of that attempt without a
    fingerprint has none."""
    newest: dict[int, int] = {}
    parts: dict[tuple[int, int], dict[int, str | None]] = {}
    for lines_of_rank in per_rank:
        for line in lines_of_rank:
            step, attempt = line["step"], line.get("attempt") or 0
            newest[step] = max(newest.get(step, attempt), attempt)
            parts.setdefault((step, attempt), {})[line.get("rank") or 0] = line.get("data_fingerprint")
    out = {}
    for step, attempt in sorted(newest.items()):
        found = parts[(step, attempt)].values()
        if found and all(found):
            out[step] = f"{sum(int(f, 16) for f in found) % FINGERPRINT_MOD:016x}"
    return out


def from_line(value: dict) -> StepMetrics | None:
    line = normalize(value)
    if line is None:
        return None
    return StepMetrics(step=line["step"], loss=line["loss"], step_time=line["step_time"],
                       tokens_per_sec_per_device=line["tokens_per_sec_per_device"], attempt=line["attempt"],
                       t=line["t"], node=line["node"])


def read_rank(path: Path) -> list[StepMetrics]:
    return [m for m in map(from_line, read_jsonl(path)) if m is not None]


def lines(run: RunDir, rank: int) -> list[dict[str, Any]]:
    """Every line of one rank's file, normalized, in file order (attempts appended one after another)."""
    return [line for line in map(normalize, read_jsonl(run.metrics_file(rank))) if line is not None]


def lines_tail(run: RunDir, rank: int, tail_bytes: int) -> list[dict[str, Any]]:
    """The lines among the last `tail_bytes` of one rank's file (the newest steps of a long run), in file order."""
    return [line for line in map(normalize, tail_jsonl(run.metrics_file(rank), tail_bytes)) if line is not None]


# An attempt's first steps carry compilation, restore and warm-up: not steady state.
WARMUP_STEPS = 3


def steady_state(rank_lines: list[dict[str, Any]], key: str, warmup: int = WARMUP_STEPS) -> list[float]:
    """`key` of every line after the first `warmup` lines of its attempt (file order: attempts one after another)."""
    out: list[float] = []
    seen: dict[Any, int] = {}
    for line in rank_lines:
        n = seen[line.get("attempt")] = seen.get(line.get("attempt"), 0) + 1
        value = line.get(key)
        if n > warmup and isinstance(value, (int, float)) and value > 0:
            out.append(float(value))
    return out


def ranks(run: RunDir) -> list[int]:
    """Ranks that have a metrics file."""
    try:
        names = os.listdir(run.metrics_dir)
    except FileNotFoundError:
        return []
    except OSError as exc:  # a file, or unreadable, in place of metrics/
        raise RkitError(f"{run.metrics_dir}: cannot be listed: {exc.strerror}; rkit writes a directory of one "
                        "metrics file per rank there. Restore it from a copy of the run directory.") from None
    return sorted(int(n[:-6]) for n in names if n.endswith(".jsonl") and n[:-6].isdigit() and len(n) < 26)


def merged(run: RunDir, rank: int = 0) -> dict[int, dict]:
    """One entry per step: the newest line wins (files are appended attempt after attempt); `recomputed` marks
    steps that were trained more than once because of a restart."""
    return merge(lines(run, rank))


def merge(rank_lines: list[dict[str, Any]]) -> dict[int, dict]:
    """`merged` of lines already read (one rank's, in file order)."""
    view: dict[int, dict] = {}
    for line in rank_lines:
        seen = view.get(line["step"])
        view[line["step"]] = {**line, "recomputed": seen is not None}
    return dict(sorted(view.items()))


def repair_tail(path: Path) -> int:
    """End a file cut mid-line by a crash with a newline, so the next attempt's first line stays whole; its size
    after (0 when there is none)."""
    try:
        with open(path, "rb+") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() == 0:
                return 0
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")
            return fh.tell()
    except FileNotFoundError:
        return 0


class MetricsTail(JsonlTail):
    """Follows one metrics file as it grows; remembers the newest step seen."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.last: StepMetrics | None = None

    @classmethod
    def at_end(cls, path: Path) -> MetricsTail:
        """One that follows what the next attempt appends: the file's last line, if a crash cut it, is ended
        first (repair_tail)."""
        tail = cls(path)
        tail.offset = repair_tail(path)
        return tail

    def poll(self) -> list[StepMetrics]:
        out = [m for m in map(from_line, self.poll_raw()) if m is not None]
        if out:
            self.last = out[-1]
        return out
