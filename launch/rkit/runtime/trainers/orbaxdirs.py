"""Orbax's checkpoint directories as rkit reads them: the step directories Orbax would see, which are committed,
and why one could not be restored (for the run directory's steps and a node-local tier's alike).

Standard library only: the host side reads them.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

TMP_MARKER = ".orbax-checkpoint-tmp"
LOCAL_METADATA_ITEM = "process_metadata"  # the emergency manager's own item in a local step (no _METADATA)


def step_dirs_in(directory: Path | None) -> dict[int, Path]:
    """Every step directory Orbax would see in `directory` (committed or not); its temporary ones excluded."""
    if directory is None:
        return {}
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return {int(e.name): Path(e.path) for e in entries
            if e.is_dir() and TMP_MARKER not in e.name and e.name.isascii() and e.name.isdigit()}


def _committed(path: Path) -> bool:
    return (path / "commit_success.txt").exists() or (path / "_CHECKPOINT_METADATA").exists()


# committed_in's last look at a directory: its mtime, every step directory, the committed ones. The supervisor asks
# every poll; once a step is committed it stays so while its name is listed, and Orbax commits a step by renaming it
# into place (the directory's mtime changes) or by a marker inside it (only an uncommitted step is looked at again),
# so an unchanged directory costs one stat plus one per uncommitted step, however many steps it keeps. A change
# under RECENT_SECONDS old is read again (two renames within the file system's mtime granularity).
_SEEN: dict[str, tuple[int, dict[int, Path], set[int]]] = {}
RECENT_SECONDS = 2.0


def committed_in(directory: Path | None) -> list[int]:
    """Steps with a committed Orbax checkpoint in `directory`; a `*.orbax-checkpoint-tmp*` one never counts."""
    if directory is None:
        return []
    try:
        seen = os.stat(directory)
    except OSError:
        return []
    cached = _SEEN.get(str(directory))
    if cached is not None and cached[0] == seen.st_mtime_ns and seen.st_mtime < time.time() - RECENT_SECONDS:
        _, dirs, committed = cached
        committed |= {step for step, path in dirs.items() if step not in committed and _committed(path)}
    else:
        dirs = step_dirs_in(directory)
        committed = {step for step, path in dirs.items() if _committed(path)}
        _SEEN[str(directory)] = (seen.st_mtime_ns, dirs, committed)
    return sorted(committed)


# The kinds of item Orbax and MaxText write in a step, by the handler class _CHECKPOINT_METADATA names for it.
PYTREE_HANDLERS = ("PyTreeHandler", "PyTreeCheckpointHandler", "StandardCheckpointHandler")  # the train state
ITERATOR_HANDLERS = ("StatefulCheckpointableHandler", "GrainCheckpointHandler")  # Grain's data iterator
JSON_HANDLERS = ("JsonCheckpointHandler", "JsonHandler")  # a JSON document (MaxText's metadata items)
ITERATOR_FILE = re.compile(r"process_([0-9]{1,6})-of-([0-9]{1,6})\.json")
ELASTIC_ITERATOR_FILE = "process_0.json"  # Grain's ElasticIterator: one global position for any process count


@dataclass(frozen=True)
class StepCheck:
    """What Orbax's own files say of one step directory: why MaxText could not restore it (`problem`, None when
    every item of a kind rkit knows is whole) and what rkit could not judge (`notes`: an item of a kind it does
    not know is not corruption)."""

    problem: str | None
    notes: tuple[str, ...] = ()


def check_step(path: Path, local: bool = False) -> StepCheck:
    """Each item of a step checked by its own format (the handler _CHECKPOINT_METADATA names for it):
    - a PyTree (the train state): its _METADATA, readable JSON, and for OCDBT the root manifest.ocdbt and each
      process's ocdbt.process_<i>/manifest.ocdbt with its data files under d/ (a data file lost among several is
      only found by the restore itself: see ranklogs.RESTORE_FAILED);
    - Grain's data iterator: one readable JSON position per process that saved it, process_<i>-of-<n>.json for
      every i below n (no _METADATA: Grain writes none);
    - a JSON item: its files readable JSON.
    A local tier's step (`local`, one process's) has a process_metadata item without _METADATA and its data
    files under the item's own d/."""
    meta = path / "_CHECKPOINT_METADATA"
    if not meta.is_file() and not (path / "commit_success.txt").is_file():
        return StepCheck("no commit marker (_CHECKPOINT_METADATA or commit_success.txt): the save never finished")
    try:
        handlers = json.loads(meta.read_text(encoding="utf-8")).get("item_handlers") if meta.is_file() else None
    except (OSError, ValueError, AttributeError):
        return StepCheck("_CHECKPOINT_METADATA is unreadable")
    notes = []
    for item in sorted(handlers or {}) if isinstance(handlers, dict) else []:
        item_dir = path / item
        if not item_dir.is_dir():
            return StepCheck(f"item {item!r} is missing")
        if local and item == LOCAL_METADATA_ITEM:
            continue
        kind = str(handlers[item]).rpartition(".")[2]
        if kind in ITERATOR_HANDLERS:
            problem = _iterator_problem(item, item_dir)
        elif kind in JSON_HANDLERS:
            problem = _json_item_problem(item, item_dir)
        elif kind in PYTREE_HANDLERS or kind == "" or local:
            problem = _pytree_problem(item, item_dir, local)
        else:
            notes.append(f"item {item!r} ({kind}) is of a kind rkit does not check; left to Orbax's restore")
            continue
        if problem is not None:
            return StepCheck(problem, tuple(notes))
    return StepCheck(None, tuple(notes))


