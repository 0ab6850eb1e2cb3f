"""A warm standby rank: a process that has already imported what does not depend on the rank or the coordinator
(Python, JAX, MaxText's trainer, Orbax, the agent) and waits to become one rank of the next attempt.

    python -m rkit.runtime.standby        (started by a backend, backends/standby.py or backends/slurm_standby.py;
                                   never by hand)

It touches no device: importing JAX initialises no backend (jax._src.xla_bridge has none until the first
jax.devices() or computation), so a standby holds no GPU and can sit beside a live attempt. The supervisor's
pipe (RKIT_SUPERVISOR_FD, the same lifeline every rank has) carries, after the token, one JSON line: the rank's
environment (what differs from the standby's), its log and its MaxText arguments. The standby then points its
stdout and stderr at the log and runs the agent exactly as a cold rank would (`agent.main`). EOF before that
line (the supervisor is gone, or dismissed its standbys) ends it quietly.

Before waiting it writes one byte to RKIT_STANDBY_READY_FD: the backend hands over only to a standby that said it
is ready (one that died or hung while importing is replaced, never counted as a training failure).

On Slurm (RKIT_STANDBY_ADDRESS set) the standbys are the tasks of a job step on one node beside the live attempt
(the order names each task's rank and its node's place in the attempt), and an attempt's processes cannot be handed
a pipe: each task connects to the supervisor's address once its imports are done. The token never crosses the
network; both ends prove they hold it (HMAC-SHA256, compared in constant time):

    supervisor -> task   rkit-sb2 <challenge>
    task -> supervisor   <task> <pid> <seconds> <nonce> <hmac(hello, challenge, task, pid, seconds, nonce)>
    supervisor -> task   <hmac(order, nonce, json)> <json>       (the order, with the attempt's directory)

The hello is the task's ready. The task applies only an order whose MAC is right and whose environment names only
what changes with every attempt (PER_ATTEMPT); anything else, or EOF first (the supervisor is gone or dismissed the
step), ends it quietly.

Image side: imports only the standard library, rkit's agent and what MaxText imports.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sys
import time
from collections.abc import Iterable
from pathlib import Path

READY_FD = "RKIT_STANDBY_READY_FD"
ADDRESS = "RKIT_STANDBY_ADDRESS"  # host:port of the supervisor's standby listener (Slurm)
TOKEN = "RKIT_STANDBY_TOKEN"
IMPORT_SECONDS = "RKIT_STANDBY_IMPORT_SECONDS"  # how long the standby's imports took (agent.started reports it)
WARM = "RKIT_WARM"  # set in the rank's environment when it started as a standby
# What changes with every attempt: all an order may set (a standby started under any other environment is cold).
PER_ATTEMPT = ("RKIT_ATTEMPT", "RKIT_RANK", "RKIT_NODE_INDEX", "RKIT_NODE", "RKIT_NODES", "RKIT_COORDINATOR",
               "RKIT_INJECT", "RKIT_SUPERVISOR_FD", "RKIT_SUPERVISOR_TOKEN", "RKIT_STANDBY_READY_FD")
PROTOCOL = b"rkit-sb2"
MAX_LINE = 256  # a challenge or a hello is shorter


def _mac(token: str, *parts: str) -> str:
    return hmac.new(token.encode(), "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def challenge_line(challenge: str) -> bytes:
    return PROTOCOL + b" " + challenge.encode() + b"\n"


def hello_line(token: str, challenge: str, task: int, pid: int, seconds: float, nonce: str) -> bytes:
    fields = [str(task), str(pid), f"{seconds:.3f}", nonce]
    return (" ".join([*fields, _mac(token, "hello", challenge, *fields)]) + "\n").encode()


def check_hello(tokens: Iterable[str], challenge: str, line: bytes) -> tuple[str, int, int, float, str] | None:
    """(token, task, pid, seconds, nonce) of a hello made under one of the tokens for this challenge; else None."""
    parts = line.decode("ascii", "replace").split()
    if len(parts) != 5 or not parts[0].isdigit() or not parts[1].isdigit() or len(parts[0]) > 6:
        return None
    try:
        seconds = float(parts[2])
    except ValueError:
        return None
    for token in tokens:
        if hmac.compare_digest(_mac(token, "hello", challenge, *parts[:4]), parts[4]):
            return token, int(parts[0]), int(parts[1]), seconds, parts[3]
    return None


def order_line(token: str, nonce: str, order: dict) -> bytes:
    body = json.dumps(order)
    return f"{_mac(token, 'order', nonce, body)} {body}\n".encode()


def check_order(token: str, nonce: str, line: bytes) -> dict | None:
    """The order if the supervisor made it (its MAC) and it sets only what changes with every attempt; else None."""
    mac, _, body = line.decode("utf-8", "replace").rstrip("\n").partition(" ")
    if not hmac.compare_digest(_mac(token, "order", nonce, body), mac):
        return None
    order = json.loads(body)
    if not isinstance(order, dict) or not isinstance(order.get("env"), dict) or set(order["env"]) - set(PER_ATTEMPT):
        return None
    return order


def warm_up() -> float:
    """Everything a rank imports before its coordinator matters; returns the seconds it took. What the agent sets
    before MaxText's import is set first here too: MaxText reads MAXTEXT_ASSETS_ROOT once, when it is imported (a
    standby that imported it without, failed as a rank: "Failed to load sentencepiece tokenizer from
    tokenizer.default", found by the fault campaign)."""
    started = time.monotonic()
    from rkit.runtime.trainers.maxtext import set_assets_root

    set_assets_root(os.environ)
    import jax  # noqa: F401 - no backend is initialised by the import
    import orbax.checkpoint  # noqa: F401
    from absl import app  # noqa: F401
    from maxtext.trainers.pre_train import train  # noqa: F401

    from rkit.runtime import agent, manifest  # noqa: F401
    from rkit.runtime.trainers import maxtext  # noqa: F401

    return time.monotonic() - started


