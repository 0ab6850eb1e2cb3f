"""rkit.readers.digest: `rkit status` reads a run's events and rank 0's metrics incrementally, and says exactly what a
full read says: on synthetic runs with restarts, after appends, after a rewrite, with MaxText's raw lines."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from rkit.contract.rundir import RunDir
from rkit.readers import outcome
from rkit.readers import status as run_status
from rkit.readers.digest import RunDigest

from .synthetic_run import write_run

T0 = 1_000_000.0


def full_read(run: RunDir) -> dict:
    """status as it was before digests: every event and every metrics line read whole."""
    return run_status.status(run, events=run.events())


def comparable(s: dict) -> dict:
    return {k: v for k, v in s.items() if k not in ("nodes",)}  # node ages are measured against now


def restarts(path: Path, attempts: int, steps: int, *, start_attempt: int = 1, period: int = 7) -> None:
    """Append `attempts` attempts of `steps` lines each to a run with two ranks; every attempt after the first
    resumes 3 steps back (recomputed steps), a save every `period` steps costs 2 s."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics").mkdir(exist_ok=True)
    (path / "attempts").mkdir(exist_ok=True)
    if not (path / "resolved.json").exists():
        (path / "resolved.json").write_text(json.dumps({
            "name": path.name, "launcher": "local", "trainer": {"steps": 10 ** 6},
            "resources": {"nodes": 1, "processes_per_node": 2}, "checkpoint": {"period": period}}))
        (path / "manifest.json").write_text(json.dumps({"config_hash": "sha256:" + "ab" * 32}))
        with open(path / "events.jsonl", "a") as fh:
            fh.write(json.dumps({"t": T0, "event": "run.submitted"}) + "\n")
    with open(path / "events.jsonl", "a") as ev, open(path / "metrics" / "0.jsonl", "a") as m0, \
            open(path / "metrics" / "1.jsonl", "a") as m1:
        for a in range(start_attempt, start_attempt + attempts):
            first = max(0, (a - 1) * (steps - 3))
            t = T0 + a * 1000.0
            ev.write(json.dumps({"t": t, "event": "attempt.started", "attempt": a, "resume_from_step": first,
                                 "nodes": ["vm"]}) + "\n")
            ev.write(json.dumps({"t": t + 5, "event": "attempt.first_step", "attempt": a, "rank": 0,
                                 "step": first, "seconds_since_start": 5}) + "\n")
            for i, step in enumerate(range(first, first + steps)):
                t += 2.0 if step % period == 0 else 0.5 + 0.01 * (step % 3)
                for rank, fh in ((0, m0), (1, m1)):
                    fh.write(json.dumps({"t": t + 5, "attempt": a, "rank": rank, "node": "vm", "step": step,
                                         "loss": 5.0 - step * 1e-3, "step_time": 0.5,
                                         "tokens_per_sec_per_device": 640.0 + i}) + "\n")
            if a % 3 == 0:
                ev.write(json.dumps({"t": t + 6, "event": "attempt.hang", "attempt": a, "seconds_silent": 4.0})
                         + "\n")
            ev.write(json.dumps({"t": t + 7, "event": "attempt.ended", "attempt": a, "cause": "task_exit",
                                 "committed_step": first + steps - 3, "decision": "restart"}) + "\n")


def test_the_digest_says_what_a_full_read_says_before_and_after_appends(tmp_path: Path, status_cache: Path):
    run = RunDir(tmp_path / "run")
    restarts(run.path, attempts=5, steps=40)
    assert comparable(run_status.status(run)) == comparable(full_read(run))
    saved = RunDigest(run, run_status.StatusFold)  # what the next `rkit status` starts from
    assert saved.metrics_digest.mark.offset == run.metrics_file(0).stat().st_size
    assert saved.events_digest.mark.offset == run.events_file.stat().st_size
    restarts(run.path, attempts=3, steps=25, start_attempt=6)  # the run went on
    with open(run.events_file, "a") as fh:  # a line still being written waits for its newline
        fh.write('{"t": 1e6, "event": "attempt.sta')
    assert comparable(run_status.status(run)) == comparable(full_read(run))
    assert len(full_read(run)["attempts"]) == 8 and full_read(run)["recomputed_steps"] > 0


def test_a_live_view_keeps_one_digest_and_reads_only_what_was_appended(tmp_path: Path):
    run = RunDir(tmp_path / "run")
    restarts(run.path, attempts=2, steps=30)
    digest = run_status.new_digest(run)
    first = run_status.status(run, digest=digest)
    offset = digest.metrics_digest.mark.offset
    restarts(run.path, attempts=1, steps=10, start_attempt=3)
    again = run_status.status(run, digest=digest)
    assert digest.metrics_digest.mark.offset > offset and len(again["attempts"]) == len(first["attempts"]) + 1
    assert comparable(again) == comparable(full_read(run))


