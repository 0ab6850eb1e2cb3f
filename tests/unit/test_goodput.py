from __future__ import annotations

from pathlib import Path

import pytest

from rkit.contract.rundir import RunDir
from rkit.readers import goodput
from rkit.run.stragglers import find_stragglers, straggler_events

from .synthetic_run import EXPECTED, T0, events, metric_lines, write_run


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    return RunDir(write_run(tmp_path / "runs dir" / "it's a run"))


def test_categories_are_right_and_sum_to_the_wall_time(run: RunDir):
    g = goodput.run_goodput(run)
    assert g.wall_seconds == pytest.approx(123.0)
    assert sum(g.seconds.values()) == pytest.approx(g.wall_seconds)
    assert set(g.seconds) == set(goodput.CATEGORIES)
    for category, seconds in EXPECTED.items():
        assert g.seconds[category] == pytest.approx(seconds), category
    assert g.goodput == pytest.approx(19 / 123)
    assert [c for c, _ in g.top_losses(3)] == ["hang", "startup", "requeue"]
    d = g.as_dict(top=3)
    assert sum(d["seconds"].values()) == pytest.approx(d["wall_seconds"], abs=1e-9)
    assert [x["category"] for x in d["top_losses"]] == ["hang", "startup", "requeue"]
    assert d["top_losses"][0]["label"] == "hang waits" and not d["in_progress"]


def test_a_run_in_progress_ends_now(run: RunDir):
    evs = [e for e in events() if e["t"] <= T0 + 111]  # attempt 2 just made its first step
    lines = [x for x in metric_lines(0, {1: "n1", 2: "n1"}) if x["t"] <= T0 + 115]
    g = goodput.compute(evs, goodput.place_lines(evs, lines), checkpoint_period=5, now=T0 + 116.5)
    assert g.in_progress and g.wall_seconds == pytest.approx(116.5)
    assert sum(g.seconds.values()) == pytest.approx(116.5)
    assert g.seconds["recompute"] == pytest.approx(3.0)  # steps 12..14
    assert g.seconds["productive"] == pytest.approx(14.0 + 1.0)  # attempt 1, and step 15
    assert g.seconds["other"] == pytest.approx(5.0 - 1.0 + 1.5)  # no run.finished yet; the step in flight
    assert g.seconds["teardown"] == pytest.approx(5.0)  # attempt 2 has not ended: no teardown for it


def test_still_in_the_queue_counts_as_queue():
    evs = events()[:2]
    g = goodput.compute(evs, [], now=T0 + 42)
    assert g.seconds["queue"] == pytest.approx(42.0) and g.wall_seconds == pytest.approx(42.0)
    assert g.goodput == 0.0


def test_a_run_that_failed_before_its_first_step_is_a_failed_start_up_not_start_up_time():
    evs = [{"t": 0.0, "event": "run.submitted"}, {"t": 1.0, "event": "attempt.started", "attempt": 1},
           {"t": 7.0, "event": "attempt.failed", "attempt": 1, "cls": "task_exit"},
           {"t": 9.0, "event": "attempt.ended", "attempt": 1, "cause": "task_exit"},
           {"t": 10.0, "event": "run.gave_up", "reason": "x"}]
    g = goodput.compute(evs, [])
    assert (g.seconds["failed_startup"], g.seconds["startup"], g.seconds["teardown"], g.seconds["other"]) == \
        (6.0, 0.0, 2.0, 2.0)
    assert goodput.CATEGORIES["failed_startup"].startswith("failed start-ups")
    # Stopped by the user before its first step: start-up time, nothing failed.
    stopped = [*evs[:2], {"t": 9.0, "event": "attempt.ended", "attempt": 1, "cause": "interrupted"},
               {"t": 10.0, "event": "run.interrupted"}]
    g = goodput.compute(stopped, [])
    assert (g.seconds["failed_startup"], g.seconds["startup"]) == (0.0, 8.0)
    assert g.wall_seconds == 10.0 and g.goodput == 0.0


def test_empty_and_resumed_runs():
    assert goodput.compute([], []).wall_seconds == 0 and goodput.compute([], []).goodput is None
    # The days between a final word and `--resume` are nobody's loss; a supervisor killed without one leaves its
    # gap to "other".
    evs = [{"t": 0.0, "event": "run.submitted"}, {"t": 5.0, "event": "run.gave_up"},
           {"t": 1000.0, "event": "run.resumed"}, {"t": 1004.0, "event": "attempt.started", "attempt": 1},
           {"t": 2000.0, "event": "run.resumed"}, {"t": 2001.0, "event": "run.finished"}]
    g = goodput.compute(evs, [])
    assert g.wall_seconds == pytest.approx(5 + 1000 + 1)
    assert g.seconds["startup"] == pytest.approx(0.0)  # attempt 1 never said more than that it started
    assert g.seconds["other"] == pytest.approx(g.wall_seconds)


