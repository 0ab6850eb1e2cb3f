"""The backend interface: how the processes of one attempt are started, watched and stopped.

A backend renders a printable request (`prepare`, pure), starts it (`submit`) and answers about the returned
handle: `Backend[RequestT, HandleT]` is generic over the two (local: LaunchRequest, LocalAttempt; Slurm:
StepRequest, StepHandle), and the warm standbys and node liveness it may hold are typed by what the supervisor
asks of them. Both launchers (local/launcher.py, slurm/launcher.py) implement it; the supervisor knows only this
module. Also
the one wait both backends' stack dumps share (`wait_for_dump`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar


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
    # The launcher ended it after another rank had failed (srun --kill-on-bad-exit): its signal is srun's, and the
    # exit it was making of its own, if any, is lost.
    ended_by_launcher: bool = False
    container_code: int | None = None  # the exit code its container runtime gave for the signal (137: SIGKILL)

    @classmethod
    def in_container(cls, rank: int, code: int, node: str | None = None) -> RankExit:
        """A rank's exit as its container runtime reports it (apptainer exec, srun --container through an OCI
        runtime): 128+N is the process inside killed by signal N, the convention of the shell and of every OCI
        runtime (runc, crun, apptainer), so a SIGKILL reads as a signal, not as `exit(137)`."""
        if 128 < code <= 128 + 64:
            return cls(rank, -(code - 128), node, container_code=code)
        return cls(rank, code, node)

    @property
    def signal_name(self) -> str | None:
        if self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"

    def describe(self) -> str:
        if self.ended_by_launcher:
            return f"was ended by the launcher ({self.signal_name}) after another rank failed"
        if self.signal_name and self.container_code is not None:
            return f"killed by {self.signal_name} (exit code {self.container_code} from its container)"
        return f"killed by {self.signal_name}" if self.signal_name else f"exited with code {self.returncode}"

    def as_record(self) -> dict:
        return {"exit_code": self.returncode if self.returncode >= 0 else None, "signal": self.signal_name,
                "node": self.node, **({"ended_by_launcher": True} if self.ended_by_launcher else {}),
                **({"container_exit_code": self.container_code} if self.container_code is not None else {})}


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


class Standbys(Protocol):
    """Warm standbys (local/standby.py, slurm/standby.py): processes that have done an attempt's imports."""

    def fill(self) -> None:
        """Start the standbys that are missing (once the live attempt trains)."""
        ...

    def check(self) -> list[dict[str, Any]]:
        """What happened to them since the last call (started, ready, died, replaced, off): standby events."""
        ...

    def dismiss(self) -> None: ...


class Liveness(Protocol):
    """Node liveness (run/liveness.py's NodeLiveness): heartbeats, suspicion and probes of an attempt's nodes."""

    def watch(self, attempt: int, nodes: list[str], tasks_per_node: int) -> None: ...

    def check(self, progress: Mapping[int, float]) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """This pass's liveness events, and the nodes confirmed dead with why. `progress`: each rank's latest
        step's time, for the ranks that made one."""
        ...

    def close(self) -> None: ...


RequestT = TypeVar("RequestT", bound=Request)
HandleT = TypeVar("HandleT", bound=Handle)


class Backend(Protocol[RequestT, HandleT]):
    name: str
    exclude: list[str]  # nodes kept out of every later attempt (always empty where nodes cannot be chosen)
    standby: Standbys | None  # where warm standbys are on
    liveness: Liveness | None  # where nodes can die apart from the supervisor's (Slurm)

    def prepare(self, *, attempt: int, processes: int, trainer_args: list[str], base_env: dict[str, str],
                attempt_dir: Path, cwd: Path, port: int | None = None,
                host_env: dict[str, str] | None = None) -> RequestT:
        """Pure: the launch of one attempt. Raises NotEnoughNodes when too few healthy nodes are left."""
        ...

    def submit(self, request: RequestT) -> HandleT: ...

    def poll(self, handle: HandleT) -> dict[int, RankExit]:
        """Ranks that have exited so far (in the order noticed)."""
        ...

    def running(self, handle: HandleT) -> list[int]: ...

    def request_save(self, handle: HandleT) -> None:
        """Ask every rank to save and stop (JAX's preemption path); returns at once."""
        ...

    def stop(self, handle: HandleT, grace: float) -> None:
        """Idempotent: SIGTERM, up to `grace` seconds, then SIGKILL; every process reaped (a launcher that waits
        for a node in `handle.failed_nodes` is not waited for)."""
        ...

    def nodes(self, handle: HandleT) -> list[str]: ...

    def healthy_nodes(self) -> list[str]:
        """Nodes a next attempt may use."""
        ...

    def recheck(self, nodes: list[str]) -> dict[str, str | None]:
        """Excluded nodes asked again (run/exclusions.py): None for one that answers (it may rejoin), else why it
        stays out."""
        ...

    def unseen_paths(self, paths: list[str]) -> tuple[dict[str, list[str]], str | None]:
        """Before the first attempt: {node: [paths it cannot see]} over the nodes an attempt may use, and why the
        check could not be made (None when it was)."""
        ...

    def unfit_gpus(self, vendor: str) -> tuple[dict[str, str], str | None]:
        """Before an attempt on GPU nodes: {node: why its GPUs are unfit} over the nodes an attempt may use
        (gpu_health.py), and why the check could not be made (None when it was)."""
        ...

    def down_nodes(self, handle: HandleT) -> list[str]:
        """Nodes of the attempt that the scheduler considers dead now."""
        ...

    def stopped_ranks(self, handle: HandleT) -> list[int]:
        """Live ranks in the stopped state (SIGSTOP, a debugger): hung for sure."""
        ...

    def lose_node(self, handle: HandleT, rank: int) -> str | None:
        """The lose_node injection: rank's node crashes for good and is reported dead with the attempt (its name);
        None where nodes are real (Slurm: crash one)."""
        ...

    def dump_stacks(self, handle: HandleT, out_dir: Path, stopped: list[int]) -> str:
        """Every live rank's Python stacks into `out_dir`; returns how."""
        ...
