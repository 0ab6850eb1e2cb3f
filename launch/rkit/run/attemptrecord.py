"""attempts/<n>/attempt.json beyond the attempt loop: finding a lost attempt (started, never ended), whether its
processes still run (pid, start time and host), and closing its record."""

from __future__ import annotations

import json
import os
import socket
import time

from rkit.contract.errors import RkitError
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir, write_json_atomic
from rkit.run.policy import Cause, Outcome
from rkit.runtime.trainers import maxtext


def started_at(pid: int) -> float | None:
    """A live process's start time (None for a dead or zombie one): with the host, it tells the recorded process
    from a later one with its pid."""
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:  # dead, not yet reaped by whoever inherited it
            return None
        return process.create_time()
    except psutil.Error:
        return None


def alive_processes(record: dict) -> dict[str, int]:
    """The recorded processes of an attempt that still run on this host (same pid and start time)."""
    if record.get("host") != socket.gethostname():
        return {}
    started = record.get("pid_started") or {}
    return {name: pid for name, pid in (record.get("pids") or {}).items()
            if started.get(name) is not None and started_at(pid) == started[name]}


def refuse_if_alive(run: RunDir, attempt: int) -> None:
    """Never two sets of trainers on one run: a lost attempt whose processes still run is refused by name."""
    try:
        record = json.loads(run.attempt_record(attempt).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    alive = alive_processes(record)
    if alive:
        pids = ", ".join(f"{name} pid {pid}" for name, pid in sorted(alive.items()))
        groups = " ".join(f"-{pid}" for pid in sorted(alive.values()))
        raise RkitError(f"{run.path}: attempt {attempt} is still running without its supervisor ({pids} on "
                        f"{record['host']}); two sets of trainers would write the same checkpoints. Stop them "
                        f"first (kill -TERM -- {groups}), then run again with --resume.")


def close_record(run: RunDir, attempt: int, outcome: Outcome) -> None:
    """A lost attempt's attempt.json says how it ended, like any other's."""
    path = run.attempt_record(attempt)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    record.update({"ended": time.time(), "cause": outcome.cause.value, "detail": outcome.detail,
                   "committed_step": outcome.committed_after})
    write_json_atomic(path, record)


def lost_attempt(run: RunDir, events: list[dict]) -> tuple[int, Outcome] | None:
    """An attempt that started and never ended: its supervisor died with it (Slurm requeued the job after the batch
    host failed, or the machine was lost). It counts against the infrastructure budget."""
    started = [e for e in events if e.get("event") == EV.ATTEMPT_STARTED]
    if not started:
        return None
    attempt = started[-1]["attempt"]
    if any(e.get("event") == EV.ATTEMPT_ENDED and e.get("attempt") == attempt for e in events):
        return None
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0") or "0"
    how = (f"node failure: Slurm requeued the job (SLURM_RESTART_COUNT={restarts})" if restarts != "0"
           else "the supervisor was killed or its machine was lost")
    return attempt, Outcome(Cause.LOST, started[-1].get("resume_from_step"), maxtext.latest_committed_step(run),
                            f"attempt {attempt} ended with its supervisor ({how})")