def test_slurm_requeue_without_an_event_is_a_requeue_wait():
    evs = [{"t": 0.0, "event": "run.submitted"}, {"t": 0.0, "event": "job.submitted", "job_id": "1"},
           {"t": 3.0, "event": "job.started", "restart_count": 0},
           {"t": 4.0, "event": "attempt.started", "attempt": 1},
           {"t": 20.0, "event": "job.started", "restart_count": 1},  # the batch host died with its node
           {"t": 21.0, "event": "run.finished"}]
    g = goodput.compute(evs, [])
    assert g.seconds["queue"] == 3.0 and g.seconds["requeue"] == pytest.approx(16.0)


def test_maxtext_raw_lines_are_placed_on_attempts_and_timed():
    evs = [{"t": 100.0, "event": "attempt.first_step", "attempt": 1},
           {"t": 200.0, "event": "attempt.first_step", "attempt": 3}]  # attempt 2 never stepped
    raw = [{"step": s, "perf/step_time_seconds": 2.0, "learning/loss": 1.0, "rank": 0} for s in (0, 1, 2, 3)]
    raw += [{"step": s, "perf/step_time_seconds": 1.0, "learning/loss": 1.0, "rank": 0} for s in (2, 3, 4)]
    from rkit.runtime.telemetry.metrics import normalize

    placed = goodput.place_lines(evs, [{**normalize(r), "rank": 0} for r in raw])
    assert [(x["attempt"], x["step"], x["t"], x["recomputed"]) for x in placed] == [
        (1, 0, 100.0, False), (1, 1, 102.0, False), (1, 2, 104.0, False), (1, 3, 106.0, False),
        (3, 2, 200.0, True), (3, 3, 201.0, True), (3, 4, 202.0, False)]
    assert all(x["t_estimated"] for x in placed)


def test_checkpoint_excess_only_on_save_steps():
    lines = [{"step": s, "step_time": 5.0 if s == 8 else 1.0, "rank": 0, "recomputed": False} for s in range(1, 12)]
    shares = goodput._step_shares(lines, period=5)
    # the first line's time is start-up; step 8 is slow but not next to a save: productive
    assert shares == {"productive": 14.0, "checkpoint": 0.0, "recompute": 0.0}
    lines[8]["step_time"] = 4.0  # step 9, before the save of step 10 (where an rkit line shows it)
    assert goodput._step_shares(lines, period=5)["checkpoint"] == 3.0
    # Real `t` on both sides: the gap is the step's time, not MaxText's step_time.
    timed = [{"step": s, "step_time": 30.0, "t": 100.0 + s * 0.5, "rank": 0} for s in range(4)]
    assert goodput._step_shares(timed, period=None) == {"productive": 1.5, "checkpoint": 0.0, "recompute": 0.0}
    assert goodput._step_shares(lines, period=None)["checkpoint"] == 0.0


def test_stragglers_found_and_not_found():
    lines = [{**x, "rank": 0} for x in metric_lines(0, {1: "n1", 2: "n1"})]
    slow = [{**x, "rank": 1} for x in metric_lines(1, {1: "n2", 2: "n3"}, slow=2.0)]
    found = find_stragglers(lines + slow, factor=1.5)
    assert [(s.node, s.attempt) for s in found] == [("n2", 1), ("n3", 2)]
    assert found[0].median == 2.0 and found[0].others_median == 1.0 and found[0].ratio == 2.0
    assert find_stragglers(lines + slow, factor=2.5) == []
    even = [{**x, "rank": 1} for x in metric_lines(1, {1: "n2", 2: "n3"}, slow=1.1)]
    assert find_stragglers(lines + even, factor=1.5) == []
    assert find_stragglers(lines, factor=1.5) == []  # one node: nobody to compare with


def test_stragglers_ignore_the_first_steps_and_need_enough_of_them():
    # Only the compilation step is slow on n2: not a straggler.
    lines = [{"node": n, "attempt": 1, "step": s, "step_time": 30.0 if (n == "n2" and s == 0) else 1.0}
             for n in ("n1", "n2", "n3") for s in range(8)]
    assert find_stragglers(lines, factor=1.5) == []
    # A window of recent lines: start_step tells where the attempt began, so they are not skipped.
    recent = [{"node": n, "attempt": 1, "step": s, "step_time": 3.0 if n == "n2" else 1.0}
              for n in ("n1", "n2", "n3") for s in range(50, 54)]
    assert [s.node for s in find_stragglers(recent, start_step=0)] == ["n2"]
    assert find_stragglers(recent) == []  # 50..52 skipped as the start of the attempt: 1 step left each
    no_node = [{"attempt": 1, "step": s, "step_time": 1.0} for s in range(10)]
    assert find_stragglers(no_node) == []


def test_straggler_events_are_read_back():
    seen = straggler_events(events())
    assert seen == [{"attempt": 2, "node": "n3", "ratio": 1.9, "median": 1.9, "others_median": 1.0,
                     "t": T0 + 115}]


