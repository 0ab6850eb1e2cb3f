"""The supervisor's policy is a pure function: tested exhaustively, no processes, no sleeping."""

from __future__ import annotations

import itertools

import pytest

from rkit.run.policy import Action, Budgets, Cause, Outcome, RunState, Tally, decide, tally_from_events

BUDGETS = Budgets(max_restarts=3, max_infra_restarts=2, crash_loop_limit=3)


def test_final_step_committed_always_finishes():
    for cause in Cause:
        decision, _ = decide(Tally(), Outcome(cause, 10, 10, "x"), BUDGETS, final_committed=True)
        assert decision.action is Action.FINISH


def test_interrupt_stops_without_spending_budget():
    decision, tally = decide(Tally(), Outcome(Cause.INTERRUPTED, 5, 5), BUDGETS, False)
    assert decision.action is Action.STOP and tally == Tally()


def test_training_failures_with_progress_restart_until_budget():
    tally = Tally()
    actions = []
    for i in range(5):
        outcome = Outcome(Cause.TASK_EXIT, i * 10, i * 10 + 10, "rank 0 exited", rank=0, code=1, step=i * 10 + 7)
        decision, tally = decide(tally, outcome, BUDGETS, False)
        actions.append(decision.action)
    assert actions == [Action.RESTART] * 3 + [Action.GIVE_UP] * 2
    assert tally.stalled == 0


def test_crash_loop_is_diagnosed_when_no_checkpoint_progress():
    tally = Tally()
    budgets = Budgets(max_restarts=10, max_infra_restarts=2, crash_loop_limit=3)
    detail = "rank 0 exited with code 3 after step 7"
    decisions = []
    for _ in range(3):
        decision, tally = decide(tally, Outcome(Cause.TASK_EXIT, 5, 5, detail), budgets, False)
        decisions.append(decision)
    assert [d.action for d in decisions] == [Action.RESTART, Action.RESTART, Action.GIVE_UP]
    assert "crash loop" in decisions[-1].reason and "same way" in decisions[-1].reason
    assert detail in decisions[-1].reason and "last committed step 5" in decisions[-1].reason


def test_progress_resets_the_crash_loop_count():
    budgets = Budgets(max_restarts=10, max_infra_restarts=2, crash_loop_limit=2)
    tally = Tally()
    # Killed at a different step each time: not the same failure, so only the progress rule counts.
    for step, (before, after) in zip([7, 12, 17], [(5, 5), (5, 10), (10, 10)], strict=True):
        outcome = Outcome(Cause.TASK_SIGNAL, before, after, "killed", rank=1, code=-9, step=step)
        decision, tally = decide(tally, outcome, budgets, False)
        assert decision.action is Action.RESTART
    decision, tally = decide(tally, Outcome(Cause.TASK_SIGNAL, 10, 10, "killed", rank=1, code=-9, step=19),
                             budgets, False)
    assert decision.action is Action.GIVE_UP and "without a new committed checkpoint" in decision.reason


def test_the_same_failure_is_a_crash_loop_even_when_a_checkpoint_slipped_in():
    """An async save may commit during any attempt: the same rank, exit code and step in a row is a crash loop."""
    budgets = Budgets(max_restarts=3, max_infra_restarts=10, crash_loop_limit=2)
    detail = "rank 0 exited with code 3 after step 15"
    tally = Tally()
    decision, tally = decide(tally, Outcome(Cause.TASK_EXIT, None, 10, detail, rank=0, code=3, step=15), budgets,
                             False)
    assert decision.action is Action.RESTART and tally.repeats == 1
    decision, tally = decide(tally, Outcome(Cause.TASK_EXIT, 10, 10, detail, rank=0, code=3, step=15), budgets,
                             False)
    assert decision.action is Action.GIVE_UP and decision.reason.startswith("crash loop")
    assert detail in decision.reason and "2 consecutive attempts failed the same way" in decision.reason


@pytest.mark.parametrize("other", [dict(rank=1, code=3, step=15), dict(rank=0, code=4, step=15),
                                   dict(rank=0, code=3, step=16), dict(rank=0, code=-9, step=15)])
