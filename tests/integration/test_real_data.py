"""Real data on the real stack (issue 37): text records made by the tests (python -m rkit.recipe.sampledata), read
through MaxText's own Grain pipeline and tokenized by its shipped sentencepiece tokenizer (recipes/tiny-grain.yaml).
Every fault resumes from the last committed step with Grain's data position, never from scratch: each test asserts
the step and the position it resumed from, and that the loss and each step's batch fingerprint equal the
uninterrupted run's (with Grain data, rkit used to quarantine every good step and start over).

One clean run for the data set (grain_baseline), shared; the faults a run can take one after another (a kill, a
hang, a preemption) are one run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rkit.contract.rundir import RunDir
from rkit.recipe import sampledata
from rkit.runtime.telemetry.metrics import lines, merged

from ..conftest import REPO, require_maxtext, rkit

pytestmark = [pytest.mark.maxtext, pytest.mark.slow]

GRAIN = REPO / "recipes" / "tiny-grain.yaml"
SHORT = ["-o", "trainer.steps=30", "-o", "checkpoint.period=10"]


@pytest.fixture(scope="session")
def data_workspace(tmp_path_factory) -> Path:
    """A workspace with spaces and quotes in its path, and the data set in it."""
    require_maxtext()
    path = tmp_path_factory.mktemp("data") / "it's real data"
    sampledata.make(path / "data" / "tiny-text")
    return path


def files(workspace: Path, kind: str = "array_record") -> list[str]:
    return ["-o", f"trainer.overrides.grain_train_files={workspace / 'data' / 'tiny-text'}/train-*.{kind}"]


def run_grain(workspace: Path, name: str, *extra: str, expect: int = 0) -> RunDir:
    done = rkit("run", str(GRAIN), "-o", f"name={name}", *SHORT, *files(workspace), *extra, cwd=workspace,
                check=expect)
    assert "Traceback" not in done.stderr
    return RunDir(workspace / "runs" / name)


def events(run: RunDir, kind: str) -> list[dict]:
    return [e for e in run.events() if e["event"] == kind]


def positions(run: RunDir) -> list[dict | None]:
    """Each attempt's data position as attempt.started says it: Grain's saved state of each process."""
    return [e.get("data_position") for e in events(run, "attempt.started")]


def saved(run: RunDir, step: int) -> dict:
    """Grain's position of each process as the step saved it (its iter item)."""
    iterator = run.orbax_dir / str(step) / "iter"
    return {p.name.split("-")[0].removeprefix("process_"): json.loads(p.read_text())
            for p in iterator.glob("process_*.json")}


def same_outcome(baseline: RunDir, run: RunDir, tolerance: float = 0.0) -> str:
    """rkit compare of the two: every step's batch fingerprint EXACT, and every loss (within `tolerance` where the
    two runs' meshes sum in another order) (the text a user reads)."""
    done = rkit("compare", "--threshold", "10", "--loss-tolerance", str(tolerance), str(baseline.path),
                str(run.path), check=0)
    assert "same data: EXACT over 30 steps" in done.stdout, done.stdout
    if tolerance:
        assert "DIFFER" not in done.stdout, done.stdout
    else:
        assert "30 steps compared, 30 EXACT" in done.stdout, done.stdout
    return done.stdout


def same_on_retrained_steps(run: RunDir) -> dict[int, list[int]]:
    """Each rank's steps that attempt 2 trained again, after asserting that on each of them the rank consumed the
    batch and lost exactly what it did in attempt 1."""
    again = {}
    for rank in (0, 1):
        by_attempt = {a: {line["step"]: line for line in lines(run, rank) if line["attempt"] == a} for a in (1, 2)}
        again[rank] = sorted(set(by_attempt[1]) & set(by_attempt[2]))
        for step in again[rank]:
            first, second = by_attempt[1][step], by_attempt[2][step]
            assert (first["data_fingerprint"], first["loss"]) == (second["data_fingerprint"], second["loss"]), step
    return again


@pytest.fixture(scope="session")
def grain_baseline(data_workspace: Path) -> RunDir:
    return run_grain(data_workspace, "grain-baseline")


