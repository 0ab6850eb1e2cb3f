"""The run directory: the contract between every rkit command and the ranks. Paths, events, atomic writes, and
whether a writer holds the run (the lock itself is the host's: run/lock.py)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rkit.contract.errors import RkitError, RunDirUnwritable
from rkit.contract.events import valid_event
from rkit.contract.safeio import JsonlTail, finite, last_jsonl, load_json, read_jsonl, tail_jsonl  # noqa: F401
from rkit.contract.stamp import redact

if TYPE_CHECKING:
    from rkit.contract.config import Config

EVENTS = "events.jsonl"
LOCK = ".lock"


def nearest_existing(path: Path) -> Path:
    """A directory that may not exist yet (the checkpoints) is on the file system of its nearest existing parent."""
    path = Path(path).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def filesystem(path: Path) -> tuple[str, int | None]:
    """The mount point that holds `path` (or its nearest existing parent) and the bytes an unprivileged writer
    can still use there."""
    path = nearest_existing(path)
    mount = path
    while not os.path.ismount(mount) and mount.parent != mount:
        mount = mount.parent
    try:
        st = os.statvfs(path)
        return str(mount), st.f_bavail * st.f_frsize
    except OSError:
        return str(mount), None


def unwritable(path: Path, exc: OSError) -> RunDirUnwritable:
    """The one diagnosis of a write the run directory's file system refused."""
    mount, free = filesystem(path)
    room = "" if free is None else f", {free} bytes free"
    return RunDirUnwritable(f"{path}: cannot write: {exc.strerror or exc} (file system {mount}{room}). The run "
                            "stopped here; free space (or fix the file system) and continue with "
                            "`rkit run RECIPE --resume`.")


# Who may read a run directory (the recipe's `access`), as the umask rkit and its trainers write it under.
UMASKS = {"private": 0o077, "group": 0o027}
UMASK_ENV = "RKIT_UMASK"  # the ranks' agents set it too (a launcher or container may not pass the umask on)


def umask_for(access: str) -> int:
    return UMASKS.get(access, UMASKS["private"])


def set_access(access: str) -> int:
    """From now on this process (and what it starts: MaxText, Orbax, Slurm's output files) creates directories
    0700 and files 0600 for 'private', 0750/0640 for 'group', whatever the user's umask."""
    mask = umask_for(access)
    os.umask(mask)
    return mask


