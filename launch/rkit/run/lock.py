"""The run's writer lock: an exclusive flock on <run>/.lock, held by the one supervisor (or `rkit run`) that may
write the run. Host side: the ranks never take it."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from rkit.contract.errors import RkitError
from rkit.contract.rundir import LOCK, RunDir, open_for_writing


class RunLock:
    """An exclusive flock on <run>/.lock, held by the one process that may write the run."""

    def __init__(self, path: Path):
        self.path = path
        self._fh = None

    @classmethod
    def of(cls, run: RunDir) -> RunLock:
        return cls(run.path / LOCK)

    def in_use(self, holder: str) -> RkitError:
        return RkitError(f"{self.path.parent}: this run is in use by {holder}. Wait for it to end "
                         f"(rkit status {self.path.parent}) or stop it first; two writers would corrupt it.")

    @classmethod
    def refuse_if_held(cls, run: RunDir) -> None:
        """Planning reads the run: refused, as taking the lock would be, while a writer holds it."""
        if run.is_locked():
            lock = cls.of(run)
            try:
                holder = lock.path.read_text(encoding="utf-8", errors="replace").strip()[:200]
            except OSError:
                holder = ""
            raise lock.in_use(holder or "another process")

    def acquire(self) -> RunLock:
        fh = os.fdopen(open_for_writing(self.path, os.O_RDWR | os.O_CREAT), "r+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            raise self.in_use(holder) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        fh.flush()
        self._fh = fh
        return self

    def release(self) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
