"""The job steps of one Slurm attempt and what their srun logs say: a cold attempt is one step (`srun` of every
rank); a warm one is the standby steps of its nodes, one per node (slurm/standby.py), watched together. Each
step ends when its srun ends; its log says which task failed and how (Slurm's view of the step), whether Slurm
could not start it, and which nodes Slurm reported dead.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from rkit.backends.base import Handle, RankExit
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir

SRUN_TASK_EXIT = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.+)")
SRUN_TERMINATING = re.compile(r"srun: (?:Terminating|Force Terminated) (?:StepId|job step)")
SRUN_NODE_FAIL = re.compile(r"(?i)node failure on (\S+)|Node (\S+) .*(?:DOWN|NOT_RESPONDING|failure)")
# srun lost a node of its step mid-start (the node crashed): it names the node by its place in the step.
SRUN_NODE_LOST = re.compile(r"(?:io error and missing step|step missing and io error) on node (\d+)")
# srun could not start the step's tasks: Slurm refused the step, or a node did not take its tasks.
SRUN_LAUNCH_FAILED = re.compile(r"srun: error: (?:Unable to create step for job \S+: .+|Task launch for StepId=\S+ "
                                r"failed on node (\S+?):? .+|.*Requested node configuration is not available.*)")
# Slurm's cgroup plugin saw the step's memory cap hit: slurmstepd's line, and srun's per task ("Out Of Memory").
SRUN_OOM = re.compile(r"slurmstepd: error: Detected \d+ oom[_-]kill event.*|srun: error: \S+: tasks? [\d,\-]+: "
                      r"Out Of Memory.*", re.IGNORECASE)
# How long srun may take to end after its step was cancelled while a node of the step is dead: srun waits for that
# node's tasks until Slurm declares the node down (SlurmdTimeout, 300 s by default); its other tasks are gone.
LOST_NODE_WAIT = 2.0


@dataclass(frozen=True)
class StepRequest:
    attempt: int
    argv: list[str]
    env: dict[str, str]
    nodes: list[str]
    log: Path
    cwd: Path
    processes: int = 0

    def describe(self) -> str:
        return shlex.join(self.argv)

    def as_record(self, root: Path) -> dict:
        return {"argv": self.argv, "nodes": self.nodes, "log": str(self.log.relative_to(root))}


def step_argv(nodes: list[str], processes: int, tasks_per_node: int, attempt_dir: Path, attempt: int, *,
              container_launch: str, sif: str | None, binds: tuple[str, ...], gpu_flags: tuple[str, ...],
              python: str, image_python: str, trainer_args: list[str]) -> list[str]:
    """The srun line of one attempt's job step (pure: `rkit run --dry-run` shows it with the nodes to come)."""
    # --overlap: a step that Slurm still counts on a dead node (until SlurmdTimeout) holds its CPUs on the
    # live ones too; without it the next attempt's step would wait for them ("Requested nodes are busy").
    srun = ["srun", "--overlap", "--kill-on-bad-exit=1", f"--nodes={len(nodes)}", f"--ntasks={processes}",
            f"--ntasks-per-node={tasks_per_node}", f"--nodelist={','.join(nodes)}",
            f"--output={attempt_dir / RunDir.rank_log_name('%t')}", "--export=ALL", f"--job-name=attempt-{attempt}"]
    agent = ["-m", "rkit.runtime.agent", *trainer_args]
    if sif is None:
        return [*srun, python, *agent]
    if container_launch == "oci":
        return [*srun, f"--container={sif}", image_python, *agent]
    # No --cleanenv here: each task's own SLURM_PROCID/SLURM_LOCALID must reach the container, and srun sets
    # them per task. What would break the image's Python is removed from the step's environment instead.
    return [*srun, "apptainer", "exec", "--no-home", *gpu_flags, *[a for path in binds for a in ("--bind", path)],
            sif, image_python, *agent]


