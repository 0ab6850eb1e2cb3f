"""What one attempt's files say while it runs, for the supervisor's loop (supervisor.py): each rank's progress from
its metrics file, the hang watch, stragglers, the first step, and the diagnoses read from the ranks' logs (disk
full, a checkpoint that could not be restored, a coordinator port in use)."""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rkit.backends.base import RankExit
from rkit.contract.config import Config
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir, filesystem
from rkit.run import preflight
from rkit.run.oomkills import OomWatch
from rkit.run.policy import Progress
from rkit.run.ranklogs import (
    LOG_LINE,
    OUT_OF_MEMORY,
    PEER_FAILED,
    LogScan,
    injected_exit,
    jax_silent_tasks,
    last_error_lines,
    rank_error,
    write_paths,
)
from rkit.run.stragglers import StragglerWatch
from rkit.run.watchdog import HangPolicy, HangWatch
from rkit.runtime.telemetry.metrics import MetricsTail
from rkit.runtime.trainers import maxtext


class Watcher(Protocol):
    """What an AttemptWatch reads of the supervisor that owns it (run/supervisor.py's Supervisor)."""

    run: RunDir
    config: Config
    poll_seconds: float
    step_times: list[float]
    clock: Callable[[], float]
    on_progress: Callable[[Progress], None]

    @property
    def processes(self) -> int: ...

# The failed ranks' logs read for the culprit of a failed attempt (the first of them in the order noticed).
CULPRIT_LOGS = 64
# A failed rank that says only that a peer went away, with ranks still running: how long the peer's own exit may
# lag behind it (a rank in a container is reaped by its runtime a moment after its peers see the reset, and under
# load the peer's exit is noticed after theirs). Measured: under 0.5 s quiet, seconds beside a CPU-heavy job.
PEER_GRACE_SECONDS = 10.0
# Fewer free bytes than this on the checkpoints' file system when a rank fails or hangs: the disk is full.
FULL_BYTES = 1 << 20
# How often the supervisor writes to the run directory itself during an attempt (the attempt folder's time stamp):
# a file system remounted read-only after an error is then known within seconds, not by the hang watch minutes
# later, when the ranks' own writes fail silently.
WRITE_CHECK_SECONDS = 5.0
REFUSED_WRITE = (errno.EROFS, errno.EIO, errno.EDQUOT, errno.ENOSPC, errno.EACCES, errno.EPERM)