def step_problem(path: Path, local: bool = False) -> str | None:
    """Why MaxText could not restore this step directory, as far as Orbax's own files show it (check_step)."""
    return check_step(path, local).problem


def _pytree_problem(item: str, item_dir: Path, local: bool) -> str | None:
    if not (item_dir / "_METADATA").is_file():
        return f"{item}/_METADATA is missing"
    if not isinstance(_read_json(item_dir / "_METADATA"), dict):  # emptied or cut: the restore fails with exit 1
        return f"{item}/_METADATA is not readable JSON (emptied or cut)"
    if local and (item_dir / "manifest.ocdbt").is_file():
        data = item_dir / "d"
        if not data.is_dir() or not any(data.iterdir()):
            return f"{item}/d holds no data files"
    elif (item_dir / "manifest.ocdbt").is_file():
        for proc in sorted(item_dir.glob("ocdbt.process_*")):
            if not (proc / "manifest.ocdbt").is_file():
                return f"{item}/{proc.name}/manifest.ocdbt is missing"
            data = proc / "d"
            if not data.is_dir() or not any(data.iterdir()):
                return f"{item}/{proc.name}/d holds no data files"
    return None


def iterator_files(item_dir: Path) -> dict[int, tuple[int, Path]]:
    """Grain's saved positions in an iterator item: process index -> (process count, file). The elastic
    iterator's one position (process_0.json, grain_use_elastic_iterator) reads as process 0 of 1."""
    found = {}
    try:
        entries = list(os.scandir(item_dir))
    except OSError:
        return {}
    for entry in entries:
        if (match := ITERATOR_FILE.fullmatch(entry.name)) is not None:
            found[int(match.group(1))] = (int(match.group(2)), Path(entry.path))
    if not found and (item_dir / ELASTIC_ITERATOR_FILE).exists():
        found[0] = (1, item_dir / ELASTIC_ITERATOR_FILE)
    return found


def _iterator_problem(item: str, item_dir: Path) -> str | None:
    files = iterator_files(item_dir)
    if not files:
        return f"{item} holds no process_<i>-of-<n>.json (Grain's data position)"
    counts = {count for count, _ in files.values()}
    if len(counts) != 1:
        return f"{item} mixes positions saved by {' and '.join(map(str, sorted(counts)))} processes"
    count = counts.pop()
    if missing := sorted(set(range(count)) - set(files)):
        return f"{item}/process_{missing[0]}-of-{count}.json is missing ({len(missing)} of {count} processes)"
    for _, file in (files[index] for index in sorted(files)):
        if not file.is_file() or not isinstance(_read_json(file), (dict, list)):
            return f"{item}/{file.name} is not readable JSON (emptied or cut)"
    return None


