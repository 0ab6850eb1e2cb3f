"""Hang detection policy (rkit.run.watchdog): the timeout it allows at each point of an attempt, on an injected
clock."""

from __future__ import annotations

import pytest

from rkit.recipe.load import load_recipe
from rkit.run.watchdog import HangPolicy, HangWatch

from ..conftest import TINY


def policy(**kw) -> HangPolicy:
    base = dict(explicit=None, enabled=True, floor=60.0, factor=10.0, startup=600.0, checkpoint_period=10)
    base.update(kw)
    return HangPolicy(**base)


def test_defaults_come_from_the_schema():
    p = HangPolicy.from_config(load_recipe(TINY).config)
    assert (p.explicit, p.enabled, p.floor, p.factor, p.startup, p.checkpoint_period) == (None, True, 60, 10, 600, 10)
    assert p.final_step == 99


@pytest.mark.parametrize("value, explicit, enabled", [("auto", None, True), (15, 15.0, True), (None, None, False)])
def test_hang_timeout_values(value, explicit, enabled):
    config = load_recipe(TINY, overrides=[f"resilience.hang_timeout={'null' if value is None else value}"]).config
    p = HangPolicy.from_config(config)
    assert (p.explicit, p.enabled) == (explicit, enabled)


def test_start_up_allowance_before_the_first_step():
    w = HangWatch(policy(), ranks=[0, 1], started=1000.0)
    assert w.check(1599.0) is None
    hang = w.check(1601.0)
    assert hang is not None and hang.ranks == [0, 1] and hang.timeout == 600 and hang.last_steps == {0: None, 1: None}


def test_auto_learns_from_the_median_step_time_with_a_floor():
    w = HangWatch(policy(), ranks=[0, 1], started=0.0)
    for step in range(1, 6):
        for rank in (0, 1):
            w.progress(rank, step, 0.5, now=float(step))
    assert w.timeout_for(0) == 60  # 10 x 0.5 s is under the floor
    slow = HangWatch(policy(), ranks=[0], started=0.0)
    for step in range(1, 6):
        slow.progress(0, step, 12.0, now=step * 12.0)
    assert slow.timeout_for(0) == 120  # 10 x median 12 s


def test_checkpoint_steps_get_twice_the_allowance():
    w = HangWatch(policy(), ranks=[0], started=0.0)
    w.progress(0, 19, 1.0, now=10.0)  # the next step, 20, saves
    assert w.timeout_for(0) == 120
    w.progress(0, 23, 1.0, now=11.0)
    assert w.timeout_for(0) == 60


def test_explicit_timeout_applies_after_the_first_step():
    w = HangWatch(policy(explicit=15.0), ranks=[0, 1], started=0.0)
    assert w.timeout_for(0) == 600
    w.progress(0, 1, 0.1, now=20.0)
    w.progress(1, 1, 0.1, now=20.0)
    w.progress(0, 2, 0.1, now=21.0)
    assert w.check(34.9) is None
    hang = w.check(35.5)  # rank 1 silent 15.5 s
    assert hang is not None and hang.ranks == [1] and hang.timeout == 15


def test_a_rank_that_stops_advancing_is_hung_even_when_others_move():
    w = HangWatch(policy(explicit=15.0), ranks=[0, 1], started=0.0)
    for t in range(1, 40):
        w.progress(0, t, 0.1, now=float(t))
    w.progress(1, 1, 0.1, now=1.0)
    hang = w.check(40.0)
    assert hang is not None and hang.ranks == [1] and hang.last_steps == {1: 1} and hang.seconds_silent == 39.0


def test_a_repeated_step_is_not_progress():
    w = HangWatch(policy(explicit=15.0), ranks=[0], started=0.0)
    w.progress(0, 5, 0.1, now=1.0)
    w.progress(0, 5, 0.1, now=10.0)  # the same step again (a recomputed line) does not reset the clock
    assert w.check(16.5) is not None


def test_disabled_never_fires():
    w = HangWatch(policy(enabled=False), ranks=[0], started=0.0)
    assert w.check(1e9) is None


def test_the_learned_step_times_carry_over_between_attempts():
    times: list[float] = []
    first = HangWatch(policy(), ranks=[0], started=0.0, step_times=times)
    for step in range(1, 4):
        first.progress(0, step, 30.0, now=step * 30.0)
    second = HangWatch(policy(), ranks=[0], started=200.0, step_times=times)
    second.progress(0, 4, None, now=210.0)
    assert second.timeout_for(0) == 300


