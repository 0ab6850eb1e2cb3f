"""The integrity check knows each kind of item Orbax and MaxText write in a step (issue 37): the train state's PyTree,
Grain's data iterator (one JSON per process, no _METADATA), JSON items; an item of a kind it does not know is a note,
never a quarantine; and when every committed step fails the same check, the check is suspect: nothing is moved and
the run stops saying so (with Grain data, the old check quarantined every good step and the run started over)."""

from __future__ import annotations

import json
from pathlib import Path

from rkit.contract.events import EV
from rkit.run.policy import RunState
from rkit.runtime.trainers.orbaxdirs import check_step, step_problem, triage

from .test_attempt_loop import Script, events, make

GRAIN = "orbax.checkpoint.experimental.v1._src.handlers.stateful_checkpointable_handler.StatefulCheckpointableHandler"
PYTREE = "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"


def maxtext_step(directory: Path, step: int, processes: int = 2, handlers: dict | None = None) -> Path:
    """A step as MaxText 0.2.5 writes it with dataset_type grain (the layout of a real run's step 20): the train
    state as OCDBT under items/, Grain's position per process under iter/."""
    path = directory / str(step)
    items = path / "items"
    for p in range(processes):
        (items / f"ocdbt.process_{p}" / "d").mkdir(parents=True)
        (items / f"ocdbt.process_{p}" / "d" / "ab12").write_bytes(b"x")
        (items / f"ocdbt.process_{p}" / "manifest.ocdbt").write_bytes(b"m")
    (items / "manifest.ocdbt").write_bytes(b"m")
    (items / "_METADATA").write_text("{}")
    (path / "iter").mkdir()
    for p in range(processes):
        (path / "iter" / f"process_{p}-of-{processes}.json").write_text(
            json.dumps({"parent": {"next_index": step + 1}, "next_row": 0, "counter": step + 1}, indent=4))
    (path / "iter" / "commit_success.txt").write_text("ok")
    (path / "commit_success.txt").write_text("ok")
    (path / "_CHECKPOINT_METADATA").write_text(json.dumps(
        {"item_handlers": handlers or {"items": PYTREE, "iter": GRAIN}}))
    return path


def test_a_step_with_grains_iterator_is_whole(tmp_path):
    assert step_problem(maxtext_step(tmp_path, 20)) is None
    assert check_step(maxtext_step(tmp_path, 30, processes=4)).notes == ()


def test_grains_iterator_is_checked_by_its_own_format(tmp_path):
    step = maxtext_step(tmp_path, 20)
    (step / "iter" / "process_1-of-2.json").write_text('{"parent": {"next_in')  # cut mid-write
    assert step_problem(step) == "iter/process_1-of-2.json is not readable JSON (emptied or cut)"
    (step / "iter" / "process_1-of-2.json").unlink()
    assert step_problem(step) == "iter/process_1-of-2.json is missing (1 of 2 processes)"
    (step / "iter" / "process_1-of-4.json").write_text("{}")
    assert step_problem(step) == "iter mixes positions saved by 2 and 4 processes"
    for file in (step / "iter").glob("process_*"):
        file.unlink()
    assert step_problem(step) == "iter holds no process_<i>-of-<n>.json (Grain's data position)"


def test_the_elastic_iterators_one_position_is_whole(tmp_path):
    step = maxtext_step(tmp_path, 20)
    for file in (step / "iter").glob("process_*"):
        file.unlink()
    (step / "iter" / "process_0.json").write_text('{"global_next_index": 42}')  # grain_use_elastic_iterator
    assert step_problem(step) is None
    (step / "iter" / "process_0.json").write_text("")
    assert step_problem(step) == "iter/process_0.json is not readable JSON (emptied or cut)"


def test_a_json_item_is_checked_as_json_and_an_unknown_kind_is_a_note_not_corruption(tmp_path):
    step = maxtext_step(tmp_path, 20, handlers={"items": PYTREE, "iter": GRAIN, "metrics": "JsonCheckpointHandler",
                                                "blob": "acme.handlers.MysteryHandler"})
    (step / "metrics").mkdir()
    (step / "metrics" / "metadata").write_text('{"loss": 1.5}')
    (step / "blob").mkdir()
    checked = check_step(step)
    assert checked.problem is None
    assert checked.notes == ("item 'blob' (MysteryHandler) is of a kind rkit does not check; left to Orbax's "
                             "restore",)
    (step / "metrics" / "metadata").write_text("")
    assert step_problem(step) == "metrics/metadata is not readable JSON (emptied or cut)"


def test_a_fifo_in_place_of_a_position_does_not_hang_the_check(tmp_path):
    import os

    step = maxtext_step(tmp_path, 20)
    (step / "iter" / "process_0-of-2.json").unlink()
    os.mkfifo(step / "iter" / "process_0-of-2.json")
    assert step_problem(step) == "iter/process_0-of-2.json is not readable JSON (emptied or cut)"


