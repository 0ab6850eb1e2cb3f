"""checkpoint.period: auto (run/cadence.py): Young/Daly's period from the measured save stall, step time and
failure rate, within the recipe's bounds; what is measured from a runs directory (this run's and its
config hash's save stalls and step times, every run's failures); the recipe's checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rkit.contract.errors import RecipeError
from rkit.contract.rundir import RunDir
from rkit.recipe.load import load_recipe
from rkit.run import cadence
from rkit.run.cadence import PRIOR_MTBF_HOURS, Measured, choose, measure

from ..conftest import TINY
from .synthetic_run import write_run


def config(*overrides: str):
    return load_recipe(TINY, ["checkpoint.period=auto", *overrides]).config


def test_young_daly_from_the_measurements():
    m = Measured(save_seconds=2.0, saves=5, step_seconds=0.5, failures=3, hours=12.0)
    c = choose(config(), m)
    mtbf = (12.0 + PRIOR_MTBF_HOURS) / 4 * 3600  # the prior counts as one more failure interval
    assert c.mtbf_seconds == pytest.approx(mtbf)
    assert c.interval_seconds == pytest.approx(math.sqrt(2 * 2.0 * mtbf), abs=1e-3)
    assert c.period == round(math.sqrt(2 * 2.0 * mtbf) / 0.5)  # 1139 steps
    assert c.why.startswith("Young/Daly")
    # a longer save or a more reliable cluster saves less often; a slower step means fewer steps
    assert choose(config(), Measured(8.0, 5, 0.5, 3, 12.0)).period == pytest.approx(2 * c.period, abs=1)
    assert choose(config(), Measured(2.0, 5, 1.0, 3, 12.0)).period == pytest.approx(c.period / 2, abs=1)
    assert choose(config(), Measured(2.0, 5, 0.5, 0, 0.0)).period > c.period


def test_the_bounds_and_the_start_before_anything_was_measured():
    m = Measured(save_seconds=2.0, saves=5, step_seconds=0.5, failures=3, hours=12.0)
    assert choose(config("checkpoint.max_period=50"), m).period == 50
    bounded = choose(config("checkpoint.max_period=50"), m).why
    assert "bounded to 50 by checkpoint.max_period" in bounded
    tiny = Measured(save_seconds=0.001, saves=1, step_seconds=10.0, failures=50, hours=1.0)
    assert choose(config("checkpoint.min_period=20"), tiny).period == 20
    nothing = Measured(save_seconds=None, saves=0, step_seconds=None, failures=0, hours=0.0)
    first = choose(config(), nothing)
    assert first.period == cadence.DEFAULT_PERIOD and first.interval_seconds is None
    assert "no save or step measured yet" in first.why
    assert choose(config("checkpoint.max_period=10"), nothing).period == 10


def test_what_a_runs_directory_measured(tmp_path: Path):
    runs = tmp_path / "runs"
    run = RunDir(write_run(runs / "this"))  # 2 attempts: a hang (a failure) and a completion, 94 s in all
    log = run.rank_log(1, 0)
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"I1202 x.py:1] [async] Finished blocking save in {s} seconds\n" for s in (0.4, 0.5, 0.9))
                   + "I1202 x.py:1] [async] Finished save (blocking + background) in 3.0 seconds\n")
    other = RunDir(write_run(runs / "other-model"))  # another model: its failures count, its saves do not
    resolved = json.loads(other.resolved.read_text())
    other.resolved.write_text(json.dumps({**resolved, "trainer": {**resolved["trainer"], "overrides": {"d": 2}}}))
    other.rank_log(1, 0).parent.mkdir(parents=True)
    other.rank_log(1, 0).write_text("I1202 x.py:1] [async] Finished blocking save in 100.0 seconds\n")
    longer = RunDir(write_run(runs / "longer"))  # the same model, longer and with another period: alike in cost
    longer.resolved.write_text(json.dumps({**resolved, "trainer": {**resolved["trainer"], "steps": 5000},
                                           "checkpoint": {"period": "auto", "max_period": 7}}))
    longer.rank_log(1, 0).parent.mkdir(parents=True)
    longer.rank_log(1, 0).write_text("I1202 x.py:1] [async] Finished blocking save in 0.7 seconds\n")
    unreadable = RunDir(write_run(runs / "unreadable-recipe"))  # its failures count; its costs cannot be compared
    unreadable.resolved.write_text("[1, 2]")
    unreadable.rank_log(1, 0).parent.mkdir(parents=True)
    unreadable.rank_log(1, 0).write_text("I1202 x.py:1] [async] Finished blocking save in 100.0 seconds\n")
    (runs / "damaged").mkdir()
    (runs / "damaged" / "events.jsonl").write_bytes(b"\x00\xff{not json\n")
    (runs / "damaged" / "manifest.json").write_text("[1, 2]")
    m = measure(run, run.load_resolved())
    assert m.save_seconds == 0.6 and m.saves == 4  # the blocking part, of the runs alike in cost only
    assert m.step_seconds == 1.0  # steady state (the saves' 3 s steps are outliers)
    # node-hours from each attempt's first step (32 -> 85 and 111 -> 122, two nodes each), in 4 readable runs
    assert m.failures == 4 and m.hours == pytest.approx(4 * 2 * (53 + 11) / 3600)
    assert cadence.cost_key(longer.load_resolved()) == cadence.cost_key(run.load_resolved()) != \
        cadence.cost_key(other.load_resolved())
    event = choose(config(), m).as_event(m)
    assert {"period", "interval_seconds", "mtbf_seconds", "save_seconds", "step_seconds", "failures",
            "reason"} <= set(event)


def test_the_failure_rate_is_the_clusters_per_node_hour_scaled_to_this_runs_size(tmp_path: Path):
    from .synthetic_run import events as timeline

    evs = timeline()
    # A config error: rank 0 failed before its first step (attempt 3), and a run that could not start (attempt 4):
    # neither is the cluster's failure, neither trained.
    evs += [{"t": 2000.0, "event": "attempt.started", "attempt": 3, "nodes": ["n1", "n2"]},
            {"t": 2030.0, "event": "attempt.ended", "attempt": 3, "cause": "task_exit"},
            {"t": 2040.0, "event": "attempt.ended", "attempt": 4, "cause": "launch_error"}]
    assert cadence._failures_and_hours(evs) == (1, pytest.approx(2 * (53 + 11) / 3600))  # the hang
    one = Measured(save_seconds=2.0, saves=5, step_seconds=0.5, failures=3, hours=12.0, nodes=1)
    wide = Measured(save_seconds=2.0, saves=5, step_seconds=0.5, failures=3, hours=12.0, nodes=256)
    # the same failures per node-hour: a 256-node job fails (nearly) 256 times as often as a 1-node one
    assert choose(config(), one).mtbf_seconds / choose(config(), wide).mtbf_seconds == pytest.approx(
        (12.0 + PRIOR_MTBF_HOURS) / (12.0 / 256 + PRIOR_MTBF_HOURS), rel=1e-9)
    assert "for 256 node(s)" in choose(config(), wide).why


def test_measure_reads_the_tails_of_a_long_runs_files(tmp_path: Path, monkeypatch):
    run = RunDir(write_run(tmp_path / "runs" / "this"))
    monkeypatch.setattr(cadence, "NEWEST_LOGS", 1)
    for n, seconds in ((1, 100.0), (2, 0.5)):  # attempt 1's saves are not among the newest attempt's
        run.rank_log(n, 0).parent.mkdir(parents=True, exist_ok=True)
        run.rank_log(n, 0).write_text(f"I1202 x.py:1] [async] Finished blocking save in {seconds} seconds\n")
    assert measure(run, run.load_resolved()).save_seconds == 0.5
    monkeypatch.setattr(cadence, "EVENTS_TAIL", 600)  # attempt 1's events are beyond the tail
    assert measure(run, run.load_resolved()).failures == 0


def test_a_run_directory_with_nothing_yet(tmp_path: Path):
    m = measure(RunDir(tmp_path / "runs" / "new"), None)
    assert (m.save_seconds, m.step_seconds, m.failures, m.hours) == (None, None, 0, 0.0)


def test_the_recipe_checks():
    assert config().checkpoint.auto and config().checkpoint.fixed_period is None
    assert load_recipe(TINY).config.checkpoint.fixed_period == 10
    for bad, key in ((["checkpoint.period=often"], "checkpoint.period"),
                     (["checkpoint.min_period=5", "checkpoint.max_period=2"], "checkpoint.min_period")):
        with pytest.raises(RecipeError) as err:
            load_recipe(TINY, bad)
        assert key in {p.path for p in err.value.problems}


def test_a_time_period_becomes_steps_of_the_measured_step_time():
    every = config("checkpoint.period=10m").checkpoint
    assert every.auto and every.every_seconds == 600.0 and every.fixed_period is None
    assert [config(f"checkpoint.period={t}").checkpoint.every_seconds for t in ("90s", "1.5h")] == [90.0, 5400.0]
    m = Measured(save_seconds=2.0, saves=5, step_seconds=0.5, failures=3, hours=12.0)
    c = choose(config("checkpoint.period=10m"), m)
    assert (c.period, c.interval_seconds) == (1200, 600.0)  # 600 s of 0.5 s steps, whatever the save or MTBF
    assert c.why == "every 10m = 600 s = 1200 steps of 0.5000 s"
    assert choose(config("checkpoint.period=10m", "checkpoint.max_period=300"), m).period == 300
    nothing = Measured(save_seconds=None, saves=0, step_seconds=None, failures=0, hours=0.0)
    first = choose(config("checkpoint.period=90s"), nothing)
    assert first.period == cadence.DEFAULT_PERIOD and "no step time measured yet" in first.why
    with pytest.raises(RecipeError) as err:
        load_recipe(TINY, ["checkpoint.period=0.0m"])
    assert [(p.path, p.message) for p in err.value.problems] == [
        ("checkpoint.period", "'0.0m' is no time; give more than 0 (e.g. 10m). (from -o checkpoint.period=0.0m)")]
    for bad in ("10 m", "10d", "-5m", "m", "0.5"):
        with pytest.raises(RecipeError) as err:
            load_recipe(TINY, [f"checkpoint.period={bad}"])
        problem = next(p for p in err.value.problems if p.path == "checkpoint.period")
        assert "90s, 10m or 1.5h" in problem.message
