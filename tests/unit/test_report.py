"""`rkit report` (plots and summaries) on a synthetic run directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rkit.contract.errors import RkitError
from rkit.contract.rundir import RunDir
from rkit.readers import report

from .synthetic_run import CONFIG_HASH, IMAGE_SHA, T0, write_run

pytest.importorskip("matplotlib")


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    return RunDir(write_run(tmp_path / "runs dir" / "it's a <run>"))


def test_series_has_the_attempt_boundaries_and_failures(run: RunDir):
    series = report.plot_series(run)
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
    written = report.write_report(run, out)
    names = sorted(p.name for p in written)
    assert names == ["goodput.png", "loss.png", "step_time.png", "summary.html", "summary.md", "tokens_per_sec.png"]
    for p in written:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000, p
    assert not list(out.glob(".*tmp"))
    md = (out / "summary.md").read_text()
    for needle in (CONFIG_HASH, IMAGE_SHA, "| 1 | from scratch | n1, n2 | - | 20.0 s | hang |",
                   "| 2 | step 10 | n1, n3 | - | 10.0 s | completed |", "| goodput | 15.4% |",
                   "| hang waits | 30.0 | 24.4% |", "attempt.hang", "| 2 | n3 | 1.90x | live (event) |",
                   "| 1 | n2 | 2.00x | from metrics", "![loss](loss.png)", "it's a \\<run>"):
        assert needle in md, needle
    page = (out / "summary.html").read_text()
    assert CONFIG_HASH in page and "<td>hang</td>" in page and "<td>completed</td>" in page
    assert "it&#x27;s a &lt;run&gt;" in page and "<img src='loss.png'" in page


def test_report_defaults_to_the_run_directory_and_runs_with_no_metrics(tmp_path: Path):
    run = RunDir(write_run(tmp_path / "no metrics", with_metrics=False))
    written = report.write_report(run)
    assert {p.parent for p in written} == {run.path / "report"}
    assert (run.path / "report" / "loss.png").stat().st_size > 5_000
    assert "| productive training | 0.0 | 0.0% |" in (run.path / "report" / "summary.md").read_text()


def test_report_on_something_that_is_not_a_run(tmp_path: Path, cli):
    with pytest.raises(RkitError, match="not an rkit run directory"):
        report.write_report(RunDir(tmp_path))
    done = cli("report", str(tmp_path / "no such run"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "not an rkit run directory" in done.stderr
    run = RunDir(write_run(tmp_path / "a run"))
    (tmp_path / "a file").write_text("x")
    with pytest.raises(RkitError, match="not a directory"):
        report.write_report(run, tmp_path / "a file")
    done = cli("status", "--watch", "--json", str(run.path))
    assert done.returncode == 2 and "--watch and --json" in done.stderr


def test_a_report_reads_each_file_once(run: RunDir, tmp_path: Path, monkeypatch):
    import builtins
    from collections import Counter

    reads: Counter[str] = Counter()
    real_open, real_read_text = builtins.open, Path.read_text

    def counting_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, Path)) and not any(c in mode for c in "wax+"):
            reads[str(Path(file))] += 1
        return real_open(file, mode, *args, **kwargs)

    def counting_read_text(self, *args, **kwargs):
        reads[str(self)] += 1
        return real_read_text(self, *args, **kwargs)

    real_os_open = os.open

    def counting_os_open(file, flags, *args, **kwargs):  # safeio.open_regular: read-only, non-blocking
        if isinstance(file, (str, Path)) and not flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            reads[str(Path(file))] += 1
        return real_os_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(Path, "read_text", counting_read_text)
    monkeypatch.setattr(os, "open", counting_os_open)
    report.write_report(run, tmp_path / "out")
    mine = {name: n for name, n in reads.items() if name.startswith(str(run.path))}
    for name in (run.events_file, run.metrics_file(0), run.metrics_file(1), run.resolved, run.manifest):
        assert mine.get(str(name)) == 1, (name, mine)
    assert all(n == 1 for n in mine.values()), mine


def test_plots_are_against_the_step_with_attempts_failures_and_recomputed_steps_marked(run: RunDir):
    """By step (MaxText's numbering), a second view against wall-clock time; the hang of attempt 1 at the last
    step it reached, attempt 2's recomputed steps 11-14 shaded; the legend outside the axes, the attempt numbers
    above them: no label on the curves."""
    series = report.plot_series(run)
    assert series.failure_steps == [(14, "hang")] and report.recomputed_spans(series) == [(11, 14)]
    fig = report.draw(series, "loss", run.name)
    by_step, by_time = fig.axes
    assert by_step.get_xlabel().startswith("step") and by_time.get_xlabel() == "wall-clock time (UTC)"
    curves = [line for line in by_step.get_lines() if line.get_label() in ("attempt 1", "attempt 2")]
    assert [list(c.get_xdata()) for c in curves] == [list(range(15)), list(range(11, 20))]
    hang = [line for line in by_step.get_lines() if line.get_label() == "failed: hang"]
    assert len(hang) == 1 and list(hang[0].get_xdata()) == [14, 14]
    labels = by_step.get_legend().get_texts()
    assert [t.get_text() for t in labels] == ["attempt 1", "attempt 2", "attempt start (#n above)", "failed: hang",
                                             "recomputed steps (trained again after a resume)"]
    shaded = [p for p in by_step.patches if p.get_label().startswith("recomputed")]
    assert len(shaded) == 1 and shaded[0].get_x() == 10.5 and shaded[0].get_width() == 4.0
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in (by_step, by_time):
        box = ax.get_window_extent(renderer)
        numbers = [t for t in ax.texts if t.get_text().startswith("#")]
        assert [t.get_text() for t in numbers] == ["#1", "#2"]
        assert all(t.get_window_extent(renderer).y0 >= box.y1 for t in numbers)  # above the plotting area
    assert by_step.get_legend().get_window_extent(renderer).x0 >= by_step.get_window_extent(renderer).x1


def test_attempt_numbers_that_would_overprint_are_thinned():
    marks = [(0.0, "#1"), (1.0, "#2"), (50.0, "#3"), (51.0, "#4"), (100.0, "#5")]
    assert report._spaced(marks, 3.0) == [(0.0, "#1"), (50.0, "#3"), (100.0, "#5")]


def test_the_summary_uses_the_step_convention(run: RunDir, tmp_path: Path):
    report.write_report(run, tmp_path / "out")
    assert "| steps | step 19, 20 of 20 steps done; last committed - |" in (tmp_path / "out" / "summary.md").read_text()