def test_a_clean_run_on_real_data_records_each_steps_batch(grain_baseline: RunDir):
    outcome = grain_baseline.load_outcome()
    assert outcome["state"] == "finished" and outcome["loss"]["count"] == 30
    data = outcome["data"]["per_step"]
    assert sorted(map(int, data)) == list(range(30)) and len(set(data.values())) == 30  # 30 different batches
    for rank in (0, 1):
        view = merged(grain_baseline, rank)
        assert all(line["data_rows"] == 1 and len(line["data_fingerprint"]) == 16 for line in view.values())
    # The tokenizer is MaxText's shipped sentencepiece model: the first loss is about ln(32000) = 10.4.
    assert 9.5 < outcome["loss"]["per_step"]["0"] < 11.5
    steps = sorted(int(p.name) for p in grain_baseline.orbax_dir.iterdir() if p.name.isdigit())
    assert steps == [0, 10, 20, 29]
    for step in steps:  # Grain's position of each process beside the train state: step + 1 batches consumed
        assert sorted(p.name for p in (grain_baseline.orbax_dir / str(step) / "iter").glob("*.json")) == [
            "process_0-of-2.json", "process_1-of-2.json"]
        assert [s["counter"] for _, s in sorted(saved(grain_baseline, step).items())] == [step + 1, step + 1]
    assert not events(grain_baseline, "checkpoint.quarantined")


def test_a_kill_a_hang_and_a_preemption_each_resume_with_the_data_position(data_workspace: Path,
                                                                            grain_baseline: RunDir):
    """Budget: three faults folded into one run (four cold starts); the hang waits out its timeout (10 s, or the
    120 s start-up allowance when it stops the resumed attempt's first step)."""
    # Rank 1 killed at step 13 (resumes from 10), a preemption at 16 (every rank saves at the next sync point, a
    # few steps later, and the next attempt resumes from that save), rank 0 stopped at 24 (found after the 10 s
    # timeout, resumes from 20). When the save lands at 23 (a quiet machine), step 24 is the resumed attempt's
    # first: the start-up allowance applies there (600 s by default, past this run's own 600 s), so it is 120 s.
    run = run_grain(data_workspace, "grain-faults", "-o", "resilience.hang_timeout=10",
                    "-o", "resilience.hang_startup_seconds=120",
                    "--inject", "kill:rank=1,step=13", "--inject", "sigterm:step=16",
                    "--inject", "hang:rank=0,step=24")
    ended = [e["cause"] for e in events(run, "attempt.ended")]
    assert ended == ["task_signal", "preempted", "hang", "completed"]
    starts = [e["resume_from_step"] for e in events(run, "attempt.started")]
    # the preemption's save lands when MaxText reaches its next sync point: a few steps after 16 (21 beside a CPU hog)
    assert starts[:2] == [None, 10] and starts[2] >= 16 and starts[3] == max(20, starts[2]), starts
    assert positions(run) == [None, *(saved(grain_baseline if s in (10, 20) else run, s) for s in starts[1:])]
    assert [s["counter"] for _, s in sorted(saved(run, starts[2]).items())] == [starts[2] + 1] * 2
    assert not events(run, "checkpoint.quarantined")
    same_outcome(grain_baseline, run)
    status = rkit("status", str(run.path), check=0).stdout
    assert "#2  resumed from step 10, data at next_index 11 on each of 2 process(es): preempted" in status, status


def test_a_cut_data_position_is_quarantined_and_the_step_before_restored(data_workspace: Path, grain_baseline: RunDir):
    # The run stops at step 25 (no restart allowed) with 0, 10 and 20 committed; step 20's position of process 1
    # is then cut, as a crash mid-write would leave it. Saves are synchronous: the exit must not race a save.
    budget = ["-o", "resilience.max_restarts=0", "-o", "checkpoint.async=false"]
    run = run_grain(data_workspace, "grain-cut", *budget, "--inject", "exit:rank=0,step=25,code=3", expect=1)
    position = run.orbax_dir / "20" / "iter" / "process_1-of-2.json"
    position.write_text(position.read_text()[:9])
    rkit("run", str(GRAIN), "-o", "name=grain-cut", *SHORT, *files(data_workspace), *budget, "--resume",
         cwd=data_workspace, check=0)
    quarantined = events(run, "checkpoint.quarantined")
    assert [(q["step"], q["reason"]) for q in quarantined] == [
        (20, "iter/process_1-of-2.json is not readable JSON (emptied or cut)")]
    assert [e["resume_from_step"] for e in events(run, "attempt.started")] == [None, 10]
    assert positions(run)[1] == saved(grain_baseline, 10)
    same_outcome(grain_baseline, run)


