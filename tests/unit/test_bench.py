"""rkit bench's pieces without training: results in pytest-benchmark's storage (read back by pytest-benchmark's
own loader and CLI), the verdict on rounds, the interleaved order, history, and deterministic mode's switches."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rkit.contract.errors import RkitError
from rkit.readers import bench, bench_history, compare, outcome
from rkit.runtime import determinism

from .test_compare import LOSSES, record


def rounds_of(median: float, rounds: int = 3, n: int = 60, seed: int = 0, shift: float = 0.0) -> list[list[float]]:
    """Per-round step times: lognormal per step, plus a per-round shift (load that changes between runs)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        level = median * (1 + rng.uniform(-shift, shift))
        out.append([level * rng.lognormvariate(0, 0.2) for _ in range(n)])
    return out


def fake_round(tmp: Path, i: int, step_rounds: list[float], resolved: dict | None = None) -> bench.Round:
    o = record(LOSSES, step_rounds, name=f"r{i}")
    resolved = resolved or {"name": "bench-tiny", "trainer": {"steps": 30}, "resources": {"nodes": 1}, "env": {}}
    manifest = {"config_hash": "sha256:c", "image": {"sha256": "sha256:" + "ab" * 32},
                "host": {"hardware": {"cpu": {"model": "AMD EPYC", "count": 2}, "gpu": {"present": False}}}}
    return bench.Round(tmp / f"r{i}", resolved, manifest, o)


def saved_result(tmp: Path, name: str, median: float, seed: int, resolved: dict | None = None) -> dict:
    rounds = [fake_round(tmp, i, r, resolved) for i, r in enumerate(rounds_of(median, seed=seed))]
    return bench.result_json(name, rounds, {"node": "test"}, {"id": "abc", "dirty": False})


def test_a_saved_result_is_read_by_pytest_benchmark_itself(tmp_path: Path):
    store = bench.storage(tmp_path / ".benchmarks")
    path = bench.save(store, "base", saved_result(tmp_path, "base", 0.05, seed=1))
    assert path.name == "0001_base.json" and path.parent.parent == tmp_path / ".benchmarks"
    path2 = bench.save(store, "cand", saved_result(tmp_path, "cand", 0.05, seed=2))
    assert path2.name == "0002_cand.json"
    # pytest-benchmark's own loader and command line read what rkit saved.
    (_, data), _ = list(store.load())
    stats = data["benchmarks"][0]["stats"]
    assert stats["rounds"] == 180 and stats["iterations"] == 1 and len(stats["data"]) == 180
    assert data["benchmarks"][0]["extra_info"]["round_sizes"] == [60, 60, 60]
    listed = subprocess.run([sys.executable, "-m", "pytest_benchmark", "--storage", str(tmp_path / ".benchmarks"),
                             "list"], capture_output=True, text=True, check=True).stdout
    assert "0001_base.json" in listed and "0002_cand.json" in listed
    shown = subprocess.run([sys.executable, "-m", "pytest_benchmark", "--storage", str(tmp_path / ".benchmarks"),
                            "compare", "0001", "0002"], capture_output=True, text=True, check=True).stdout
    assert "base (0001_base)" in shown and "cand (0002_cand)" in shown


def test_extra_info_names_what_the_result_ran_on(tmp_path: Path):
    extra = saved_result(tmp_path, "x", 0.05, seed=1)["benchmarks"][0]["extra_info"]
    for key in ("image_sha256", "config_hash", "rkit_version", "hardware_sha256", "loss_sha256", "math_sha256"):
        assert extra[key], key
    assert extra["loss_sha256_per_round"] == [extra["loss_sha256"]] * 3


def test_saved_results_round_trip_into_the_verdict(tmp_path: Path):
    store = bench.storage(tmp_path / "s")
    bench.save(store, "base", saved_result(tmp_path, "base", 0.05, seed=1))
    bench.save(store, "same", saved_result(tmp_path, "same", 0.05, seed=2))
    bench.save(store, "slow", saved_result(tmp_path, "slow", 0.065, seed=3))
    base = bench.as_outcome("base", bench.load_saved(store, "base")[1])
    assert [len(r) for r in base["step_time"]["samples"]] == [60, 60, 60]
    limits = compare.Limits(threshold=0.10)
    same = bench.verdict(base, bench.as_outcome("same", bench.load_saved(store, "0002")[1]), limits)
    assert same["agree"] and same["loss"]["counts_in_verdict"], bench.render(same)
    slow = bench.verdict(base, bench.as_outcome("slow", bench.load_saved(store, "0003_slow")[1]), limits)
    assert not slow["agree"] and slow["worse"] == ["step_time", "tokens_per_sec_per_device"], bench.render(slow)


