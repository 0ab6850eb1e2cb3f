"""`rkit status` (goodput, stragglers, --watch) and `rkit report` on a synthetic run directory."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from rkit import plots, report
from rkit.errors import RkitError
from rkit.rundir import RunDir

from .synthetic_run import CONFIG_HASH, IMAGE_SHA, T0, write_run

pytest.importorskip("matplotlib")


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    return RunDir(write_run(tmp_path / "runs dir" / "it's a <run>"))


def test_status_has_goodput_stragglers_and_nodes(run: RunDir):
    s = report.status(run)
    g = s["goodput"]
    assert g["wall_seconds"] == pytest.approx(123.0)
    assert sum(g["seconds"].values()) == pytest.approx(g["wall_seconds"])
    assert g["goodput"] == pytest.approx(round(19 / 123, 4))
    assert [x["category"] for x in g["top_losses"]] == ["hang", "startup", "requeue"]
    assert [(x["node"], x["attempt"]) for x in s["stragglers"]] == [("n3", 2)]
    assert s["last_event"]["event"] == "run.finished"
    assert {n["node"]: (n["ranks"], n["last_step"]) for n in s["nodes"]} == {"n1": ([0], 19), "n3": ([1], 19)}
    json.dumps(s)  # --json prints it
    text = report.render_status(s)
    assert "goodput    15.4% of 123.0 s; lost: hang waits 30.0 s, start-up and compilation 30.0 s, requeue" in text
    assert "straggler  n3 in attempt 2: median step time 1.90x" in text


def test_node_state_reads_the_telemetry_sample_age(run: RunDir):
    (run.path / "telemetry").mkdir()
    (run.path / "telemetry" / "n1.jsonl").write_text(json.dumps({"t": T0 + 200, "node": "n1"}) + "\n{broken")
    rows = report.node_states(run, {"attempt": 2, "nodes": ["n1", "n3"]}, now=T0 + 203.5)
    assert rows[0] == {"node": "n1", "ranks": [0], "last_step": 19, "telemetry_age_seconds": 3.5}
    assert rows[1]["telemetry_age_seconds"] is None
    # Attempt 3 has started and nobody reported yet.
    assert [r["ranks"] for r in report.node_states(run, {"attempt": 3, "nodes": ["n4"]}, now=0)] == [[]]


def test_watch_of_a_finished_run(run: RunDir):
    from rich.console import Console

    out = io.StringIO()
    sleeps: list[float] = []
    state = report.watch(run, console=Console(file=out, width=160, force_terminal=False), sleep=sleeps.append,
                         clock=lambda: T0 + 130)
    assert state.value == "finished" and sleeps == []
    text = out.getvalue()
    assert "step 20/20" in text and "n1" in text and "n3" in text and "goodput  15.4%" in text
    assert "last event  7 s ago: run.finished" in text


def test_watch_redraws_until_the_run_ends(run: RunDir):
    from rich.console import Console

    final = run.events_file.read_text().splitlines()
    run.events_file.write_text("\n".join(final[:-1]) + "\n")  # no run.finished yet
    lines = run.events_file.read_text()
    lock = run.lock().acquire()  # as a live supervisor does: the run is running until it lets go
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            run.events_file.write_text(lines + final[-1] + "\n")
            lock.release()

    try:
        state = report.watch(run, console=Console(file=io.StringIO(), width=120), sleep=sleep)
    finally:
        lock.release()
    assert state.value == "finished" and sleeps == [2.0, 2.0]


def test_series_has_the_attempt_boundaries_and_failures(run: RunDir):
    series = plots.plot_series(run)
    assert series.boundaries == [(T0 + 12, 1), (T0 + 101, 2)]
    assert series.failures == [(T0 + 80, "hang")]  # when the hang was seen, not the end
    assert [p["step"] for p in series.points] == list(range(15)) + list(range(11, 20))
    assert {p["attempt"] for p in series.points} == {1, 2}
    warming = [p for p in series.points if p["attempt"] == 2][:4]
    assert [p["step_time"] for p in warming] == [None, None, None, 1.0]  # compilation left out
    assert [p["tokens_per_sec"] for p in warming] == [None, None, None, 128.0]
    assert [p["recomputed"] for p in series.points if p["attempt"] == 2][:4] == [True] * 4
    # Plotted times fall inside their attempts.
    for p in series.points:
        start = dict((a, t) for t, a in series.boundaries)[p["attempt"]]
        assert p["t"] >= start


def test_report_writes_plots_and_summaries(run: RunDir, tmp_path: Path):
    out = tmp_path / "out dir"
    written = plots.write_report(run, out)
    names = sorted(p.name for p in written)
    assert names == ["goodput.png", "loss.png", "step_time.png", "summary.html", "summary.md", "tokens_per_sec.png"]
    for p in written:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000, p
    assert not list(out.glob(".*tmp"))
    md = (out / "summary.md").read_text()
    for needle in (CONFIG_HASH, IMAGE_SHA, "| 1 | from scratch | n1, n2 | 20.0 s | hang |",
                   "| 2 | step 10 | n1, n3 | 10.0 s | completed |", "| goodput | 15.4% |",
                   "| hang waits | 30.0 | 24.4% |", "attempt.hang", "| 2 | n3 | 1.90x | live (event) |",
                   "| 1 | n2 | 2.00x | from metrics", "![loss](loss.png)", "it's a \\<run>"):
        assert needle in md, needle
    page = (out / "summary.html").read_text()
    assert CONFIG_HASH in page and "<td>hang</td>" in page and "<td>completed</td>" in page
    assert "it&#x27;s a &lt;run&gt;" in page and "<img src='loss.png'" in page


def test_report_defaults_to_the_run_directory_and_runs_with_no_metrics(tmp_path: Path):
    run = RunDir(write_run(tmp_path / "no metrics", with_metrics=False))
    written = plots.write_report(run)
    assert {p.parent for p in written} == {run.path / "report"}
    assert (run.path / "report" / "loss.png").stat().st_size > 5_000
    assert "| productive training | 0.0 | 0.0% |" in (run.path / "report" / "summary.md").read_text()


def test_report_on_something_that_is_not_a_run(tmp_path: Path, cli):
    with pytest.raises(RkitError, match="not an rkit run directory"):
        plots.write_report(RunDir(tmp_path))
    done = cli("report", str(tmp_path / "no such run"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "not an rkit run directory" in done.stderr
    run = RunDir(write_run(tmp_path / "a run"))
    (tmp_path / "a file").write_text("x")
    with pytest.raises(RkitError, match="not a directory"):
        plots.write_report(run, tmp_path / "a file")
    done = cli("status", "--watch", "--json", str(run.path))
    assert done.returncode == 2 and "--watch and --json" in done.stderr
