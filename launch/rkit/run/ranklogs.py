"""What the ranks' logs say, for a diagnosis the exit codes cannot give: a write that failed for space (a
checkpoint save) and a rank's last error lines. Read incrementally, at most every `every` seconds: logs grow
for days and live on a shared file system."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from rkit.contract.safeio import open_regular

# Orbax/TensorStore report a failed write as RESOURCE_EXHAUSTED ("Error writing ..."); Python and the C library
# as ENOSPC / EDQUOT. XLA's out-of-memory is RESOURCE_EXHAUSTED too, but never about writing.
DISK_FULL = re.compile(rb"No space left on device|Disk quota exceeded|\[Errno 28\]|\[Errno 122\]"
                       rb"|RESOURCE_EXHAUSTED[^\n]*(?:[Ee]rror writing|[Ww]rite|[Nn]o space|[Qq]uota)")
MAX_READ = 1 << 20  # per log and look: a burst of output is read over several looks
# The path a failed write names: TensorStore's `local file "/..."`, Orbax's `directory: /...`, Python's
# `[Errno 28] No space left on device: '/...'` (never a traceback's `File "/.../x.py"`).
WRITE_PATH = re.compile(r"local file \"(/[^\"\n]+)\"|directory: (/\S+)"
                        r"|(?:No space left on device|Disk quota exceeded): '(/[^'\n]+)'")


def write_paths(text: str, start: int = 0, end: int | None = None) -> list[str]:
    """The paths failed writes name in text[start:end] (WRITE_PATH), in order."""
    found = WRITE_PATH.findall(text, start, len(text) if end is None else end)
    return [next(p for p in groups if p) for groups in found]


# A restore that failed: TensorStore's DATA_LOSS/NOT_FOUND on a checkpoint's files, Orbax's own errors, MaxText
# refusing a step directory it cannot use.
RESTORE_FAILED = re.compile(rb"DATA_LOSS|Error reading shard|NOT_FOUND: [^\n]*(?:ocdbt|checkpoint|orbax)"
                            rb"|[Ff]ailed to restore|checkpoint already exists")
# JAX's coordination service (process 0) could not listen: gRPC's bind error, then JAX's own.
PORT_IN_USE = re.compile(rb"Failed to add port to server|Failed to start RPC server")
# JAX's coordination service declared a process dead (its heartbeat_timeout_seconds): a peer's node may be gone.
JAX_PEER_LOST = re.compile(rb"stopped sending heartbeats|heartbeat timeout\. This indicates that the remote task")
# MaxText's data loader on the end of the training data (StopTraining, logged as "Training stopped: ...").
OUT_OF_DATA = re.compile(rb"You may have run out of training data")
PATTERNS = {"disk_full": DISK_FULL, "restore_failed": RESTORE_FAILED, "port_in_use": PORT_IN_USE,
            "jax_peer_lost": JAX_PEER_LOST, "out_of_data": OUT_OF_DATA}
# A rank's own verdict on its failed restore (runtime/trainers/emergency.py, with a local tier): the step was
# damaged, and in which tier (the rank moved a local copy aside itself); or the restore was broken off by something
# else (a peer lost, memory, I/O), printed before its traceback, whose lines then say nothing of the step.
RESTORE_VERDICT = re.compile(rb"rkit: Failed to restore step (\d+) from the (local|persistent) tier")
RESTORE_BROKEN_OFF = re.compile(rb"rkit: the restore of step \d+.* was broken off")
# Orbax's record of a finished restore (its standard logger, through absl): the CheckpointManager's start time
# (the rank's wall clock) and duration, e.g. `{'step': 240, 'event_type': 'restore', ...,
# 'checkpoint_manager_start_time': 1796146611.46, 'checkpoint_manager_duration_secs': 0.12}`.
RESTORED = re.compile(rb"'event_type': 'restore'.*'checkpoint_manager_start_time': ([0-9.eE+-]+), "
                      rb"'checkpoint_manager_duration_secs': ([0-9.eE+-]+)")


class LogScan:
    """The ranks' logs, read where the last look stopped: the first line of each kind (PATTERNS), and the log
    it is in."""

    def __init__(self, paths: list[Path], clock: Callable[[], float], every: float = 1.0):
        self.paths = list(paths)
        self.clock = clock
        self.every = every
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._next = 0.0
        self.found: dict[str, tuple[str, Path]] = {}
        self.restore_lines: dict[Path, str] = {}  # per log: its first line saying a restore failed
        self.verdicts: dict[Path, tuple[int, str]] = {}  # per log: the rank's own verdict, (step, tier)
        self.broken_off: set[Path] = set()  # logs whose rank said its restore was broken off, not damaged
        self.restores: dict[Path, tuple[float, float]] = {}  # per log: Orbax's restore, (start, end)
        self._restores_read = False  # restore_span was asked: later lines need not be searched for a restore

    def scan(self, force: bool = False) -> dict[str, tuple[str, Path]]:
        now = self.clock()
        if force or now >= self._next:
            self._next = now + self.every
            for path in self.paths:
                for line in self._new_lines(path):
                    for kind, pattern in PATTERNS.items():
                        if kind not in self.found and pattern.search(line):
                            self.found[kind] = (line.decode("utf-8", "replace").strip()[:400], path)
                    if path not in self.restore_lines and RESTORE_FAILED.search(line):
                        self.restore_lines[path] = line.decode("utf-8", "replace").strip()[:400]
                    if path not in self.verdicts and (m := RESTORE_VERDICT.search(line)):
                        self.verdicts[path] = (int(m[1]), m[2].decode())
                    if RESTORE_BROKEN_OFF.search(line):
                        self.broken_off.add(path)
                    if not self._restores_read and path not in self.restores and (m := RESTORED.search(line)):
                        try:
                            start, seconds = float(m[1]), float(m[2])
                        except ValueError:
                            continue
                        self.restores[path] = (start, start + max(0.0, seconds))
        return self.found

    def restore_span(self, force: bool = False) -> tuple[float, float] | None:
        """Orbax's restore in the logs read so far: the first rank's start to the last rank's end (wall clock),
        or None when no rank has restored (a fresh start, or an Orbax that does not log it). Asked once, at the
        attempt's first step: the lines after it are not searched for a restore."""
        self.scan(force)
        self._restores_read = True
        if not self.restores:
            return None
        return min(a for a, _ in self.restores.values()), max(b for _, b in self.restores.values())

    def disk_full(self, force: bool = False) -> str | None:
        """The first log line that says a write failed for space, once one was written."""
        hit = self.scan(force).get("disk_full")
        return hit[0] if hit else None

    def disk_full_path(self) -> str | None:
        """The path the failed write was to, where the line itself names none (Python's bare `OSError: [Errno 28]
        No space left on device`): the last path in the lines before it (Orbax's `Failed to run ... in background
        save thread, directory: /...`). Read once the line was found."""
        hit = self.found.get("disk_full")
        text = tail_text(hit[1]) if hit else None
        if not hit or text is None or (at := text.rfind(hit[0])) < 0:
            return None
        return next(reversed(write_paths(text, max(0, at - 4096), at)), None)

    def restore_failed(self, force: bool = False) -> tuple[str, Path] | None:
        """The first log saying a restore failed, of those whose rank did not say its restore was broken off
        (a peer's loss, not the step's bytes: the attempt then fails as a task failure)."""
        self.scan(force)
        return next(((line, path) for path, line in self.restore_lines.items() if path not in self.broken_off),
                    None)

    def restore_verdict(self) -> tuple[int, str] | None:
        """A rank's own word on which step failed to restore, and from which tier, as (step, tier); None where
        no rank said (no local tier: MaxText's own restore)."""
        return next((v for path, v in self.verdicts.items() if path not in self.broken_off), None)

    def port_in_use(self, force: bool = False) -> tuple[str, Path] | None:
        return self.scan(force).get("port_in_use")

    def _new_lines(self, path: Path) -> list[bytes]:
        try:
            with open_regular(path) as fh:
                fh.seek(self._offsets.get(path, 0))
                chunk = fh.read(MAX_READ)
                self._offsets[path] = fh.tell()
        except OSError:
            return []
        parts = (self._partial.get(path, b"") + chunk).split(b"\n")
        self._partial[path] = parts.pop()[-MAX_READ:]
        return parts


