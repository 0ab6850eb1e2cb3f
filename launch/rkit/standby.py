"""A warm standby rank: a process that has already imported what does not depend on the rank or the coordinator
(Python, JAX, MaxText's trainer, Orbax, the agent) and waits to become one rank of the next attempt.

    python -m rkit.standby        (started by a backend, backends/standby.py or backends/slurm_standby.py;
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
a pipe: each task connects to the supervisor's address once its imports are
done, says `<token> <task> <pid> <seconds>` (that line is its ready), and waits on the connection for the same
JSON line, with the attempt's directory instead of a log (the task's log is its rank's log there). EOF first (the
supervisor is gone or dismissed the step) ends it quietly.

Image side: imports only the standard library, rkit's agent and what MaxText imports.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

READY_FD = "RKIT_STANDBY_READY_FD"
ADDRESS = "RKIT_STANDBY_ADDRESS"  # host:port of the supervisor's standby listener (Slurm)
TOKEN = "RKIT_STANDBY_TOKEN"
IMPORT_SECONDS = "RKIT_STANDBY_IMPORT_SECONDS"  # how long the standby's imports took (agent.started reports it)
WARM = "RKIT_WARM"  # set in the rank's environment when it started as a standby


def warm_up() -> float:
    """Everything a rank imports before its coordinator matters; returns the seconds it took."""
    started = time.monotonic()
    import jax  # noqa: F401 - no backend is initialised by the import
    import orbax.checkpoint  # noqa: F401
    from absl import app  # noqa: F401
    from maxtext.trainers.pre_train import train  # noqa: F401

    from . import agent, manifest  # noqa: F401
    from .trainers import maxtext  # noqa: F401

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
    from .rundir import open_for_writing

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
    from . import agent

    agent.main(order["argv"], lifeline=lifeline)
    return 0


def main_on_slurm() -> int:
    import socket

    host, _, port = os.environ.pop(ADDRESS).rpartition(":")
    token = os.environ.pop(TOKEN)
    task = int(os.environ["SLURM_PROCID"])
    seconds = warm_up()
    with socket.create_connection((host, int(port)), timeout=120) as conn:
        conn.settimeout(None)
        conn.sendall(f"{token} {task} {os.getpid()} {seconds:.3f}\n".encode())
        line = read_line(conn.fileno())
    if line is None:
        return 0  # dismissed
    order = json.loads(line)
    from .rundir import RunDir

    # A standby step of one node gives its tasks ranks of their own (RKIT_RANK in the order); else the task's.
    rank = order["env"].get("RKIT_RANK") or str(task)
    return take_order(order, Path(order["attempt_dir"]) / RunDir.rank_log_name(int(rank)), seconds)


def main() -> int:
    if ADDRESS in os.environ:
        return main_on_slurm()
    fd, token = int(os.environ["RKIT_SUPERVISOR_FD"]), os.environ["RKIT_SUPERVISOR_TOKEN"].encode()
    if os.read(fd, len(token)) != token:
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