@pytest.mark.parametrize("how", ["rewritten", "truncated", "replaced"])
def test_a_rewritten_truncated_or_replaced_file_is_read_again_from_its_start(tmp_path: Path, how: str):
    run = RunDir(tmp_path / "run")
    restarts(run.path, attempts=3, steps=30)
    run_status.status(run)  # the cache now knows these files
    path = run.metrics_file(0)
    text = path.read_text()
    if how == "rewritten":  # same inode, same length, other losses
        path.write_text(text.replace('"loss": 4.9', '"loss": 3.9'))
    elif how == "truncated":
        path.write_text(text[: len(text) // 3].rsplit("\n", 1)[0] + "\n")
    else:
        (run.path / "new").write_text(text.replace('"loss": 4.9', '"loss": 2.9') + text)
        os.replace(run.path / "new", path)
    assert comparable(run_status.status(run)) == comparable(full_read(run))


def test_maxtext_raw_lines_and_a_hand_written_last_line_read_as_before(tmp_path: Path):
    run = RunDir(write_run(tmp_path / "run"))
    raw = [{"step": s, "learning/loss": 6.0 - s * 0.1, "perf/step_time_seconds": 1.0} for s in range(15)]
    run.metrics_file(0).write_text("\n".join(json.dumps(x) for x in raw))  # no newline after the last
    s = run_status.status(run)
    assert s["step"] == 14 and comparable(s) == comparable(full_read(run))


def test_the_cache_is_private_and_a_folder_others_can_write_is_not_used(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("RKIT_STATUS_CACHE", str(tmp_path / "cache"))
    run = RunDir(tmp_path / "run")
    restarts(run.path, attempts=2, steps=30)
    run_status.status(run)
    (folder,) = (tmp_path / "cache").iterdir()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert sorted(p.name for p in folder.iterdir()) == ["events.pickle", "metrics-0.npz"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in folder.iterdir())
    folder.chmod(0o777)  # anyone could have planted a pickle there: it is not read, nothing is written
    before = {p: p.stat().st_mtime_ns for p in folder.iterdir()}
    digest = RunDigest(run, run_status.StatusFold)
    assert digest.events_digest.mark.offset == 0 and digest.metrics_digest.mark.offset == 0
    restarts(run.path, attempts=1, steps=10, start_attempt=3)
    assert comparable(run_status.status(run)) == comparable(full_read(run))
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir()} == before


def test_a_cold_reader_starts_from_the_supervisors_digest_and_says_what_a_full_read_says(tmp_path: Path,
                                                                                         monkeypatch):
    """The supervisor keeps a digest in <run>/digest/ after each attempt's end (outcome.chronicle): a reader with
    an empty cache (a new machine, a pruned cache) reads only what came after it; one others could write is not
    loaded."""
    run = RunDir(tmp_path / "run")
    restarts(run.path, attempts=4, steps=30)
    config = run.config()
    outcome.chronicle(run, config, False)  # attempt 4 ended
    assert stat.S_IMODE(run.digest_dir.stat().st_mode) == 0o700
    assert sorted(p.name for p in run.digest_dir.iterdir()) == ["events.pickle", "metrics-0.npz"]
    kept = (run.events_file.stat().st_size, run.metrics_file(0).stat().st_size)
    restarts(run.path, attempts=1, steps=12, start_attempt=5)  # attempt 5 is training
    monkeypatch.setenv("RKIT_STATUS_CACHE", str(tmp_path / "cold"))
    cold = RunDigest(run, run_status.StatusFold)
    assert (cold.events_digest.mark.offset, cold.metrics_digest.mark.offset) == kept
    assert comparable(run_status.status(run)) == comparable(full_read(run))
    # the reader's own cache, once ahead of the run's, is the one read
    assert RunDigest(run, run_status.StatusFold).metrics_digest.mark.offset == run.metrics_file(0).stat().st_size
    run.digest_dir.chmod(0o770)  # a folder others could write to: its pickle is never loaded
    monkeypatch.setenv("RKIT_STATUS_CACHE", str(tmp_path / "cold-again"))
    assert RunDigest(run, run_status.StatusFold).events_digest.mark.offset == 0
    assert comparable(run_status.status(run)) == comparable(full_read(run))
    outcome.chronicle(run, config, True)  # the final word: outcome.json too; the unsafe folder is left alone
    assert run.outcome_file.is_file() and sorted(run.digest_dir.iterdir())


def test_clean_lines_make_the_columns_that_normalizing_each_line_makes():
    """The digest reads rkit's own lines a column at a time (metric_columns._clean_columns), and any chunk with a
    line it cannot take that way line by line through metrics.normalize: the columns are the same either way."""
    import numpy as np
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from rkit.readers import metric_columns
    from rkit.runtime.telemetry import metrics

    number = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.integers(-10 ** 400, 10 ** 400),
                       st.floats(), st.floats(-2e15, 2e15), st.floats(-10, 2e11), st.text(max_size=3))
    clean = st.fixed_dictionaries({"step": st.integers(0, 10 ** 6), "attempt": st.integers(1, 5),
                                   "rank": st.integers(0, 1), "t": st.floats(0, 1e10),
                                   "loss": st.one_of(st.floats(), st.none()), "step_time": st.floats(0, 10),
                                   "tokens_per_sec_per_device": st.floats(0, 1e6)})
    odd = st.fixed_dictionaries({"step": st.one_of(st.integers(-3, 10 ** 6), st.floats(0, 10), st.none())}, optional={
        key: number for key in ("attempt", "rank", "t", "loss", "step_time", "tokens_per_sec_per_device",
                                "learning/loss")})
    taken = []

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(raw=st.lists(st.one_of(clean, odd), min_size=1, max_size=6), rank=st.integers(0, 1))
    def same(raw: list[dict], rank: int) -> None:
        fast = metric_columns._clean_columns(raw, rank)
        if fast is None:
            return
        taken.append(len(raw))
        rows = [line for v in raw if (line := metrics.normalize(v, metric_columns.FIELDS)) is not None]
        columns, legacy = metric_columns._normalized_columns(rows, rank)
        assert fast[1] == legacy and set(fast[0]) == set(columns)
        for key, column in columns.items():
            assert np.array_equal(fast[0][key], column, equal_nan=column.dtype.kind == "f"), (key, raw)

    same()
    assert len(taken) > 50  # the fast path was taken, not only refused