# Orbax's event_tracking lines: the whole save (async: blocking + background) and the part that blocks training.
SAVE_DONE = re.compile(rb"\] \[(?:async|sync)\] Finished save(?: \(blocking \+ background\))? in ([0-9.]+) seconds")
SAVE_BLOCKING = re.compile(rb"\] \[async\] Finished blocking save in ([0-9.]+) seconds")


def save_seconds(logs: list[Path], tail_bytes: int | None = None) -> tuple[list[float], list[float]]:
    """Orbax's save durations (whole, blocking) found in these logs (in each one's last `tail_bytes`, if given)."""
    whole: list[float] = []
    blocking: list[float] = []
    for log in logs:
        try:
            with open_regular(log) as fh:  # a FIFO or /dev/zero in place of a log: skipped, not waited on
                if tail_bytes is not None:
                    fh.seek(0, 2)
                    fh.seek(max(0, fh.tell() - tail_bytes))
                text = fh.read()
        except OSError:
            continue
        whole.extend(float(m) for m in SAVE_DONE.findall(text))
        blocking.extend(float(m) for m in SAVE_BLOCKING.findall(text))
    return whole, blocking


def tail_text(path: Path, tail_bytes: int = 65536) -> str | None:
    """The end of a rank's log as text; None when it cannot be read (missing, or not a regular file: a FIFO in
    its place must not stall the supervisor)."""
    try:
        with open_regular(path) as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - tail_bytes))
            return fh.read(tail_bytes).decode("utf-8", "replace")
    except OSError:
        return None