@dataclass
class StepPreview:
    """The first attempt's job step as `rkit run --dry-run` shows it, before the job has nodes: the backend's
    `prepare` with the nodes, and the coordinator on the first of them, named by what they will be. The
    supervisor's SlurmStepBackend makes the same line (step_argv) once the allocation is known."""

    tasks_per_node: int
    container_launch: str
    sif: str | None
    binds: tuple[str, ...]
    gpu_flags: tuple[str, ...]
    python: str
    image_python: str
    agent_path: str | None = None

    def prepare(self, *, attempt: int, processes: int, trainer_args: list[str], base_env: dict[str, str],
                attempt_dir: Path, cwd: Path, port: int | None = None,
                host_env: dict[str, str] | None = None) -> StepRequest:
        nodes = [f"<node {n + 1}>" for n in range(max(1, processes // self.tasks_per_node))]
        env = {**base_env, "RKIT_NPROCS": str(processes), "RKIT_COORDINATOR": "<node 1>:<port>",
               "PYTHONUNBUFFERED": "1"}
        if self.sif is not None and self.agent_path:
            env["PYTHONPATH"] = self.agent_path
        argv = step_argv(nodes, processes, self.tasks_per_node, attempt_dir, attempt,
                         container_launch=self.container_launch, sif=self.sif, binds=self.binds,
                         gpu_flags=self.gpu_flags, python=self.python, image_python=self.image_python,
                         trainer_args=trainer_args)
        return StepRequest(attempt=attempt, argv=argv, env=env, nodes=nodes,
                           log=attempt_dir / RunDir.launcher_log_name, cwd=cwd, processes=processes)


@dataclass(frozen=True)
class StepPart:
    """One job step of the attempt: its name (scancel finds it by it), its srun, srun's log, and its ranks (its
    task t is rank first_rank + t)."""

    name: str
    proc: subprocess.Popen
    log: Path
    first_rank: int
    tasks: int

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class StepHandle(Handle):
    request: StepRequest | None = None
    parts: list[StepPart] = field(default_factory=list)
    classified: set[str] = field(default_factory=set)  # the parts whose srun ended and was read

    @classmethod
    def cold(cls, request: StepRequest, proc: subprocess.Popen) -> StepHandle:
        return cls(request=request, parts=[StepPart(f"attempt-{request.attempt}", proc, request.log, 0,
                                                     request.processes)])

    @property
    def alive(self) -> bool:
        return any(part.alive for part in self.parts)

    def pids(self) -> dict[str, int]:
        return {("srun" if i == 0 else f"srun-{i}"): part.proc.pid for i, part in enumerate(self.parts)}

    def poll(self) -> dict[int, RankExit]:
        """Read each part whose srun ended (once). A cold step ends when any task fails (--kill-on-bad-exit); of a
        warm attempt only the failed node's step does, and the caller stops the rest."""
        for part in self.parts:
            code = part.proc.poll()
            if code is None or part.name in self.classified:
                continue
            self.classified.add(part.name)
            for rank, rank_exit in self._classify(part, code).items():
                self.exits.setdefault(rank, rank_exit)
        return self.exits

    def _part_nodes(self, part: StepPart) -> list[str]:
        """The part's nodes in Slurm's order of the step (its node ids), hostnames in natural order."""
        nodes = list(self.request.nodes) if self.request is not None else []
        if len(self.parts) > 1 and nodes and self.request.processes:  # a warm attempt: a part per node
            per_node = max(1, self.request.processes // len(nodes))
            nodes = nodes[part.first_rank // per_node:part.first_rank // per_node + 1]
        return sorted(nodes, key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])

    @property
    def _contained(self) -> bool:
        """Its tasks run in a container (srun --container, or apptainer exec): an exit code 128+N is signal N."""
        argv = self.request.argv if self.request is not None else []
        return any(a.startswith("--container=") for a in argv) or "apptainer" in argv

    def _classify(self, part: StepPart, code: int) -> dict[int, RankExit]:
        text = part.log.read_text(encoding="utf-8", errors="replace") if part.log.exists() else ""
        exits: dict[int, RankExit] = {}
        ending = SRUN_TERMINATING.search(text)  # srun ending the step: the tasks named after it were its to end
        for task in SRUN_TASK_EXIT.finditer(text):
            node, tasks, what = task.groups()
            for rank in (part.first_rank + t for t in _ranks(tasks)):
                m = re.search(r"exit code (\d+)", what)
                sig = re.search(r"Killed|Terminated|[Ss]egmentation|Aborted|signal (\d+)|Out Of Memory", what)
                if m:
                    code = int(m.group(1))
                    exits.setdefault(rank, RankExit.in_container(rank, code, node) if self._contained
                                     else RankExit(rank, code, node))
                elif sig:
                    by_srun = ending is not None and task.start() > ending.start() and sig.group(0) in (
                        "Killed", "Terminated")
                    exits.setdefault(rank, RankExit(rank, -_signal_of(sig.group(0)), node, ended_by_launcher=by_srun))
        if self.out_of_memory is None and (oom := SRUN_OOM.search(text)):
            self.out_of_memory = f"Slurm said: {oom.group(0).strip()[:300]}"
        for match in SRUN_NODE_LOST.finditer(text):
            step_nodes = self._part_nodes(part)
            if int(match.group(1)) < len(step_nodes) and step_nodes[int(match.group(1))] not in self.failed_nodes:
                self.failed_nodes.append(step_nodes[int(match.group(1))])
        for match in SRUN_NODE_FAIL.finditer(text):
            node = (match.group(1) or match.group(2) or "").rstrip(":,.")
            if node and node not in self.failed_nodes:
                self.failed_nodes.append(node)
        if code != 0 and self.launch_failed is None:
            self.launch_failed = self._launch_failure(text, exits)
        # Ranks srun did not name: 0 when the step succeeded, srun's own code when nothing was named,
        # else killed because a peer failed (--kill-on-bad-exit).
        for rank in range(part.first_rank, part.first_rank + part.tasks):
            if code == 0 or not exits:
                exits.setdefault(rank, RankExit(rank, code))
            else:
                exits.setdefault(rank, RankExit(rank, -signal.SIGKILL, ended_by_launcher=True))
        return exits

    def _launch_failure(self, text: str, exits: dict[int, RankExit]) -> str | None:
        """What srun said when it could not start the step (the nodes it named go to `failed_nodes`), or, when no
        rank's agent started at all, srun's last error line: the step failed before training could. A failure on
        every node of a cold step is the image's or the launcher's (an unreadable SIF, a broken bind), not every
        node's: no node is named, and the same failure again is a crash loop, never an empty allocation."""
        found = list(SRUN_LAUNCH_FAILED.finditer(text))
        blamed = [n for m in found if (n := m.group(1))]
        said = found[0].group(0).removeprefix("srun: error: ").strip() if found else None
        if said is None:
            run, attempt = RunDir(self.request.env["RKIT_RUN_DIR"]), self.request.attempt
            if any(e.get("event") == EV.AGENT_STARTED and e.get("attempt") == attempt for e in run.events()):
                return None
            # srun named the nodes whose tasks ended before their agent began
            blamed = [e.node for e in exits.values() if e.node and e.returncode != 0]
            errors = [line.strip() for line in text.splitlines() if "error" in line.lower()]
            said = "no rank started" + (f" ({errors[-1][:300]})" if errors else "")
        if len(self.parts) == 1 and self.request.nodes and set(blamed) >= set(self.request.nodes):
            return f"{said}; on every node of the step: the image or the launcher, not the nodes"
        self.failed_nodes.extend(n for n in dict.fromkeys(blamed) if n not in self.failed_nodes)
        return said

    def running(self) -> list[int]:
        return [rank for part in self.parts if part.alive
                for rank in range(part.first_rank, part.first_rank + part.tasks)]

    def wait_gone(self, timeout: float) -> None:
        """Each part's srun, at most `timeout` seconds in all; one that is still there is killed (its process
        group: srun and what it started here)."""
        deadline = time.monotonic() + timeout
        for part in self.parts:
            try:
                part.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(part.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                part.proc.wait()


def _ranks(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        elif part.isdigit():
            out.append(int(part))
    return out


def _signal_of(text: str) -> int:
    if text.startswith("signal"):
        return int(text.split()[-1])
    return {"Killed": signal.SIGKILL, "Out Of Memory": signal.SIGKILL, "Terminated": signal.SIGTERM,
            "Aborted": signal.SIGABRT}.get(
        text, signal.SIGSEGV)
