"""TensorBoard's own record of a restart, so that a resumed run's curves stay continuous.

MaxText writes its summaries of every attempt into <run>/tensorboard/ (trainers/maxtext.route_tensorboard): after a
crash at step 24 and a resume from the checkpoint of step 20, steps 21-24 are written twice, and TensorBoard
shows both (its out-of-order check applies only to files without a version; MaxText's are `brain.Event:2`).
TensorFlow's supervisors solved this with a `SessionLog.START` event at the step training restarts from:
TensorBoard's event accumulator (`purge_orphaned_data`, on by default; AMD's compare_runs.py reads through it)
then drops every earlier event at or after that step. The supervisor writes one, in a file of its own, before
each attempt that follows one which wrote summaries."""

from __future__ import annotations

import time
from pathlib import Path


def mark_restart(tensorboard_dir: Path, step: int) -> str | None:
    """Write a SessionLog.START at `step` (the first step the next attempt trains) when earlier attempts wrote
    event files here; returns why not where it could not (no TensorBoard in this Python), else None."""
    try:
        if not any(tensorboard_dir.glob("events.out.tfevents.*")):
            return None
    except OSError:
        return None
    try:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError as exc:
        return f"no restart mark in {tensorboard_dir}: TensorBoard is not importable here ({exc})"
    try:
        writer = EventFileWriter(str(tensorboard_dir), filename_suffix=".rkit-restart")
        writer.add_event(Event(step=step, wall_time=time.time(), session_log=SessionLog(status=SessionLog.START)))
        writer.close()
    except OSError as exc:
        return f"no restart mark in {tensorboard_dir}: {exc}"
    return None
