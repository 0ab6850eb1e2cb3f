"""JAX's preemption sync point against Orbax's save-finalize thread (trainers.maxtext.guard_the_preemption_sync_point).

The fake manager follows JAX's PreemptionSyncManager (xla/tsl/distributed_runtime/preemption): every call records
its step as the task's counter; on a preemption notice the sync point is the largest counter + 1; a call is at the
sync point only with exactly that step."""

from __future__ import annotations

import pytest


class SyncManager:
    def __init__(self):
        self.counter, self.sync = 0, -1

    def reached(self, step: int) -> bool:
        self.counter = step
        return step == self.sync

    def preempt(self, *counters: int) -> None:  # every task's counter at the protocol; this one's among them
        self.sync = max((self.counter, *counters)) + 1


@pytest.fixture
def sync(monkeypatch):
    from jax.experimental import multihost_utils

    manager = SyncManager()
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", manager.reached)
    return manager


def run(sync, guarded: bool) -> int | None:
    """The loop asks at steps 229..240; step 230's async save finishes after the loop asked for 231, and Orbax's
    finalize thread asks for 230; SIGTERM comes then. The step the loop saves and stops at, or None."""
    from jax.experimental import multihost_utils

    from rkit.runtime.trainers.maxtext import guard_the_preemption_sync_point

    if guarded:
        guard_the_preemption_sync_point()
    ask = multihost_utils.reached_preemption_sync_point
    for step in range(229, 241):
        if ask(step):
            return step
        if step == 231:
            ask(230)  # the finalize thread of step 230's save (CheckpointManager._finalize)
            sync.preempt()  # the SIGTERM, on both tasks at once (the other task's counter: 231 too, or less)
    return None


def test_a_save_finishing_after_the_loop_moved_on_no_longer_hides_the_preemption_sync_point(sync):
    assert run(sync, guarded=True) == 232  # the next step: the save comes at once


def test_without_the_guard_the_sync_point_falls_behind_the_loop(sync):
    # (what the campaign saw: the sync point set to a step already passed, the preemption save never came)
    assert run(sync, guarded=False) is None