def read_line(fd: int) -> bytes | None:
    """One newline-ended line from the pipe; None at EOF before it."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            return None
        data += chunk
    return data


def take_order(order: dict, log_path: Path, seconds: float, lifeline: int | None = None) -> int:
    """Become the rank the order describes: its log, its environment (a value of None unsets), then the agent."""
    from rkit.contract.rundir import open_for_writing

    log = open_for_writing(log_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    for name, value in order["env"].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    os.environ.update({WARM: "1", IMPORT_SECONDS: f"{seconds:.3f}"})
    from rkit.runtime import agent

    agent.main(order["argv"], lifeline=lifeline)
    return 0


def main_on_slurm() -> int:
    import socket

    host, _, port = os.environ.pop(ADDRESS).rpartition(":")
    token = os.environ.pop(TOKEN)
    task = int(os.environ["SLURM_PROCID"])
    seconds = warm_up()
    nonce = secrets.token_hex(16)
    with socket.create_connection((host, int(port)), timeout=120) as conn:
        conn.settimeout(None)
        said = read_line(conn.fileno())
        if said is None or not said.startswith(PROTOCOL + b" ") or len(said) > MAX_LINE:
            return 0  # dismissed, or not our supervisor
        conn.sendall(hello_line(token, said[len(PROTOCOL) + 1:].strip().decode(), task, os.getpid(), seconds, nonce))
        line = read_line(conn.fileno())
    order = None if line is None else check_order(token, nonce, line)
    if order is None:
        return 0  # dismissed, or an order the supervisor did not make
    from rkit.contract.rundir import RunDir

    # A standby step of one node gives its tasks ranks of their own (RKIT_RANK in the order); else the task's.
    rank = order["env"].get("RKIT_RANK") or str(task)
    return take_order(order, Path(order["attempt_dir"]) / RunDir.rank_log_name(int(rank)), seconds)


def main() -> int:
    if ADDRESS in os.environ:
        return main_on_slurm()
    fd, token = int(os.environ["RKIT_SUPERVISOR_FD"]), os.environ["RKIT_SUPERVISOR_TOKEN"].encode()
    if not hmac.compare_digest(os.read(fd, len(token)), token):
        return 3
    seconds = warm_up()
    ready = int(os.environ.pop(READY_FD))
    os.write(ready, b"R")
    os.close(ready)
    line = read_line(fd)
    if line is None:
        return 0  # dismissed
    order = json.loads(line)
    return take_order(order, Path(order["log"]), seconds, lifeline=fd)


if __name__ == "__main__":
    sys.exit(main())
