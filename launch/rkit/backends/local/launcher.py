"""Local backend: the processes of one attempt on this machine, jax.distributed over 127.0.0.1.

prepare() is pure (a printable LaunchRequest); submit() starts it; poll/stop/nodes watch and end it.
Each rank runs in its own process group so that a stop reaches everything it started.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rkit.backends import gpu_health
from rkit.backends.base import Handle, RankExit, wait_for_dump
from rkit.backends.local.standby import StandbyPool
from rkit.contract.heartbeat import JAX_HEARTBEAT_ENV
from rkit.contract.rundir import RunDir, open_for_writing, write_atomic
from rkit.runtime.trainers.localtier import NODE_ENV, NODES_ENV


@dataclass(frozen=True)
class RankLaunch:
    rank: int
    argv: list[str]
    env: dict[str, str]
    log: Path


@dataclass(frozen=True)
class LaunchRequest:
    attempt: int
    ranks: list[RankLaunch]
    cwd: Path
    nodes: tuple[str, ...] = ()  # the attempt's (virtual) nodes; () for the machine itself

    def describe(self) -> str:
        return "\n".join(f"rank {r.rank}: {' '.join(r.argv)}  > {r.log}" for r in self.ranks)

    def as_record(self, root: Path) -> dict:
        return {"ranks": [{"rank": r.rank, "argv": r.argv, "log": str(r.log.relative_to(root))} for r in self.ranks]}


@dataclass
class LocalAttempt(Handle):
    request: LaunchRequest | None = None
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    lifelines: list[int] = field(default_factory=list)  # write ends of the ranks' supervisor pipes

    def release(self) -> None:
        """Close the pipes' write ends once every rank is reaped (a live rank would take it as our death)."""
        while self.lifelines:
            os.close(self.lifelines.pop())

    def pids(self) -> dict[str, int]:
        return {str(r): p.pid for r, p in self.procs.items()}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Container:
    """Run each rank inside an Apptainer image: `apptainer exec --cleanenv --no-home [--nv|--rocm] --bind ... SIF
    python` (the user's home stays out: nothing in it is the run's, and a shared cluster's home holds credentials)."""

    apptainer: str
    sif: str
    gpu_flags: tuple[str, ...] = ()
    binds: tuple[str, ...] = ()
    python: str = "/opt/venv/bin/python"
    agent_path: str | None = None  # an image without rkit's agent: the bound copy's directory (imageagent)

    def wrap(self, argv: list[str]) -> list[str]:
        binds = [arg for path in self.binds for arg in ("--bind", path)]
        return [self.apptainer, "exec", "--cleanenv", "--no-home", *self.gpu_flags, *binds, self.sif, self.python,
                *argv]

    def wrap_env(self, host_env: dict[str, str], process_env: dict[str, str]) -> dict[str, str]:
        """Apptainer's own environment, plus each training variable as APPTAINERENV_<name> (values never
        appear on a command line)."""
        env = {k: v for k, v in host_env.items() if k in ("PATH", "HOME", "USER", "LANG", "TMPDIR")
               or k.startswith("APPTAINER")}
        env.update({f"APPTAINERENV_{k}": v for k, v in process_env.items()})
        if self.agent_path:
            env["APPTAINERENV_PYTHONPATH"] = self.agent_path
        return env


