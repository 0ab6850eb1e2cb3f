"""Batch-script rendering is a pure function: golden files a reviewer can read, every recipe option, and
hostile values that arrive unchanged (as single argv items) or are rejected, never executed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from rkit.backends.slurm.launcher import render_batch, sbatch_options, step_port
from rkit.backends.slurm.steps import SRUN_TASK_EXIT, _ranks
from rkit.contract.errors import RecipeError
from rkit.contract.rundir import RunDir
from rkit.recipe.load import load_recipe, parse_recipe

from ..conftest import REPO

GOLDEN = REPO / "tests" / "golden"
RECIPE = REPO / "recipes" / "tiny-slurm.yaml"
HOSTILE = ["a b", "it's", 'say "hi"', "$(touch PWNED)", "`touch PWNED`", "x;touch PWNED", "$HOME", "a\\b"]


def render(run_path: Path, *overrides: str):
    recipe = load_recipe(RECIPE, list(overrides))
    return render_batch(RunDir(run_path), recipe.config, python="/opt/py/bin/python3")


def test_golden_batch_script_and_argv():
    request = render(Path("/runs/tiny-slurm"))
    golden_script = GOLDEN / "tiny-slurm.sbatch"
    golden_argv = GOLDEN / "tiny-slurm.argv"
    if os.environ.get("RKIT_UPDATE_GOLDEN"):
        golden_script.write_text(request.script)
        golden_argv.write_text("\n".join(request.argv) + "\n")
    assert request.script == golden_script.read_text()
    assert request.argv == golden_argv.read_text().splitlines()


@pytest.mark.parametrize("overrides,expected", [
    ([], ["--parsable", "--requeue", "--signal=B:USR1@60", "--job-name=tiny-slurm", "--nodes=3",
          "--ntasks-per-node=1", "--partition=debug", "--time=00:30:00", "--no-kill"]),
    (["slurm.account=proj", "slurm.qos=high", "slurm.gpus_per_node=8", "slurm.exclusive=true",
      "slurm.spare_nodes=0", "resources.processes_per_node=8", "slurm.signal_lead_seconds=300"],
     ["--parsable", "--requeue", "--signal=B:USR1@300", "--job-name=tiny-slurm", "--nodes=2",
      "--ntasks-per-node=8", "--partition=debug", "--account=proj", "--qos=high", "--time=00:30:00",
      "--gpus-per-node=8", "--exclusive"]),
    (["slurm.partition=null", "slurm.time=null"],
     ["--parsable", "--requeue", "--signal=B:USR1@60", "--job-name=tiny-slurm", "--nodes=3",
      "--ntasks-per-node=1", "--no-kill"]),
])
def test_every_option_maps_to_one_argv_item(overrides, expected):
    assert sbatch_options(load_recipe(RECIPE, overrides).config) == expected


def test_extra_sbatch_options_are_validated():
    recipe = load_recipe(RECIPE)
    recipe.resolved["slurm"]["extra_sbatch"] = ["--mail-type=END", "--constraint=mi300x&ib"]
    assert sbatch_options(recipe.config)[-2:] == ["--mail-type=END", "--constraint=mi300x&ib"]
    text = RECIPE.read_text().replace("  container_launch: oci", "  container_launch: oci\n  extra_sbatch: "
                                      "['--requeue', 'rm -rf /', \"--x=a\\nb\", '--wrap=id']")
    with pytest.raises(RecipeError) as err:
        parse_recipe("hostile.yaml", text)
    paths = {p.path for p in err.value.problems}
    assert {"slurm.extra_sbatch[0]", "slurm.extra_sbatch[1]", "slurm.extra_sbatch[2]", "slurm.extra_sbatch[3]"} <= paths


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_arrive_unchanged_as_single_argv_items(value):
    request = render(Path("/runs/x"), f"slurm.partition={value}", f"slurm.account={value}")
    assert f"--partition={value}" in request.argv and f"--account={value}" in request.argv


@pytest.mark.parametrize("escaped", ["a\\nb", "a\\rb", "a\\x1bb", "a\\tb"])
def test_control_characters_are_rejected(escaped):
    text = RECIPE.read_text().replace("partition: debug", f'partition: "{escaped}"')
    with pytest.raises(RecipeError) as err:
        parse_recipe("hostile.yaml", text)
    assert [p.path for p in err.value.problems] == ["slurm.partition"]


@pytest.mark.parametrize("name", ["dir with spaces", "it's", "$(touch PWNED)", "`touch PWNED`", "new\nline", "a;b"])
def test_hostile_run_paths_are_quoted_never_executed(tmp_path: Path, name: str):
    """Run the rendered script with /bin/echo as the Python: it must print the path verbatim, run nothing."""
    run_path = tmp_path / name / "runs" / "x"
    recipe = load_recipe(RECIPE)
    request = render_batch(RunDir(run_path), recipe.config, python="/bin/echo")
    script = tmp_path / "job.sbatch"
    script.write_text(request.script)
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert done.stdout == f"-m rkit.cli supervise {run_path.resolve()}\n"
    assert not (tmp_path / "PWNED").exists()
    assert request.argv[-1] == str(run_path.resolve() / "job.sbatch")
    assert all("\n" not in line for line in request.script.splitlines())  # a comment cannot end early


def test_srun_error_lines_and_ports():
    line = "srun: error: c2: task 1: Exited with exit code 3"
    node, tasks, what = SRUN_TASK_EXIT.search(line).groups()
    assert (node, _ranks(tasks), what) == ("c2", [1], "Exited with exit code 3")
    assert _ranks("0-2,5") == [0, 1, 2, 5]
    assert step_port("12", 1) != step_port("12", 2) and 20000 <= step_port("12", 1) < 40000


@pytest.mark.parametrize("job_id", ["-1", "--signal=KILL", "12;34", "12 34", "", None, 12, "1_2_3", "abc", "12\n"])
def test_job_ids_are_checked_before_any_slurm_command(job_id, tmp_path: Path, monkeypatch):
    from rkit.backends.slurm import launcher as slurm
    from rkit.contract.errors import RkitError
    from rkit.run import runner

    ran = []
    monkeypatch.setattr(slurm.subprocess, "run", lambda argv, **kw: ran.append(argv))
    for call in (slurm.cancel, slurm.requeue, slurm.job_state, lambda j: slurm.exclude_nodes(j, ["n1"])):
        with pytest.raises(RkitError, match="is not a Slurm job id"):
            call(job_id)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.emit("job.submitted", job_id=job_id)
    with pytest.raises(RkitError, match=r"events.jsonl \(job.submitted\).*not a Slurm job id"):
        runner.slurm_job(run)
    assert ran == []
    assert [slurm.checked_job_id(j) for j in ("7", "123_4", "99+1")] == ["7", "123_4", "99+1"]


def test_the_coordinator_port_is_checked_free_where_it_can_be():
    import socket

    from rkit.backends.slurm.launcher import free_coordinator_port, step_port

    first = step_port("77", 3)
    assert free_coordinator_port("127.0.0.1", "77", 3) == first  # free: the same port as before
    with socket.socket() as held:
        held.bind(("127.0.0.1", first))
        held.listen()
        other = free_coordinator_port("127.0.0.1", "77", 3)
        assert other != first and 20000 <= other < 40000
        with socket.socket() as probe:  # and it really is free
            probe.bind(("127.0.0.1", other))
        # An address of another host cannot be checked from here: the hashed port, as before.
        assert free_coordinator_port("192.0.2.1", "77", 3) == first


def test_every_apptainer_exec_leaves_the_home_out(tmp_path: Path, monkeypatch):
    from rkit.backends.local.launcher import Container
    from rkit.backends.slurm.launcher import SlurmStepBackend

    local = Container(apptainer="apptainer", sif="/images/x.sif", binds=("/runs/r",)).wrap(["-m", "rkit.runtime.agent"])
    assert local[:4] == ["apptainer", "exec", "--cleanenv", "--no-home"]
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)  # the step runs on this host
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    step = SlurmStepBackend(nodes_per_step=1, tasks_per_node=1, container_launch="apptainer", sif="/images/x.sif",
                            binds=("/runs/r",)).prepare(attempt=1, processes=1, trainer_args=["steps=5"], base_env={},
                                                       attempt_dir=tmp_path, cwd=tmp_path, port=12345, host_env={})
    at = step.argv.index("apptainer")
    assert step.argv[at:at + 3] == ["apptainer", "exec", "--no-home"] and "/images/x.sif" in step.argv


def test_the_shared_path_check_names_each_node_and_what_it_cannot_see():
    from rkit.backends.shared_paths import check_argv, unseen

    nodes, paths = ["n1", "n2", "n3"], ["/shared/runs/r", "/scratch/x.sif"]
    argv = check_argv(nodes, paths)
    assert argv[:2] == ["srun", "--nodes=3"] and "--label" in argv and argv[-3:] == ["--", *paths]
    stdout = "0: /shared/runs/r\n0: /scratch/x.sif\n1: /shared/runs/r\n"
    stderr = ("1: stat: cannot statx '/scratch/x.sif': No such file or directory\n"
              "srun: error: n2: task 1: Exited with exit code 1\n")  # n3's task printed nothing: it never ran
    assert unseen(nodes, paths, stdout, stderr) == {"n2": ["/scratch/x.sif"], "n3": paths}
    assert unseen(nodes, paths, "".join(f"{i}: {p}\n" for i in range(3) for p in paths), "") == {}