def last_error_lines(path: Path, lines: int = 5, tail_bytes: int = 65536) -> list[str]:
    """A rank's last lines that look like an error (a Python exception, an absl/XLA error), newest last."""
    text = tail_text(path, tail_bytes)
    if text is None:
        return []
    hits, after_frame = [], False
    for line in text.splitlines():
        # a traceback's frames and their source lines (`raise Exception(  # pylint: ...`) quote code, not the error
        quoted = after_frame and line.startswith("    ")
        after_frame = TRACEBACK_FRAME.match(line) is not None
        if after_frame or quoted or line.strip() == "Traceback (most recent call last):":
            continue
        if re.search(r"Error|Exception|RESOURCE_EXHAUSTED|DATA_LOSS|NOT_FOUND|^E\d{4} ", line):
            hits.append(line.strip())
    return [h[:300] for h in hits[-lines:]]


TRACEBACK_FRAME = re.compile(r'^\s*File "[^"]*", line \d+')


# The last line of a Python traceback: `ValueError: ...`, `jax.errors.JaxRuntimeError: ...`, `KeyboardInterrupt`.
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure|Fault)"
                            r"(?::\s.*)?$")
LOG_LINE = re.compile(r"^[IWEF]\d{4} |^\d{4}-\d\d-\d\d[ T]")  # absl/glog's, or a timestamped logger's
FATAL_LINE = re.compile(r"^F\d{4} ")  # absl/glog's LOG(FATAL), which then aborts the process
# Lines a rank's own runtime prints on a fatal error when no Python exception does: absl/glog fatal and error
# lines (XLA, gRPC, TensorStore), Orbax's and XLA's RESOURCE_EXHAUSTED / DATA_LOSS.
RUNTIME_ERROR = re.compile(r"^[FE]\d{4} |Check failed|RESOURCE_EXHAUSTED|DATA_LOSS|INTERNAL:|Segmentation fault|"
                           r"Fatal Python error|^rkit: injected fault ")
# rkit's own `--inject` line, which a rank writes just before it ends itself (runtime.agent._act): its spec.
INJECTED_FAULT = re.compile(r"^rkit: injected fault '([^']*)' fires")


def injected_exit(said: str | None) -> int | None:
    """The exit a rank gave itself when its own last words are rkit's `--inject` line (`Injection.own_exit`: -9
    for its SIGKILL, the injection's code for exit); None for anything else. When srun ended such a rank after a
    peer's exit (--kill-on-bad-exit), its own exit is lost from srun's report, but rkit made it and knows it."""
    from rkit.contract.errors import RkitError
    from rkit.runtime.inject import parse_injection

    hit = INJECTED_FAULT.match(said or "")
    try:
        return parse_injection(hit.group(1)).own_exit if hit else None
    except RkitError:
        return None


# A rank that failed because a peer went away, not for a cause of its own: its collective's connection to the peer
# broke (Gloo's TCP pairs, NCCL/RCCL's sockets), or JAX's coordination service reported another task's error.
PEER_FAILED = re.compile(r"Gloo [\w-]+ failed|Gloo context initialization failed|Connection reset by peer"
                         r"|Connection closed by (?:remote )?peer"
                         r"|Broken pipe|remote process exited|another task|tasks are unhealthy|"
                         + JAX_PEER_LOST.pattern.decode())
