"""Slurm backend: the batch job (rendered, submitted with sbatch) and each attempt as a job step (srun).

Rendering is pure: `render_batch` returns the sbatch argv and the batch script text, a printable object.
Recipe values travel as single argv items (never through a shell); the script itself only quotes paths.
"""

from __future__ import annotations

import errno
import os
import shlex
import signal
import socket
import subprocess
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from rkit.backends import gpu_health, shared_paths
from rkit.backends.base import NotEnoughNodes, RankExit, wait_for_dump
from rkit.backends.slurm.queries import (  # noqa: F401 - the Slurm backend's queries, used through this module too
    JOB_ID,
    UNASKED,
    cancel,
    check_container_launch,
    checked_job_id,
    cpus_on_node,
    exclude_nodes,
    exclusion_that_fits,
    held_down,
    hostnames,
    job_state,
    node_address,
    node_states,
    requeue,
    slurm_output,
    slurm_version,
    slurmd_addresses,
    step_id,
    step_ids,
    submitted_job_id,
)
from rkit.backends.slurm.standby import SlurmStandbyPool
from rkit.backends.slurm.steps import LOST_NODE_WAIT, StepHandle, StepPart, StepRequest, step_argv
from rkit.contract.config import Config, Resilience
from rkit.contract.errors import RkitError
from rkit.contract.rundir import RunDir, current_umask, open_for_writing, write_atomic
from rkit.contract.stamp import redact
from rkit.run.liveness import HeartbeatListener, NodeLiveness, Probe, settled

# sbatch options rkit sets itself (sbatch_options, render_batch): refused in slurm.extra_sbatch, with where they
# come from.
OWNED_OPTIONS = {
    "--requeue": "always on", "--no-requeue": "rkit requeues", "--signal": "slurm.signal_lead_seconds",
    "--parsable": "always on", "--output": "the run directory", "--error": "the run directory",
    "--open-mode": "append", "--nodes": "resources.nodes (min_nodes) + slurm.spare_nodes",
    "--ntasks-per-node": "resources.processes_per_node", "--ntasks": "resources", "--job-name": "name",
    "--partition": "slurm.partition", "--account": "slurm.account", "--qos": "slurm.qos", "--time": "slurm.time",
    "--gpus-per-node": "slurm.gpus_per_node", "--exclusive": "slurm.exclusive", "--wrap": "the batch script",
    "--container": "image and slurm.container_launch", "--chdir": "the run directory",
    "--export": "rkit passes the environment the job needs", "--export-file": "rkit passes the environment",
}
# How long a probe that timed out may wait more for the node's slurmd to take a TCP connection (a dead host sends no
# refusal): the supervisor's loop waits this long at most, once per dead-looking node.
SLURMD_CONNECT_SECONDS = 2.0
# sbatch options that are whole options of their own although an owned option starts with them
NOT_ABBREVIATIONS = {"--gpus"}


def owned_option(name: str) -> str | None:
    """The owned option `name` means to sbatch, which takes any unambiguous prefix (--outp is --output)."""
    if name in OWNED_OPTIONS:
        return name
    if name in NOT_ABBREVIATIONS or len(name) < 4:
        return None
    return next((owned for owned in sorted(OWNED_OPTIONS) if owned.startswith(name)), None)


@dataclass(frozen=True)
class BatchRequest:
    argv: list[str]
    script: str
    script_path: Path

    def describe(self) -> str:
        return shlex.join(self.argv)


def sbatch_options(config: Config) -> list[str]:
    """Every option from the recipe, one argv item each."""
    slurm, res = config.slurm, config.resources
    opts = ["--parsable", "--requeue", f"--signal=B:USR1@{slurm.signal_lead_seconds}",
            f"--job-name={config.name}", f"--nodes={nodes_option(config)}",
            f"--ntasks-per-node={res.processes_per_node}"]
    for value, flag in ((slurm.partition, "--partition"), (slurm.account, "--account"), (slurm.qos, "--qos"),
                        (slurm.time, "--time")):
        if value is not None:
            opts.append(f"{flag}={value}")
    if slurm.gpus_per_node:
        opts.append(f"--gpus-per-node={slurm.gpus_per_node}")
    if slurm.exclusive:
        opts.append("--exclusive")
    if slurm.spare_nodes or res.can_shrink:
        # A dead node must not end the job when a spare can replace it, or the others train on without it
        # (resources.min_nodes): the supervisor excludes it instead.
        opts.append("--no-kill")
    opts.extend(slurm.extra_sbatch)
    return opts


