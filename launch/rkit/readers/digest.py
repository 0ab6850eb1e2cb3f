"""Incremental reads for `rkit status` and its live views (`--watch`, `rkit run --wait`).

events.jsonl and rank 0's metrics file grow for days; reading them whole on every call cost 42.6 s and 2.2 GiB
at 1M metric lines per rank. A digest remembers, per file, how far it has read (the offset just after the last
whole line), the file's identity (device, inode, and the sha256 of its first bytes and of the bytes just before
that offset) and what it parsed there: the events as a list, rank 0's metrics as numpy columns. The next call
reads only what was appended since; a file that was replaced, truncated or rewritten is read again from its
start, so a digest can make a call faster, never different.

Digests live in the reader's own cache ($RKIT_STATUS_CACHE, else $XDG_CACHE_HOME/rkit/status, else
~/.cache/rkit/status), one folder per run directory path, 0700 / 0600: a reader never writes into a run
directory (it may not own it), and a cache that cannot be used just means a full read. The supervisor, the run
directory's writer, keeps one more in <run>/digest/ (`keep_in_run`, after each attempt's end and the final word):
a reader whose own cache is behind (cold: a new machine, another user's account, a pruned cache) starts from that
one, so a cold `rkit status` of a month-old run reads what its current attempt appended, not the month. The events
digest is a pickle and is only ever loaded from a folder this user owns that nobody else can write to (another
user's run directory's digest is not loaded: a full read).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import stat
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rkit.contract.events import valid_event
from rkit.contract.rundir import RunDir
from rkit.contract.safeio import MAX_LINE_BYTES, objects, open_regular, private_dir
from rkit.readers import goodput_events, metric_columns

# 2: goodput's start-up in parts (EventFold.agents); 3: its restore (AttemptTimes.restore); 4: detection;
# 5: injections without a spec
VERSION = 6
SIGNATURE_BYTES = 4096
CHUNK_BYTES = 8 << 20
# Save a digest once 1/32 of its file, at most 1 MiB, was read since its last save: a later process then re-reads
# at most that much (parsing a byte costs some 30 times what saving one does), and a live view does not rewrite
# tens of MB of columns on every frame.
SAVE_AFTER_BYTES = 1 << 20
COLUMNS = ("step", "attempt", "t", "loss", "loss_present", "step_time", "tokens", "recomputed")


def cache_root() -> Path:
    if os.environ.get("RKIT_STATUS_CACHE"):
        return Path(os.environ["RKIT_STATUS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rkit" / "status"


def _private_dir(path: Path) -> Path | None:
    """`path` made (0700) or found; None unless this user owns it and nobody else can write to it."""
    try:
        info = os.lstat(private_dir(path))
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        return None
    return path


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Mark:
    """Where a digest stopped reading one file, and how to tell that file again."""

    dev: int = 0
    ino: int = 0
    offset: int = 0
    head: str = ""
    tail: str = ""

    def signature(self, fh: Any, offset: int) -> tuple[str, str]:
        fh.seek(0)
        head = _sha(fh.read(min(SIGNATURE_BYTES, offset)))
        fh.seek(max(0, offset - SIGNATURE_BYTES))
        return head, _sha(fh.read(offset - max(0, offset - SIGNATURE_BYTES)))

    def still_valid(self, fh: Any, info: os.stat_result) -> bool:
        """The file is the one this mark read (same inode, not shorter, same bytes where the mark looked)."""
        if (info.st_dev, info.st_ino) != (self.dev, self.ino) or info.st_size < self.offset:
            return False
        return self.offset == 0 or self.signature(fh, self.offset) == (self.head, self.tail)


def read_new_lines(path: Path, mark: Mark, on_chunk: Callable[[list[dict]], None],
                   on_restart: Callable[[], None], valid: Callable[[dict], bool] | None = None) -> Mark:
    """Hand the whole JSON objects appended to `path` since `mark` to `on_chunk`, a chunk at a time, and return
    the new mark. When the file is not the one `mark` read
    (replaced, truncated, rewritten, gone), `on_restart` is called first and the file is read from its start."""
    try:
        fh = open_regular(path)
    except FileNotFoundError:
        if mark.offset:
            on_restart()
        return Mark()
    with fh:
        info = os.fstat(fh.fileno())
        offset = mark.offset
        if not mark.still_valid(fh, info):
            on_restart()
            offset = 0
        fh.seek(offset)
        partial = b""
        while chunk := fh.read(CHUNK_BYTES):
            parts = (partial + chunk).split(b"\n")
            partial = parts.pop()
            offset += len(chunk)
            if len(partial) > MAX_LINE_BYTES:  # no record is this long: its rest fails to parse, and is skipped
                partial = b""
            on_chunk(list(objects(parts, valid)))
        last = list(objects([partial], valid)) if partial.strip() else []
        if last:  # a whole object without its newline (a file written by hand): read_jsonl reads it too
            on_chunk(last)
        else:  # a line still being written (or cut by a crash) waits for its newline
            offset -= len(partial)
        head, tail = Mark().signature(fh, offset)
    return Mark(info.st_dev, info.st_ino, offset, head, tail)


@dataclass
class _Digest:
    mark: Mark = field(default_factory=Mark)
    saved_offset: int = 0


@dataclass
class EventsDigest(_Digest):
    """The events folded into `fold` (an object with `feed(event)`: status.StatusFold), not kept themselves."""

    fold: Any = None

    def refresh(self, path: Path) -> Any:
        def restart() -> None:
            self.fold = type(self.fold)()

        def feed(chunk: list[dict]) -> None:
            for e in chunk:
                self.fold.feed(e)

        self.mark = read_new_lines(path, self.mark, feed, restart, valid_event)
        return self.fold


@dataclass
class MetricsDigest(_Digest):
    """One rank's metrics lines as columns, in file order, with `recomputed` (place_lines's: the rank trained the
    line's step before, in an earlier line) and goodput's per-attempt summary of every attempt whose lines did
    not change since it was made. `legacy`: some line lacks an attempt or a time, or names another rank
    (MaxText's raw lines, runs from before rkit's own lines): those need place_lines's estimates, and the callers
    read the file whole."""

    columns: dict[str, np.ndarray] = field(default_factory=lambda: _empty())
    legacy: bool = False
    period: int | None = None
    summaries: dict[int, goodput_events.AttemptSteps] = field(default_factory=dict)

    def refresh(self, path: Path, rank: int) -> MetricsDigest:
        def restart() -> None:
            self.columns, self.legacy, self.summaries = _empty(), False, {}

        self.mark = read_new_lines(path, self.mark, lambda chunk: self._append(chunk, rank), restart)
        return self

    def _append(self, raw: list[dict], rank: int) -> None:
        made = metric_columns.columns(raw, rank)
        if made is None:
            return
        new, legacy = made
        self.legacy = self.legacy or legacy
        new["recomputed"] = _seen_before(self.columns["step"], new["step"])
        for attempt in np.unique(new["attempt"]).tolist():
            self.summaries.pop(attempt, None)
        for k in COLUMNS:  # one column at a time: the old one is freed before the next is copied
            self.columns[k] = np.concatenate([self.columns[k], new.pop(k)])

    def newest_steps(self, n: int) -> list[dict[str, Any]]:
        """The merged view's last `n` steps (metrics.merge: the newest line of each step, by step), with the
        fields status reads. Looks near the newest step first: a step's lines are near each other's."""
        c = self.columns
        step = c["step"]
        if not len(step):
            return []
        near = np.flatnonzero(step > step.max() - 4 * n)
        values = np.unique(step[near])
        if len(values) < n:
            near = np.arange(len(step))
            values = np.unique(step)
        out = []
        for value in values[-n:].tolist():
            i = near[np.flatnonzero(step[near] == value)[-1]]
            out.append({"step": value, "loss": float(c["loss"][i]) if c["loss_present"][i] else None,
                        "step_time": _none(c["step_time"][i]), "tokens_per_sec_per_device": _none(c["tokens"][i])})
        return out

    def attempts(self) -> list[int]:
        """The attempts these lines name."""
        return np.unique(self.columns["attempt"]).tolist()

    def recomputed_steps(self) -> int:
        """Steps trained more than once (the merged view's `recomputed`)."""
        return int(len(np.unique(self.columns["step"][self.columns["recomputed"]])))

    def attempt_steps(self, period: int | None) -> dict[int, goodput_events.AttemptSteps]:
        """goodput.attempt_steps of these lines (one rank's, all timed), from the columns; the attempts whose
        lines did not change since the last call are not computed again."""
        if period != self.period:
            self.summaries, self.period = {}, period
        attempt = self.columns["attempt"]
        present = self.attempts()
        dirty = [a for a in present if a not in self.summaries]
        if dirty:
            rows = np.flatnonzero(np.isin(attempt, dirty)) if len(dirty) < len(present) else np.arange(len(attempt))
            self.summaries.update(_summaries({k: v[rows] for k, v in self.columns.items()}, period))
        return {a: self.summaries[a] for a in present}


def _seen_before(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Per value of `new`: it is in `old`, or earlier in `new`."""
    if not len(new):
        return np.zeros(0, np.bool_)
    _, first, inverse = np.unique(new, return_index=True, return_inverse=True)
    earlier = np.arange(len(new)) != first[inverse]
    if not len(old):
        return earlier
    low = min(int(old.min()), int(new.min()))
    seen = np.zeros(max(int(old.max()), int(new.max())) - low + 1, np.bool_)
    seen[old - low] = True
    return earlier | seen[new - low]


def _summaries(c: dict[str, np.ndarray], period: int | None) -> dict[int, goodput_events.AttemptSteps]:
    """goodput_events.AttemptSteps per attempt of timed lines in file order, vectorized over attempts: the step times
    are the gaps between an attempt's consecutive lines, split by goodput._step_shares's rule."""
    order = np.argsort(c["attempt"], kind="stable")  # an attempt's lines keep their file order
    attempt, t, step, recomputed = (c[k][order] for k in ("attempt", "t", "step", "recomputed"))
    starts = np.r_[0, np.flatnonzero(np.diff(attempt)) + 1]
    group = np.cumsum(np.r_[0, np.diff(attempt) != 0])
    groups = len(starts)
    pair = group[1:] == group[:-1]
    gaps = np.maximum(0.0, np.diff(t))[pair]
    of = group[1:][pair]
    later_step, later_recomputed = step[1:][pair], recomputed[1:][pair]
    # Each attempt's median gap: gaps sorted within attempts (by gap, then stably by attempt).
    counts = np.bincount(of, minlength=groups)
    by_gap = np.argsort(gaps, kind="stable")
    ranked = gaps[by_gap][np.argsort(of[by_gap], kind="stable")]
    offsets = np.r_[0, np.cumsum(counts)[:-1]]
    median = np.zeros(groups)
    has = counts > 0
    median[has] = (ranked[offsets[has] + (counts[has] - 1) // 2] + ranked[offsets[has] + counts[has] // 2]) / 2
    excess = np.where(_near_save(later_step, period), np.maximum(0.0, gaps - median[of]), 0.0)
    rest = gaps - excess
    sums = {"productive": np.where(later_recomputed, 0.0, rest), "checkpoint": excess,
            "recompute": np.where(later_recomputed, rest, 0.0)}
    sums = {k: np.bincount(of, weights=v, minlength=groups) for k, v in sums.items()}
    newest = np.maximum.reduceat(t, starts)
    nonzero = np.flatnonzero(t != 0)
    first = np.full(groups, np.nan)
    hit, where = np.unique(group[nonzero], return_index=True)
    first[hit] = t[nonzero[where]]
    return {int(attempt[starts[g]]): goodput_events.AttemptSteps(
        first_t=_none(first[g]), last_timed_t=float(newest[g]), newest_t=float(newest[g]),
        shares={k: float(sums[k][g]) for k in ("productive", "checkpoint", "recompute")}) for g in range(groups)}


def _empty() -> dict[str, np.ndarray]:
    kinds = {"step": np.int64, "attempt": np.int64, "loss_present": np.bool_, "recomputed": np.bool_}
    return {k: np.zeros(0, kinds.get(k, np.float64)) for k in COLUMNS}


def _none(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


def _near_save(steps: np.ndarray, period: int | None) -> np.ndarray:
    """goodput._near_save, for a column of steps."""
    if not period or period <= 0:
        return np.zeros(len(steps), np.bool_)
    r = np.mod(steps, period)
    return (r == 0) | (r == 1 % period) | (r == period - 1)


def _worth_saving(digest: _Digest, force: bool) -> bool:
    new = abs(digest.mark.offset - digest.saved_offset)
    return new > 0 and (force or new >= min(SAVE_AFTER_BYTES, digest.mark.offset // 32))


class RunDigest:
    """The digests of one run directory: events and rank 0's metrics. Keep one across the frames of a live view;
    `save` writes them to the cache when enough is new."""

    def __init__(self, run: RunDir, fold: Callable[[], Any], cache: Path | None = None, *,
                 folder: Path | None = None):
        """The digests in `folder`, else in the reader's cache (`cache`, else cache_root()) or, where the run's
        own (<run>/digest/, the supervisor's) has read further, that one."""
        self.run = run
        self.new_fold = fold
        if folder is None:
            root = cache_root() if cache is None else cache
            try:
                key = _sha(str(run.path.resolve()).encode("utf-8", "surrogateescape"))[:32]
            except OSError:
                key = None
            folder = None if key is None else root / key
        self.folder = folder
        self.events_digest: EventsDigest = self._load_events(folder)
        self.metrics_digest: MetricsDigest = self._load_metrics(folder)
        if folder != run.digest_dir:
            kept = self._load_events(run.digest_dir)
            if kept.mark.offset > self.events_digest.mark.offset:
                self.events_digest = kept  # into the reader's cache once SAVE_AFTER_BYTES more were read
            kept = self._load_metrics(run.digest_dir)
            if kept.mark.offset > self.metrics_digest.mark.offset:
                self.metrics_digest = kept

    # ------------------------------------------------------------------ reading

    def fold(self) -> Any:
        """The events folded, up to the last whole line."""
        return self.events_digest.refresh(self.run.events_file)

    def rank0(self) -> MetricsDigest:
        return self.metrics_digest.refresh(self.run.metrics_file(0), 0)

    # ------------------------------------------------------------------ the cache

    @staticmethod
    def _open(folder: Path | None, name: str) -> Any:
        """A digest file open for reading, only from a folder this user owns and nobody else can write to, never
        through a link, and only when this user owns the file and nobody else can write to it; else None."""
        path = None if folder is None else folder / name
        if path is None or not path.parent.is_dir() or _private_dir(path.parent) is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        fh = os.fdopen(fd, "rb")
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or info.st_mode & 0o022:
            fh.close()
            return None
        return fh

    def _load_events(self, folder: Path | None) -> EventsDigest:
        fresh = EventsDigest(fold=self.new_fold())
        fh = self._open(folder, "events.pickle")
        if fh is None:
            return fresh
        try:
            with fh:
                value = pickle.load(fh)
            fold = value["fold"]
            # Another rkit's fold (its fields changed) is not this one's.
            if value.get("version") != VERSION or type(fold) is not type(fresh.fold) or \
                    sorted(vars(fold)) != sorted(vars(fresh.fold)):
                return fresh
            mark = Mark(**value["mark"])
            return EventsDigest(mark=mark, saved_offset=mark.offset, fold=fold)
        except Exception:  # noqa: BLE001 - a cache that cannot be read is a cache that is not there
            return fresh

    def _load_metrics(self, folder: Path | None) -> MetricsDigest:
        fh = self._open(folder, "metrics-0.npz")
        if fh is None:
            return MetricsDigest()
        try:
            with fh, np.load(fh, allow_pickle=False) as npz:
                meta = json.loads(str(npz["meta"]))
                if meta.get("version") != VERSION:
                    return MetricsDigest()
                columns = {k: npz[k] for k in COLUMNS}
            mark = Mark(**meta["mark"])
            summaries = {int(a): goodput_events.AttemptSteps(**v) for a, v in meta["summaries"].items()}
            return MetricsDigest(mark=mark, saved_offset=mark.offset, columns=columns, legacy=bool(meta["legacy"]),
                                 period=meta["period"], summaries=summaries)
        except Exception:  # noqa: BLE001 - likewise
            return MetricsDigest()

    def save(self, force: bool = False) -> None:
        """Write each digest that read enough more since its last save (see SAVE_AFTER_BYTES; any change with
        `force`)."""
        if self.folder is None or _private_dir(self.folder) is None:
            return
        e, m = self.events_digest, self.metrics_digest
        if _worth_saving(e, force):
            self._write("events.pickle", lambda fh: pickle.dump(
                {"version": VERSION, "mark": vars(e.mark), "fold": e.fold}, fh, protocol=pickle.HIGHEST_PROTOCOL))
            e.saved_offset = e.mark.offset
        if _worth_saving(m, force):
            meta = json.dumps({"version": VERSION, "mark": vars(m.mark), "legacy": m.legacy, "period": m.period,
                               "summaries": {a: asdict(v) for a, v in m.summaries.items()}})
            self._write("metrics-0.npz", lambda fh: np.savez(fh, meta=np.array(meta), **m.columns))
            m.saved_offset = m.mark.offset

    def _write(self, name: str, write: Callable[[Any], None]) -> None:
        """`write(file)` into a new temp file beside `name`, then renamed over it (a reader never sees half)."""
        assert self.folder is not None
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{name}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as fh:
                write(fh)
            os.replace(tmp, self.folder / name)
        except (OSError, pickle.PicklingError, ValueError):
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass


def keep_in_run(run: RunDir, fold: Callable[[], Any]) -> None:
    """The supervisor's copy of the digests, brought up to date in <run>/digest/ (0700): read from where the last
    copy stopped (an attempt's lines), written whole. A cache: whatever goes wrong here leaves the run as it was
    and a reader reads more."""
    try:
        digest = RunDigest(run, fold, folder=run.digest_dir)
        digest.fold()
        digest.rank0()
        digest.save(force=True)
    except Exception:  # noqa: BLE001 - never a reason for the run to stop
        pass
