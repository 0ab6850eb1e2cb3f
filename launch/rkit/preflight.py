"""What the supervisor checks before it starts an attempt, and the cheap check before it reads a rank's metrics:
each a stop with a diagnosis (a `run.gave_up` event naming what and where, then RkitError: exit 2), never a
failed attempt that spends a budget."""

from __future__ import annotations

import os
import sys

from .backends.base import Backend
from .errors import RkitError
from .image import ImageIdentity
from .rundir import EV, JsonlTail, RunDir


def shared_paths(run: RunDir, backend: Backend, image: ImageIdentity | None, attempt: int) -> None:
    """Once per supervisor start: every node an attempt may use sees the run directory and the image (the
    backend adds its tasks' Python). A check that could not be made is a warning, not a stop."""
    found, why = backend.unseen_paths([str(run.path.resolve()), *([image.path] if image else [])])
    if why:
        sys.stderr.write(f"rkit: warning: the shared file system check was not made: {why}\n")
    if found:
        unseen = "; ".join(f"{node} cannot see {', '.join(paths)}" for node, paths in sorted(found.items()))
        reason = (f"shared file system check failed before attempt {attempt}: {unseen}. The run directory, the "
                  "image and the Python must be on a file system every node mounts at the same path (the JAX "
                  "cache may be node-local): move them there and resume.")
        run.emit(EV.RUN_GAVE_UP, reason=reason)
        raise RkitError(reason)


def image_unchanged(run: RunDir, image: ImageIdentity | None, attempt: int) -> None:
    """Before every attempt: the SIF must be the one the run was stamped with (never silently run different
    software)."""
    if image is None:
        return
    try:
        image.check_unchanged()
    except RkitError as exc:
        run.emit(EV.RUN_GAVE_UP, reason=f"image check failed before attempt {attempt}: {exc}")
        raise


def grew(tail: JsonlTail) -> bool:
    """The file's size is not where the tail stopped reading (it grew, or was truncated or removed)."""
    try:
        return os.stat(tail.path).st_size != tail.offset
    except FileNotFoundError:
        return tail.offset != 0