def nodes_option(config: Config) -> str:
    """sbatch --nodes: the attempt's nodes and the spares; with resources.min_nodes and when_short continue, a
    range from min_nodes, so that Slurm starts the job on fewer nodes rather than wait for all of them (sbatch
    allocates as many as it can within the range without delaying the start)."""
    res, most = config.resources, config.resources.nodes + config.slurm.spare_nodes
    return f"{res.fewest_nodes}-{most}" if res.elastic else str(most)


def render_batch(run: RunDir, config: Config, python: str, sbatch: str = "sbatch") -> BatchRequest:
    """The batch script runs `rkit supervise RUN` with the given Python; everything else is sbatch argv."""
    run_path = run.path.resolve()
    resolved_run = RunDir(run_path)
    argv = [sbatch, *sbatch_options(config), "--open-mode=append", f"--output={resolved_run.batch_log_pattern}",
            f"--chdir={run_path}", str(resolved_run.batch_script)]
    script = "\n".join([
        "#!/bin/bash",
        "# Rendered by rkit; submitted as (one argv item per line, never through a shell):",
        *[f"#   {_visible(redact(item))}" for item in argv],
        "# The supervisor runs every attempt as a job step, resumes from the last committed checkpoint,",
        "# and requeues the job on a time-limit/preemption signal (USR1) or when a node must be avoided.",
        f"exec {shlex.quote(python)} -m rkit.cli supervise {shlex.quote(str(run_path))}",
        "",
    ])
    return BatchRequest(argv=argv, script=script, script_path=resolved_run.batch_script)


def _visible(text: str) -> str:
    # A comment line that held a newline would end the comment: show control characters escaped.
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def submit(request: BatchRequest) -> str:
    write_atomic(request.script_path, request.script)  # replaces a planted link instead of writing through it
    os.chmod(request.script_path, 0o777 & ~current_umask())  # a new file of ours: executable, as private as the run
    try:
        done = subprocess.run(request.argv, capture_output=True, text=True, timeout=120, check=False)
    except FileNotFoundError:
        raise RkitError(f"{request.argv[0]}: not found; launcher: slurm needs Slurm's client commands on PATH "
                        "(for the test bed: eval \"$(ci/slurm-testbed.sh env)\").") from None
    if done.returncode != 0:
        raise RkitError(f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}")
    job_id = done.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise RkitError(f"sbatch printed no job id: {done.stdout!r}")
    return job_id


# ---------------------------------------------------------------- job steps


def step_port(job_id: str, attempt: int, tries: int = 0) -> int:
    """A port for jax.distributed's coordinator, different for every attempt of every job (and every try)."""
    return 20000 + zlib.crc32(f"{job_id}:{attempt}:{tries}".encode() if tries else
                              f"{job_id}:{attempt}".encode()) % 20000


def free_coordinator_port(address: str, job_id: str, attempt: int, tries: int = 20) -> int:
    """step_port, checked free where it can be: when the coordinator's address is one of this host's (the batch
    host is usually the allocation's first node), a port some other process holds is skipped for the next
    candidate. On another node it cannot be checked: a bind failure there ends the attempt as PORT_IN_USE
    (infrastructure), and the next attempt has another port."""
    for k in range(tries):
        port = step_port(job_id, attempt, k)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    continue
                return port  # not an address of this host (or not IPv4): cannot check here
            return port
    return step_port(job_id, attempt)


