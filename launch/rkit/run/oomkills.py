"""Out-of-memory kills of the ranks' memory cgroup: a rank killed by SIGKILL while the kernel's OOM killer acted in
its cgroup ran out of memory (a container's or a job's memory cap), which a new attempt with the same config
would do again. cgroup v2 counts them in `memory.events` (`oom_kill N`, limit in `memory.max`), v1 in
`memory.oom_control` (`oom_kill N`, limit in `memory.limit_in_bytes`). Counted when the attempt starts, compared
when a rank fails; where the files cannot be read (another node, no memory controller), nothing is said."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # v1 says 9223372036854771712 for "no limit"


def memory_cgroup(pid: int, root: Path = CGROUP_ROOT) -> Path | None:
    """The directory of `pid`'s memory cgroup (v1's memory controller, else v2's unified one)."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            v1 = root / "memory" / parts[2].lstrip("/")
        elif parts[1] == "":
            v2 = parts[2].lstrip("/")
    candidates = [v1] + ([root / v2, root / "unified" / v2] if v2 is not None else [])
    for candidate in candidates:
        if candidate is not None and _counter_file(candidate) is not None:
            return candidate
    return None


def _counter_file(cgroup: Path) -> Path | None:
    for name in ("memory.events", "memory.oom_control"):
        if (cgroup / name).is_file():
            return cgroup / name
    return None


def oom_kills(cgroup: Path) -> int | None:
    """How many processes the OOM killer has killed in this cgroup (and below it, for v2's memory.events)."""
    counter = _counter_file(cgroup)
    if counter is None:
        return None
    try:
        for line in counter.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def memory_limit(cgroup: Path) -> int | None:
    for name in ("memory.max", "memory.limit_in_bytes"):
        try:
            text = (cgroup / name).read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            return None
        return None if value >= UNLIMITED else value
    return None


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


@dataclass
class OomWatch:
    """The OOM-kill counters of the cgroups the attempt's processes run in, as they were at its start."""

    start: dict[Path, int] = field(default_factory=dict)

    @classmethod
    def of(cls, pids: list[int]) -> OomWatch:
        start = {}
        for pid in [os.getpid(), *pids]:
            cgroup = memory_cgroup(pid)
            if cgroup is not None and cgroup not in start and (n := oom_kills(cgroup)) is not None:
                start[cgroup] = n
        return cls(start)

    def killed(self) -> str | None:
        """Where the OOM killer acted since the start: the cgroup, its kills and its limit; None if nowhere."""
        for cgroup, before in self.start.items():
            now = oom_kills(cgroup)
            if now is not None and now > before:
                limit = memory_limit(cgroup)
                cap = f"memory limit {gib(limit)}" if limit is not None else "no memory limit of its own"
                return (f"the kernel's OOM killer killed {now - before} process(es) in memory cgroup "
                        f"{cgroup} ({cap})")
        return None
