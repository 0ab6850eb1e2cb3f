"""The fault campaign's schedule (tests/benchmarks/chaos.py, `make chaos`): seeded, valid for the run it fires into."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rkit.runtime.inject import parse_injections


@pytest.fixture(scope="module")
def chaos():
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        import chaos
    finally:
        sys.path.pop(0)
    return chaos


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another(chaos):
    one, again, other = chaos.schedule(1, 20), chaos.schedule(1, 20), chaos.schedule(2, 20)
    assert [f.describe() for f in one] == [f.describe() for f in again]
    assert [f.describe() for f in one] != [f.describe() for f in other]


@pytest.mark.parametrize("seed", range(1, 51))
def test_each_schedule_fits_its_run_and_rkit_takes_its_injections(chaos, seed):
    faults = chaos.schedule(seed, 20)
    steps = chaos.steps_for(20)
    assert len(faults) == 20 and [f.index for f in faults] == list(range(20))
    stepped = [f for f in faults if f.kind not in chaos.FOLLOWERS]
    assert all(10 <= b.step - a.step <= 25 for a, b in zip(stepped, stepped[1:], strict=False))
    assert stepped[0].step >= chaos.START and stepped[-1].step + 30 <= steps
    for before, f in zip(faults, faults[1:], strict=False):
        if f.kind in chaos.FOLLOWERS:  # in the recovery of a failure, never of a preemption or another follower
            assert before.kind not in (*chaos.FOLLOWERS, "preempt") and f.step == before.step
    assert all(f.step % chaos.PERIOD == 0 for f in faults if f.on_save)
    assert all(f.rank == 1 for f in faults if f.kind in chaos.BY_HARNESS)  # never the batch host's node
    specs = [s for f in faults if (s := f.spec()) is not None]
    assert len(specs) == sum(f.kind not in chaos.BY_HARNESS for f in faults)
    parsed = parse_injections(specs, processes=2, steps=steps)
    assert [i.kind for i in parsed] == [f.kind for f in faults if f.kind not in chaos.BY_HARNESS]