def current_umask() -> int:
    try:
        with open("/proc/self/status") as fh:
            return int(next(line for line in fh if line.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o077)
        os.umask(mask)
        return mask


class PlantedLink(RkitError):
    """A symbolic link where rkit writes in a run directory: nothing is written through it."""

    def __init__(self, path: Path):
        super().__init__(f"{path}: is a symbolic link; rkit does not write through links in a run directory "
                         "(one planted there would redirect its writes elsewhere). Remove the link, check the run "
                         "directory, and run again.")


def open_for_writing(path: Path, flags: int = os.O_WRONLY | os.O_APPEND | os.O_CREAT) -> int:
    """The one way to open a run-directory file for writing: never through a symbolic link (PlantedLink)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PlantedLink(path) from None
        raise


def write_atomic(path: Path, data: bytes | str) -> None:
    """The one atomic writer: a reader never sees half a file (a uniquely named temp file beside it, created
    new, fsync, rename over `path`, which replaces a link rather than writing through it). A refused write
    leaves no temp file and raises RunDirUnwritable."""
    tmp = None
    try:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        tmp = Path(name)
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fd, 0o666 & ~current_umask())
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            try:
                tmp.unlink()
            except OSError:
                pass
        raise unwritable(path, exc) from None


def write_json_atomic(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


# The parts of manifest.json that readers walk into (manifest.py writes them).
MANIFEST_TYPES: dict[str, type] = {"rkit_version": str, "run": dict, "config_hash": str, "hashed_config": dict,
                                   "image": dict, "launcher": str, "injections": list, "host": dict,
                                   "determinism": dict, "training_changes": list, "reproduced_from": dict}
class RunDir:
    """Paths inside one run directory, plus the append-only event log."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def name(self) -> str:
        return self.path.name

    recipe = property(lambda self: self.path / "recipe.yaml")
    resolved = property(lambda self: self.path / "resolved.json")
    manifest = property(lambda self: self.path / "manifest.json")
    events_file = property(lambda self: self.path / EVENTS)
    outcome_file = property(lambda self: self.path / "outcome.json")  # outcome.py: what the run came out as
    metrics_dir = property(lambda self: self.path / "metrics")
    attempts_dir = property(lambda self: self.path / "attempts")
    # MaxText's base_output_directory is the run directory and its run_name is "checkpoints",
    # so <run>/checkpoints is MaxText's output and Orbax saves under <run>/checkpoints/checkpoints/<step>.
    maxtext_base = property(lambda self: self.path)
    maxtext_run_name = "checkpoints"
    checkpoints = property(lambda self: self.path / "checkpoints")
    orbax_dir = property(lambda self: self.path / "checkpoints" / "checkpoints")
    # each rank's record of its node-local checkpoints (checkpoint.local_dir: runtime/trainers/localtier.py)
    local_tier_dir = property(lambda self: self.path / "checkpoints" / "local-tier")
    tensorboard_dir = property(lambda self: self.path / "tensorboard")  # MaxText's summaries (trainers/maxtext)
    digest_dir = property(lambda self: self.path / "digest")  # readers/digest.keep_in_run: status's head start

    def metrics_file(self, rank: int) -> Path:
        return self.metrics_dir / f"{rank}.jsonl"

    def maxtext_metrics_file(self, attempt: int, rank: int) -> Path:
        """MaxText's own metrics_file for one rank of one attempt (the agent turns it into metrics_file)."""
        return self.attempt_dir(attempt) / "maxtext" / f"metrics-{rank}.jsonl"

    def attempt_dir(self, attempt: int) -> Path:
        return self.attempts_dir / str(attempt)

    # ------------------------------------------------------------ inside an attempt

    def attempt_record(self, attempt: int) -> Path:
        """attempts/<n>/attempt.json: when, where, how launched, pids, how it ended."""
        return self.attempt_dir(attempt) / "attempt.json"

    @staticmethod
    def rank_log_name(rank: int | str) -> str:
        """A rank's stdout+stderr inside its attempt's directory; `rank` may be srun's `%t` pattern."""
        return f"rank-{rank}.log"

    def rank_log(self, attempt: int, rank: int | str) -> Path:
        return self.attempt_dir(attempt) / self.rank_log_name(rank)

    launcher_log_name = "srun.log"  # the launcher's own output (srun's, with its task-failure lines)

    def launcher_log(self, attempt: int) -> Path:
        return self.attempt_dir(attempt) / self.launcher_log_name

    standby_dir = property(lambda self: self.path / "standby")

    def standby_step_dir(self, k: int) -> Path:
        """standby/step-<k>/: a Slurm standby step's task logs and srun output (backends/slurm_standby.py)."""
        return self.standby_dir / f"step-{k}"

    def env_capture(self, attempt: int, rank: int) -> Path:
        """One rank's environment manifest, written by its agent."""
        return self.attempt_dir(attempt) / "env" / f"rank-{rank}.json"

    def stacks_dir(self, attempt: int) -> Path:
        return self.attempt_dir(attempt) / "stacks"

    @staticmethod
    def stacks_file_name(rank: int, tool: str = "") -> str:
        """Every thread's stack of a hung rank: faulthandler's (tool "") or another tool's (e.g. "py-spy")."""
        return f"rank-{rank}.{tool}.txt" if tool else f"rank-{rank}.txt"

    def stacks_file(self, attempt: int, rank: int, tool: str = "") -> Path:
        return self.stacks_dir(attempt) / self.stacks_file_name(rank, tool)

    def preempt_request(self, attempt: int) -> Path:
        """The supervisor creates this file to ask every rank of the attempt to save and stop."""
        return self.attempt_dir(attempt) / "preempt"

    def telemetry_log(self, attempt: int, node: str) -> Path:
        """The output of a node's telemetry process (sampler and exporter) in one attempt."""
        return self.attempt_dir(attempt) / f"telemetry-{node}.log"

    # ------------------------------------------------------------ the run's other files

    quarantine_dir = property(lambda self: self.checkpoints / "quarantine")  # steps MaxText must not restore
    report_dir = property(lambda self: self.path / "report")  # rkit report's default output
    batch_script = property(lambda self: self.path / "job.sbatch")  # the rendered Slurm batch script
    batch_log_pattern = property(lambda self: self.path / "slurm-%j.out")  # sbatch --output (%j: the job id)

    # ------------------------------------------------------------ telemetry

    telemetry_dir = property(lambda self: self.path / "telemetry")

    def telemetry_file(self, node: str) -> Path:
        """A node's health samples."""
        return self.telemetry_dir / f"{node}.jsonl"

    def exporter_file(self, node: str) -> Path:
        """Where a node's Prometheus exporter listens."""
        return self.telemetry_dir / f"{node}.exporter.json"

    def planted_links(self) -> list[Path]:
        """The directories rkit, MaxText and the agent's copy write into (and those of every attempt) that are
        symbolic links, and the links inside them: a link planted as a parent would carry every write below it
        elsewhere, which O_NOFOLLOW on the file cannot see; a file link (metrics/0.jsonl) would end every rank."""
        dirs = [self.path, self.attempts_dir, self.metrics_dir, self.telemetry_dir, self.checkpoints,
                self.orbax_dir, self.report_dir, self.tensorboard_dir, self.path / "agent", self.standby_dir]
        if self.attempts_dir.is_dir() and not self.attempts_dir.is_symlink():
            for n in self.attempt_numbers()[-1:]:  # older attempts' folders are never written again (an
                attempt = self.attempt_dir(n)  # attempt's folder that is a link shows in attempts/ itself)
                dirs += [attempt, attempt / "env", attempt / "maxtext", attempt / "stacks"]
        links = {d for d in dirs if d.is_symlink()}
        for d in dirs:
            try:  # scandir: the entries' types come with the listing (a thousand attempts, no stat each)
                with os.scandir(d) as entries:
                    links.update(Path(e.path) for e in entries if e.is_symlink())
            except OSError:  # absent, a link (already named), not a directory
                pass
        return sorted(links)

    def refuse_planted_links(self) -> None:
        """PlantedLink (exit 2) naming the first linked directory, before anything is written below it."""
        if links := self.planted_links():
            raise PlantedLink(links[0])

    def attempt_numbers(self) -> list[int]:
        try:
            names = os.listdir(self.attempts_dir)
        except OSError:  # none yet (or not a folder: refused where it is written)
            return []
        return sorted(int(n) for n in names if n.isascii() and n.isdigit())

    def exists(self) -> bool:
        return self.resolved.is_file()

    def require(self) -> RunDir:
        if not self.exists():
            raise RkitError(f"{self.path}: not an rkit run directory (no resolved.json). "
                            "Give a directory made by `rkit run`, e.g. runs/<name>.")
        return self

    def load_resolved(self) -> dict:
        return self._load_object(self.require().resolved, "rkit writes it once, when the run is created")

    def config(self) -> Config:
        """The typed view of resolved.json."""
        from rkit.contract.config import Config, ConfigTypeError

        try:
            return Config.from_resolved(self.load_resolved())
        except ConfigTypeError as exc:
            raise RkitError(f"{self.resolved}: damaged: {exc}; rkit writes it once, when the run is created. "
                            "Restore it from a copy of the run directory.") from None

    def load_manifest(self) -> dict:
        if not os.path.lexists(self.manifest):
            return {}
        stamp = self._load_object(self.manifest, "rkit writes it once, when the run is created")
        for key, want in MANIFEST_TYPES.items():
            if stamp.get(key) is not None and not isinstance(stamp[key], want):
                raise RkitError(f"{self.manifest}: damaged: {key} is a {type(stamp[key]).__name__}, not a "
                                f"{want.__name__}; rkit writes it once, when the run is created. Restore it from a "
                                "copy of the run directory.")
        image = stamp.get("image") or {}
        for key in ("sha256", "path", "reference", "kind", "flavor"):
            if image.get(key) is not None and not isinstance(image[key], str):
                raise RkitError(f"{self.manifest}: damaged: image.{key} is not a string. Restore it from a copy "
                                "of the run directory.")
        return stamp

    def load_outcome(self) -> dict:
        return self._load_object(self.outcome_file, "rkit writes it when the run ends; delete it and rkit "
                                                    "computes the outcome again from the run's files")

    @staticmethod
    def _load_object(path: Path, how: str) -> dict:
        """A JSON object file of the run; a damaged one is a clear error (exit 2), never a traceback."""
        value = load_json(path, f"run file ({how})")
        if not isinstance(value, dict):
            raise RkitError(f"{path}: damaged, not a JSON object; {how}. Restore it from a copy of the run "
                            "directory.")
        return value

    # ------------------------------------------------------------ events

    def emit(self, name: str, /, **fields: Any) -> dict:
        """Append one event; one write of one line, so concurrent writers do not interleave."""
        event = {"t": round(time.time(), 3), **redact(fields), "event": name}
        line = json.dumps(event, sort_keys=True, default=str) + "\n"
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = open_for_writing(self.events_file)
            try:
                os.write(fd, line.encode("utf-8"))
            finally:
                os.close(fd)
        except OSError as exc:
            raise unwritable(self.events_file, exc) from None
        return event

    def events(self) -> list[dict]:
        """Every event whose fields have the vocabulary's types (valid_event); a damaged line is skipped."""
        return list(read_jsonl(self.events_file, valid_event))

    def recent_events(self, enough: Callable[[list[dict]], bool], first_bytes: int = 64 << 10) -> list[dict]:
        """The newest events, read from the file's end in tails four times longer each time until `enough` says
        they hold what the caller needs (or the whole file is read): a month-old run's start costs a day-old's."""
        size = first_bytes
        while True:
            found = tail_jsonl(self.events_file, size, valid_event)
            try:
                whole = size >= os.stat(self.events_file).st_size
            except OSError:
                return found
            if whole or enough(found):
                return found
            size *= 4

    # ------------------------------------------------------------ lock

    def is_locked(self) -> bool:
        """True while some process (a supervisor) holds this run's writer lock."""
        path = self.path / LOCK
        if not path.exists():
            return False
        with os.fdopen(open_for_writing(path, os.O_RDWR | os.O_CREAT), "r+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fh, fcntl.LOCK_UN)
        return False