def test_tfrecord_data_resumes_where_it_was_and_recomputed_steps_see_the_same_batches(data_workspace: Path):
    # MaxText's other file type with Grain: TFRecord, read sequentially (files interleaved). No second clean run:
    # the steps attempt 2 trains again (11-13) must consume the batches attempt 1 consumed, and lose the same. Saves
    # in the foreground: step 10 is committed before step 11 trains, so the kill at 14 resumes from 10 however busy
    # the machine (beside a CPU hog at 397ff70 an async save of step 10 was still in flight at 14: resumed from 0).
    name = "grain-tfrecord"
    done = rkit("run", str(GRAIN), "-o", f"name={name}", *SHORT, *files(data_workspace, "tfrecord"),
                "-o", "trainer.overrides.grain_file_type=tfrecord", "-o", "trainer.overrides.grain_num_threads=1",
                "-o", "checkpoint.async=false", "--inject", "kill:rank=1,step=14", cwd=data_workspace, check=0)
    assert "Traceback" not in done.stderr
    run = RunDir(data_workspace / "runs" / name)
    assert [e["resume_from_step"] for e in events(run, "attempt.started")] == [None, 10]
    assert positions(run)[1] is not None  # the sequential reader's position was saved and restored
    again = same_on_retrained_steps(run)
    assert all(steps[:3] == [11, 12, 13] for steps in again.values()), again


def test_the_node_local_tier_restores_the_data_position_with_its_step(data_workspace: Path, grain_baseline: RunDir):
    # checkpoint.local_dir: each of the two processes is one data-parallel replica; the first saves every 10 steps
    # to the run directory, the second every 2 to "its node's" storage. MaxText's emergency manager saves no data
    # iterator: rkit writes each process's Grain position beside each step (checkpoints/data-position/).
    local = data_workspace.parent / "node-local grain"
    run = run_grain(data_workspace, "grain-local", "-o", f"checkpoint.local_dir={local}",
                    "-o", "checkpoint.local_period=2", "-o", "trainer.overrides.ici_data_parallelism=-1",
                    "-o", "trainer.overrides.ici_fsdp_parallelism=1", "--inject", "kill:rank=1,step=19")
    [restored] = events(run, "checkpoint.restored")
    assert restored["tier"] == "local" and 12 <= restored["step"] <= 18, restored
    assert restored["data_position"] == "restored"
    resumed = events(run, "attempt.started")[1]
    assert 10 < resumed["resume_from_step"] <= restored["step"]
    position = resumed["data_position"]
    assert [p["counter"] for _, p in sorted(position.items())] == [resumed["resume_from_step"] + 1] * 2
    # The steps attempt 2 trains again (resumed from 16: the kill comes after step 18, before 18's async save is
    # committed on a busy machine) lose exactly what attempt 1 lost: the local tier restored the state bit-exact.
    same_on_retrained_steps(run)
    # Against the baseline, the data is the same at every step; the loss is not bit-exact: the local tier's
    # data-parallel mesh sums in another order than the baseline's fsdp one, from step 10 of attempt 1 on, before
    # any fault (max |A-B| 0.00155 over 30 steps, the same in every run), so the shrink's tolerance applies.
    same_outcome(grain_baseline, run, tolerance=SHRINK_TOLERANCE)
    kept = sorted(int(p.name) for p in (run.checkpoints / "data-position").iterdir())
    persistent = sorted(int(p.name) for p in run.orbax_dir.iterdir() if p.name.isdigit())
    assert all(step in persistent or step >= 24 for step in kept), (kept, persistent)  # the rest pruned


