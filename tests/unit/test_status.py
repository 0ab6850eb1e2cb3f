"""`rkit status` (goodput, stragglers, --watch) on a synthetic run directory."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from rkit.contract.events import EV
from rkit.contract.rundir import RunDir
from rkit.readers import status as run_status
from rkit.readers.watch import watch as live_view
from rkit.run.lock import RunLock
from rkit.run.policy import RunState

from .synthetic_run import T0, write_run


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    return RunDir(write_run(tmp_path / "runs dir" / "it's a <run>"))


def test_status_has_goodput_stragglers_and_nodes(run: RunDir):
    s = run_status.status(run)
    g = s["goodput"]
    assert g["wall_seconds"] == pytest.approx(123.0)
    assert sum(g["seconds"].values()) == pytest.approx(g["wall_seconds"])
    assert g["goodput"] == pytest.approx(round(19 / 123, 4))
    assert [x["category"] for x in g["top_losses"]] == ["hang", "startup", "requeue"]
    assert [(x["node"], x["attempt"]) for x in s["stragglers"]] == [("n3", 2)]
    assert s["last_event"]["event"] == "run.finished"
    assert {n["node"]: (n["ranks"], n["last_step"]) for n in s["nodes"]} == {"n1": ([0], 19), "n3": ([1], 19)}
    json.dumps(s)  # --json prints it
    text = run_status.render_status(s)
    assert ("goodput    15.4% of 123.0 s; lost: hang waits 30.0 s, start-up (processes, containers) 30.0 s, "
            "requeue") in text
    assert "straggler  n3 in attempt 2: median step time 1.90x" in text


def test_node_state_reads_the_telemetry_sample_age(run: RunDir):
    (run.path / "telemetry").mkdir()
    (run.path / "telemetry" / "n1.jsonl").write_text(json.dumps({"t": T0 + 200, "node": "n1"}) + "\n{broken")
    rows = run_status.node_states(run, {"attempt": 2, "nodes": ["n1", "n3"]}, now=T0 + 203.5)
    assert rows[0] == {"node": "n1", "ranks": [0], "last_step": 19, "telemetry_age_seconds": 3.5}
    assert rows[1]["telemetry_age_seconds"] is None
    # Attempt 3 has started and nobody reported yet.
    assert [r["ranks"] for r in run_status.node_states(run, {"attempt": 3, "nodes": ["n4"]}, now=0)] == [[]]


def test_watch_of_a_finished_run(run: RunDir):
    from rich.console import Console

    out = io.StringIO()
    sleeps: list[float] = []
    state = live_view(run, console=Console(file=out, width=160, force_terminal=False), sleep=sleeps.append,
                             clock=lambda: T0 + 130)
    assert state.value == "finished" and sleeps == []
    text = out.getvalue()
    assert "step 19, 20/20 done" in text and "n1" in text and "n3" in text and "goodput  15.4%" in text
    assert "last event  7 s ago: run.finished" in text


def test_watch_redraws_until_the_run_ends(run: RunDir):
    from rich.console import Console

    final = run.events_file.read_text().splitlines()
    run.events_file.write_text("\n".join(final[:-1]) + "\n")  # no run.finished yet
    lines = run.events_file.read_text()
    lock = RunLock.of(run).acquire()  # as a live supervisor does: the run is running until it lets go
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            run.events_file.write_text(lines + final[-1] + "\n")
            lock.release()

    try:
        state = live_view(run, console=Console(file=io.StringIO(), width=120), sleep=sleep)
    finally:
        lock.release()
    assert state.value == "finished" and len(sleeps) == 2 and all(1.0 < x <= 2.0 for x in sleeps)


def test_a_cut_final_line_reads_the_state_from_what_is_committed(run: RunDir, tmp_path: Path, monkeypatch):
    (tmp_path / "squeue").write_text("#!/bin/sh\n")  # the job has left the queue
    (tmp_path / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    text = run.events_file.read_bytes()
    cut = text[: text.rindex(b'{"')] + b'{"event": "run.fin'  # the final word cut mid-line
    run.events_file.write_bytes(cut)
    final = run.config().trainer.final_step
    s = run_status.status(run)
    assert s["state"] == "stopped"  # nothing committed: the supervisor's end is unknown
    assert s["reason"].endswith("resume with `rkit run RECIPE --resume`")  # a run stamped before resume_command
    stamp = json.loads(run.manifest.read_text())
    stamp.setdefault("run", {})["resume_command"] = "rkit run /abs/recipes/tiny-cpu.yaml -o trainer.steps=20 --resume"
    run.manifest.write_text(json.dumps(stamp))
    assert run_status.status(run)["reason"].endswith(f"resume with `{stamp['run']['resume_command']}`")
    (run.orbax_dir / str(final)).mkdir(parents=True)
    (run.orbax_dir / str(final) / "commit_success.txt").write_text("ok")
    s = run_status.status(run)
    assert s["state"] == "finished" and "the final step is committed" in s["reason"]


def test_disk_low_and_disk_full_are_shown(run: RunDir):
    run.emit("disk.low", attempt=2, node="n1", fs="checkpoints", path="/ckpt", free_bytes=1024, total_bytes=10**6,
             fraction=0.001024, threshold=0.05)
    s = run_status.status(run)
    assert s["disk_low"][0]["fs"] == "checkpoints" and s["disk_low"][0]["free_bytes"] == 1024
    text = run_status.render_status(s)
    assert "disk low   checkpoints (/ckpt) on n1 in attempt 2: 1024 bytes free, 0.10% (threshold 5%)" in text


def test_ls_lists_finished_failed_and_running_runs(tmp_path: Path, cli):
    from .synthetic_run import CONFIG_HASH, IMAGE_SHA, events

    root = tmp_path / "runs"
    write_run(root / "a-finished")
    gave_up = [e for e in events() if e["event"] != "run.finished"]
    write_run(root / "b-failed", event_list=[*gave_up, {"t": T0 + 124, "event": "run.gave_up", "reason": "x"}])
    write_run(root / "c-running", event_list=gave_up[:5])
    write_run(root / "d-broken")
    (root / "d-broken" / "manifest.json").write_text("{not json")
    (root / "not-a-run").mkdir()
    lock = RunLock.of(RunDir(root / "c-running")).acquire()
    try:
        done = cli("ls", str(root), check=0)
        rows = json.loads(cli("ls", str(root), "--json", check=0).stdout)
    finally:
        lock.release()
    assert [r["name"] for r in rows] == ["a-finished", "b-failed", "c-running", "d-broken"]
    assert [r["state"] for r in rows] == ["finished", "gave up", "running", "unreadable"]
    assert rows[0]["step"] == 19 and rows[0]["total_steps"] == 20 and rows[0]["config_hash"] == CONFIG_HASH
    assert rows[0]["image_sha256"] == IMAGE_SHA and rows[0]["launcher"] == "slurm"
    lines = done.stdout.splitlines()
    assert rows[0]["steps_done"] == 20
    assert lines[0].split() == ["NAME", "STATE", "STEP", "DONE", "LOSS", "CONFIG", "IMAGE", "LAUNCHER", "JOB", "AGE"]
    # MaxText's step number (the last checkpoint is step 19 of a 20-step run) and the steps done
    assert lines[1].split()[:4] == ["a-finished", "finished", "19", "20/20"] and "abababababab" in lines[1]
    assert "cdcdcdcdcdcd" in lines[1] and "d-broken" in lines[4] and "unreadable" in lines[4]
    assert "not-a-run" not in done.stdout
    one = json.loads(cli("ls", str(root / "a-finished"), "--json", check=0).stdout)
    assert [r["name"] for r in one] == ["a-finished"]
    missing = cli("ls", str(tmp_path / "nope"), check=2)
    assert "not a directory" in missing.stderr and "Traceback" not in missing.stderr


def test_watch_redraws_every_interval_from_the_start_of_each_read(run: RunDir, monkeypatch):
    """A read that takes 1.5 s is followed by 0.5 s of sleep: a frame every 2 s, not every 3.5 s."""
    from rich.console import Console

    now = [T0 + 130.0]
    real_status = run_status.status
    reads = []

    def slow_status(*args, **kwargs):
        now[0] += 1.5
        reads.append(now[0])
        s = real_status(*args, **kwargs)
        return {**s, "state": "running"} if len(reads) < 3 else s

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    sleeps: list[float] = []
    monkeypatch.setattr(run_status, "status", slow_status)
    live_view(run, console=Console(file=io.StringIO(), width=120), sleep=sleep, clock=lambda: now[0])
    assert sleeps == [0.5, 0.5] and reads[2] - reads[1] == reads[1] - reads[0] == 2.0


def many_stragglers(run: RunDir, n: int = 40) -> None:
    for i in range(n):
        run.emit("node.straggler", attempt=2, node=f"node{i:02d}", ratio=2.0 + i / 100, median=2.0, others_median=1.0)


def test_status_shows_the_top_stragglers_and_counts_the_rest(run: RunDir):
    from rich.console import Console

    many_stragglers(run)
    s = run_status.status(run)
    assert len(s["stragglers"]) == 41  # --json keeps them all
    text = run_status.render_status(s)
    shown = [line.split()[1] for line in text.splitlines() if line.startswith("straggler")]
    assert shown == ["node39", "node38", "node37", "node36", "node35"]  # the slowest first
    assert "... and 36 more stragglers (--json lists them all)" in text
    out = io.StringIO()
    live_view(run, console=Console(file=out, width=160), sleep=lambda _: None)
    frame = out.getvalue()
    assert frame.count("straggler  ") == 5 and "straggler  node39 (attempt 2): 2.39x" in frame
    assert "... and 36 more stragglers" in frame


def test_status_text_of_the_generated_scale_run(tmp_path: Path, cli):
    """tests/benchmarks/status_scale.py's run (inject.fired events without a spec, disk.low and straggler events
    in every attempt): plain `rkit status` printed a TypeError traceback (None in the injections' join)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        from status_scale import generate
    finally:
        sys.path.pop(0)
    run = generate(tmp_path / "big", 2000, 200)
    done = cli("status", str(run), check=0)
    assert "Traceback" not in done.stderr and done.stderr == ""
    lines = done.stdout.splitlines()
    assert "injected   ?:rank=1,step=0, ?:rank=1,step=100, ?:rank=1,step=200, ?:rank=1,step=300, " \
           "?:rank=1,step=400 and 15 more" in lines
    assert sum(line.startswith("straggler") for line in lines) == 5 and sum(
        line.startswith("disk low") for line in lines) == 5
    assert "progress   step 1999, 2000 of 2000 steps done, last committed step -, loss 4.9980" in lines
    s = json.loads(cli("status", "--json", str(run), check=0).stdout)
    assert s["step"] == 1999 and s["steps_done"] == 2000 and len(s["stragglers"]) == 20


def test_the_step_convention_of_status(run: RunDir):
    """MaxText's own step numbers (from 0), and the count done: a 20-step run ends at step 19, 20 of 20 done."""
    s = run_status.status(run)
    assert s["step"] == 19 and s["steps_done"] == 20 and s["last_committed_step"] is None
    assert "progress   step 19, 20 of 20 steps done, last committed step -" in run_status.render_status(s)
    lines = []
    run_status.follow(run, echo=lines.append, poll_seconds=0)
    assert lines == ["finished: step 19, 20 of 20 steps done, committed -, attempts 2"]


def test_ls_and_status_count_the_steps_of_a_resumed_run_alike(run: RunDir):
    """A resumed attempt retrains steps the interrupted one had reached: rank 0's last line is behind the furthest
    step; `rkit ls` and `rkit status` both show the furthest (the merged view's newest)."""
    from rkit.readers import listing
    from rkit.runtime.telemetry import metrics

    furthest = max(metrics.lines(run, 0), key=lambda line: line["step"])
    behind = dict(furthest, attempt=furthest["attempt"] + 1, step=furthest["step"] - 5, t=furthest["t"] + 1)
    text = run.metrics_file(0).read_text()
    run.metrics_file(0).write_text(text[: text.rindex("\n") + 1] + json.dumps(behind) + "\n")  # after whole lines
    s, row = run_status.status(run), listing.row(run)
    assert s["step"] == row["step"] == furthest["step"] and s["steps_done"] == row["steps_done"]


def test_watch_draws_its_first_frame_from_the_tails_before_the_history_is_read(run: RunDir, monkeypatch):
    """A month-old run's history takes seconds to read cold: the first frame comes from the files' tails (the newest
    step, the committed step, the last event), goodput and the nodes from the full read in the next frame."""
    from rich.console import Console

    from rkit.readers import watch as watch_view

    first = watch_view.glance(run)
    assert (first["step"], first["total_steps"], first["state"], first["goodput"]) == (19, 20, "finished", None)
    assert first["last_event"]["event"] == "run.finished" and len(first["attempts"]) == len(run.attempt_numbers())
    frame = io.StringIO()
    Console(file=frame, width=160).print(watch_view.render_watch(first, T0 + 130))
    assert "step 19, 20/20 done" in frame.getvalue() and "(reading the run's history" in frame.getvalue()
    order: list = []
    real_status, real_render = run_status.status, watch_view.render_watch
    monkeypatch.setattr(run_status, "status", lambda *a, **k: order.append("status") or real_status(*a, **k))
    monkeypatch.setattr(watch_view, "render_watch",
                        lambda s, now: order.append(("frame", s["goodput"] is None)) or real_render(s, now))
    live_view(run, console=Console(file=io.StringIO(), width=120), sleep=lambda s: None, clock=lambda: T0 + 130)
    assert order[:3] == [("frame", True), "status", ("frame", False)]


@pytest.mark.parametrize("squeue,said", [
    (None, "Slurm could not be asked about job 42 (squeue could not be run: No such file or directory)"),
    ("echo 'slurm_load_jobs error: Unable to contact slurm controller (connect failure)' >&2; exit 1",
     "Slurm could not be asked about job 42 (squeue failed: slurm_load_jobs error: Unable to contact slurm "
     "controller (connect failure))"),
    ("echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1", "resume with `"),
    ("exit 0", "resume with `"),
])
def test_a_slurm_run_whose_job_squeue_cannot_see_is_not_called_gone(tmp_path: Path, monkeypatch, squeue, said):
    """`rkit status` run where squeue is not on PATH (or the controller does not answer) said "stopped ... resume
    with rkit run --resume" of a run Slurm was about to requeue (the fault campaign's status reading): only a job
    squeue says it does not know (or does not list) has gone."""
    from rkit.readers.status import run_state, slurm_info

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if squeue is not None:
        (bin_dir / "squeue").write_text(f"#!/bin/sh\n{squeue}\n")
        (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.emit(EV.JOB_SUBMITTED, job_id="42")
    run.emit(EV.ATTEMPT_STARTED, attempt=1, resume_from_step=None)
    evs = run.events()
    info = slurm_info(evs)
    state, reason = run_state(run, evs, info)
    assert state is RunState.STOPPED and said in reason, reason
    assert info["asked"] is (said == "resume with `")