class LocalBackend:
    """Every rank on this machine. With one node (the recipes' usual case), nodes cannot be chosen and nothing is
    ever excluded. With several (an elastic recipe's rehearsal: resources.min_nodes), each node is a virtual one,
    `<host>-node<i>` with its processes_per_node ranks, which the `lose_node` injection can lose for good (as a
    crashed node with no spare): the next attempt then trains on the others."""

    name = "local"

    def __init__(self, python: str | None = None, container: Container | None = None, warm_standby: bool = False,
                 jax_heartbeat_seconds: int | None = None, nodes: int = 1, processes_per_node: int = 1):
        self.node_count, self.per_node = nodes, processes_per_node
        self.python = python or sys.executable
        self.jax_heartbeat_seconds = jax_heartbeat_seconds  # Resilience.local_jax_heartbeat_seconds
        self.container = container
        self.exclude: list[str] = []
        self.standby = StandbyPool(container is not None) if warm_standby else None
        self.liveness = None  # one machine, the supervisor's own: it cannot die apart from the supervisor

    def prepare(self, *, attempt: int, processes: int, trainer_args: list[str], base_env: dict[str, str],
                attempt_dir: Path, cwd: Path, port: int | None = None,
                host_env: dict[str, str] | None = None) -> LaunchRequest:
        """`base_env` is what the training process sees; `host_env` what a container runtime needs."""
        coordinator = f"127.0.0.1:{port or free_port()}"
        nodes = tuple(self.healthy_nodes()[: -(-processes // self.per_node)]) if self.node_count > 1 else ()
        ranks = []
        for rank in range(processes):
            env = dict(base_env)
            env.update({"RKIT_RANK": str(rank), "RKIT_NPROCS": str(processes), "RKIT_COORDINATOR": coordinator,
                        "PYTHONUNBUFFERED": "1"})
            if nodes:  # each rank's virtual node, and the attempt's (the node-local tier's folders follow them)
                env.update({NODE_ENV: nodes[rank // self.per_node], NODES_ENV: ",".join(nodes)})
            if self.jax_heartbeat_seconds is not None:
                env[JAX_HEARTBEAT_ENV] = str(self.jax_heartbeat_seconds)
            argv = ["-m", "rkit.runtime.agent", *trainer_args]
            if self.container:
                argv, env = self.container.wrap(argv), self.container.wrap_env(host_env or {}, env)
            else:
                argv = [self.python, *argv]
            ranks.append(RankLaunch(rank=rank, argv=argv, env=env, log=attempt_dir / RunDir.rank_log_name(rank)))
        return LaunchRequest(attempt=attempt, ranks=ranks, cwd=cwd, nodes=nodes)

    def submit(self, request: LaunchRequest) -> LocalAttempt:
        """Each rank gets the read end of a pipe only this process writes to (agent.watch_supervisor): when the
        supervisor dies, even by SIGKILL, the kernel closes the write end and the rank stops itself."""
        handle = LocalAttempt(request=request)
        try:
            for r in request.ranks:
                r.log.parent.mkdir(parents=True, exist_ok=True)
                if self.standby is not None and (warm := self.standby.take(r.rank, r.env)) is not None:
                    self.standby.hand_over(warm, r.env, r.argv, r.log)
                    handle.procs[r.rank] = warm.proc
                    handle.lifelines.append(warm.lifeline)
                    continue
                read_end, write_end = os.pipe()
                handle.lifelines.append(write_end)
                token = secrets.token_hex(16)
                os.write(write_end, token.encode())
                prefix = "APPTAINERENV_" if self.container else ""
                env = {**r.env, f"{prefix}RKIT_SUPERVISOR_FD": str(read_end), f"{prefix}RKIT_SUPERVISOR_TOKEN": token}
                try:
                    with os.fdopen(open_for_writing(r.log), "ab") as log:
                        handle.procs[r.rank] = subprocess.Popen(
                            r.argv, env=env, cwd=request.cwd, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(read_end,))
                finally:
                    os.close(read_end)
        except OSError:
            self.stop(handle, grace=0)
            raise
        if self.standby is not None:  # the next attempt's ranks: started once this one trains (StandbyPool.fill)
            self.standby.remember(request.ranks, request.cwd)
        return handle

    def poll(self, handle: LocalAttempt) -> dict[int, RankExit]:
        """Ranks that have exited so far (in the order noticed)."""
        for rank, proc in handle.procs.items():
            if rank not in handle.exits and proc.poll() is not None:
                handle.exits[rank] = self._exit(rank, proc.returncode)
                # Anything the rank started dies with it.
                self._signal_group(proc, signal.SIGKILL)
        if len(handle.exits) == len(handle.procs):
            handle.release()
        return handle.exits

    def _exit(self, rank: int, code: int) -> RankExit:
        return RankExit.in_container(rank, code) if self.container is not None else RankExit(rank, code)

    def running(self, handle: LocalAttempt) -> list[int]:
        self.poll(handle)
        return [rank for rank in handle.procs if rank not in handle.exits]

    def request_save(self, handle: LocalAttempt) -> None:
        """SIGTERM to every rank: JAX and Orbax save at the preemption sync point, then MaxText stops."""
        self.signal_all(handle, signal.SIGTERM)

    def signal_all(self, handle: LocalAttempt, sig: int) -> None:
        for rank, proc in handle.procs.items():
            if rank not in handle.exits:
                self._signal_group(proc, sig)

    def stop(self, handle: LocalAttempt, grace: float, sig: int = signal.SIGTERM) -> None:
        """Idempotent: `sig` to every live rank, wait up to `grace` seconds, then SIGKILL and reap. A stopped rank
        (SIGSTOP, a hang) is continued right after `sig`, so that it can act on it within the grace."""
        if grace > 0:
            self.signal_all(handle, sig)
            self.signal_all(handle, signal.SIGCONT)
            deadline = time.monotonic() + grace
            while self.running(handle) and time.monotonic() < deadline:
                time.sleep(0.05)
        self.signal_all(handle, signal.SIGKILL)
        for rank, proc in handle.procs.items():
            proc.wait()
            handle.exits.setdefault(rank, self._exit(rank, proc.returncode))
            self._signal_group(proc, signal.SIGKILL)
        handle.release()

    def nodes(self, handle: LocalAttempt) -> list[str]:
        return list(handle.request.nodes) or [socket.gethostname()]

    def healthy_nodes(self) -> list[str]:
        host = socket.gethostname()
        if self.node_count == 1:
            return [host]
        return [name for i in range(self.node_count) if (name := f"{host}-node{i}") not in self.exclude]

    def recheck(self, nodes: list[str]) -> dict[str, str | None]:
        """A virtual node lost to `lose_node` rehearses a crashed machine: it stays out."""
        return dict.fromkeys(nodes, "a virtual node lost to lose_node stays lost")

    def lose_node(self, handle: LocalAttempt, rank: int) -> str | None:
        """The `lose_node` injection: rank's virtual node crashes (its ranks are SIGKILLed) and is reported dead
        with the attempt, as srun reports a node failure; the supervisor then leaves it out. None on one node."""
        if not handle.request.nodes or rank >= len(handle.request.ranks):
            return None
        index = rank // self.per_node
        node = handle.request.nodes[index]
        handle.failed_nodes.append(node)
        for r, proc in handle.procs.items():
            if r // self.per_node == index and r not in handle.exits:
                self._signal_group(proc, signal.SIGKILL)
        return node

    def unseen_paths(self, paths: list[str]) -> tuple[dict[str, list[str]], str | None]:
        return {}, None  # one machine: the supervisor sees what its ranks see

    def unfit_gpus(self, vendor: str) -> tuple[dict[str, str], str | None]:
        return gpu_health.check(None, vendor)

    def down_nodes(self, handle: LocalAttempt) -> list[str]:
        return []  # this machine is up: it runs the supervisor

    def stopped_ranks(self, handle: LocalAttempt) -> list[int]:
        """Live ranks with a process in the stopped state (SIGSTOP, a debugger): hung for sure."""
        import psutil

        out = []
        for rank, proc in handle.procs.items():
            if rank in handle.exits:
                continue
            try:
                top = psutil.Process(proc.pid)
                if any(p.status() == psutil.STATUS_STOPPED for p in (top, *top.children(recursive=True))):
                    out.append(rank)
            except psutil.Error:
                continue
        return out

    def dump_stacks(self, handle: LocalAttempt, out_dir: Path, stopped: list[int]) -> str:
        """Python stacks of every live rank: py-spy when it is installed (works on a stopped process), else
        SIGQUIT, which the agent's faulthandler writes to stacks/rank-<r>.txt once the process runs. Every live
        rank is stopped first; then each is continued alone until its dump is written and stopped again, so no
        rank can train on meanwhile (alone it cannot pass a collective): a hang stays a hang until the kill.
        (Continuing them all for a moment let a SIGSTOPped tiny run race to its final step and save it.)"""
        import psutil

        out_dir.mkdir(parents=True, exist_ok=True)
        pyspy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
        how = "py-spy" if pyspy else "faulthandler (SIGQUIT; the agent writes stacks/rank-<r>.txt)"
        self.signal_all(handle, signal.SIGSTOP)
        for rank, proc in handle.procs.items():
            if rank in handle.exits:
                continue
            try:  # the agent itself, also when a container runtime started it
                family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
                target = next((p.pid for p in family if "rkit.runtime.agent" in " ".join(p.cmdline())), proc.pid)
            except psutil.Error:
                continue
            if pyspy:
                try:
                    done = subprocess.run([pyspy, "dump", "--pid", str(target)], capture_output=True, text=True,
                                          timeout=30, check=False)
                    write_atomic(out_dir / RunDir.stacks_file_name(rank, "py-spy"), done.stdout + done.stderr)
                    continue
                except (OSError, subprocess.TimeoutExpired):
                    how = "faulthandler (SIGQUIT; the agent writes stacks/rank-<r>.txt)"
            dump = out_dir / RunDir.stacks_file_name(rank)
            before = dump.stat().st_size if dump.exists() else 0
            try:
                os.kill(target, signal.SIGQUIT)
            except ProcessLookupError:
                continue
            self._signal_group(proc, signal.SIGCONT)
            wait_for_dump(dump, before)
            self._signal_group(proc, signal.SIGSTOP)
        return how

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
