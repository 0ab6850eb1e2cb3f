"""Node health: one sample of CPU, memory, load, disks and GPUs (telemetry/gpu.py reads those); the loop that
appends samples to telemetry/<node>.jsonl and warns (event `disk.low`) before a full disk breaks a checkpoint save.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from rkit.contract.events import EV
from rkit.contract.rundir import RunDir, nearest_existing, open_for_writing, read_jsonl
from rkit.runtime.telemetry.gpu import (  # noqa: F401 - the probes are named through this module too
    ABSENT,
    GPU_BACKEND_ENV,
    SYSFS_DRM,
    AbsentProbe,
    AmdSmiProbe,
    GpuProbe,
    NvmlProbe,
    RocmSmiProbe,
    SysfsProbe,
    default_gpu,
    detect_gpu,
)

DISK_LOW_EVENT = EV.DISK_LOW
MIN_CPU_INTERVAL = 0.05  # seconds: a CPU percentage over a shorter window is noise


def disk_usage(path: Path) -> dict[str, Any]:
    try:
        usage = psutil.disk_usage(str(nearest_existing(path)))
    except OSError:
        return {"path": str(path), "free_bytes": None, "total_bytes": None}
    # psutil's free is what an unprivileged writer (Orbax) can still use (f_bavail).
    return {"path": str(path), "free_bytes": usage.free, "total_bytes": usage.total}


_cpu_last = time.monotonic()  # psutil measures from its previous call, or from its import (earlier than this)


def _cpu_percent() -> float | None:
    """System-wide CPU use since the previous call, without sleeping; null when that window is too short."""
    global _cpu_last
    now = time.monotonic()
    value = psutil.cpu_percent(interval=None)
    window, _cpu_last = now - _cpu_last, now
    return value if window >= MIN_CPU_INTERVAL else None


def sample(paths: Mapping[str, Path], gpu: GpuProbe | None = None) -> dict[str, Any]:
    """One health sample of this node; `paths` names the file systems to watch ({"run": ..., "checkpoints": ...})."""
    probe = default_gpu() if gpu is None else gpu
    memory = psutil.virtual_memory()
    load1, load5, load15 = os.getloadavg()
    try:
        gpus = probe.read()
    except Exception:  # noqa: BLE001 - a driver that breaks mid-run must not stop the sampler
        gpus = []
    used = memory.total - memory.available  # what the kernel cannot hand out: caches do not count
    return {
        "t": round(time.time(), 3),
        "cpu_percent": _cpu_percent(),
        "load1": round(load1, 3), "load5": round(load5, 3), "load15": round(load15, 3),
        "mem_used_bytes": used, "mem_total_bytes": memory.total,
        "mem_percent": round(100.0 * used / memory.total, 2) if memory.total else None,
        "disks": {label: disk_usage(path) for label, path in paths.items()},
        "gpu_backend": probe.name,
        "gpus": gpus,
    }


class HealthSampler:
    """Samples one node for one attempt: appends to telemetry/<node>.jsonl and emits disk.low events."""

    def __init__(self, run: RunDir, *, attempt: int, node: str, disk_low_fraction: float = 0.05,
                 gpu: GpuProbe | None = None, paths: Mapping[str, Path] | None = None):
        self.run, self.attempt, self.node = run, attempt, node
        self.disk_low_fraction = disk_low_fraction
        self.gpu = default_gpu() if gpu is None else gpu
        self.paths = dict(paths) if paths is not None else {"run": run.path, "checkpoints": run.checkpoints}
        self.path = run.telemetry_file(node)
        self._warned: set[str] = set()
        self._warned_devices: set[int] = set()

    def tick(self) -> dict[str, Any]:
        """Take one sample, append it (one write), check the disks; returns the line written."""
        line = {"node": self.node, "attempt": self.attempt, **sample(self.paths, gpu=self.gpu)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_for_writing(self.path)
        try:
            os.write(fd, (json.dumps(line, sort_keys=True) + "\n").encode("utf-8"))
        finally:
            os.close(fd)
        self.check_disks(line["disks"])
        return line

    def check_disks(self, disks: Mapping[str, Mapping[str, Any]]) -> list[dict]:
        """One disk.low event per file system per attempt, for the whole run (other nodes share the file
        system; the event log says whether one of them has already warned)."""
        emitted = []
        for label, disk in disks.items():
            free, total = disk.get("free_bytes"), disk.get("total_bytes")
            if label in self._warned or free is None or not total:
                continue
            fraction = free / total
            if fraction >= self.disk_low_fraction:
                continue
            self._warned.add(label)
            device = _device(Path(disk["path"]))
            if device is not None and device in self._warned_devices:
                continue  # the checkpoints live on the run's file system: that one has been reported
            if device is not None:
                self._warned_devices.add(device)
            if self._already_emitted(label):
                continue
            emitted.append(self.run.emit(DISK_LOW_EVENT, attempt=self.attempt, node=self.node, fs=label,
                                         path=disk["path"], free_bytes=free, total_bytes=total,
                                         fraction=round(fraction, 6), threshold=self.disk_low_fraction))
        return emitted

    def _already_emitted(self, label: str) -> bool:
        return any(e.get("event") == DISK_LOW_EVENT and e.get("attempt") == self.attempt and e.get("fs") == label
                   for e in read_jsonl(self.run.events_file))

    def run_forever(self, interval: float, stop: threading.Event) -> None:
        """A sample now, then every `interval` seconds on a fixed schedule until `stop` is set."""
        next_at = time.monotonic()
        while not stop.is_set():
            try:
                self.tick()
            except OSError:
                pass  # a full or vanished file system: the next tick tries again; training goes on
            next_at += interval
            now = time.monotonic()
            if next_at < now:  # suspended or overloaded: skip the missed samples instead of bursting
                next_at = now + interval
            stop.wait(next_at - now)


def _device(path: Path) -> int | None:
    try:
        return os.stat(nearest_existing(path)).st_dev
    except OSError:
        return None