class StartupPhase:
    """Which part of its start-up an attempt is in, from its agents' events (agent.started: the process runs;
    agent.ready: jax.distributed set up and MaxText imported), read from where events.jsonl ended when the attempt
    began, at most once a second, until the first step: what the live display names while the step count is 0."""

    def __init__(self, events_file: Path, attempt: int, ranks: int, resumed_from: int | None):
        self.file, self.attempt, self.ranks, self.resumed_from = events_file, attempt, ranks, resumed_from
        try:
            self.offset = events_file.stat().st_size
        except OSError:
            self.offset = 0
        self.partial = b""
        self.started: set[int] = set()
        self.ready: set[int] = set()
        self.next = 0.0

    def read(self) -> None:
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + 1.0
        try:
            with open(self.file, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read(1 << 20)
        except OSError:
            return
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()[-(1 << 16):]
        for line in lines:
            if b'"agent.' not in line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("attempt") == self.attempt and isinstance(event.get("rank"), int):
                {EV.AGENT_STARTED: self.started, EV.AGENT_READY: self.ready}.get(event.get("event"), set()).add(
                    event["rank"])

    def describe(self) -> str:
        if len(self.ready) >= self.ranks:
            return ("compiling" if self.resumed_from is None else f"restoring step {self.resumed_from}, compiling")
        if len(self.started) >= self.ranks:
            return f"jax.distributed set-up, importing MaxText ({len(self.ready)}/{self.ranks} ready)"
        return f"starting processes ({len(self.started)}/{self.ranks})"


@dataclass
class AttemptWatch:
    """What one attempt's metrics files say: each rank's progress, the hang watch, stragglers, the first step."""

    sup: Watcher
    attempt: int
    started: float  # wall clock, for attempt.first_step
    tails: dict[int, MetricsTail]
    progress: Progress
    resumed_from: int | None = None
    first_step_seen: bool = False
    oom: OomWatch = field(default_factory=OomWatch)  # the OOM-kill counters at the attempt's start
    peer_words: dict[int, bool] = field(default_factory=dict)  # failed rank -> its log blames a peer
    peer_wait_since: float | None = None
    next_write_check: float = 0.0  # time.monotonic() of the next write_refused check

    def __post_init__(self) -> None:
        sup = self.sup
        self.hang = HangWatch(HangPolicy.from_config(sup.config, sup.period), ranks=list(self.tails),
                              started=sup.clock(),
                              step_times=sup.step_times)
        factor = float(sup.config.observability.straggler_factor)
        self.stragglers = StragglerWatch(sup.run, self.attempt, factor, sup.clock)
        # Its own clock: how often the logs are read is about I/O, not policy (a hang forces a read anyway).
        self.logs = LogScan([sup.run.rank_log(self.attempt, r) for r in self.tails], time.monotonic)
        # Each poll stats every rank's metrics file; past 64 ranks the files are looked at every few polls (512
        # ranks: every 0.8 s), exits still every poll. Metrics only feed the hang watch (timeouts of minutes),
        # stragglers and progress.
        self.scan_every, self.next_scan = sup.poll_seconds * max(1, len(self.tails) // 64), 0.0
        self.phase = StartupPhase(sup.run.events_file, self.attempt, len(self.tails), self.resumed_from)

    def disk_full(self, force: bool) -> str | None:
        """A rank's log line saying a write failed for space, with the checkpoints' file system; or, when a rank
        failed or hung, that file system being full (its log may live there too and then says nothing); or the
        run directory refusing the supervisor's own write (every WRITE_CHECK_SECONDS)."""
        if (refused := self.write_refused()) is not None:
            return refused
        line = self.logs.disk_full(force)
        if line is None and not force:
            return None
        if line is not None and (elsewhere := self._written_elsewhere(line)) is not None:
            return f"{line} ({elsewhere})"
        mount, free = filesystem(self.sup.run.orbax_dir)
        if line is None:
            if free is None or free > FULL_BYTES:
                return None
            line = "a rank failed or stopped with no room left on the run directory's file system"
        return f"{line} (file system {mount}: {'?' if free is None else free} bytes free)"

    def _written_elsewhere(self, line: str) -> str | None:
        """Where a failed write went when its line names a path outside the run directory: the node-local tier
        (checkpoint.local_dir) or another file system of the rank's node, which this host cannot measure (its own
        file at that path, if any, is another disk). None for a write into the run directory, or no path."""
        path = next(iter(write_paths(line)), None) or self.logs.disk_full_path()
        if path is None:
            return None
        if any(Path(path).is_relative_to(root) for root in (self.sup.run.path, os.path.realpath(self.sup.run.path))):
            return None
        local = self.sup.config.checkpoint.local_dir
        prefix = local.split("$", 1)[0].rstrip("/") if local else None
        if prefix and path.startswith(prefix + "/"):
            return f"the node-local tier, checkpoint.local_dir {local}, on the rank's node: free space there"
        return f"a file system of the rank's node outside the run directory: {path}"

    def write_refused(self) -> str | None:
        now = time.monotonic()
        if now < self.next_write_check:
            return None
        self.next_write_check = now + WRITE_CHECK_SECONDS
        folder = self.sup.run.attempt_dir(self.attempt)
        try:
            os.utime(folder)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno not in REFUSED_WRITE:
                return None
            mount, free = filesystem(folder)
            return (f"the run directory's file system refused the supervisor's own write to {folder}: "
                    f"{exc.strerror or exc} (file system {mount}: {'?' if free is None else free} bytes free); "
                    "the ranks' logs, metrics and checkpoints cannot be written there either")
        return None

    def restore_failed(self, force: bool) -> str | None:
        """Before a resumed attempt's first step: the failing rank's last error lines."""
        if self.first_step_seen or self.resumed_from is None:
            return None
        hit = self.logs.restore_failed(force)
        if hit is None:
            return None
        line, log = hit
        lines = last_error_lines(log) or [line]
        return f"{log.name}: " + " | ".join(lines)

    def failure(self, rank_exit: RankExit) -> tuple[str | None, str | None]:
        """A failed rank's own last error line, and whether (and how it was seen that) it ran out of memory: the
        OOM killer in its cgroup since the attempt began (a SIGKILL not the launcher's), or its own words
        (MemoryError, XLA's)."""
        said = rank_error(self.sup.run.rank_log(self.attempt, rank_exit.rank))
        oom = self.oom.killed() if rank_exit.returncode == -9 and not rank_exit.ended_by_launcher else None
        if oom is None and said is not None and OUT_OF_MEMORY.search(said):
            oom = "its log says so"
        return said, oom

    def culprit(self, failed: list[RankExit]) -> tuple[RankExit, str | None, str | None]:
        """Of the ranks that failed (in the order noticed), the one whose failure explains the others', with its
        own words and how it ran out of memory (`failure`). A rank whose collective broke because a peer went away
        (ranklogs.PEER_FAILED) is the culprit only when no other is: under load srun may report the peer's abort
        before the failing rank's own exit, or end the failing rank itself (--kill-on-bad-exit) before its exit
        is seen; the exit a rank ended by srun gave itself through rkit's `--inject` is its own again
        (`injected_exit`). At most `CULPRIT_LOGS` logs are read, on a shared file system, once per failed attempt."""
        ranked: dict[int, tuple[RankExit, str | None, str | None]] = {}
        for rank_exit in failed[:CULPRIT_LOGS]:
            said, oom = self.failure(rank_exit)
            if oom is not None or (said is not None and not PEER_FAILED.search(said)):
                if rank_exit.ended_by_launcher and (code := injected_exit(said)) is not None:
                    rank_exit = RankExit(rank_exit.rank, code, rank_exit.node)  # its own (injected) exit, not srun's
                return rank_exit, said, oom  # its own words: the culprit
            # Else, best first: a rank that died silently of its own (a SIGKILL from outside), one whose peer went
            # away, one the launcher ended with nothing said.
            order = 2 if said is not None else (3 if rank_exit.ended_by_launcher else 1)
            ranked.setdefault(order, (rank_exit, said, oom))
        return ranked[min(ranked)]  # `failed` is never empty: the supervisor asks once a rank failed

    def _blames_peer(self, rank_exit: RankExit) -> bool:
        """Whether a failed rank's own words only say that a peer went away (read once per rank)."""
        if rank_exit.rank not in self.peer_words:
            said, oom = self.failure(rank_exit)
            self.peer_words[rank_exit.rank] = oom is None and said is not None and bool(PEER_FAILED.search(said))
        return self.peer_words[rank_exit.rank]

    def culprit_may_lag(self, failed: list[RankExit], everyone_exited: bool, probing: bool = False) -> bool:
        """Whether to hold the verdict on a failed attempt for a moment: every rank that failed so far says only
        that a peer went away, and the peer (still counted as running) has not been seen to exit. Judged now, a
        survivor would be named for the peer's failure (a task_exit for a SIGKILL). At most `PEER_GRACE_SECONDS`
        from the first such poll; each failed rank's log is read once for it."""
        own = [e for e in failed[:CULPRIT_LOGS] if not e.ended_by_launcher]
        if not own or (everyone_exited and len(own) == len(failed)):
            return False  # (a peer the launcher ended said nothing of its own: its node may be the one gone)
        for rank_exit in own:
            if not self._blames_peer(rank_exit):
                return False
        now = self.sup.clock()
        if self.peer_wait_since is None:
            self.peer_wait_since = now
        # A node liveness is probing (its heartbeats stopped) may be the peer's: its verdict is seconds away.
        return now - self.peer_wait_since < PEER_GRACE_SECONDS or probing

    def silent_peers(self, failed: list[RankExit], running: list[int]) -> tuple[int, ...]:
        """The ranks JAX's coordination service named, in the logs of failed ranks that only blame a peer, as
        having stopped sending heartbeats, and that did not fail of their own: still running once the peer grace
        has run out (`culprit_may_lag`), or ended by the launcher after the others (srun --kill-on-bad-exit ends a
        stopped rank as soon as its peer aborts). Such a rank is hung (stopped, or its process frozen): the ranks
        JAX aborted for it are not the culprits."""
        named: set[int] = set()
        for rank_exit in failed[:CULPRIT_LOGS]:
            if rank_exit.ended_by_launcher:
                continue  # srun's kill: its own words, if any, came before
            if not self._blames_peer(rank_exit):
                return ()
            named |= jax_silent_tasks(self.sup.run.rank_log(self.attempt, rank_exit.rank))
        ended = {e.rank for e in failed if e.ended_by_launcher}
        silent = named & (set(running) | ended)
        if silent & set(running) and (self.peer_wait_since is None
                                      or self.sup.clock() - self.peer_wait_since < PEER_GRACE_SECONDS):
            return ()  # it may yet exit on its own and say why
        return tuple(sorted(silent))

    def jax_peer_lost(self, force: bool) -> str | None:
        """A rank's log line saying JAX's coordination service declared a process dead."""
        hit = self.logs.scan(force).get("jax_peer_lost")
        return None if hit is None else f"{hit[1].name}: {hit[0]}"

    def out_of_data(self, force: bool) -> str | None:
        """A rank's log saying MaxText stopped training because its data ran out (which rank, and its line)."""
        hit = self.logs.scan(force).get("out_of_data")
        if hit is None:
            return None
        line, log = hit
        said = line.split("] ", 1)[-1] if LOG_LINE.match(line) else line
        return f"{log.stem.replace('-', ' ')}'s data ran out (MaxText: {said!r})"

    def port_in_use(self, force: bool) -> str | None:
        """Before the first step: a rank's log saying jax.distributed's coordinator could not listen."""
        hit = None if self.first_step_seen else self.logs.port_in_use(force)
        return None if hit is None else f"{hit[1].name}: {hit[0]}"

    def read(self, force: bool = False) -> None:
        """The metrics files at most every `scan_every` (a poll, longer with many ranks), or now (`force`)."""
        sup, progress = self.sup, self.progress
        now = time.monotonic()
        scan = force or now >= self.next_scan
        if scan:
            self.next_scan = now + self.scan_every
        for rank, tail in self.tails.items() if scan else ():
            if not preflight.grew(tail):  # one stat, not open, read and close
                continue
            for m in tail.poll():
                self.hang.progress(rank, m.step, m.step_time, sup.clock())
                self.stragglers.add(m)
                progress.step = m.step if rank == 0 or progress.step is None else max(progress.step, m.step)
                if rank == 0 and m.tokens_per_sec_per_device:
                    progress.tokens_per_sec = m.tokens_per_sec_per_device * sup.processes
                if not self.first_step_seen:
                    self.first_step_seen = True
                    restored = self.logs.restore_span(force=True)  # goodput's restore, apart from compilation
                    sup.run.emit(EV.ATTEMPT_FIRST_STEP, attempt=self.attempt, step=m.step, rank=rank,
                                 seconds_since_start=round(time.time() - self.started, 3),
                                 **({"restore_started": round(restored[0], 3),
                                     "restore_seconds": round(restored[1] - restored[0], 3)} if restored else {}))
        self.stragglers.check()
        progress.committed = maxtext.latest_committed_step(sup.run)
        progress.message = f"attempt {self.attempt}"
        final = sup.config.trainer.final_step
        if not self.first_step_seen:
            self.phase.read()
            progress.message += f": {self.phase.describe()}"
        elif progress.step is not None and progress.step >= final and progress.committed != final:
            progress.message += ": saving the final checkpoint"
        sup.on_progress(progress)

    def last_steps(self) -> dict[int, int | None]:
        return {rank: tail.last.step if tail.last else None for rank, tail in self.tails.items()}
