"""Warm standbys on Slurm: one standby job step beside the live attempt, on the same nodes with the same tasks,
whose tasks have already imported Python, JAX, MaxText and the agent (rkit.standby). The next attempt on those
nodes is that step: the supervisor sends each task its order and the step is watched, stopped and classified like
a cold attempt's step. A new standby step is started once that attempt has trained its first step.

Slurm cannot hand one step's processes to another step, and a job step cannot be given a pipe, so the standby
step is the attempt's step to be: `srun --overlap` (it shares the allocation's CPUs, memory and GPUs with the live
step; it touches no device until it becomes the attempt), the same container, nodes, tasks and environment as the
attempt it was started beside. Each task connects back to a listener in the supervisor once its imports are done
(a token, its task id, its pid); that connection carries the order. The supervisor's death closes it, and the
batch job's end ends the step.

A standby step is used only on the same nodes, with the same srun options and the same environment except what
changes with every attempt (standby.PER_ATTEMPT). Otherwise (a node was excluded, an attempt runs on a spare) it
is cancelled and the attempt starts cold. A step that dies while waiting is replaced; after three that died in a
row, standbys stop for this job (a note says why). None of it ever counts as a training failure.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..rundir import RunDir, open_for_writing
from .standby import PER_ATTEMPT, fingerprint

MAX_DEATHS = 3  # standby steps that died in a row before standbys stop for this job
HELLO_SECONDS = 5.0  # a connected task sends its line at once; a peer that does not is no standby of ours


def step_name(k: int) -> str:
    return f"standby-{k}"


def standby_argv(argv: list[str], out_dir: Path, name: str) -> list[str]:
    """An attempt's srun command line as a standby step: --overlap, its own name and output, rkit.standby
    instead of the agent and its MaxText arguments."""
    out = []
    for item in argv[: argv.index("rkit.agent")]:
        if item.startswith("--output="):
            item = f"--output={out_dir / RunDir.rank_log_name('%t')}"
        elif item.startswith("--job-name="):
            item = f"--job-name={name}"
        out.append(item)
    return [out[0], *([] if "--overlap" in out else ["--overlap"]), *out[1:], "rkit.standby"]


def shape(argv: list[str], env: dict[str, str], nodes: list[str]) -> str:
    """What must be equal for a standby step to become an attempt: nodes, srun options, container and Python,
    and the environment except what changes with every attempt."""
    fixed = [item for item in argv[: argv.index("rkit.agent")]
             if not item.startswith(("--output=", "--job-name="))]
    return fingerprint({**env, "\0argv": "\0".join(fixed), "\0nodes": ",".join(nodes)}, False)


@dataclass
class StandbyStep:
    name: str
    proc: subprocess.Popen
    tasks: int
    key: str
    launcher_log: Path
    token: str
    conns: dict[int, socket.socket] = field(default_factory=dict)  # task -> its connection, once it said ready
    pids: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return len(self.conns) == self.tasks and self.proc.poll() is None

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()


class SlurmStandbyPool:
    """The standby step of a Slurm job (at most one). `cancel(name, proc)` ends a step by its name (the backend's
    scancel of <job>.<step>)."""

    def __init__(self, cancel: Callable[[str, subprocess.Popen], None], address: str):
        self.cancel = cancel
        self.address = address  # how the nodes reach this host (its NodeAddr)
        self.step: StandbyStep | None = None
        self.listener: socket.socket | None = None
        self._template: Any = None  # the last attempt's StepRequest
        self._count = 0
        self._deaths = 0
        self._notes: list[dict[str, Any]] = []

    def remember(self, request: Any) -> None:
        self._template = request

    def _listen(self) -> socket.socket:
        if self.listener is None:
            self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.listener.bind(("0.0.0.0", 0))
            self.listener.listen(64)
            self.listener.setblocking(False)
        return self.listener

    def fill(self) -> None:
        if self.step is None and self._template is not None and self._deaths < MAX_DEATHS:
            self._spawn("started")

    def _spawn(self, why: str) -> None:
        request = self._template
        self._count += 1
        name = step_name(self._count)
        out_dir = RunDir(request.env["RKIT_RUN_DIR"]).standby_step_dir(self._count)
        out_dir.mkdir(parents=True, exist_ok=True)
        port = self._listen().getsockname()[1]
        token = secrets.token_hex(16)
        env = {**request.env, "RKIT_STANDBY_ADDRESS": f"{self.address}:{port}", "RKIT_STANDBY_TOKEN": token}
        launcher_log = out_dir / RunDir.launcher_log_name
        try:
            with os.fdopen(open_for_writing(launcher_log), "ab") as log:
                proc = subprocess.Popen(standby_argv(request.argv, out_dir, name), env=env, cwd=request.cwd,
                                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
        except OSError as exc:
            self._deaths = MAX_DEATHS
            self._notes.append({"what": "failed", "step": name, "reason": str(exc)})
            return
        self.step = StandbyStep(name, proc, request.processes, shape(request.argv, request.env, request.nodes),
                                launcher_log, token)
        self._notes.append({"what": why, "step": name, "nodes": list(request.nodes), "pid": proc.pid})

    def _accept(self, step: StandbyStep) -> None:
        while self.listener is not None:
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return
            try:
                conn.settimeout(HELLO_SECONDS)
                line = conn.makefile("rb").readline(200).decode("ascii", "replace").split()
                conn.settimeout(None)
            except OSError:
                conn.close()
                continue
            if len(line) != 4 or line[0] != step.token or not line[1].isdigit() or not line[2].isdigit():
                conn.close()  # another step's task (one that was cancelled), or not ours at all
                continue
            task = int(line[1])
            step.conns[task], step.pids[task] = conn, int(line[2])
            try:
                step.seconds[task] = float(line[3])
            except ValueError:
                step.seconds[task] = 0.0

    def check(self) -> list[dict[str, Any]]:
        """Accept the tasks' ready lines; replace a step that died while waiting; what changed (for events)."""
        step = self.step
        if step is not None:
            was = step.ready
            self._accept(step)
            if step.proc.poll() is not None:
                self.step = None
                step.close()
                self._deaths += 1
                self._notes.append({"what": "died", "step": step.name, "pid": step.proc.pid,
                                    "returncode": step.proc.returncode})
                if self._deaths < MAX_DEATHS:
                    self._spawn("replaced")
                else:
                    self._notes.append({"what": "off", "reason": f"{MAX_DEATHS} standby steps died in a row "
                                        f"(their output: {step.launcher_log.parent})"})
            elif step.ready and not was:
                self._deaths = 0
                self._notes.append({"what": "ready", "step": step.name,
                                    "pids": {str(t): p for t, p in sorted(step.pids.items())},
                                    "import_seconds": round(max(step.seconds.values()), 3)})
        notes, self._notes = self._notes, []
        return notes

    def take(self, request: Any) -> StandbyStep | None:
        """The ready standby step, if it fits this attempt's launch (taken out of the pool); else None (cold)."""
        step, self.step = self.step, None
        if step is None:
            return None
        self._accept(step)
        fits = step.key == shape(request.argv, request.env, request.nodes)
        if step.ready and fits:
            return step
        self._discard(step, "not ready" if not step.ready else
                      "another environment or other nodes (the attempt starts cold)")
        return None

    def hand_over(self, step: StandbyStep, request: Any, attempt_dir: Path) -> None:
        """Each task's order: what changes with every attempt, the MaxText arguments, the attempt's directory."""
        at = request.argv.index("rkit.agent")
        order = {"env": {k: request.env.get(k) for k in PER_ATTEMPT}, "argv": request.argv[at + 1:],
                 "attempt_dir": str(attempt_dir)}
        line = (json.dumps(order) + "\n").encode()
        for conn in step.conns.values():
            try:
                conn.sendall(line)
            except OSError:
                pass  # that task is gone: srun ends the step (--kill-on-bad-exit), classified as a cold one would be
        step.close()
        self._notes.append({"what": "taken", "step": step.name,
                            "pids": {str(t): p for t, p in sorted(step.pids.items())}})

    def _discard(self, step: StandbyStep, reason: str) -> None:
        step.close()
        if step.proc.poll() is None:
            self.cancel(step.name, step.proc)
        self._notes.append({"what": "discarded", "step": step.name, "reason": reason})

    def dismiss(self) -> None:
        if self.step is not None:
            self._discard(self.step, "the job's supervisor is done")
            self.step = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None
