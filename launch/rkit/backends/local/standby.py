"""Warm standbys for the local launcher: one waiting process per rank (rkit.runtime.standby, the image side), so that a
new attempt's ranks skip Python's, JAX's and MaxText's imports. The pool spawns them beside a live attempt, says
which are ready, replaces one that died while waiting, and hands a ready one its rank at the next attempt.

Standbys start once an attempt has trained its first step (before that their imports would slow its start-up),
so a failure in the first seconds of training restarts cold. A standby is used only when the new rank's
environment equals the one it was started with, except what changes with every attempt (PER_ATTEMPT): JAX reads
some variables when it is imported, so a standby started under another environment starts cold instead. It is
never part of a live attempt, holds no device, and a standby that is not ready when an attempt starts is killed
and the rank starts cold: it never counts as a failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import select
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rkit.contract.rundir import open_for_writing
from rkit.runtime.standby import PER_ATTEMPT

PREFIX = "APPTAINERENV_"
STANDBY_LOG = "standby.log"


def inside(env: dict[str, str], container: bool) -> dict[str, str]:
    """The variables as the process sees them (a container's come in as APPTAINERENV_<name>)."""
    if not container:
        return dict(env)
    return {k[len(PREFIX):]: v for k, v in env.items() if k.startswith(PREFIX)}


def fingerprint(env: dict[str, str], container: bool) -> str:
    seen = {k: v for k, v in inside(env, container).items() if k not in PER_ATTEMPT}
    return hashlib.sha256(json.dumps(seen, sort_keys=True).encode()).hexdigest()


def standby_argv(rank_argv: list[str]) -> list[str]:
    """The rank's command line up to its Python, running rkit.runtime.standby instead of the agent."""
    at = rank_argv.index("rkit.runtime.agent")
    return [*rank_argv[:at], "rkit.runtime.standby"]


@dataclass
class Standby:
    rank: int
    proc: subprocess.Popen
    lifeline: int  # write end of its supervisor pipe (the rank's lifeline once it takes the rank)
    ready_fd: int  # read end of its ready pipe
    key: str
    ready: bool = False

    def poll_ready(self) -> bool:
        if not self.ready and self.proc.poll() is None:
            readable, _, _ = select.select([self.ready_fd], [], [], 0)
            if readable and os.read(self.ready_fd, 1) == b"R":
                self.ready = True
        return self.ready

    def discard(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.close()

    def close(self) -> None:
        for fd in (self.lifeline, self.ready_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class StandbyPool:
    def __init__(self, container: bool):
        self.container = container
        self.log: Path | None = None  # <run>/standby.log: what standbys print before they take a rank
        self.waiting: dict[int, Standby] = {}
        self._template: dict[int, tuple[list[str], dict[str, str], Path]] = {}
        self._notes: list[dict[str, Any]] = []

    def remember(self, ranks: list[Any], cwd: Path) -> None:
        """The attempt just started: its ranks' command lines and environments are the next standbys'."""
        self.cwd = cwd
        self.log = ranks[0].log.parent.parent.parent / STANDBY_LOG  # <run>/attempts/<n>/rank-<r>.log
        self._template = {r.rank: (standby_argv(r.argv), dict(r.env), r.log) for r in ranks}

    def fill(self) -> None:
        for rank in self._template:
            if rank not in self.waiting:
                self._spawn(rank, "started")

    def _spawn(self, rank: int, why: str) -> None:
        argv, env, _ = self._template[rank]
        sup_read, sup_write = os.pipe()
        ready_read, ready_write = os.pipe()
        token = secrets.token_hex(16)
        os.write(sup_write, token.encode())
        prefix = PREFIX if self.container else ""
        env = {**env, f"{prefix}RKIT_SUPERVISOR_FD": str(sup_read), f"{prefix}RKIT_SUPERVISOR_TOKEN": token,
               f"{prefix}RKIT_STANDBY_READY_FD": str(ready_write)}
        try:
            with os.fdopen(open_for_writing(self.log), "ab") as log:
                proc = subprocess.Popen(argv, env=env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        pass_fds=(sup_read, ready_write))
        except OSError as exc:
            os.close(sup_write)
            os.close(ready_read)
            self._notes.append({"rank": rank, "what": "failed", "reason": str(exc)})
            return
        finally:
            os.close(sup_read)
            os.close(ready_write)
        self.waiting[rank] = Standby(rank, proc, sup_write, ready_read, fingerprint(env, self.container))
        self._notes.append({"rank": rank, "what": why, "pid": proc.pid})

    def check(self) -> list[dict[str, Any]]:
        """Replace standbys that died while waiting; return what changed since the last call (for events)."""
        for rank, standby in list(self.waiting.items()):
            was = standby.ready
            if standby.proc.poll() is not None:
                code = standby.proc.returncode
                del self.waiting[rank]
                standby.close()
                self._notes.append({"rank": rank, "what": "died", "pid": standby.proc.pid, "returncode": code})
                self._spawn(rank, "replaced")
            elif standby.poll_ready() and not was:
                self._notes.append({"rank": rank, "what": "ready", "pid": standby.proc.pid})
        notes, self._notes = self._notes, []
        return notes

    def take(self, rank: int, env: dict[str, str]) -> Standby | None:
        """A ready standby started under the same environment, taken out of the pool; else None (cold)."""
        standby = self.waiting.pop(rank, None)
        if standby is None:
            return None
        if standby.poll_ready() and standby.key == fingerprint(env, self.container):
            os.close(standby.ready_fd)
            return standby
        standby.discard()
        self._notes.append({"rank": rank, "what": "discarded", "pid": standby.proc.pid,
                            "reason": "not ready" if not standby.ready else "another environment"})
        return None

    def hand_over(self, standby: Standby, env: dict[str, str], argv: list[str], log: Path) -> None:
        """The rank's order: its environment (as the process sees it), MaxText arguments and log."""
        at = argv.index("rkit.runtime.agent")
        order = {"env": {k: v for k, v in inside(env, self.container).items()
                         if k not in ("RKIT_SUPERVISOR_FD", "RKIT_SUPERVISOR_TOKEN")},
                 "argv": argv[at + 1:], "log": str(log)}
        os.write(standby.lifeline, (json.dumps(order) + "\n").encode())

    def dismiss(self) -> None:
        """Every waiting standby ends (EOF on its pipe; killed if it does not)."""
        for standby in self.waiting.values():
            standby.discard()
        self.waiting.clear()