def test_straggler_watch_flags_a_slow_node_once(tmp_path):
    from rkit.contract.rundir import RunDir
    from rkit.run.stragglers import StragglerWatch
    from rkit.runtime.telemetry.metrics import StepMetrics

    now = [0.0]
    run = RunDir(tmp_path / "run")
    watch = StragglerWatch(run, attempt=2, factor=1.5, clock=lambda: now[0])
    for step in range(20):
        watch.add(StepMetrics(step, 1.0, 0.1, None, node="fast"))
        watch.add(StepMetrics(step, 1.0, 0.1, None, node="fast2"))
        watch.add(StepMetrics(step, 1.0, 0.3, None, node="slow"))
    watch.check()
    now[0] = 100.0
    watch.check()
    flagged = [e for e in run.events() if e["event"] == "node.straggler"]
    assert [(e["node"], e["attempt"], round(e["ratio"], 1)) for e in flagged] == [("slow", 2, 3.0)]


@pytest.mark.parametrize("explicit", [None, 10.0])
def test_the_end_of_training_gets_the_start_up_allowance(explicit):
    """After the last step's line only the final save and the shutdown remain: no step-sized timeout there."""
    w = HangWatch(policy(explicit=explicit, final_step=29), ranks=[0], started=0.0)
    w.progress(0, 27, 0.1, now=10.0)
    assert w.timeout_for(0) == (60.0 if explicit is None else 10.0)
    w.progress(0, 28, 0.1, now=11.0)
    assert w.timeout_for(0) == 600.0
    assert w.check(now=11.0 + 599.0) is None and w.check(now=11.0 + 601.0) is not None


def test_a_run_directory_that_refuses_the_supervisors_own_write_is_known_at_the_next_check(tmp_path, monkeypatch):
    """A file system remounted read-only after an error: the supervisor's own write (the attempt folder's time
    stamp, every WRITE_CHECK_SECONDS) is refused, and the attempt ends as disk_full at once, not by the hang watch."""
    import errno
    import os
    from types import SimpleNamespace

    from rkit.contract.rundir import RunDir
    from rkit.run import attemptwatch
    from rkit.run.ending import Observation, classify
    from rkit.run.policy import Cause

    run = RunDir(tmp_path / "run")
    run.attempt_dir(1).mkdir(parents=True)
    watch = SimpleNamespace(sup=SimpleNamespace(run=run), attempt=1, next_write_check=0.0)
    check = attemptwatch.AttemptWatch.write_refused
    assert check(watch) is None and watch.next_write_check > 0  # writable: nothing said, the next check later
    calls = []

    def refused(path, *args, **kwargs):
        calls.append(path)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(attemptwatch.os, "utime", refused)
    assert check(watch) is None and calls == []  # not before WRITE_CHECK_SECONDS
    watch.next_write_check = 0.0
    said = check(watch)
    assert calls == [run.attempt_dir(1)] and "refused the supervisor's own write" in said
    assert "Read-only file system" in said
    ending = classify(Observation(processes=2, exits=(), step=12, disk_full=said))
    assert ending.cause is Cause.DISK_FULL and said in ending.detail


def test_a_stopped_rank_is_the_hangs_culprit_before_its_own_silence_passes_the_timeout():
    """Rank 1 SIGSTOPped; rank 0 blocks in the next collective. The supervisor read rank 0's last line first, so at
    the check only rank 0 is past the timeout (CI under load): the stopped rank is still named, with its step."""
    from rkit.run.ending import Observation, classify
    from rkit.run.policy import Cause

    watch = HangWatch(HangPolicy(explicit=60.0, enabled=True, floor=30.0, factor=5.0, startup=300.0,
                                 checkpoint_period=0), ranks=[0, 1], started=0.0)
    watch.progress(0, 15, 0.1, now=100.0)
    watch.progress(1, 15, None, now=103.0)
    hang = watch.check(now=161.0)
    assert hang is not None and hang.ranks == [0]  # rank 1's silence (58 s) is still within the timeout
    ending = classify(Observation(processes=2, exits=(), step=15, hang=hang, stopped=(1,), last_steps={0: 15, 1: 15}))
    assert ending.cause is Cause.HANG and ending.rank == 1 and ending.step == 15 and "rank 1" in ending.detail
    assert hang.ordered((1,)) == [1, 0] and hang.ordered() == [0]
    assert classify(Observation(processes=2, exits=(), step=15, hang=hang, last_steps={0: 15, 1: 15})).rank == 0