def test_start_up_splits_into_launch_imports_distributed_set_up_and_compilation():
    def ev(t: float, kind: str, **fields) -> dict:
        return {"t": 1000.0 + t, "event": kind, **fields}

    cold = [ev(0, "run.submitted"), ev(0, "attempt.started", attempt=1),
            ev(2, "agent.started", attempt=1, rank=0), ev(3, "agent.started", attempt=1, rank=1),
            ev(10, "agent.ready", attempt=1, rank=0, distributed_seconds=1.0, import_seconds=6.0),
            ev(12, "agent.ready", attempt=1, rank=1, distributed_seconds=2.0, import_seconds=6.5),
            ev(20, "attempt.first_step", attempt=1, rank=0), ev(20, "attempt.ended", attempt=1, cause="completed"),
            ev(20, "run.finished")]
    g = goodput.compute(cold, [], checkpoint_period=10)
    assert {k: round(v, 6) for k, v in g.seconds.items() if v} == {"startup": 3.0, "import": 7.0, "distributed": 2.0,
                                                                  "compile": 8.0}
    # A warm rank: the standby takes the rank before the supervisor records attempt.started; nothing to import.
    warm = [ev(0, "run.submitted"), ev(-0.1 + 1, "agent.started", attempt=1, rank=0),
            ev(1, "attempt.started", attempt=1), ev(1.5, "agent.ready", attempt=1, rank=0, distributed_seconds=0.02),
            ev(9, "attempt.first_step", attempt=1, rank=0), ev(9, "attempt.ended", attempt=1, cause="completed"),
            ev(9, "run.finished")]
    g = goodput.compute(warm, [], checkpoint_period=10)
    assert g.seconds["startup"] == pytest.approx(0.0) and g.seconds["import"] == pytest.approx(0.48)
    assert g.seconds["distributed"] == pytest.approx(0.02) and g.seconds["compile"] == pytest.approx(7.5)
    assert g.seconds["other"] == pytest.approx(1.0)  # run.submitted -> attempt.started


ORBAX_RESTORED = ("I1201 17:26:47.156346 140582557404032 standard_logger.py:34] {'step': 9, 'event_type': 'restore', "
                  "'directory': '/runs/x/checkpoints/checkpoints', 'checkpointer_start_time': 1796146006.9944065, "
                  "'checkpointer_duration_secs': 0.161848783493042, 'checkpoint_manager_start_time': "
                  "%s, 'checkpoint_manager_duration_secs': %s}\n")


def test_orbax_restore_record_in_the_ranks_logs_is_the_restore_span(tmp_path):
    from rkit.run.ranklogs import LogScan

    logs = [tmp_path / "rank-0.log", tmp_path / "rank-1.log", tmp_path / "rank-2.log"]
    logs[0].write_text("I1201 config...\n" + ORBAX_RESTORED % ("1000.5", "0.25") + "completed step: 10\n")
    logs[1].write_text(ORBAX_RESTORED % ("1000.25", "0.75"))  # started first, ended last
    logs[2].write_text("{'step': 10, 'event_type': 'save', 'checkpoint_manager_start_time': 5.0}\n")  # not a restore
    assert LogScan(logs, clock=lambda: 0.0).restore_span(force=True) == (1000.25, 1001.0)
    logs[0].write_text("a fresh start: nothing restored\n")
    assert LogScan(logs[:1], clock=lambda: 0.0).restore_span(force=True) is None


def test_the_restore_is_its_own_part_of_the_start_up_inside_compilation():
    def ev(t: float, kind: str, **fields) -> dict:
        return {"t": 1000.0 + t, "event": kind, **fields}

    resumed = [ev(0, "run.submitted"), ev(0, "attempt.started", attempt=1),
               ev(1, "agent.started", attempt=1, rank=0),
               ev(9, "agent.ready", attempt=1, rank=0, distributed_seconds=1.0),
               ev(20, "attempt.first_step", attempt=1, rank=0, restore_started=1012.0, restore_seconds=1.5),
               ev(20, "attempt.ended", attempt=1, cause="completed"), ev(20, "run.finished")]
    g = goodput.compute(resumed, [], checkpoint_period=10)
    assert {k: round(v, 6) for k, v in g.seconds.items() if v} == {"startup": 1.0, "import": 7.0, "distributed": 1.0,
                                                                  "restore": 1.5, "compile": 9.5}
    # A restore record outside agent.ready -> first step (another host's clock) is clipped to that window.
    resumed[4] = ev(20, "attempt.first_step", attempt=1, rank=0, restore_started=1018.0, restore_seconds=5.0)
    g = goodput.compute(resumed, [], checkpoint_period=10)
    assert g.seconds["restore"] == pytest.approx(2.0) and g.seconds["compile"] == pytest.approx(9.0)
    assert sum(g.seconds.values()) == pytest.approx(g.wall_seconds)
