"""Warm standbys on Slurm: one standby job step per healthy node of the allocation, the spare nodes included,
beside the live attempt, whose tasks (the attempt's tasks per node) have already imported Python, JAX, MaxText and
the agent (rkit.runtime.standby). The next attempt is made of the standby steps of its nodes: the supervisor sends each
task its order (its rank, its node's place in the attempt, what changes with every attempt), and the steps are
watched, stopped and classified together like a cold attempt's one step. So an attempt that replaces a dead node
by a spare starts warm on the spare too. New standby steps are started once that attempt has trained its first
step.

Slurm cannot hand one step's processes to another step, and a job step cannot be given a pipe, so a standby step
is the attempt's part to be: `srun --overlap` (it shares the allocation's CPUs, memory and GPUs with the live step;
it touches no device until it becomes the attempt), the same container, srun options and environment as the
attempt it was started beside, on one node. Each task connects back to a listener in the supervisor once its
imports are done and proves it holds its step's token (rkit.runtime.standby's challenge, hello and order,
HMAC-SHA256; the token never crosses the network); that connection carries the order, which the task checks the
same way. The supervisor's death closes it, and the batch job's end ends the step.

The listener binds the address the nodes reach this host at, and never waits on a peer: connections are accepted
and read without blocking, each has HELLO_SECONDS to say its hello (measured in the watch loop), at most
MAX_PENDING wait at once (the oldest goes first), so a flood of idle or slow connections costs the loop a few
non-blocking calls per pass.

The attempt is warm only when every one of its nodes has a ready standby step started under the same srun options
and environment (except what changes with every attempt: standby.PER_ATTEMPT); otherwise it starts cold and the
ready steps wait for the next one. A node that leaves the healthy set (excluded) loses its standby step. A step
that dies while waiting is replaced; after three that died in a row, standbys stop for this job (a note says
why). None of it ever counts as a training failure.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rkit.backends.local.standby import PER_ATTEMPT, fingerprint
from rkit.contract.rundir import RunDir, open_for_writing
from rkit.runtime import standby as protocol

MAX_DEATHS = 3  # standby steps that died in a row before standbys stop for this job
HELLO_SECONDS = 10.0  # a connected task answers the challenge at once; a peer that does not is no standby of ours
MAX_PENDING = 64  # connections waiting to say their hello; beyond it the oldest is closed
ACCEPTS_PER_PASS = 256  # connections taken off the backlog in one pass (the rest wait for the next)
# srun options that place a step; a standby step has its own (one node), so they are not part of its shape
PLACEMENT = ("--output=", "--job-name=", "--nodes=", "--ntasks=", "--nodelist=")


def step_name(k: int) -> str:
    return f"standby-{k}"


def standby_argv(argv: list[str], out_dir: Path, name: str, node: str, tasks_per_node: int) -> list[str]:
    """An attempt's srun command line as the standby step of one node: --overlap, that node and its tasks, its
    own name and output, rkit.runtime.standby instead of the agent and its MaxText arguments."""
    out = []
    for item in argv[: argv.index("rkit.runtime.agent")]:
        if item.startswith("--output="):
            item = f"--output={out_dir / RunDir.rank_log_name('%t')}"
        elif item.startswith("--job-name="):
            item = f"--job-name={name}"
        elif item.startswith("--nodes="):
            item = "--nodes=1"
        elif item.startswith("--ntasks="):
            item = f"--ntasks={tasks_per_node}"
        elif item.startswith("--nodelist="):
            item = f"--nodelist={node}"
        out.append(item)
    return [out[0], *([] if "--overlap" in out else ["--overlap"]), *out[1:], "rkit.runtime.standby"]


def shape(argv: list[str], env: dict[str, str]) -> str:
    """What must be equal for a standby step to become part of an attempt: srun options, container and Python,
    and the environment except what changes with every attempt."""
    fixed = [item for item in argv[: argv.index("rkit.runtime.agent")] if not item.startswith(PLACEMENT)]
    return fingerprint({**env, "\0argv": "\0".join(fixed)}, False)


@dataclass
class StandbyStep:
    name: str
    node: str
    proc: subprocess.Popen
    tasks: int
    key: str
    launcher_log: Path
    token: str
    conns: dict[int, socket.socket] = field(default_factory=dict)  # task -> its connection, once it said ready
    nonces: dict[int, str] = field(default_factory=dict)  # task -> its hello's nonce (its order's MAC covers it)
    pids: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return len(self.conns) == self.tasks and self.proc.poll() is None

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()


@dataclass
class Pending:
    """A connection that has not said its hello yet."""
    conn: socket.socket
    challenge: str
    deadline: float
    data: bytes = b""


class SlurmStandbyPool:
    """The standby steps of a Slurm job, one per healthy node. `cancel({name: proc})` ends steps by their names
    (the backend's scancel of <job>.<step>, all at once); `healthy()` lists the nodes an attempt may use."""

    def __init__(self, cancel: Callable[[dict[str, subprocess.Popen]], None], address: str,
                 healthy: Callable[[], list[str]], tasks_per_node: int):
        self.cancel = cancel
        self.address = address  # how the nodes reach this host (its NodeAddr)
        self.healthy = healthy
        self.tasks_per_node = tasks_per_node
        self.steps: dict[str, StandbyStep] = {}  # node -> its standby step
        self.listener: socket.socket | None = None
        self.pending: list[Pending] = []
        self.clock = time.monotonic
        self._template: Any = None  # the last attempt's StepRequest
        self._count = 0
        self._deaths = 0
        self._notes: list[dict[str, Any]] = []

    def remember(self, request: Any) -> None:
        self._template = request

    def _listen(self) -> socket.socket:
        if self.listener is None:
            family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
            self.listener = socket.socket(family, socket.SOCK_STREAM)
            try:
                self.listener.bind((self.address, 0))
            except OSError:  # a NodeAddr that is a name this host does not resolve to itself: every interface
                self.listener.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
            self.listener.listen(64)
            self.listener.setblocking(False)
        return self.listener

    def fill(self) -> None:
        """A standby step on every healthy node that has none; the steps of nodes no longer healthy go."""
        healthy = self.healthy()
        for node in [n for n in self.steps if n not in healthy]:
            step = self.steps.pop(node)
            self._discard(step, "its node left the healthy nodes")
            if step.proc.poll() is None:  # its srun waits for a dead node's tasks until Slurm gives up on it
                step.proc.kill()
                step.proc.wait()
        if self._template is None:
            return
        for node in healthy:
            if node not in self.steps and self._deaths < MAX_DEATHS:
                self._spawn(node, "started")

    def _spawn(self, node: str, why: str) -> None:
        request = self._template
        run = RunDir(request.env["RKIT_RUN_DIR"])
        while True:  # a number no earlier job of the run used: its srun log would be appended to, and read again
            self._count += 1
            out_dir = run.standby_step_dir(self._count)
            try:
                out_dir.mkdir(parents=True)
                break
            except FileExistsError:
                pass
        name = step_name(self._count)
        port = self._listen().getsockname()[1]
        token = secrets.token_hex(16)
        env = {**request.env, "RKIT_STANDBY_ADDRESS": f"{self.address}:{port}", "RKIT_STANDBY_TOKEN": token}
        launcher_log = out_dir / RunDir.launcher_log_name
        try:
            with os.fdopen(open_for_writing(launcher_log), "ab") as log:
                proc = subprocess.Popen(standby_argv(request.argv, out_dir, name, node, self.tasks_per_node),
                                        env=env, cwd=request.cwd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            self._deaths = MAX_DEATHS
            self._notes.append({"what": "failed", "step": name, "node": node, "reason": str(exc)})
            return
        self.steps[node] = StandbyStep(name, node, proc, self.tasks_per_node, shape(request.argv, request.env),
                                       launcher_log, token)
        self._notes.append({"what": why, "step": name, "nodes": [node], "pid": proc.pid})

    def _accept(self) -> None:
        """Take new connections and read what the waiting ones said, never waiting on any of them."""
        now = self.clock()
        for _ in range(ACCEPTS_PER_PASS if self.listener is not None else 0):
            try:
                conn, _ = self.listener.accept()
            except OSError:  # BlockingIOError: nobody else is waiting
                break
            challenge = secrets.token_hex(16)
            try:
                conn.setblocking(False)
                conn.send(protocol.challenge_line(challenge))  # a few bytes into an empty send buffer
            except OSError:
                conn.close()
                continue
            self.pending.append(Pending(conn, challenge, now + HELLO_SECONDS))
            while len(self.pending) > MAX_PENDING:
                self.pending.pop(0).conn.close()
        tokens = {step.token: step for step in self.steps.values()}
        waiting = []
        for p in self.pending:
            try:
                chunk = p.conn.recv(protocol.MAX_LINE)
            except BlockingIOError:
                chunk = None
            except OSError:
                chunk = b""
            if chunk is not None:
                p.data += chunk
            if b"\n" in p.data:
                hello = protocol.check_hello(tokens, p.challenge, p.data.split(b"\n", 1)[0])
                step = None if hello is None else tokens[hello[0]]
                if step is None or hello[1] >= step.tasks or hello[1] in step.conns:
                    p.conn.close()  # another step's task (one that was cancelled), or not ours at all
                    continue
                _, task, pid, seconds, nonce = hello
                p.conn.setblocking(True)
                step.conns[task], step.pids[task], step.seconds[task], step.nonces[task] = p.conn, pid, seconds, nonce
            elif chunk == b"" or len(p.data) >= protocol.MAX_LINE or now >= p.deadline:
                p.conn.close()
            else:
                waiting.append(p)
        self.pending = waiting

    def check(self) -> list[dict[str, Any]]:
        """Accept the tasks' ready lines; replace a step that died while waiting; what changed (for events)."""
        was = {node: step.ready for node, step in self.steps.items()}
        self._accept()
        for node, step in list(self.steps.items()):
            if step.proc.poll() is not None:
                del self.steps[node]
                step.close()
                self._deaths += 1
                self._notes.append({"what": "died", "step": step.name, "pid": step.proc.pid,
                                    "returncode": step.proc.returncode})
                if self._deaths < MAX_DEATHS:
                    self._spawn(node, "replaced")
                else:
                    self._notes.append({"what": "off", "reason": f"{MAX_DEATHS} standby steps died in a row "
                                        f"(their output: {step.launcher_log.parent})"})
            elif step.ready and not was.get(node):
                self._deaths = 0
                self._notes.append({"what": "ready", "step": step.name, "nodes": [node],
                                    "pids": {str(t): p for t, p in sorted(step.pids.items())},
                                    "import_seconds": round(max(step.seconds.values()), 3)})
        notes, self._notes = self._notes, []
        return notes

    def take(self, request: Any) -> list[StandbyStep] | None:
        """The ready standby steps of the attempt's nodes, in its node order, if every node has one that fits
        its launch (taken out of the pool); else None (cold: a step that does not fit is cancelled, a ready one
        that fits waits for the next attempt)."""
        self._accept()
        key = shape(request.argv, request.env)
        for node in request.nodes:
            step = self.steps.get(node)
            if step is not None and step.key != key:
                self._discard(self.steps.pop(node), "another environment (the attempt starts cold)")
        steps = [self.steps.get(node) for node in request.nodes]
        if not all(step is not None and step.ready for step in steps):
            for step in steps:
                if step is not None and not step.ready:
                    self._discard(self.steps.pop(step.node), "not ready")
            return None
        for node in request.nodes:
            del self.steps[node]
        return steps

    def hand_over(self, steps: list[StandbyStep], request: Any, attempt_dir: Path) -> None:
        """Each task's order: its rank and its node's place in the attempt, what changes with every attempt, the
        MaxText arguments, the attempt's directory."""
        at = request.argv.index("rkit.runtime.agent")
        shared = {k: request.env.get(k) for k in PER_ATTEMPT}
        for index, step in enumerate(steps):
            for task, conn in step.conns.items():
                env = {**shared, "RKIT_RANK": str(index * step.tasks + task), "RKIT_NODE_INDEX": str(index)}
                order = {"env": env, "argv": request.argv[at + 1:], "attempt_dir": str(attempt_dir)}
                try:
                    conn.settimeout(HELLO_SECONDS)  # a task that took its order reads it at once
                    conn.sendall(protocol.order_line(step.token, step.nonces[task], order))
                except OSError:
                    pass  # that task is gone: srun ends its step, classified as a cold one would be
            step.close()
            self._notes.append({"what": "taken", "step": step.name, "nodes": [step.node],
                                "pids": {str(t): p for t, p in sorted(step.pids.items())}})

    def _discard(self, step: StandbyStep, reason: str) -> None:
        self._discard_all([step], reason)

    def _discard_all(self, steps: list[StandbyStep], reason: str) -> None:
        alive = {s.name: s.proc for s in steps if s.proc.poll() is None}  # before the close: a task that reads EOF
        for step in steps:  # ends its step by itself
            step.close()
        if alive:
            self.cancel(alive)
        self._notes += [{"what": "discarded", "step": s.name, "node": s.node, "reason": reason} for s in steps]

    def dismiss(self) -> None:
        self._discard_all(list(self.steps.values()), "the job's supervisor is done")
        self.steps.clear()
        for p in self.pending:
            p.conn.close()
        self.pending.clear()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
