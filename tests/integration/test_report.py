"""`rkit report` and `rkit status` goodput on a real tiny MaxText run with two faults (a kill and an exit):
three attempts, two resumes from committed checkpoints, recomputed steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rkit.contract.rundir import RunDir
from rkit.readers import report

from ..conftest import TINY, require_maxtext, rkit

pytestmark = [pytest.mark.maxtext, pytest.mark.slow]

FAULTS = ["--inject", "kill:rank=1,step=25", "--inject", "exit:rank=0,step=60"]


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory) -> RunDir:
    require_maxtext()
    runs = tmp_path_factory.mktemp("report") / "runs with spaces"
    done = rkit("run", str(TINY), "-o", "name=two-faults", "-o", f"runs_dir={runs}", "--quiet", *FAULTS,
                check=0, timeout=900)
    assert "Traceback" not in done.stderr
    return RunDir(runs / "two-faults")


def test_status_json_goodput_adds_up(faulty_run: RunDir):
    """Budget: its set-up makes the one faulted run that the report's tests share."""
    s = json.loads(rkit("status", "--json", str(faulty_run.path), check=0).stdout)
    assert s["state"] == "finished"
    assert [a["cause"] for a in s["attempts"]] == ["task_signal", "task_exit", "completed"]
    g = s["goodput"]
    assert sum(g["seconds"].values()) == pytest.approx(g["wall_seconds"], abs=1e-6)
    assert g["wall_seconds"] == pytest.approx(s["elapsed_seconds"], abs=0.5)
    assert 0 < g["goodput"] < 1 and g["goodput"] == pytest.approx(g["seconds"]["productive"] / g["wall_seconds"],
                                                                   abs=1e-4)
    for category in ("productive", "startup", "recompute", "teardown"):
        assert g["seconds"][category] > 0, category
    assert len(g["top_losses"]) == 3 and g["top_losses"][0]["seconds"] >= g["top_losses"][-1]["seconds"]
    text = rkit("status", str(faulty_run.path), check=0).stdout
    assert "goodput    " in text and "% of " in text


def test_report_writes_plots_and_summary(faulty_run: RunDir):
    done = rkit("report", str(faulty_run.path), check=0)
    out = faulty_run.path / "report"
    assert sorted(Path(line).name for line in done.stdout.split("\n") if line) == [
        "goodput.png", "loss.png", "step_time.png", "summary.html", "summary.md", "tokens_per_sec.png"]
    for name in ("loss.png", "tokens_per_sec.png", "step_time.png", "goodput.png"):
        assert (out / name).stat().st_size > 10_000, name
    md = (out / "summary.md").read_text()
    stamp = faulty_run.load_manifest()
    for needle in (stamp["config_hash"], "task_signal", "task_exit", "completed", "inject.fired", "attempt.failed",
                   "| productive training |", "| recomputed steps |"):
        assert needle in md, needle
    assert stamp["config_hash"] in (out / "summary.html").read_text()
    series = report.plot_series(faulty_run)
    assert [a for _, a in series.boundaries] == [1, 2, 3]
    assert [cause for _, cause in series.failures] == ["task_signal", "task_exit"]
    starts = [t for t, _ in series.boundaries]
    assert all(starts[p["attempt"] - 1] <= p["t"] for p in series.points)
    assert {p["attempt"] for p in series.points} == {1, 2, 3}