class SlurmStepBackend:
    """Attempts as `srun` steps inside the batch job's allocation. Same interface as LocalBackend."""

    name = "slurm"

    def __init__(self, *, nodes_per_step: int, tasks_per_node: int, container_launch: str = "apptainer",
                 sif: str | None = None, binds: tuple[str, ...] = (), gpu_flags: tuple[str, ...] = (),
                 python: str | None = None, exclude: tuple[str, ...] = (),
                 image_python: str = "/opt/venv/bin/python", agent_path: str | None = None,
                 warm_standby: bool = False, liveness: Resilience | None = None):
        self.nodes_per_step = nodes_per_step
        self.tasks_per_node = tasks_per_node
        self.container_launch = container_launch
        self.sif = sif
        self.binds = binds
        self.gpu_flags = gpu_flags
        self.python = python or os.environ.get("RKIT_PYTHON") or "python3"
        self.exclude = list(exclude)
        self.image_python = image_python  # the image's Python (imageagent.probe)
        self._slurmd: dict[str, tuple[str, int]] = {}  # node -> its slurmd's address and port, asked once
        self.agent_path = agent_path  # an image without rkit's agent: the bound copy's directory
        # How the nodes reach this host (its NodeAddr): the standby step's and the heartbeats' address.
        address = node_address(os.environ.get("SLURMD_NODENAME") or socket.gethostname())
        # The next attempt's step, started beside the live one (slurm/standby.py).
        self.standby = SlurmStandbyPool(self._cancel_steps, address, self.healthy_nodes,
                                        tasks_per_node) if warm_standby else None
        # Every node's heartbeat and the probe step that confirms a silent node dead (liveness.py).
        self.liveness = None if liveness is None else NodeLiveness(
            HeartbeatListener(address), self.start_probe, self.slurmd_silent,
            silence=float(liveness.node_silence_seconds),
            probe_timeout=float(liveness.node_probe_seconds), jax_heartbeat_seconds=liveness.jax_heartbeat_seconds,
            clock=time.monotonic)

    def start_probe(self, node: str) -> subprocess.Popen:
        """A one-task step on `node` that runs `true` (liveness.py's second channel): --overlap, so that neither
        the live attempt nor a step Slurm still counts on a dead node keeps it waiting."""
        return subprocess.Popen(["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
                                 f"--job-name=probe-{node}", "--output=none", "true"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, start_new_session=True)

    def slurmd_silent(self, node: str) -> str | None:
        """Why `node`'s slurmd takes no connection (refused, or no answer in SLURMD_CONNECT_SECONDS), None when it
        does or when its address is not known (the controller did not say: no evidence against the node)."""
        if node not in self._slurmd:  # learned when its attempt was prepared, unless the controller did not say
            self._slurmd.update(slurmd_addresses([node], timeout=SLURMD_CONNECT_SECONDS))
            if node not in self._slurmd:
                return None
        address, port = self._slurmd[node]
        try:
            socket.create_connection((address, port), timeout=SLURMD_CONNECT_SECONDS).close()
        except TimeoutError:
            return f"its slurmd ({address}:{port}) did not answer a connection in {SLURMD_CONNECT_SECONDS:g} s"
        except OSError as exc:
            return f"its slurmd ({address}:{port}) took no connection: {exc.strerror or exc}"
        return None

    def recheck(self, nodes: list[str]) -> dict[str, str | None]:
        """Excluded nodes asked again (run/exclusions.py): one outside this job's allocation or that Slurm holds
        down or drained stays out; the others get a probe step, all at once, bounded as liveness's are (a probe
        that times out asks the node's slurmd too). None for each that answers."""
        allocation = set(self.allocation())
        out: dict[str, str | None] = {n: "not in this job's allocation" for n in nodes if n not in allocation}
        states = node_states([n for n in nodes if n in allocation])
        for node, state in states.items():
            if node in nodes and held_down(state):
                out[node] = f"Slurm holds it {state}"
        timeout = self.liveness.probe_timeout if self.liveness is not None else 5.0
        probes = {}
        for node in [n for n in nodes if n not in out]:
            try:
                probes[node] = Probe(node, self.start_probe(node), time.monotonic(), time.monotonic() + timeout)
            except OSError as exc:
                out[node] = f"the probe step could not start: {exc}"
        while probes:
            for node, probe in list(probes.items()):
                if (result := probe.result(time.monotonic())) is None:
                    continue
                del probes[node]
                verdict, said = settled(node, *result, self.slurmd_silent)
                out[node] = None if verdict == "alive" else said
            time.sleep(0.1 if probes else 0)
        return out

    def allocation(self) -> list[str]:
        return hostnames(os.environ.get("SLURM_JOB_NODELIST", "")) or [socket.gethostname()]

    def healthy_nodes(self) -> list[str]:
        return [n for n in self.allocation() if n not in self.exclude]

    def unseen_paths(self, paths: list[str]) -> tuple[dict[str, list[str]], str | None]:
        own = [self.python] if self.sif is None and os.path.isabs(self.python) else []  # the tasks' Python
        return shared_paths.check(self.healthy_nodes(), [*paths, *own])

    def unfit_gpus(self, vendor: str) -> tuple[dict[str, str], str | None]:
        return gpu_health.check(self.healthy_nodes(), vendor)

    def prepare(self, *, attempt: int, processes: int, trainer_args: list[str], base_env: dict[str, str],
                attempt_dir: Path, cwd: Path, port: int | None = None,
                host_env: dict[str, str] | None = None) -> StepRequest:
        healthy = self.healthy_nodes()
        count = max(1, processes // self.tasks_per_node)  # fewer than nodes_per_step when shrunk (run/elastic.py)
        if len(healthy) < count:
            raise NotEnoughNodes(healthy, self.exclude)
        nodes = healthy[:count]
        # Where their slurmds listen, asked now in one call: a probe that times out later (the controller may be
        # what is slow then) settles on a connection to the node's slurmd without asking the controller.
        if self.liveness is not None and (unknown := [n for n in healthy if n not in self._slurmd]):
            self._slurmd.update(slurmd_addresses(unknown))
        job_id = os.environ.get("SLURM_JOB_ID", "0")
        address = node_address(nodes[0])
        coordinator = f"{address}:{port or free_coordinator_port(address, job_id, attempt)}"
        env = dict(host_env or os.environ)
        env.update(base_env)
        env.update({"RKIT_NPROCS": str(processes), "RKIT_COORDINATOR": coordinator, "PYTHONUNBUFFERED": "1"})
        if self.liveness is not None:
            env.update(self.liveness.environment())
        env.pop("RKIT_RANK", None)  # each task's rank is its SLURM_PROCID
        argv = step_argv(nodes, processes, self.tasks_per_node, attempt_dir, attempt,
                         container_launch=self.container_launch, sif=self.sif, binds=self.binds,
                         gpu_flags=self.gpu_flags, python=self.python, image_python=self.image_python,
                         trainer_args=trainer_args)
        if self.sif is not None:
            for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
                env.pop(name, None)
            if self.agent_path:
                env["PYTHONPATH"] = self.agent_path
        return StepRequest(attempt=attempt, argv=argv, env=env, nodes=nodes,
                           log=attempt_dir / RunDir.launcher_log_name, cwd=cwd, processes=processes)

    def submit(self, request: StepRequest) -> StepHandle:
        request.log.parent.mkdir(parents=True, exist_ok=True)
        if self.standby is not None:
            self.standby.remember(request)  # the next standby steps are this attempt's, once it trains
            if (warm := self.standby.take(request)) is not None:
                self.standby.hand_over(warm, request, request.log.parent)
                parts = []
                for index, step in enumerate(warm):
                    log = request.log if index == 0 else request.log.with_name(f"srun-{step.node}.log")
                    try:  # srun's output (its task-failure lines) under the attempt's name too
                        os.link(step.launcher_log, log)
                    except OSError:
                        log = step.launcher_log
                    parts.append(StepPart(step.name, step.proc, log, index * step.tasks, step.tasks))
                return StepHandle(request=request, parts=parts)
        with os.fdopen(open_for_writing(request.log), "ab") as log:
            proc = subprocess.Popen(request.argv, env=request.env, cwd=request.cwd, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        return StepHandle.cold(request, proc)

    def poll(self, handle: StepHandle) -> dict[int, RankExit]:
        """The ranks whose step ended, from srun's logs (slurm/steps.py)."""
        return handle.poll()

    def running(self, handle: StepHandle) -> list[int]:
        return handle.running()

    def request_save(self, handle: StepHandle) -> None:
        """Through the agents' request file: a container runtime between srun and the trainer may not pass a
        signal on (or may die of it and leave the trainer running)."""
        if handle.alive:
            RunDir(handle.request.env["RKIT_RUN_DIR"]).preempt_request(handle.request.attempt).touch()

    def signal_all(self, handle: StepHandle, sig: int) -> None:
        """SIGTERM (save and stop) goes through the agents' request file; any other signal ends the steps."""
        if not handle.alive:
            return
        if sig == signal.SIGTERM:
            self.request_save(handle)
            return
        for part in handle.parts:
            if part.alive:
                self._cancel_step(part.name, part.proc, sig)

    @staticmethod
    def _cancel_step(name: str, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        """Cancel the job step `name`: Slurm terminates every task (and the container runtime's kill/delete hooks
        run). Outside a job (or before squeue lists the step), `sig` to its srun's process group."""
        SlurmStepBackend._cancel_steps({name: proc}, sig)

    @staticmethod
    def _cancel_steps(steps: dict[str, subprocess.Popen], sig: int = signal.SIGKILL) -> None:
        """_cancel_step for many steps at once: one squeue and one scancel per 256 steps (a 512-node job's standbys
        are dismissed in seconds, within the requeue's signal lead, not one squeue and scancel each)."""
        job_id, ids = os.environ.get("SLURM_JOB_ID"), step_ids(list(steps))
        listed = [f"{job_id}.{ids[name]}" for name in steps if name in ids]
        for i in range(0, len(listed), 256):
            subprocess.run(["scancel", *listed[i:i + 256]], capture_output=True, check=False, timeout=30)
        for name, proc in steps.items():
            if name not in ids:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self, handle: StepHandle, grace: float, sig: int = signal.SIGTERM) -> None:
        if grace > 0:
            self.signal_all(handle, sig)
            deadline = time.monotonic() + grace
            while handle.alive and time.monotonic() < deadline:
                time.sleep(0.1)
        if handle.alive:
            self.signal_all(handle, signal.SIGKILL)
            handle.wait_gone(LOST_NODE_WAIT if handle.failed_nodes else 60)
        self.poll(handle)

    def nodes(self, handle: StepHandle) -> list[str]:
        return list(handle.request.nodes)

    def down_nodes(self, handle: StepHandle) -> list[str]:
        """Nodes of this step that Slurm considers dead (DOWN, FAIL or not responding)."""
        nodes = list(handle.request.nodes)
        states = node_states(nodes)
        return [n for n in nodes if n in states and (states[n].endswith("*") or states[n].startswith(("down", "fail")))]

    def stopped_ranks(self, handle: StepHandle) -> list[int]:
        return []  # the ranks' processes are on other nodes

    def lose_node(self, handle: StepHandle, rank: int) -> str | None:
        return None  # real nodes: the injection is refused for launcher: slurm (inject.parse_injections)

    def dump_stacks(self, handle: StepHandle, out_dir: Path, stopped: list[int]) -> str:
        """SIGQUIT to every task of the step (the agents' faulthandler writes stacks/rank-<r>.txt), then SIGCONT
        (a stopped task dumps once it runs); returns once every rank's dump is written (at most 2 s), so that the
        kill that follows comes before a continued task could train on."""
        job_id = os.environ.get("SLURM_JOB_ID")
        steps = [step for part in handle.parts if part.alive and (step := step_id(part.name)) is not None]
        if not job_id or not steps:
            return "none (the step is gone)"
        dumps = [out_dir / RunDir.stacks_file_name(r) for r in range(handle.request.processes)]
        before = [d.stat().st_size if d.exists() else 0 for d in dumps]
        for sig in ("QUIT", "CONT"):
            for step in steps:
                subprocess.run(["scancel", f"--signal={sig}", f"{job_id}.{step}"], capture_output=True, check=False)
        for dump, size in zip(dumps, before, strict=True):
            wait_for_dump(dump, size)
        return "faulthandler (SIGQUIT through scancel; the agents write stacks/rank-<r>.txt)"