# Grain's elastic iterator (one global position, any process count): what elastic shrink needs with grain data.
ELASTIC = ["-o", "trainer.overrides.grain_use_elastic_iterator=true", "-o", "trainer.overrides.packing=false",
           "-o", "resources.nodes=2", "-o", "resources.processes_per_node=1", "-o", "resources.min_nodes=1"]
# As test_tiny_maxtext's: the same global batch on half the devices with twice the accumulation sums the gradients
# in another order.
SHRINK_TOLERANCE = 0.005


def test_a_shrink_and_a_grow_back_consume_the_same_tokens_at_every_step(data_workspace: Path):
    """Budget: three attempts on real Grain data (full, shrunk, grown back), each a cold start of MaxText."""
    # The uninterrupted run on two (virtual) nodes; then the same recipe loses node 1 for good at step 12 (no spare:
    # attempt 2 trains on one process, twice the accumulation, from step 10), its rank fails at 23 with no restart
    # left, and `--resume` grows it back to two processes from step 20. Saves are synchronous: the exit fires 3 steps
    # after step 20's save began, and an async save may still be writing then (CI, beside a CPU hog, resumed from 10).
    clean = run_grain(data_workspace, "grain-elastic", *ELASTIC)
    budget = ["-o", "resilience.max_restarts=0", "-o", "checkpoint.async=false"]
    run = run_grain(data_workspace, "grain-shrink", *ELASTIC, *budget, "--inject", "lose_node:rank=1,step=12",
                    "--inject", "exit:rank=0,step=23,code=3", expect=1)
    rkit("run", str(GRAIN), "-o", "name=grain-shrink", *SHORT, *files(data_workspace), *ELASTIC, *budget,
         "--resume", cwd=data_workspace, check=0)
    started = events(run, "attempt.started")
    assert [(e["resume_from_step"], e["processes"]) for e in started] == [(None, 2), (10, 1), (20, 2)]
    assert [e["gradient_accumulation_steps"] for e in started] == [1, 2, 1]
    # Grain's elastic iterator keeps one global position, the next global sequence: (step + 1) x the global batch
    # of 2, saved by each process that trained the step (MaxText 0.2.5 writes it per process; rkit restores it on
    # another process count, runtime/trainers/maxtext.restore_elastic_positions_at_any_count)
    assert started[1]["data_position"] == saved(clean, 10) == {p: {"global_next_index": 22} for p in ("0", "1")}
    assert started[2]["data_position"] == {"0": {"global_next_index": 42}}  # saved by the shrunk attempt's process
    done = rkit("compare", "--threshold", "10", "--loss-tolerance", str(SHRINK_TOLERANCE), str(clean.path),
                str(run.path), check=0)
    assert "same data: EXACT over 30 steps" in done.stdout, done.stdout
    assert "DIFFER" not in done.stdout, done.stdout



def test_data_that_runs_out_before_the_last_step_gives_up_at_once_naming_it(data_workspace: Path):
    """Budget: one cold start on a data set of 24 short documents, which runs out after about 10 steps.
    Found by the fault campaign (tests/benchmarks/chaos.py): one process's data ended first, it stopped ("Training
    stopped: You may have run out of training data"), its peer waited for it in a collective, and rkit called it a
    hang and restarted it three times, each resuming at the same place in the data. Now the first attempt ends as
    soon as the line is written, and the run gives up with what to do (a new attempt would run out again)."""
    short = data_workspace / "data" / "short-text"
    sampledata.make(short, documents_per_file=12, files=2)
    run = run_grain(data_workspace, "grain-short", "-o",
                    f"trainer.overrides.grain_train_files={short}/train-*.array_record", expect=1)
    status = json.loads(rkit("status", "--json", str(run.path), check=0).stdout)
    assert status["state"] == "gave up" and [a["cause"] for a in status["attempts"]] == ["out_of_data"]
    assert "out of training data after step" in status["reason"] and "data ran out (MaxText: \"Training stopped: " \
        "You may have run out of training data" in status["reason"], status["reason"]
    assert "trainer.overrides.num_epoch" in status["reason"] and status["step"] < 29
    assert not events(run, "attempt.hang")  # never waited out as a hang