# Out of memory in the rank's own words: Python's MemoryError, XLA's allocator (host or device), the C++ runtime.
OUT_OF_MEMORY = re.compile(r"\bMemoryError\b|RESOURCE_EXHAUSTED: Out of memory|[Oo]ut of memory (?:while|trying)"
                           r"|std::bad_alloc|Cannot allocate memory|hipErrorOutOfMemory|CUDA_ERROR_OUT_OF_MEMORY")


JAX_SILENT_TASKS = "stopped sending heartbeats):"
JAX_TASK_ID = re.compile(r"task:(\d+)|^(\d+(?:\s*,\s*\d+)*)$")
# JAX's fatal line when this process's own calls to the coordination service (hosted by process 0) went unanswered:
# its heartbeat RPC timed out (a stopped leader: DEADLINE_EXCEEDED) or found no one (UNAVAILABLE). It names no task.
JAX_FATAL = "JAX distributed service detected fatal errors"
JAX_LEADER_UNANSWERED = re.compile(r"absl::Status: (?:DEADLINE_EXCEEDED|UNAVAILABLE)\b")


def jax_silent_tasks(path: Path, tail_bytes: int = 65536) -> set[int]:
    """The processes JAX's coordination service named in a rank's log as having stopped sending heartbeats (its
    error lists them after "The following tasks are unhealthy (stopped sending heartbeats):", one a line, as a
    task id or a task name ending in task:<id>); or process 0, whose coordination service left this process's
    heartbeats unanswered (`JAX_LEADER_UNANSWERED`: a stopped process 0 hosts a stopped service); empty when the
    log says neither."""
    text = tail_text(path, tail_bytes)
    if text is None:
        return set()
    if JAX_SILENT_TASKS not in text:
        # No task named: JAX's service itself did not answer this process, so process 0, which hosts it, is silent.
        fatal = text.rfind(JAX_FATAL)
        return {0} if fatal >= 0 and JAX_LEADER_UNANSWERED.search(text, fatal, fatal + 2000) else set()
    after = text[text.rindex(JAX_SILENT_TASKS) + len(JAX_SILENT_TASKS):].splitlines()
    named: set[int] = set()
    for line in after[1:9] if after and not after[0].strip() else after[:8]:
        line = line.strip()
        if not line or line.startswith("The tasks have") or LOG_LINE.match(line):
            break
        for m in JAX_TASK_ID.finditer(line):
            named.update(int(x) for x in (m.group(1) or m.group(2)).split(","))
    return named


def rank_error(path: Path, tail_bytes: int = 65536) -> str | None:
    """A failed rank's own words for why it failed: the last Python exception line after a traceback (MaxText's
    `ValueError: 'learning_rat' not in ...`), else the last fatal/error line of its runtime (XLA, gRPC, Orbax);
    None when its log says nothing of the kind. Credentials in URLs are masked."""
    from rkit.contract.stamp import REDACTED, redact_value

    text = tail_text(path, tail_bytes)
    if text is None:
        return None
    lines = [line.strip() for line in text.splitlines()]
    found = None
    # The last traceback, less those Python prints and ignores at shutdown ("Exception ignored in: <... __del__>":
    # a loader's finaliser failing as the interpreter goes), which follow the rank's real failure.
    traceback_at = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last")
                        and not (i and lines[i - 1].startswith("Exception ignored in"))), default=None)
    if traceback_at is not None:
        at = next((i for i in range(traceback_at + 1, len(lines)) if EXCEPTION_LINE.match(lines[i])), None)
        if at is not None:
            # A message on several lines (pydantic's "1 validation error for MaxTextConfig", then the key and
            # why): up to two more, up to the next log line.
            more = []
            for line in lines[at + 1:at + 4]:
                if not line or LOG_LINE.match(line) or line.startswith(("Traceback", "For further information")):
                    break
                more.append(line)
            found = " | ".join([lines[at], *more[:2]])
    if found is None:
        at = next((i for i in range(len(lines) - 1, -1, -1) if RUNTIME_ERROR.search(lines[i])
                   or OUT_OF_MEMORY.search(lines[i])), None)
        if at is None:
            return None
        found = lines[at]
        if found.startswith("Fatal Python error: Aborted"):
            # Python's words for the abort() that absl/glog's LOG(FATAL) ends with: the fatal line before it says
            # why (JAX's coordination service: "Terminating process because ... another task died").
            found = next((lines[i] for i in range(at - 1, -1, -1) if FATAL_LINE.match(lines[i])), found)
    return redact_value(found, REDACTED)[:400]
