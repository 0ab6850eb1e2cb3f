"""`rkit run --resume` after operational changes (issue 13, item 3): budgets, timeouts, observability and Slurm's
time or queue may change (recorded as run.changed), trainer.steps may grow, what the run trains may not."""

from __future__ import annotations

import json

import pytest

from rkit.contract.errors import RkitError
from rkit.contract.rundir import RunDir
from rkit.recipe.load import load_recipe
from rkit.run import runner
from rkit.run.plan import plan

from ..conftest import TINY


def start(tmp_path, *extra: str) -> RunDir:
    recipe = load_recipe(TINY, [f"runs_dir={tmp_path}", "name=r", *extra])
    with runner.open_run(plan(recipe, resume=False, injections=[])) as (run, _lock):
        return run


def resume(tmp_path, *extra: str) -> RunDir:
    recipe = load_recipe(TINY, [f"runs_dir={tmp_path}", "name=r", *extra])
    with runner.open_run(plan(recipe, resume=True, injections=[])) as (run, _lock):
        return run


def commit(run: RunDir, step: int) -> None:
    (run.orbax_dir / str(step)).mkdir(parents=True)
    (run.orbax_dir / str(step) / "commit_success.txt").write_text("ok")


def test_operational_changes_are_accepted_and_recorded(tmp_path):
    run = start(tmp_path)
    before = run.load_manifest()["config_hash"]
    resume(tmp_path, "resilience.max_restarts=9", "slurm.time=02:00:00", "observability.prometheus.port=9500",
           "access=group")
    (changed,) = [e for e in run.events() if e["event"] == "run.changed"]
    assert changed["changes"] == {"resilience.max_restarts": [3, 9], "slurm.time": [None, "02:00:00"],
                                  "observability.prometheus.port": [9400, 9500], "access": ["private", "group"]}
    assert run.config().resilience.max_restarts == 9 and run.config().slurm.time == "02:00:00"
    assert run.load_manifest()["config_hash"] == before == changed["config_hash"]
    assert [e["event"] for e in run.events()][-2:] == ["run.changed", "run.resumed"]
    resume(tmp_path, "resilience.max_restarts=9", "slurm.time=02:00:00", "observability.prometheus.port=9500",
           "access=group")  # the same again: nothing to record
    assert len([e for e in run.events() if e["event"] == "run.changed"]) == 1


def test_a_training_change_is_refused_and_listed(tmp_path):
    run = start(tmp_path)
    resolved = run.resolved.read_bytes()
    with pytest.raises(RkitError, match=r"changed: resources.gpus_per_node, trainer.overrides.base_emb_dim\)"):
        resume(tmp_path, "trainer.overrides.base_emb_dim=128", "resources.gpus_per_node=2",
               "resilience.max_restarts=9")
    assert run.resolved.read_bytes() == resolved  # nothing half-applied
    assert not [e for e in run.events() if e["event"] in ("run.changed", "run.resumed")]


def test_steps_may_grow_but_not_end_before_the_committed_step(tmp_path):
    run = start(tmp_path, "trainer.steps=30")
    commit(run, 29)
    before = run.load_manifest()["config_hash"]
    resume(tmp_path, "trainer.steps=50")
    (changed,) = [e for e in run.events() if e["event"] == "run.changed"]
    assert changed["changes"] == {"trainer.steps": [30, 50]}
    assert run.config().trainer.steps == 50
    assert run.load_manifest()["config_hash"] != before
    assert json.loads(run.resolved.read_text())["trainer"]["steps"] == 50
    with pytest.raises(RkitError, match="trainer.steps 20 ends before the committed step 29"):
        resume(tmp_path, "trainer.steps=20")
    assert run.config().trainer.steps == 50
