"""Plan, then execute (run/plan.py, run/runner.py): `--dry-run` prints the plan, the supervisor starts the plan's
own request for the first attempt, and execution refuses a run directory that changed after it was planned."""

from __future__ import annotations

import shlex
import sys

import pytest

from rkit.readers.outcome import chronicle
from rkit.recipe.load import load_recipe
from rkit.run import runner
from rkit.run.plan import plan
from rkit.run.supervisor import Supervisor
from rkit.runtime.inject import parse_injections

from ..conftest import TINY


def test_the_first_attempt_starts_the_very_request_the_dry_run_printed(tmp_path):
    recipe = load_recipe(TINY, [f"runs_dir={tmp_path}", "name=p", "env.FOO=bar"])
    launch = plan(recipe, resume=False, injections=parse_injections(["kill:rank=1,step=5"], recipe.processes))
    text = launch.render()
    assert not (tmp_path / "p").exists()  # planning writes nothing
    for rank in launch.first_request.ranks:  # every rank's whole command line, its coordinator port included
        assert shlex.join(rank.argv) in text and f"RKIT_COORDINATOR={rank.env['RKIT_COORDINATOR']}" in text
    assert "  FOO=bar" in text and "(new)" in text
    sup = Supervisor(run=launch.run, config=recipe.config, injections=launch.injections, backend=launch.backend,
                     base_env=launch.base_env, host_env=launch.host_env, image=None,
                     jax_cache_dir=launch.jax_cache_dir, planned=(1, [0], launch.first_request),
                     chronicle=chronicle)
    in_trainer = [i for i in launch.injections if i.in_trainer]
    assert sup.launch_request(1, in_trainer, launch.run.attempt_dir(1)) is launch.first_request
    later = sup.launch_request(2, in_trainer, launch.run.attempt_dir(2))  # made the same way, for attempt 2
    assert later is not launch.first_request and later.ranks[0].env["RKIT_ATTEMPT"] == "2"
    assert [r.argv for r in later.ranks] == [r.argv for r in launch.first_request.ranks]


def test_a_resume_plan_names_its_changes_and_the_next_attempt(tmp_path):
    recipe = load_recipe(TINY, [f"runs_dir={tmp_path}", "name=r"])
    with runner.open_run(plan(recipe, resume=False, injections=[])) as (run, _lock):
        run.attempt_dir(1).mkdir(parents=True)
    before = recipe.config.resilience.max_restarts
    changed = load_recipe(TINY, [f"runs_dir={tmp_path}", "name=r", f"resilience.max_restarts={before + 2}"])
    launch = plan(changed, resume=True, injections=[])
    assert launch.continuing and launch.first_attempt == 2
    assert launch.changes == {"resilience.max_restarts": [before, before + 2]}
    assert f"# --resume changes resilience.max_restarts: {before!r} -> {before + 2!r}" in launch.render()
    assert "attempt 2 next" in launch.render()


def test_execute_refuses_a_run_directory_that_changed_after_it_was_planned(tmp_path):
    recipe = load_recipe(TINY, [f"runs_dir={tmp_path}", "name=c"])
    launch = plan(recipe, resume=False, injections=[])
    (tmp_path / "c").mkdir()  # another rkit made it meanwhile
    with pytest.raises(runner.ChangedSincePlanned, match="changed since planned: the run directory appeared"):
        with runner.open_run(launch):
            pass
    assert list((tmp_path / "c").iterdir()) == []  # nothing written
    (tmp_path / "c").rmdir()
    with runner.open_run(plan(recipe, resume=False, injections=[])) as (run, _lock):
        pass
    resume = plan(recipe, resume=True, injections=[])
    run.attempt_dir(1).mkdir(parents=True)  # an attempt started meanwhile (another supervisor)
    before = run.events_file.read_bytes(), run.manifest.read_bytes()
    with pytest.raises(runner.ChangedSincePlanned, match="planned attempt 1 .* found attempt 2"):
        with runner.open_run(resume):
            pass
    assert (run.events_file.read_bytes(), run.manifest.read_bytes()) == before
    gone = plan(recipe, resume=True, injections=[])
    import shutil

    shutil.rmtree(run.path)  # planned as a resume, then the run went away
    with pytest.raises(runner.ChangedSincePlanned, match="went away"):
        with runner.open_run(gone):
            pass
    assert not run.path.exists()


def test_an_existing_run_without_resume_is_refused_when_planning(tmp_path):
    recipe = load_recipe(TINY, [f"runs_dir={tmp_path}", "name=e"])
    with runner.open_run(plan(recipe, resume=False, injections=[])):
        pass
    with pytest.raises(Exception, match="already exists. Continue it with"):
        plan(recipe, resume=False, injections=[])


def test_supervise_plans_from_the_run_directory_what_its_submission_recorded(tmp_path):
    from rkit.contract.events import EV
    from rkit.run.plan import plan_supervised

    recipe = load_recipe(TINY, [f"runs_dir={tmp_path}", "name=s", "launcher=slurm", "env.FOO=bar"])
    injections = parse_injections(["kill:rank=1,step=5"], recipe.processes)
    submitted = plan(recipe, resume=False, injections=injections)
    text = submitted.render()
    assert "#!/bin/bash" in text and shlex.join(submitted.first_request.argv) in text  # the attempt's srun line
    with runner.open_run(submitted) as (run, _lock):
        run.emit(EV.JOB_SUBMITTED, job_id="7", injections=[i.as_dict() for i in injections])
        run.emit(EV.NODES_EXCLUDED, excluded=["c2"])
        run.attempt_dir(1).mkdir(parents=True)
    inside = plan_supervised(run, {"SLURM_JOB_ID": "7", "PATH": "/usr/bin"})
    assert inside.recipe is None and inside.config == recipe.config
    assert [i.spec for i in inside.injections] == ["kill:rank=1,step=5"] and inside.excluded == ["c2"]
    assert inside.first_attempt == 2 and inside.base_env["FOO"] == "bar" and inside.image is None
    # The line the dry run showed is the line the supervisor's backend makes, once the nodes have names.
    from rkit.backends.slurm.launcher import SlurmStepBackend
    from rkit.run.attempt import attempt_request

    res = recipe.config.resources
    backend = SlurmStepBackend(nodes_per_step=res.nodes, tasks_per_node=res.processes_per_node,
                               python=recipe.config.slurm.python or sys.executable)
    backend.allocation = lambda: ["c1", "c2", "c3"]
    shown = [a.replace("<node 1>", "c1") for a in submitted.first_request.argv]
    real = attempt_request(backend, recipe.config, run, None, submitted.base_env, {}, submitted.jax_cache_dir, 1, [
        i for i in injections if i.in_trainer], run.path.resolve() / "attempts" / "1")
    assert real.argv == shown and real.env["RKIT_NPROCS"] == submitted.first_request.env["RKIT_NPROCS"] == "2"