def test_a_different_failure_starts_the_count_again(other):
    budgets = Budgets(max_restarts=10, max_infra_restarts=10, crash_loop_limit=2)
    first = Outcome(Cause.TASK_EXIT, None, 10, "a", rank=0, code=3, step=15)
    cause = Cause.TASK_SIGNAL if other["code"] < 0 else Cause.TASK_EXIT
    _, tally = decide(Tally(), first, budgets, False)
    decision, tally = decide(tally, Outcome(cause, 10, 20, "b", **other), budgets, False)
    assert decision.action is Action.RESTART and tally.repeats == 1


def test_identical_hangs_are_a_crash_loop_before_the_infrastructure_budget_is_gone():
    budgets = Budgets(max_restarts=3, max_infra_restarts=10, crash_loop_limit=3)
    tally = Tally()
    actions = []
    for _ in range(3):
        hang = Outcome(Cause.HANG, 10, 10, "hang: rank 1 made no step progress", rank=1, step=12)
        decision, tally = decide(tally, hang, budgets, False)
        actions.append(decision.action)
    assert actions == [Action.RESTART, Action.RESTART, Action.GIVE_UP] and tally.infra_failures == 3
    assert "crash loop" in decision.reason and "rank 1" in decision.reason


def test_repeated_preemptions_are_never_a_crash_loop():
    budgets = Budgets(max_restarts=3, max_infra_restarts=10, crash_loop_limit=2)
    tally = Tally()
    for _ in range(5):
        decision, tally = decide(tally, Outcome(Cause.PREEMPTED, 10, 10, "SIGUSR1", requeue=True, step=12), budgets,
                                 False)
        assert decision.action is Action.REQUEUE
    assert tally.repeats == 0


def test_infrastructure_failures_have_their_own_budget():
    tally = Tally(training_failures=3)
    for expected in [Action.RESTART, Action.RESTART, Action.GIVE_UP]:
        decision, tally = decide(tally, Outcome(Cause.PREEMPTED, 5, 5, "SIGTERM"), BUDGETS, False)
        assert decision.action is expected
    assert "infrastructure budget" in decision.reason and tally.training_failures == 3


def test_exhaustive_small_space_is_well_formed():
    """Every combination yields a decision with a reason; budgets never go negative."""
    causes = [c for c in Cause if c is not Cause.COMPLETED]
    for cause, before, after, final in itertools.product(causes, [None, 5], [None, 5, 10], [False, True]):
        for tally in [Tally(), Tally(3, 2, 2, ("a", "b"))]:
            decision, new = decide(tally, Outcome(cause, before, after, "d"), BUDGETS, final)
            assert decision.reason
            assert new.training_failures >= tally.training_failures
            assert new.infra_failures >= tally.infra_failures


def test_tally_is_replayed_from_events():
    events = [{"event": "attempt.ended", "tally": {"training_failures": 2, "infra_failures": 1, "stalled": 1,
                                                   "stalled_details": ["x"]}}]
    assert tally_from_events(events) == Tally(2, 1, 1, ("x",))
    tally = Tally(1, 2, 0, (), "task_exit rank=0 code=3 step=15", 1)
    assert tally_from_events([{"event": "attempt.ended", "tally": tally.as_dict()}]) == tally


@pytest.mark.parametrize("state,terminal", [(RunState.FINISHED, True), (RunState.GAVE_UP, True),
                                            (RunState.RUNNING, False), (RunState.INTERRUPTED, False),
                                            (RunState.STOPPED, False), (RunState.PENDING, False)])
def test_terminal_states(state, terminal):
    assert state.is_terminal() is terminal


@pytest.mark.parametrize("cause", [Cause.HANG, Cause.LOST, Cause.NODE_FAIL, Cause.PREEMPTED])
def test_hangs_and_lost_attempts_spend_the_infrastructure_budget(cause):
    tally = Tally(training_failures=1, stalled=2, stalled_details=("a", "b"))
    decision, tally = decide(tally, Outcome(cause, 10, 10, "x"), BUDGETS, False)
    assert decision.action is Action.RESTART and tally.infra_failures == 1 and tally.training_failures == 1
    assert tally.stalled == 0  # an infrastructure failure says nothing about a crash loop


def test_an_attempt_without_an_end_is_found_as_lost(tmp_path, monkeypatch):
    from rkit.contract.rundir import RunDir
    from rkit.run.attemptrecord import lost_attempt

    run = RunDir(tmp_path / "run 1")
    run.emit("attempt.started", attempt=1, resume_from_step=None)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    attempt, outcome = lost_attempt(run, run.events())
    assert attempt == 1 and outcome.cause is Cause.LOST and "Slurm requeued the job" in outcome.detail
    run.emit("attempt.ended", attempt=1, cause="lost")
    assert lost_attempt(run, run.events()) is None


