"""A resumed run's TensorBoard curve is continuous: the restart mark makes TensorBoard drop the summaries of the
steps trained again (tbmarks.py), read through TensorBoard's own event accumulator."""

from __future__ import annotations

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.compat.proto.event_pb2 import Event  # noqa: E402
from tensorboard.compat.proto.summary_pb2 import Summary  # noqa: E402
from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: E402

from rkit.run.tbmarks import mark_restart  # noqa: E402


def write_losses(logdir, steps, loss, suffix):
    writer = EventFileWriter(str(logdir), filename_suffix=suffix)
    for step in steps:
        writer.add_event(Event(step=step, wall_time=float(step),
                               summary=Summary(value=[Summary.Value(tag="learning/loss", simple_value=loss(step))])))
    writer.close()


def losses(logdir) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("learning/loss")]


def test_after_a_resume_each_step_is_on_the_curve_once_with_the_newer_value(tmp_path):
    assert mark_restart(tmp_path, 21) is None and not list(tmp_path.iterdir())  # nothing written yet: no mark
    write_losses(tmp_path, range(0, 25), lambda s: 10.0 - s / 10, ".a1")  # attempt 1 crashed after step 24
    assert [s for s, _ in losses(tmp_path)] == list(range(25))
    assert mark_restart(tmp_path, 21) is None  # attempt 2 resumes from the checkpoint of step 20
    write_losses(tmp_path, range(21, 30), lambda s: 20.0 - s / 10, ".a2")
    curve = losses(tmp_path)
    assert [s for s, _ in curve] == list(range(30))  # 21-24 once, not twice
    assert dict(curve)[22] == pytest.approx(20.0 - 2.2) and dict(curve)[20] == pytest.approx(10.0 - 2.0)


def test_without_the_mark_tensorboard_keeps_both(tmp_path):
    # What the mark fixes: MaxText's files are version 2, so TensorBoard does not purge out-of-order steps.
    write_losses(tmp_path, range(0, 25), lambda s: 1.0, ".a1")
    write_losses(tmp_path, range(21, 30), lambda s: 2.0, ".a2")
    assert [s for s, _ in losses(tmp_path)].count(22) == 2