def test_every_committed_step_failing_the_same_way_makes_the_check_suspect(tmp_path):
    dirs = {s: maxtext_step(tmp_path, s) for s in (0, 10, 20)}
    for path in dirs.values():
        (path / "iter" / "process_1-of-2.json").unlink()
    found = triage(dirs)
    assert found.quarantine == {}
    assert found.suspect == ("every committed step (0, 10, 20) fails the same check: iter/process_1-of-2.json is "
                             "missing (1 of 2 processes)")
    maxtext_step(tmp_path / "fresh", 30)
    dirs[30] = tmp_path / "fresh" / "30"  # one good step, the newest: the restore takes it, the others are not read
    assert triage(dirs).suspect is None and triage(dirs).quarantine == {}
    (dirs[30] / "items" / "_METADATA").unlink()  # a good step older than the bad ones: the check can tell, they go
    dirs = {5: maxtext_step(tmp_path / "fresh", 5), **{s: dirs[s] for s in (0, 10, 20)}}
    assert triage(dirs).suspect is None and sorted(triage(dirs).quarantine) == [10, 20]


def test_a_lone_bad_step_or_an_unfinished_save_is_still_quarantined(tmp_path):
    dirs = {10: maxtext_step(tmp_path, 10), 20: maxtext_step(tmp_path, 20)}
    (dirs[20] / "items" / "_METADATA").unlink()
    assert triage(dirs).quarantine == {20: "items/_METADATA is missing"}
    (tmp_path / "30").mkdir()
    dirs[30] = tmp_path / "30"
    assert sorted(triage(dirs).quarantine) == [20, 30]


def test_the_supervisor_stops_on_a_suspect_check_and_moves_nothing(tmp_path):
    sup, backend = make(tmp_path, Script())
    for step in (4, 8):
        (maxtext_step(sup.run.orbax_dir, step) / "iter" / "process_0-of-2.json").write_text("")
    assert sup.run_to_end() is RunState.GAVE_UP
    assert not events(sup.run, EV.CHECKPOINT_QUARANTINED) and not events(sup.run, EV.ATTEMPT_STARTED)
    assert sorted(p.name for p in sup.run.orbax_dir.iterdir()) == ["4", "8"]
    ended = events(sup.run, EV.ATTEMPT_ENDED)
    assert [e["cause"] for e in ended] == ["check_suspect"]
    reason = events(sup.run, EV.RUN_GAVE_UP)[0]["reason"]
    assert reason.startswith("every committed step (4, 8) fails the same check: iter/process_0-of-2.json is not "
                             "readable JSON") and "suspects its own check" in reason


def test_the_supervisor_resumes_from_a_grain_step_and_notes_an_unknown_item(tmp_path):
    sup, _ = make(tmp_path, Script())
    for step in (4, 8):
        maxtext_step(sup.run.orbax_dir, step, handlers={"items": PYTREE, "iter": GRAIN, "x": "acme.XHandler"})
        (sup.run.orbax_dir / str(step) / "x").mkdir()
    assert sup.run_to_end() is RunState.FINISHED
    assert events(sup.run, EV.ATTEMPT_STARTED)[0]["resume_from_step"] == 8
    assert not events(sup.run, EV.CHECKPOINT_QUARANTINED)
    assert [n["step"] for n in events(sup.run, EV.CHECKPOINT_NOTE)] == [8]  # step 4 is not read: 8 is whole


def test_triage_reads_newest_first_and_stops_at_the_step_a_restore_takes(tmp_path):
    # 500 steps on disk cost what 3 do: the steps before the newest good one are never read (a restore never
    # reaches them); a damaged one there is found only when the steps after it are gone.
    for step in (10, 20, 30):
        maxtext_step(tmp_path, step)
    (tmp_path / "10" / "_CHECKPOINT_METADATA").write_text("{")
    (tmp_path / "30" / "iter" / "process_0-of-2.json").unlink()
    dirs = {s: tmp_path / str(s) for s in (10, 20, 30)}
    assert triage(dirs).quarantine == {30: "iter/process_0-of-2.json is missing (1 of 2 processes)"}
    assert set(triage({10: dirs[10]}).quarantine) == {10}


def test_quarantined_steps_go_once_a_newer_step_is_committed(tmp_path):
    from rkit.contract.rundir import RunDir
    from rkit.run import preflight

    run = RunDir(tmp_path / "run")
    for name in ("20", "20-2", "40", "notes"):
        (run.quarantine_dir / name).mkdir(parents=True)
    maxtext_step(run.orbax_dir, 10)
    assert preflight.checkpoints(run) is None and not events(run, EV.CHECKPOINT_PRUNED)  # 20 may be all there is
    maxtext_step(run.orbax_dir, 30)
    assert preflight.checkpoints(run) is None
    assert [e["names"] for e in events(run, EV.CHECKPOINT_PRUNED)] == [["20", "20-2"]]
    assert sorted(p.name for p in run.quarantine_dir.iterdir()) == ["40", "notes"]
    # A suspect check: what it moved aside earlier may be the good steps; nothing is removed then.
    for step in (50, 60):
        maxtext_step(run.orbax_dir, step)
    for step in (10, 30, 50, 60):  # every committed step fails one and the same check
        (run.orbax_dir / str(step) / "iter" / "process_0-of-2.json").write_text("")
    assert preflight.checkpoints(run) is not None and (run.quarantine_dir / "40").is_dir()
