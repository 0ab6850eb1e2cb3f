"""Grain's data position for the steps of the node-local tier (`checkpoint.local_dir`): MaxText's emergency manager
saves and restores only the train state, in both tiers, so a restore would start the data over. rkit keeps each
process's position beside: at every step either tier saves, each process writes its Grain iterator's state to
<run>/checkpoints/data-position/<step>/process_<i>-of-<n>.json (the run directory: a node replaced with empty
storage still finds the positions of the step its replica restores), and after a restore of step S each process
sets its iterator to its position of S. A position missing for the restored step is said (stderr and the
`checkpoint.restored` event), never silent. Positions of steps neither tier holds any more are removed.

The files are those of MaxText's own `iter` item (Grain's JSON state per process), so the integrity check and
`rkit status` read them alike (orbaxdirs.iterator_files, data_position).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from rkit.contract.rundir import RunDir

# The training loop's data iterator, captured by the loop's hooks (trainers.maxtext.hook_the_train_loop) before the
# first save and restore; MaxText's emergency save and restore are not given it.
ITERATOR: list[Any] = [None]


def directory(run: RunDir) -> Path:
    return run.checkpoints / "data-position"


def _grain_iterator(data_iterator: Any) -> Any:
    """The Grain iterator inside MaxText's multi-host loader (or the loader's list's first)."""
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0] if data_iterator else None
    return getattr(data_iterator, "local_iterator", None)


def _state_text(iterator: Any) -> str | None:
    try:
        state = iterator.get_state()
    except (AttributeError, NotImplementedError, TypeError):
        return None
    return state.decode() if isinstance(state, bytes) else json.dumps(state, indent=4)


def save(run: RunDir, step: int, process: int, count: int) -> Path | None:
    """This process's position after `step` (its batch consumed), written whole (a temporary file renamed)."""
    iterator = _grain_iterator(ITERATOR[0])
    text = None if iterator is None else _state_text(iterator)
    if text is None:
        return None
    target = directory(run) / str(step) / f"process_{process}-of-{count}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, target)
    return target


def restore(run: RunDir, step: int, process: int, count: int) -> str:
    """Set this process's iterator to its position of `step`: 'restored', 'missing' (said on stderr) or 'none'
    (no Grain iterator: synthetic data, which has no position)."""
    iterator = _grain_iterator(ITERATOR[0])
    if iterator is None or not hasattr(iterator, "set_state"):
        return "none"
    path = directory(run) / str(step) / f"process_{process}-of-{count}.json"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        sys.stderr.write(f"rkit: WARNING: no data position of step {step} for process {process} ({path}): the data "
                         "of this process starts over from its beginning\n")
        sys.stderr.flush()
        return "missing"
    state = iterator.get_state()
    iterator.set_state(text.encode() if isinstance(state, bytes) else json.loads(text))
    return "restored"


def prune(run: RunDir, held: set[int]) -> list[int]:
    """Remove the positions of steps neither tier holds (`held`: the run directory's committed steps and the
    local steps the ranks recorded). A step newer than the newest held one may be a save still in flight (a rank
    records a local step only once it committed): kept."""
    newest = max(held, default=-1)
    gone = []
    try:
        entries = list(os.scandir(directory(run)))
    except OSError:
        return []
    for entry in entries:
        if entry.name.isdigit() and int(entry.name) < newest and int(entry.name) not in held:
            shutil.rmtree(entry.path, ignore_errors=True)
            gone.append(int(entry.name))
    return sorted(gone)