def _json_item_problem(item: str, item_dir: Path) -> str | None:
    for file in sorted(item_dir.iterdir()):
        if file.is_file() and file.name != "commit_success.txt" and _read_json(file) is None:
            return f"{item}/{file.name} is not readable JSON (emptied or cut)"
    return None


def _read_json(path: Path, limit: int = 64 << 20) -> object:
    """A regular file's JSON, or None (unreadable, not JSON, a FIFO or larger than `limit`)."""
    try:
        with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NONBLOCK)) as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None
            data = fh.read(limit + 1)
            return None if len(data) > limit else json.loads(data or b"null")
    except (OSError, ValueError):
        return None


POSITION_BYTES = 512  # a larger position (a mixture's) is recorded by its size only


def data_position(step_dir: Path | None) -> dict[str, object] | None:
    """Where the data resumes with this step: Grain's saved position of each process (its iterator item, as Grain
    wrote it; a large one as its size), for attempt.started and rkit status; None when the step saved none."""
    if step_dir is None:
        return None
    meta = _read_json(step_dir / "_CHECKPOINT_METADATA")
    handlers = meta.get("item_handlers") if isinstance(meta, dict) else None
    names = [item for item, kind in (handlers or {}).items()
             if str(kind).rpartition(".")[2] in ITERATOR_HANDLERS] if isinstance(handlers, dict) else []
    return positions_in(step_dir / (names[0] if names else "iter"))


def positions_in(folder: Path) -> dict[str, object] | None:
    """Each process's position in a folder of Grain's position files (an `iter` item, or rkit's data-position
    folder of a step of the node-local tier's run: runtime/trainers/datapos.py)."""
    files = iterator_files(folder)
    out: dict[str, object] = {}
    for index, (_, file) in sorted(files.items())[:1024]:
        size = file.stat().st_size if file.is_file() else 0
        out[str(index)] = _read_json(file) if size <= POSITION_BYTES else {"bytes": size}
    return out or None


@dataclass(frozen=True)
class Triage:
    """The step directories of a checkpoint directory sorted before an attempt: those to move aside (step ->
    why), and `suspect` when every committed step fails one and the same check (then none is moved)."""

    quarantine: dict[int, str]
    notes: dict[int, tuple[str, ...]]
    suspect: str | None = None


def triage(dirs: dict[int, Path], local: bool = False) -> Triage:
    """Which steps MaxText must not restore from. When two or more committed steps all fail with the same
    reason, the check is more likely wrong than every save of the run (a format rkit misreads): nothing is
    moved and `suspect` says why, so that the run stops with it instead of starting over from scratch.
    Newest first, up to the first committed step that passes: a restore takes that one, and the steps before it
    are never read (the cost is the same whether the run keeps 3 steps or 500)."""
    checks: dict[int, StepCheck] = {}
    committed = []
    for step in sorted(dirs, reverse=True):
        path = dirs[step]
        checks[step] = check_step(path, local)
        if _committed(path):
            committed.append(step)
            if checks[step].problem is None:
                break
    bad = {step: c.problem for step, c in checks.items() if c.problem is not None}
    notes = {step: c.notes for step, c in checks.items() if c.notes}
    reasons = {bad.get(step) for step in committed}
    if len(committed) >= 2 and None not in reasons and len(reasons) == 1:
        reason = reasons.pop()
        steps = ", ".join(map(str, sorted(committed)))
        return Triage({}, notes, f"every committed step ({steps}) fails the same check: {reason}")
    return Triage(bad, notes)


def local_step_problem(path: Path) -> str | None:
    return step_problem(path, local=True)