def test_the_loss_counts_only_when_the_training_math_is_the_same(tmp_path: Path):
    a = bench.as_outcome("a", saved_result(tmp_path, "a", 0.05, seed=1)["benchmarks"][0])
    other_math = {"name": "bench-tiny", "trainer": {"steps": 30, "overrides": {"learning_rate": 1}}, "env": {}}
    b = bench.as_outcome("b", saved_result(tmp_path, "b", 0.05, seed=2, resolved=other_math)["benchmarks"][0])
    b["loss"] = {**b["loss"], "per_step": {k: v + 1 for k, v in b["loss"]["per_step"].items()}}
    result = bench.verdict(a, b, compare.Limits(threshold=0.10))
    assert not result["same_math"] and not result["loss"]["agree"] and result["agree"]
    assert "not in the verdict: the training math differs" in bench.render(result)
    same_math = bench.verdict(a, {**b, "_math": a["_math"]}, compare.Limits(threshold=0.10))
    assert not same_math["agree"] and "the loss differs" in bench.render(same_math)


def test_a_shift_between_rounds_widens_the_interval():
    """The bootstrap resamples rounds first: a load shift between runs is noise, not a regression."""
    steady = compare.ratio_interval(rounds_of(0.05, seed=1), rounds_of(0.05, seed=2))
    shifty = compare.ratio_interval(rounds_of(0.05, seed=1, shift=0.2), rounds_of(0.05, seed=2, shift=0.2))
    assert (shifty[2] - shifty[1]) > 1.5 * (steady[2] - steady[1])
    one = compare.ratio_interval(rounds_of(0.05, rounds=1, seed=1)[0], rounds_of(0.05, rounds=1, seed=2)[0])
    assert one[1] < one[0] < one[2]


def test_rounds_interleave():
    assert bench.order(3, ["baseline", "candidate"]) == [
        ("baseline", 1), ("candidate", 1), ("baseline", 2), ("candidate", 2), ("baseline", 3), ("candidate", 3)]


@pytest.mark.parametrize("which", ["", "nope", "0099", "a/b/c", "x\ny"])
def test_an_unknown_saved_result_is_exit_2(tmp_path: Path, which: str):
    store = bench.storage(tmp_path / "s")
    bench.save(store, "base", saved_result(tmp_path, "base", 0.05, seed=1))
    with pytest.raises(RkitError):
        bench.load_saved(store, which)


def test_a_file_that_is_not_an_rkit_result_is_exit_2(tmp_path: Path, cli):
    bogus = tmp_path / "bogus.json"
    bogus.write_text(json.dumps({"benchmarks": [{"group": "other", "stats": {}}]}))
    done = cli("bench", "compare", str(bogus), str(bogus), "--storage", str(tmp_path / "s"), check=2)
    assert "not a result saved by rkit bench" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("name", ["../x", "a b", "", "-x", "x*"])
def test_save_names_are_file_name_safe(name: str):
    with pytest.raises(RkitError):
        bench.safe_name(name)


def test_history_plots_one_point_per_result(tmp_path: Path, cli):
    store = bench.storage(tmp_path / "s")
    for i, median in enumerate((0.05, 0.051, 0.07)):
        bench.save(store, f"r{i}", saved_result(tmp_path, f"r{i}", median, seed=i))
    out = tmp_path / "h.png"
    done = cli("bench", "history", "--storage", str(tmp_path / "s"), "--out", str(out), check=0)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [line for line in done.stdout.splitlines() if line.startswith("000")]
    assert [r.split()[1:3] for r in rows] == [[f"r{i}", "abababababab"] for i in range(3)]  # name, image prefix
    medians = [float(r.split()[3]) for r in rows]
    assert medians[2] > medians[0] * 1.25
    empty = cli("bench", "history", "--storage", str(tmp_path / "none"), check=2)
    assert "no saved rkit bench results" in empty.stderr


def test_bad_gate_overrides_fail_before_anything_runs(tmp_path: Path, cli):
    from ..conftest import TINY

    done = cli("bench", "gate", str(TINY), "--candidate", "trainer.steps=0", cwd=tmp_path, check=2)
    assert "trainer.steps" in done.stderr and not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- deterministic mode's switches
def test_deterministic_switches_go_last_and_survive():
    env = determinism.apply({"XLA_FLAGS": "--xla_gpu_autotune_level=4 --xla_cpu_enable_fast_math=false",
                             "NCCL_ALGO": "Tree"})
    flags = determinism.xla_flag_values(env["XLA_FLAGS"])
    assert flags["--xla_gpu_autotune_level"] == "0" and flags["--xla_cpu_enable_fast_math"] == "false"
    assert env["NCCL_ALGO"] == "Ring"
    assert determinism.clobbered(env, "threefry2x32") == []


