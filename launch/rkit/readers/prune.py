"""`rkit prune`: what weeks of runs leave on disk that no run needs any more. `plan` lists (nothing removed), then
`remove` deletes, each run's share under that run's writer lock (a supervisor cannot start on it meanwhile).

What goes, and what stays:
- a finished run's checkpoints but its final step (the trained weights; its outcome is reproduced from its recipe,
  image and data, not from checkpoints); a run that stopped short of its end (gave up, interrupted) keeps
  its newest RESUMABLE committed steps, the step `--resume` takes and two to fall back on; unfinished saves
  (Orbax's temporary folders), quarantined steps and the data positions (checkpoints/data-position/<step>: the
  node-local tier's) of steps older than the newest kept one and not kept, of either. A run a supervisor or a
  Slurm job may still be working on (running, pending, requeued, or stopped: no final word, as between a requeue
  and its restart or when squeue did not answer) or whose files cannot be read is left whole and said so. The
  image cache is shared by every runs directory: `--images` keeps only what RUNS_DIR's runs name (and each
  flavor's newest).
- with `images`: cached images (rkit image build's `<flavor>-<key>.sif` and its record and build log) that no run in
  the runs directory was made with, apart from each flavor's newest (what the next `rkit run` takes).
- with `caches`: JAX compilation cache entries and `rkit status` digests not used for `older_than_days`.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rkit.contract.errors import RkitError
from rkit.contract.rundir import RunDir
from rkit.readers import listing
from rkit.runtime.trainers import datapos, maxtext
from rkit.runtime.trainers.orbaxdirs import TMP_MARKER

RESUMABLE = 3  # committed steps a resumable run keeps: the one a restart takes and two to fall back on
# Left whole: a supervisor or a Slurm job may still work on it ("stopped": no final word, which is also how a run
# looks when squeue did not answer or between a requeue and its restart), or its files cannot be read.
BUSY = ("running", "pending", "requeued", "stopped", "unreadable")
JAX_SUFFIXES = ("-cache", "-atime")  # JAX's persistent compilation cache: an entry and its access time


@dataclass(frozen=True)
class Removal:
    path: Path
    bytes: int
    why: str
    run: RunDir | None = None  # the run it belongs to (removed under its lock)

    def as_dict(self) -> dict:
        return {"path": str(self.path), "bytes": self.bytes, "why": self.why}


@dataclass(frozen=True)
class Plan:
    removals: tuple[Removal, ...]
    kept: tuple[str, ...]  # runs left whole, with why

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.removals)

    def as_dict(self) -> dict:
        return {"removals": [r.as_dict() for r in self.removals], "bytes": self.bytes, "kept": list(self.kept)}


def size_of(path: Path) -> int:
    """Bytes under `path` (its own if a file or a link), without following links; unreadable parts count 0."""
    try:
        info = os.lstat(path)
    except OSError:
        return 0
    if not stat.S_ISDIR(info.st_mode):
        return info.st_size
    total = 0
    for root, dirs, files in os.walk(path, onerror=lambda _: None):
        for name in dirs + files:
            try:
                entry = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            total += 0 if stat.S_ISDIR(entry.st_mode) else entry.st_size
    return total


def _entries(directory: Path) -> list[os.DirEntry]:
    try:
        return sorted(os.scandir(directory), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []


def run_removals(run: RunDir, state: str) -> list[Removal]:
    """One ended run's checkpoints beyond what it still needs (see the module's docstring)."""
    committed = maxtext.committed_steps(run)
    keep = set(committed[-1:] if state == "finished" else committed[-RESUMABLE:])
    out = []
    for step, path in sorted(maxtext.step_dirs(run).items()):
        if step not in keep:
            why = "an older checkpoint" if step in committed else "an unfinished save"
            out.append(Removal(path, size_of(path), f"{why} of a {state} run (kept: {sorted(keep)})", run))
    for entry in _entries(run.orbax_dir):
        if TMP_MARKER in entry.name:
            out.append(Removal(Path(entry.path), size_of(Path(entry.path)), "an unfinished save", run))
    for entry in _entries(run.quarantine_dir):
        out.append(Removal(Path(entry.path), size_of(Path(entry.path)), "a quarantined step", run))
    for entry in _entries(datapos.directory(run)):  # (the local tier's) newer than every kept step: kept
        if entry.name.isdigit() and int(entry.name) not in keep and int(entry.name) < max(keep, default=-1):
            out.append(Removal(Path(entry.path), size_of(Path(entry.path)),
                               f"the data position of a step no longer kept (kept: {sorted(keep)})", run))
    return out


def image_removals(cache: Path, runs: list[RunDir]) -> list[Removal]:
    """Cached images no run in the list was made with, apart from each flavor's newest."""
    used_sha, used_path = set(), set()
    for run in runs:
        try:
            image = run.load_manifest().get("image") or {}
        except RkitError:
            continue
        if isinstance(image, dict):
            used_sha.add(image.get("sha256"))
            used_path.add(str(image.get("path")))
    records = []
    for entry in _entries(cache):
        if entry.name.endswith(".json") and entry.is_file(follow_symlinks=False):
            try:
                record = json.loads(Path(entry.path).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(record, dict) and isinstance(record.get("flavor"), str):
                records.append((Path(entry.path), record))
    newest: dict[str, float] = {}
    for _, record in records:
        built = record.get("built") if isinstance(record.get("built"), (int, float)) else 0
        newest[record["flavor"]] = max(newest.get(record["flavor"], 0), built)
    out = []
    for path, record in records:
        sif = path.with_suffix(".sif")
        if record.get("sha256") in used_sha or str(sif) in used_path or str(record.get("path")) in used_path \
                or (record.get("built") or 0) == newest[record["flavor"]]:
            continue
        why = f"a {record['flavor']} image no run in the runs directory was made with, not the newest"
        for part in (sif, path.with_suffix(".build.log"), path):
            if os.path.lexists(part):
                out.append(Removal(part, size_of(part), why))
    return out


def _idle(path: Path, now: float, older_than_days: float) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return now - max(info.st_atime, info.st_mtime) > older_than_days * 86400


def cache_removals(jax_cache: Path, status_cache: Path, older_than_days: float, now: float) -> list[Removal]:
    out = []
    for entry in _entries(jax_cache):
        path = Path(entry.path)
        if entry.name.endswith(JAX_SUFFIXES) and _idle(path, now, older_than_days):
            out.append(Removal(path, size_of(path), f"a JAX compilation cache entry unused for "
                                                    f"{older_than_days:g} days"))
    for entry in _entries(status_cache):
        path = Path(entry.path)
        files = [Path(e.path) for e in _entries(path)] or [path]
        if entry.is_dir(follow_symlinks=False) and all(_idle(f, now, older_than_days) for f in files):
            out.append(Removal(path, size_of(path), f"an `rkit status` digest unused for {older_than_days:g} days"))
    return out


def plan(runs_dir: Path, *, images: bool, caches: bool, older_than_days: float = 30.0,
         image_cache: Path | None = None, jax_cache: Path | None = None, status_cache: Path | None = None,
         now: float | None = None) -> Plan:
    """What `rkit prune` would remove, and which runs it leaves whole; nothing is touched."""
    runs = listing.runs_in(runs_dir)
    removals: list[Removal] = []
    kept = []
    for run in runs:
        row = listing.row(run)
        if row["state"] in BUSY:
            kept.append(f"{run.name}: {row['state']}" + (f" ({row['reason']})" if row.get("reason") else ""))
            continue
        removals += run_removals(run, row["state"])
    if images:
        from rkit.images.store import cache_dir

        removals += image_removals(image_cache or cache_dir(), runs)
    if caches:
        from rkit.readers.digest import cache_root
        from rkit.run.attempt import default_jax_cache_dir

        removals += cache_removals(jax_cache or Path(default_jax_cache_dir()), status_cache or cache_root(),
                                   older_than_days, time.time() if now is None else now)
    return Plan(tuple(removals), tuple(kept))


def _by_run(removals: tuple[Removal, ...]) -> Iterator[tuple[RunDir | None, list[Removal]]]:
    groups: dict[str, tuple[RunDir | None, list[Removal]]] = {}
    for r in removals:
        key = "" if r.run is None else str(r.run.path)
        groups.setdefault(key, (r.run, []))[1].append(r)
    yield from groups.values()


def remove(p: Plan) -> list[str]:
    """Delete what the plan lists; a run's share only while this process holds its writer lock (a run taken by a
    supervisor since the plan is skipped and said so). The problems, one line each."""
    from rkit.run.lock import RunLock

    problems = []
    for run, items in _by_run(p.removals):
        lock = RunLock.of(run) if run is not None else None
        try:
            if lock is not None:
                lock.acquire()
        except RkitError as exc:
            problems.append(f"{run.name}: skipped: {exc}")
            continue
        try:
            for r in items:
                try:
                    if os.path.isdir(r.path) and not os.path.islink(r.path):
                        shutil.rmtree(r.path)
                    else:
                        os.unlink(r.path)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    problems.append(f"{r.path}: not removed: {exc.strerror}")
        finally:
            if lock is not None:
                lock.release()
    return problems


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def render(p: Plan, dry_run: bool) -> str:
    verb = "would remove" if dry_run else "removed"
    lines = [f"{verb} {human(r.bytes):>10}  {r.path}  ({r.why})" for r in p.removals]
    lines += [f"left whole  {k}" for k in p.kept]
    lines.append(f"{verb} {len(p.removals)} item(s), {human(p.bytes)}" +
                 (": run again without --dry-run to remove them" if dry_run and p.removals else ""))
    return "\n".join(lines)
