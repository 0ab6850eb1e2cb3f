"""Per-step metrics: MaxText's metrics_file lines, one file per process, read incrementally or merged."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..rundir import RunDir, read_jsonl


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float | None
    step_time: float | None
    tokens_per_sec_per_device: float | None


def from_line(value: dict) -> StepMetrics | None:
    if "step" not in value:
        return None
    try:
        step = int(value["step"])
    except (TypeError, ValueError):
        return None
    return StepMetrics(step=step, loss=value.get("learning/loss"), step_time=value.get("perf/step_time_seconds"),
                       tokens_per_sec_per_device=value.get("perf/per_device_tokens_per_sec"))


def read_rank(path: Path) -> list[StepMetrics]:
    return [m for m in map(from_line, read_jsonl(path)) if m is not None]


def merged(run: RunDir, rank: int = 0) -> dict[int, dict]:
    """One entry per step (the newest line wins: files are appended attempt after attempt);
    `recomputed` marks steps that were trained more than once because of a restart."""
    view: dict[int, dict] = {}
    for m in read_rank(run.metrics_file(rank)):
        seen = view.get(m.step)
        view[m.step] = {"step": m.step, "loss": m.loss, "step_time": m.step_time,
                        "tokens_per_sec_per_device": m.tokens_per_sec_per_device,
                        "recomputed": seen is not None}
    return dict(sorted(view.items()))


def repair_tail(path: Path) -> None:
    """End a file cut mid-line by a crash with a newline, so the next attempt's first line stays whole."""
    try:
        with open(path, "rb+") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() == 0:
                return
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")
    except FileNotFoundError:
        return


class MetricsTail:
    """Follows one metrics file as it grows; remembers the newest step seen."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self._partial = b""
        self.last: StepMetrics | None = None

    def skip_existing(self) -> None:
        try:
            self.offset = self.path.stat().st_size
        except FileNotFoundError:
            self.offset = 0

    def poll(self) -> list[StepMetrics]:
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < self.offset:  # MaxText truncates the file when it starts again from step 0
                    self.offset, self._partial = 0, b""
                fh.seek(self.offset)
                chunk = fh.read()
                self.offset = fh.tell()
        except FileNotFoundError:
            return []
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            try:
                value = json.loads(line)
            except ValueError:
                continue
            m = from_line(value) if isinstance(value, dict) else None
            if m is not None:
                out.append(m)
                self.last = m
        return out
