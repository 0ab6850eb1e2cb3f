"""rkit compare's verdicts on outcome records: the loss step by step, performance ratios with their interval,
and the outcome record's own pieces (checksum, steady state, Orbax's save timings)."""

from __future__ import annotations

import json
import random
import struct

import pytest

from rkit.contract.errors import RkitError
from rkit.contract.rundir import RunDir
from rkit.readers import compare, outcome

from ..conftest import rkit


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def record(losses: list[float], step_times: list[float], name: str = "r", rss: int = 1 << 30) -> dict:
    return {"version": 1, "run": name, "state": "finished", "config_hash": "sha256:c", "image_sha256": None,
            "loss": {"per_step": {str(i): f32(v) for i, v in enumerate(losses)},
                     "sha256": outcome.loss_checksum([f32(v) for v in losses])},
            "step_time": outcome.summary(step_times),
            "tokens_per_sec_per_device": outcome.summary([1000 / t for t in step_times]),
            "host_rss_bytes": outcome.summary([rss] * len(step_times)), "device_memory_peak_bytes": None}


def noisy(median: float, n: int = 200, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    return [median * rng.lognormvariate(0, 0.15) for _ in range(n)]


LOSSES = [6.0 - 0.01 * i for i in range(30)]


def test_identical_outcomes_agree_bit_for_bit():
    a, b = record(LOSSES, noisy(0.1, seed=1)), record(LOSSES, noisy(0.1, seed=2))
    result = compare.compare(a, b)
    assert result["agree"] and result["loss"]["counts"] == {"EXACT": 30, "WITHIN": 0, "DIFFER": 0}
    assert result["loss"]["ranges"] == [{"from": 0, "to": 29, "status": "EXACT"}]
    assert [m["verdict"] for m in result["performance"][:3]] == ["same", "same", "same"]
    assert "verdict: the same outcome" in compare.render(result)


def test_one_ulp_names_the_first_divergent_step_with_both_values_in_hex():
    changed = list(LOSSES)
    changed[7] = struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", LOSSES[7]))[0] + 1))[0]
    a, b = record(LOSSES, noisy(0.1)), record(changed, noisy(0.1))
    result = compare.compare(a, b)
    first = result["loss"]["first_divergence"]
    assert not result["agree"] and first["step"] == 7 and first["status"] == "DIFFER"
    assert int(first["b_hex"], 16) - int(first["a_hex"], 16) == 1
    assert [r["status"] for r in result["loss"]["ranges"]] == ["EXACT", "DIFFER", "EXACT"]
    text = compare.render(result)
    assert f"first divergence at step 7: A {first['a']!r} (0x{first['a_hex']})" in text and "DIFFERENT" in text
    # Within a tolerance it agrees, and says WITHIN.
    loose = compare.compare(a, b, compare.Limits(loss_tolerance=1e-5))
    assert loose["agree"] and loose["loss"]["counts"]["WITHIN"] == 1


def test_missing_steps_do_not_agree():
    result = compare.compare(record(LOSSES, noisy(0.1)), record(LOSSES[:20], noisy(0.1)))
    assert not result["agree"] and result["loss"]["only_in_a"] == {"count": 10, "first": 20, "last": 29}


@pytest.mark.parametrize("factor,verdict", [(1.3, "slower"), (0.7, "faster"), (1.02, "same")])
def test_step_time_ratio_and_verdict(factor, verdict):
    a = record(LOSSES, noisy(0.1, seed=3))
    b = record(LOSSES, [t * factor for t in noisy(0.1, seed=4)])
    row = next(m for m in compare.compare(a, b)["performance"] if m["metric"] == "step_time")
    lo, hi = row["interval"]
    assert lo <= row["ratio"] <= hi and row["verdict"] == verdict
    tps = next(m for m in compare.compare(a, b)["performance"] if m["metric"] == "tokens_per_sec_per_device")
    assert tps["verdict"] == verdict  # fewer tokens per second is slower too
    assert compare.compare(a, b)["agree"] is (verdict != "slower")


def test_more_memory_beyond_the_threshold_is_worse():
    a = record(LOSSES, noisy(0.1, seed=5), rss=1 << 30)
    b = record(LOSSES, noisy(0.1, seed=5), rss=int(1.5 * (1 << 30)))
    result = compare.compare(a, b)
    assert result["worse"] == ["host_rss"] and not result["agree"]


def test_the_checksum_is_over_float32_bytes_in_step_order():
    assert outcome.loss_checksum([1.0, 2.0]) != outcome.loss_checksum([2.0, 1.0])
    assert outcome.loss_checksum([1.0]) == "sha256:" + __import__("hashlib").sha256(b"\x00\x00\x80?").hexdigest()


def test_steady_state_drops_each_attempts_first_steps():
    lines = [{"attempt": 1, "step_time": 10.0}] * 3 + [{"attempt": 1, "step_time": 0.1}] * 5 + \
            [{"attempt": 2, "step_time": 9.0}] * 3 + [{"attempt": 2, "step_time": 0.2}] * 2
    assert outcome.steady_state(lines, "step_time") == [0.1] * 5 + [0.2] * 2


def test_orbax_save_timings_are_read_from_the_logs(tmp_path):
    log = tmp_path / "rank-0.log"
    log.write_text("I1130 event_tracking.py:171] [process=0] [async] Finished blocking save in 0.06 seconds. "
                   "Continuing save @ /x/0.\n"
                   "I1130 event_tracking.py:184] [process=0] [async] Finished save (blocking + background) in "
                   "0.43 seconds @ /x/0\n"
                   "I1130 event_tracking.py:184] [process=0] [sync] Finished save in 1.25 seconds @ /x/10\n")
    assert outcome.save_seconds([log, tmp_path / "missing.log"]) == ([0.43, 1.25], [0.06])


def test_compare_cli_refuses_bad_input(tmp_path):
    done = rkit("compare", str(tmp_path), str(tmp_path))
    assert done.returncode == 2 and "not an rkit run directory" in done.stderr and "Traceback" not in done.stderr
    one = rkit("compare", str(tmp_path))
    assert one.returncode == 2 and "two runs or more" in one.stderr


def test_a_damaged_outcome_file_is_a_clear_error(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    (run.path / "resolved.json").write_text(json.dumps({"name": "run"}))
    run.outcome_file.write_text("{not json")
    with pytest.raises(RkitError, match="outcome.json: damaged"):
        outcome.load(run.path)


def test_time_to_first_step_is_the_attempts_first_step_event_whichever_rank_it_names(tmp_path):
    from .synthetic_run import events, write_run

    evs = [dict(e, rank=1) if e["event"] == "attempt.first_step" else e for e in events()]
    run = RunDir(write_run(tmp_path / "run", event_list=evs))
    assert outcome.compute(run)["time_to_first_step_seconds"] == 20


def test_compare_says_the_learning_rate_schedule_differs_when_the_steps_do(tmp_path):
    from rkit.recipe.load import load_recipe

    from ..conftest import TINY

    paths = []
    for steps in (30, 40):
        run = RunDir(tmp_path / f"s{steps}")
        run.path.mkdir()
        run.resolved.write_text(json.dumps(load_recipe(TINY, [f"trainer.steps={steps}"]).resolved))
        paths.append(run.path)
    changed = list(LOSSES)
    changed[2] += 0.5
    result = compare.with_training_differences(compare.compare(record(LOSSES, noisy(0.1)), record(changed, noisy(0.1))),
                                               *paths)
    [why] = result["training_differences"]
    assert why.startswith("learning-rate schedule differs: 30 vs 40 steps")
    assert f"  {why}" in compare.render(result)
    same = compare.with_training_differences(compare.compare(record(LOSSES, [0.1]), record(LOSSES, [0.1])),
                                             paths[0], paths[0])
    assert same["training_differences"] == [] and "schedule" not in compare.render(same)
    assert compare.with_training_differences({}, tmp_path / "nothing", paths[0])["training_differences"] == []


def test_compare_says_which_steps_of_an_extended_run_trained_under_its_earlier_schedule(tmp_path):
    """A run extended by --resume from 40 to 60 steps trained steps 0-39 under the 40-step schedule: compare against
    a clean 60-step run says so, and that it explains a divergence before step 40."""
    from rkit.recipe.load import load_recipe

    from ..conftest import TINY

    runs = []
    for name in ("clean", "extended"):
        run = RunDir(tmp_path / name)
        run.path.mkdir()
        run.resolved.write_text(json.dumps(load_recipe(TINY, ["trainer.steps=60"]).resolved))
        stamp = {"run": {"name": name}}
        events = [{"event": "attempt.started", "attempt": 1, "t": 100.0, "resume_from_step": None}]
        if name == "extended":
            stamp["training_changes"] = [{"t": 200.0, "changes": {"trainer.steps": [40, 60]},
                                          "why": "learning-rate schedule differs: 40 vs 60 steps"}]
            events.append({"event": "attempt.started", "attempt": 2, "t": 201.0, "resume_from_step": 39})
        run.manifest.write_text(json.dumps(stamp))
        run.events_file.write_text("".join(json.dumps(e) + "\n" for e in events))
        runs.append(run.path)
    changed = list(LOSSES)
    changed[2] += 0.5
    result = compare.with_training_differences(compare.compare(record(LOSSES, noisy(0.1)), record(changed, noisy(0.1))),
                                               *runs)
    [said] = result["training_differences"]
    assert said == ("B was changed by a --resume: steps 0-39 trained before it, the later ones after it "
                    "(learning-rate schedule differs: 40 vs 60 steps); this explains the divergence from step 2")
    assert f"  {said}" in compare.render(result)