def test_a_lost_attempt_whose_processes_still_run_is_refused(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    from rkit.contract.errors import RkitError
    from rkit.contract.rundir import RunDir, write_json_atomic
    from rkit.run.attemptrecord import refuse_if_alive
    from rkit.run.attemptrecord import started_at as _started

    run = RunDir(tmp_path / "run")
    run.attempt_dir(1).mkdir(parents=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"host": socket.gethostname(), "pids": {"0": sleeper.pid, "1": os.getpid()},
                  "pid_started": {"0": _started(sleeper.pid), "1": _started(os.getpid()) + 5}}  # 1: a reused pid
        write_json_atomic(run.attempt_record(1), record)
        with pytest.raises(RkitError, match=f"attempt 1 is still running without its supervisor \\(0 pid "
                                            f"{sleeper.pid} on"):
            refuse_if_alive(run, 1)
    finally:
        sleeper.kill()
        sleeper.wait()
    refuse_if_alive(run, 1)  # gone: nothing to refuse
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    started = _started(zombie.pid)
    while _started(zombie.pid) is not None:  # it exits; unreaped, it stays a zombie until wait()
        os.sched_yield()
    write_json_atomic(run.attempt_record(1), {**record, "pids": {"0": zombie.pid}, "pid_started": {"0": started}})
    refuse_if_alive(run, 1)  # a zombie is dead: its supervisor's death killed it, nobody reaped it yet
    zombie.wait()
    write_json_atomic(run.attempt_record(1), {**record, "host": "another-host"})
    refuse_if_alive(run, 1)  # another machine's processes cannot be checked from here


def test_planned_ends_spend_no_budget_however_many():
    # A 30-day run on a partition with a 24 h limit: every job ends on its time-limit signal with its save.
    tally = Tally()
    for day in range(30):
        outcome = Outcome(Cause.PREEMPTED, day * 100, day * 100 + 100, "SIGUSR1 after step 99 (time limit or "
                          "preemption)", requeue=True, step=day * 100 + 99, planned=True)
        decision, tally = decide(tally, outcome, BUDGETS, False)
        assert decision.action is Action.REQUEUE, decision.reason
        assert f"a planned end, saved at step {day * 100 + 100} (no budget spent)" in decision.reason
    assert (tally.planned_ends, tally.infra_failures, tally.training_failures) == (30, 0, 0)
    # An injected SIGTERM (no requeue) answered by its save restarts in place, also uncharged.
    decision, tally = decide(tally, Outcome(Cause.PREEMPTED, 5, 8, "SIGTERM", step=7, planned=True), BUDGETS, False)
    assert decision.action is Action.RESTART and tally.infra_failures == 0 and tally.planned_ends == 31
    # Whose save did not commit: an infrastructure failure, charged as before.
    decision, tally = decide(tally, Outcome(Cause.PREEMPTED, 8, 8, "SIGUSR1", requeue=True, step=9), BUDGETS, False)
    assert decision.action is Action.REQUEUE and tally.infra_failures == 1 and tally.planned_ends == 31


@pytest.mark.parametrize("every,gives_up_at", [(1000, None), (999, 4), (250, 4)])
def test_the_training_budget_refills_after_a_window_of_committed_steps(every, gives_up_at):
    # max_restarts 3 over a window of 1000 committed steps: one failure every 1000 steps goes on for ever, one
    # every 999 steps (or 250) is the fourth failure within the window, and gives up naming it.
    budgets = Budgets(max_restarts=3, max_infra_restarts=2, crash_loop_limit=3, window_steps=1000)
    tally = Tally()
    for n in range(1, 13):
        at = n * every
        outcome = Outcome(Cause.TASK_EXIT, at - every, at, "rank 0 exited with code 1", rank=0, code=1, step=at + 3)
        decision, tally = decide(tally, outcome, budgets, False)
        if n == gives_up_at:
            assert decision.action is Action.GIVE_UP
            assert "4 training failures, each within 1000 committed steps of the one before " \
                   "(resilience.budget_window_steps)" in decision.reason
            return
        assert decision.action is Action.RESTART, (n, decision.reason)
    assert gives_up_at is None and tally.training_failures == 1 and tally.refills == 11


def test_the_infrastructure_budget_refills_and_a_crash_loop_is_still_one():
    budgets = Budgets(max_restarts=3, max_infra_restarts=2, crash_loop_limit=3, window_steps=100)
    tally = Tally()
    for at in (None, 50, 150, 260, 370, 480):  # a node lost now and then, each after >= 100 steps: never given up
        decision, tally = decide(tally, Outcome(Cause.NODE_FAIL, at, at, "node failure", nodes=(f"n{at}",)),
                                 budgets, False)
        assert decision.action is Action.RESTART, decision.reason
    assert tally.infra_failures == 1 and tally.refills == 4  # 50 - (-1) < 100: no refill before step 150
    # Three close together exhaust it, and the give-up names the window.
    for at, action in ((490, Action.RESTART), (495, Action.GIVE_UP)):
        decision, tally = decide(tally, Outcome(Cause.NODE_FAIL, at, at, "node failure", nodes=(f"n{at}",)),
                                 budgets, False)
        assert decision.action is action
    assert "3 failures, each within 100 committed steps of the one before" in decision.reason
    # The same failure in a row is a crash loop whatever the window: never a lifetime count, never unbounded.
    tally = Tally()
    for n in range(3):
        decision, tally = decide(tally, Outcome(Cause.HANG, 500 * n, 500 * n, "hang", rank=1, step=7), budgets,
                                 False)
    assert decision.action is Action.GIVE_UP and "crash loop" in decision.reason


def test_each_budget_refills_on_its_own_stretch():
    # Training failures 10,000 steps apart with a node lost every 900 steps between them: the node failures do not
    # keep the training budget from refilling (nor the reverse).
    budgets = Budgets(max_restarts=1, max_infra_restarts=100, crash_loop_limit=3, window_steps=1000)
    tally = Tally()
    for at in range(0, 40_001, 900):
        if at % 10_000 < 900 and at >= 900:
            decision, tally = decide(tally, Outcome(Cause.TASK_EXIT, at, at, "rank 0 exited", rank=0, code=1,
                                                    step=at + 3), budgets, False)
            assert decision.action is Action.RESTART, decision.reason
        decision, tally = decide(tally, Outcome(Cause.NODE_FAIL, at, at, "node", nodes=(f"n{at}",)), budgets, False)
        assert decision.action is Action.RESTART, decision.reason
    assert tally.training_failures == 1 and tally.infra_failures > 40


def test_the_window_and_the_planned_ends_are_replayed_on_resume():
    tally = Tally(1, 2, 0, (), None, 0, planned_ends=5, last_failure_at=700, refills=2, last_infra_at=650)
    assert tally_from_events([{"event": "attempt.ended", "tally": tally.as_dict()}]) == tally


def test_data_that_ran_out_is_seen_before_the_hang_its_peers_make_and_is_not_retried():
    """The fault campaign's reference run: one process's data ended at step 382 and its peer waited for it; five
    hang restarts, each resuming at the same place in the data, until a crash loop. The line is the ending."""
    from rkit.backends.base import RankExit
    from rkit.run.ending import Observation, Stop, classify
    from rkit.run.watchdog import Hang

    said = "rank 1's data ran out (MaxText: 'Training stopped: You may have run out of training data.')"
    hang = Hang(ranks=[0], last_steps={0: 382}, seconds_silent=61.0, timeout=60.0)
    for exits in ((), (RankExit(1, 0),)):
        ending = classify(Observation(processes=2, exits=exits, step=382, hang=hang, out_of_data=said))
        assert (ending.cause, ending.stop) == (Cause.OUT_OF_DATA, Stop.NOW)
        assert ending.detail == f"out of training data after step 382: {said}"
    finished = classify(Observation(processes=2, exits=(RankExit(0, 0), RankExit(1, 0)), out_of_data=said,
                                    final_committed=True))
    assert finished.cause is Cause.COMPLETED  # the final step committed: the data lasted
    decision, tally = decide(Tally(), Outcome(Cause.OUT_OF_DATA, 380, 380, "out of training data ...", step=382),
                             BUDGETS, False)
    assert decision.action is Action.GIVE_UP and tally == Tally()
    assert "a new attempt would resume at the same place in the data and run out again" in decision.reason
    assert "trainer.overrides.num_epoch" in decision.reason