def test_a_clobbered_switch_is_named():
    env = determinism.apply({})
    env["XLA_FLAGS"] += " --xla_gpu_autotune_level=4"  # e.g. an image's own XLA_FLAGS appended after rkit's
    env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "1"  # AMD's images default it to 1
    lost = determinism.clobbered(env, "unsafe_rbg")  # MaxText's own PRNG choice
    assert {item["switch"] for item in lost} == {"XLA_FLAGS --xla_gpu_autotune_level",
                                                  "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "jax_default_prng_impl"}
    assert {"switch": "XLA_FLAGS --xla_gpu_autotune_level", "expected": "0", "found": "4"} in lost



def test_too_much_noise_is_called_inconclusive_not_same():
    a = {"step_time": {**outcome.summary([1.0]), "samples": rounds_of(0.05, seed=1, shift=0.6), "n": 180}}
    b = {"step_time": {**outcome.summary([1.0]), "samples": rounds_of(0.05, seed=2, shift=0.6), "n": 180}}
    noisy = compare.compare_metric("step_time", a, b, compare.Limits(threshold=0.05))
    assert noisy["verdict"] == "same" and noisy["inconclusive"]
    quiet = compare.compare_metric("step_time", {"step_time": {**a["step_time"], "samples": rounds_of(0.05, seed=1)}},
                                   {"step_time": {**b["step_time"], "samples": rounds_of(0.05, seed=2)}},
                                   compare.Limits(threshold=0.10))
    assert quiet["verdict"] == "same" and not quiet["inconclusive"]


def test_each_round_says_when_it_starts_and_what_was_measured_so_far(tmp_path: Path):
    lines: list[str] = []
    medians = {"baseline": 0.010, "candidate": 0.020}
    done = bench.run_rounds(lambda side, i: fake_round(tmp_path, i, [medians[side]] * 10), 2,
                            ["baseline", "candidate"], lines.append)
    assert [len(done[s]) for s in done] == [2, 2] and len(lines) == 8
    assert lines[0] == "rkit bench: round 1/4: baseline 1 training ..."
    assert lines[1].startswith("rkit bench: round 1/4: baseline 1: ") and "step time median 10.0 ms over" in lines[1]
    assert lines[1].endswith("; so far baseline 10.0 ms (1 round)")
    assert lines[3].endswith("; so far baseline 10.0 ms (1 round), candidate 20.0 ms (1 round)")
    assert lines[7].endswith("; so far baseline 10.0 ms (2 rounds), candidate 20.0 ms (2 rounds)")


def test_history_names_its_units_and_the_saved_names(tmp_path: Path, monkeypatch):
    store = bench.storage(tmp_path / "s")
    for name, median in (("base", 0.05), ("new-image", 0.07)):
        bench.save(store, name, saved_result(tmp_path, name, median, seed=1))
    points = bench_history.history_points(store, "step_time")
    table = bench_history.render_history(points, "step_time").splitlines()
    assert table[0] == "step time:" and table[1].split()[:5] == ["RESULT", "NAME", "IMAGE", "MEDIAN", "(ms)"]
    assert "95% INTERVAL (ms)" in table[1]
    assert table[2].split()[:3] == ["0001", "base", "abababababab"] and 45 < float(table[2].split()[3]) < 55
    assert table[3].split()[:2] == ["0002", "new-image"]
    rss = bench_history.render_history(bench_history.history_points(store, "host_rss"), "host_rss").splitlines()
    assert "MEDIAN (MiB)" in rss[1] and float(rss[2].split()[3]) == 1024
    from rkit.readers import report

    seen = {}
    monkeypatch.setattr(report, "save_png", lambda fig, path: seen.update(
        ylabel=fig.axes[0].get_ylabel(), ticks=[t.get_text() for t in fig.axes[0].get_xticklabels()]))
    bench_history.plot_history(points, "step_time", tmp_path / "h.png")
    assert seen["ylabel"] == "step time (ms)"
    assert seen["ticks"] == ["0001 base\nabababababab", "0002 new-image\nabababababab"]


def test_pytest_benchmark_histograms_work_from_the_bench_lock(tmp_path: Path):
    """`pytest-benchmark compare --histogram` needs pygal and pygaljs: the host's bench lock pins them."""
    lock = (Path(__file__).parents[2] / "containers" / "lock" / "bench.txt").read_text()
    for name in ("pygal", "pygaljs"):
        assert f"\n{name}==" in lock and "--hash=sha256:" in lock.split(f"\n{name}==")[1].split("\n")[1], name
    pytest.importorskip("pygal")
    store = bench.storage(tmp_path / ".benchmarks")
    bench.save(store, "base", saved_result(tmp_path, "base", 0.05, seed=1))
    bench.save(store, "cand", saved_result(tmp_path, "cand", 0.05, seed=2))
    subprocess.run([sys.executable, "-m", "pytest_benchmark", "--storage", str(tmp_path / ".benchmarks"), "compare",
                    "0001", "0002", "--histogram", str(tmp_path / "hist")], capture_output=True, text=True,
                   check=True, cwd=tmp_path)
    (svg,) = tmp_path.glob("hist*.svg")
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()
