"""The backend interface: how the processes of one attempt are started, watched and stopped.

A backend renders a printable request (`prepare`, pure), starts it (`submit`) and answers about the returned
handle. Both backends (local.py, slurm.py) implement `Backend`; the supervisor knows only this module. Also
the one wait both backends' stack dumps share (`wait_for_dump`).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


def wait_for_dump(path: Path, before: int, deadline: float = 2.0, settle: float = 0.03) -> bool:
    """Until the stacks file grew past `before` and stayed the same size for `settle` seconds (faulthandler
    writes it from the signal handler, thread after thread), at most `deadline` seconds: whether it did."""
    end, size, since = time.monotonic() + deadline, -1, time.monotonic()
    while time.monotonic() < end:
        now = path.stat().st_size if path.exists() else 0
        if now != size:
            size, since = now, time.monotonic()
        elif size > before and time.monotonic() - since >= settle:
            return True
        time.sleep(0.005)
    return False


@dataclass
class RankExit:
    rank: int
    returncode: int  # negative: killed by that signal (subprocess convention)
    node: str | None = None

    @property
    def signal_name(self) -> str | None:
        if self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"

    def describe(self) -> str:
        return f"killed by {self.signal_name}" if self.signal_name else f"exited with code {self.returncode}"

    def as_record(self) -> dict:
        return {"exit_code": self.returncode if self.returncode >= 0 else None, "signal": self.signal_name,
                "node": self.node}


class NotEnoughNodes(Exception):
    """Too few healthy nodes are left for the next attempt: the allocation cannot go on."""

    def __init__(self, healthy: list[str], excluded: list[str]):
        self.healthy, self.excluded = healthy, excluded
        super().__init__(f"{len(healthy)} healthy node(s) left in the allocation (excluded: {', '.join(excluded)})")


class Request(Protocol):
    """What `prepare` renders: printable and testable before anything starts."""

    attempt: int

    def describe(self) -> str: ...

    def as_record(self, root: Path) -> dict[str, Any]:
        """The launch as attempt.json records it (paths relative to the run directory `root`)."""
        ...


@dataclass
class Handle:
    """One started attempt, as the supervisor sees it."""

    exits: dict[int, RankExit] = field(default_factory=dict)  # ranks that exited, in the order noticed
    failed_nodes: list[str] = field(default_factory=list)  # nodes the launcher reported dead with the attempt
    # The launcher could not start the attempt's processes (Slurm could not create the step, a task could not be
    # launched on a node, or the step failed before any rank's agent started): what it said. Infrastructure.
    launch_failed: str | None = None
    # The launcher saw a task killed for memory (Slurm's cgroup: "Detected 1 oom_kill event ..."): what it said.
    out_of_memory: str | None = None

    def pids(self) -> dict[str, int]:
        """The processes to look for when the supervisor is gone (attempt.json's `pids`)."""
        raise NotImplementedError


class Backend(Protocol):
    name: str
    exclude: list[str]  # nodes kept out of every later attempt (always empty where nodes cannot be chosen)
    standby: Any  # a StandbyPool (backends/standby.py) where warm standbys are on, else None
    liveness: Any  # a NodeLiveness (liveness.py) where nodes can die apart from the supervisor's, else None

    def prepare(self, *, attempt: int, processes: int, trainer_args: list[str], base_env: dict[str, str],
                attempt_dir: Path, cwd: Path, port: int | None = None,
                host_env: dict[str, str] | None = None) -> Request:
        """Pure: the launch of one attempt. Raises NotEnoughNodes when too few healthy nodes are left."""
        ...

    def submit(self, request: Any) -> Handle: ...

    def poll(self, handle: Any) -> dict[int, RankExit]:
        """Ranks that have exited so far (in the order noticed)."""
        ...

    def running(self, handle: Any) -> list[int]: ...

    def request_save(self, handle: Any) -> None:
        """Ask every rank to save and stop (JAX's preemption path); returns at once."""
        ...

    def stop(self, handle: Any, grace: float) -> None:
        """Idempotent: SIGTERM, up to `grace` seconds, then SIGKILL; every process reaped (a launcher that waits
        for a node in `handle.failed_nodes` is not waited for)."""
        ...

    def nodes(self, handle: Any) -> list[str]: ...

    def healthy_nodes(self) -> list[str]:
        """Nodes a next attempt may use."""
        ...

    def unseen_paths(self, paths: list[str]) -> tuple[dict[str, list[str]], str | None]:
        """Before the first attempt: {node: [paths it cannot see]} over the nodes an attempt may use, and why the
        check could not be made (None when it was)."""
        ...

    def unfit_gpus(self, vendor: str) -> tuple[dict[str, str], str | None]:
        """Before an attempt on GPU nodes: {node: why its GPUs are unfit} over the nodes an attempt may use
        (gpu_health.py), and why the check could not be made (None when it was)."""
        ...

    def down_nodes(self, handle: Any) -> list[str]:
        """Nodes of the attempt that the scheduler considers dead now."""
        ...

    def stopped_ranks(self, handle: Any) -> list[int]:
        """Live ranks in the stopped state (SIGSTOP, a debugger): hung for sure."""
        ...

    def dump_stacks(self, handle: Any, out_dir: Path, stopped: list[int]) -> str:
        """Every live rank's Python stacks into `out_dir`; returns how."""
        ...
