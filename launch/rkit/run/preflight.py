"""What the supervisor checks before it starts an attempt, and the cheap check before it reads a rank's metrics:
each a stop with a diagnosis (a `run.gave_up` event naming what and where, then RkitError: exit 2), never a
failed attempt that spends a budget; and the run directory's checkpoints, sorted before each attempt (those MaxText
could not restore moved aside)."""

from __future__ import annotations

import os
import shutil
import sys

from rkit.backends.base import Backend
from rkit.contract.errors import RkitError
from rkit.contract.events import EV
from rkit.contract.rundir import JsonlTail, RunDir, write_json_atomic
from rkit.images.identity import ImageIdentity
from rkit.runtime import devices
from rkit.runtime.trainers import maxtext


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


def no_planted_links(run: RunDir, attempt: int) -> None:
    """Before every attempt: no symbolic link where rkit or a rank writes (a rank would die on it, O_NOFOLLOW,
    and the same traceback on every rank would read as a crash loop)."""
    if links := run.planted_links():
        reason = (f"planted link before attempt {attempt}: {links[0]} is a symbolic link; rkit does not write "
                  "through links in a run directory. Remove it, check the run directory, and resume.")
        run.emit(EV.RUN_GAVE_UP, reason=reason)
        raise RkitError(reason)


def image_unchanged(run: RunDir, image: ImageIdentity | None, attempt: int) -> ImageIdentity | None:
    """Before every attempt: the SIF must be the one the run was stamped with, or a rebuild holding the same
    environment (never silently run different software). Returns the image to run: a rebuilt one is recorded
    (an `image.rebuilt` event and the manifest's `image_rebuilt` list: "rebuilt, same environment")."""
    if image is None:
        return None
    try:
        rebuilt = image.check_unchanged()
    except RkitError as exc:
        run.emit(EV.RUN_GAVE_UP, reason=f"image check failed before attempt {attempt}: {exc}")
        raise
    if rebuilt is None:
        return image
    note = {"attempt": attempt, "path": rebuilt.path, "expected": image.sha256, "found": rebuilt.sha256,
            "environment_sha256": rebuilt.environment_sha256, "verdict": "rebuilt, same environment"}
    run.emit(EV.IMAGE_REBUILT, **note)
    stamp = run.load_manifest()
    stamp["image_rebuilt"] = [*stamp.get("image_rebuilt", []), note]
    write_json_atomic(run.manifest, stamp)
    return rebuilt


def gpu_vendor(gpus_per_node: int, image: ImageIdentity | None) -> str | None:
    """Whose tool checks the GPUs: the image's vendor (--nv, --rocm), else whichever tool this host has; None
    when there is nothing to check (no GPUs in the recipe, or no vendor tool)."""
    if gpus_per_node <= 0:
        return None
    vendor = devices.vendor_of(image.gpu_flags if image else ())
    if vendor:
        return vendor
    return "nvidia" if shutil.which("nvidia-smi") else "amd" if shutil.which("amd-smi") else None


def gpu_health(run: RunDir, backend: Backend, vendor: str | None, attempt: int) -> dict[str, str]:
    """Before every attempt on GPU nodes: {node: why its GPUs are unfit} (the supervisor excludes those
    nodes like dead ones). A check that could not be made is a warning. The local launcher cannot leave its one
    node out: there an unfit GPU stops the run with the diagnosis."""
    if vendor is None:
        return {}
    found, why = backend.unfit_gpus(vendor)
    if why:
        sys.stderr.write(f"rkit: warning: the GPU health check was not made before attempt {attempt}: {why}\n")
    if found and backend.name == "local":
        reason = (f"GPU health check failed before attempt {attempt}: "
                  + "; ".join(f"{node}: {what}" for node, what in sorted(found.items()))
                  + ". Free or repair the GPUs (nvidia-smi / amd-smi show them), then resume.")
        run.emit(EV.RUN_GAVE_UP, reason=reason)
        raise RkitError(reason)
    return found


def grew(tail: JsonlTail) -> bool:
    """The file's size is not where the tail stopped reading (it grew, or was truncated or removed)."""
    try:
        return os.stat(tail.path).st_size != tail.offset
    except FileNotFoundError:
        return tail.offset != 0




def checkpoints(run: RunDir) -> str | None:
    """Before every attempt: a step directory MaxText would see but could not restore from is moved aside, so the
    attempt resumes from the previous good step (rkit's idea of committed and MaxText's agree); an item of a kind
    rkit does not check is a `checkpoint.note`. When every committed step fails the same check, the check is
    suspect: nothing is moved, and the reason is returned (the attempt ends check_suspect, the run stops)."""
    found = maxtext.triage(maxtext.step_dirs(run))
    for step, notes in sorted(found.notes.items()):
        run.emit(EV.CHECKPOINT_NOTE, step=step, notes=list(notes))
    for step, problem in sorted(found.quarantine.items(), reverse=True):
        quarantine(run, step, problem)
    if not found.suspect and (gone := maxtext.prune_quarantine(run)):  # suspect: what it moved may be the good ones
        run.emit(EV.CHECKPOINT_PRUNED, what="quarantine", names=gone)
    return found.suspect


def quarantine(run: RunDir, step: int, reason: str) -> None:
    target = maxtext.quarantine(run, step)
    if target is not None:
        run.emit(EV.CHECKPOINT_QUARANTINED, step=step, reason=reason, moved_to=str(target.relative_to(run.path)))
