"""Orbax's checkpoint directories as rkit reads them: the step directories Orbax would see, which are committed,
and why one could not be restored (for the run directory's steps and a node-local tier's alike).

Standard library only: the host side reads them.
"""

from __future__ import annotations

import json
import os
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


def committed_in(directory: Path | None) -> list[int]:
    """Steps with a committed Orbax checkpoint in `directory`; a `*.orbax-checkpoint-tmp*` one never counts."""
    return sorted(step for step, path in step_dirs_in(directory).items()
                  if (path / "commit_success.txt").exists() or (path / "_CHECKPOINT_METADATA").exists())


def step_problem(path: Path, local: bool = False) -> str | None:
    """Why MaxText could not restore this step directory, as far as Orbax's own files show it; None when they
    are all there. Orbax writes: _CHECKPOINT_METADATA (the item handlers, the commit time) and, per item, its
    _METADATA, and for OCDBT the root manifest.ocdbt and each process's ocdbt.process_<i>/manifest.ocdbt with
    its data files under d/. (A data file lost among several is only found by the restore itself: see
    ranklogs.RESTORE_FAILED.) A local tier's step (`local`, one process's) has a process_metadata item
    without _METADATA and its data files under the item's own d/."""
    meta = path / "_CHECKPOINT_METADATA"
    if not meta.is_file() and not (path / "commit_success.txt").is_file():
        return "no commit marker (_CHECKPOINT_METADATA or commit_success.txt): the save never finished"
    try:
        handlers = json.loads(meta.read_text(encoding="utf-8")).get("item_handlers") if meta.is_file() else None
    except (OSError, ValueError, AttributeError):
        return "_CHECKPOINT_METADATA is unreadable"
    for item in sorted(handlers or {}):
        item_dir = path / item
        if not item_dir.is_dir():
            return f"item {item!r} is missing"
        if local and item == LOCAL_METADATA_ITEM:
            continue
        if not (item_dir / "_METADATA").is_file():
            return f"{item}/_METADATA is missing"
        try:  # Orbax's tree metadata, JSON: an emptied or cut one fails the restore with a bare exit 1
            tree = json.loads((item_dir / "_METADATA").read_bytes())
        except (OSError, ValueError):
            tree = None
        if not isinstance(tree, dict):
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


def local_step_problem(path: Path) -> str | None:
    return step_problem(path, local=True)
