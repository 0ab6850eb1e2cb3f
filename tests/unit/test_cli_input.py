"""Bad input through the real CLI: exit 2, file + key + line in the message, nothing written, no traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rkit.contract.errors import RkitError
from rkit.contract.rundir import RunDir
from rkit.recipe.load import parse_recipe
from rkit.run.lock import RunLock

from ..conftest import TINY

BAD = {
    "wrong-type.yaml": ("name: bad\ntrainer:\n  kind: maxtext\n  steps: lots\n", "trainer.steps", 4),
    "unknown-key.yaml": ("name: bad\ntrainer: {kind: maxtext, steps: 3}\ncheckpont: {}\n", "checkpont", 3),
    "missing.yaml": ("name: bad\n", "trainer", None),
    "malformed.yaml": ("name: bad\ntrainer: [1, 2\n", "malformed YAML", 3),
    "empty.yaml": ("", "empty", None),
}


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "dir with 'quotes' and spaces"
    d.mkdir()
    return d


@pytest.mark.parametrize("name", sorted(BAD))
@pytest.mark.parametrize("command", ["validate", "run"])
def test_bad_recipes_exit_2_with_key_and_line(cli, workdir: Path, name: str, command: str):
    text, key, line = BAD[name]
    recipe = workdir / name
    recipe.write_text(text)
    done = cli(command, str(recipe), cwd=workdir)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert str(recipe) in done.stderr and key in done.stderr
    if line:
        assert f"{recipe}:{line}:" in done.stderr
    assert not (workdir / "runs").exists()


def test_binary_and_huge_files_exit_2(cli, workdir: Path):
    (workdir / "bin.yaml").write_bytes(os.urandom(4096) + b"\x00")
    (workdir / "huge.yaml").write_bytes(b"name: x\n" + b"#" * (10 * 1024 * 1024))
    for name, words in [("bin.yaml", "binary"), ("huge.yaml", "10.5 MB")]:
        done = cli("run", name, cwd=workdir)
        assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr
    assert not (workdir / "runs").exists()


def test_validate_json_lists_every_problem(cli, workdir: Path):
    (workdir / "r.yaml").write_text("name: x\ntrainer: {kind: jaxformer, steps: 0}\nextra: 1\n")
    done = cli("validate", "--json", "r.yaml", cwd=workdir)
    assert done.returncode == 2
    report = json.loads(done.stdout)
    assert {p["path"] for p in report["problems"]} == {"trainer.kind", "trainer.steps", "extra"}
    assert all(p["line"] for p in report["problems"])


def test_bad_override_and_injection_exit_2(cli, workdir: Path):
    done = cli("run", str(TINY), "-o", "resources.processes_per_node=two", cwd=workdir)
    assert done.returncode == 2 and "resources.processes_per_node" in done.stderr
    done = cli("run", str(TINY), "--inject", "kill:rank=5,step=3", cwd=workdir)
    assert done.returncode == 2 and "rank 5 does not exist" in done.stderr
    assert not (workdir / "runs").exists()


def test_existing_run_needs_resume_and_a_held_lock_refuses(cli, workdir: Path):
    run = RunDir(workdir / "runs" / "tiny-cpu")
    run.path.mkdir(parents=True)
    run.resolved.write_text("{}")
    done = cli("run", str(TINY), cwd=workdir)
    assert done.returncode == 2 and "--resume" in done.stderr and "already exists" in done.stderr
    with RunLock.of(run):
        done = cli("run", str(TINY), "--resume", cwd=workdir)
    assert done.returncode == 2 and "in use by pid" in done.stderr
    assert run.resolved.read_text() == "{}"  # nothing was touched


def test_status_and_diff_of_non_runs_exit_2(cli, workdir: Path):
    done = cli("status", str(workdir))
    assert done.returncode == 2 and "not an rkit run directory" in done.stderr
    done = cli("diff", str(workdir), str(workdir / "nope.json"))
    assert done.returncode == 2 and "Traceback" not in done.stderr


@pytest.mark.parametrize("damage", [b'{"name": "cut', b"\xff\xfe", b"[1, 2]", b"[" * 100_000])
@pytest.mark.parametrize("which", ["resolved.json", "manifest.json"])
def test_a_damaged_stamp_exits_2_with_one_line(cli, workdir: Path, damage: bytes, which: str):
    run = RunDir(workdir / "runs" / "damaged")
    run.path.mkdir(parents=True)
    run.resolved.write_text(json.dumps({"name": "damaged", "trainer": {"steps": 3}}))
    run.emit("run.submitted", name="damaged")
    (run.path / which).write_bytes(damage)
    for command in (["status"], ["status", "--json"], ["report"], ["diff", str(run.path)]):
        done = cli(*command, str(run.path), cwd=workdir)
        assert done.returncode == 2, (command, done.stderr)
        assert "Traceback" not in done.stderr and f"{which}: damaged" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


yaml_like = st.text(alphabet=st.sampled_from(list("abcnmetrkisp:-[]{}#&*!|>'\"\n\t 0123456789.,?%@`")), max_size=200)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(yaml_like, st.text(max_size=200)))
def test_loader_fuzz_never_crashes(text):
    """Whatever the text, the loader returns a recipe or raises RkitError - nothing else."""
    try:
        recipe = parse_recipe("fuzz.yaml", text)
    except RkitError as exc:
        assert str(exc).startswith("fuzz.yaml")
    else:
        assert recipe.config_hash.startswith("sha256:")


@settings(max_examples=200, deadline=None)
@given(key=st.text(max_size=30), value=st.text(max_size=30))
def test_override_fuzz_never_crashes(key, value):
    try:
        parse_recipe(str(TINY), TINY.read_text(), [f"{key}={value}"])
    except RkitError:
        pass


def test_dry_run_of_an_image_not_built_yet_prints_the_whole_plan(tmp_path, cli):
    """A GPU recipe's plan before its image exists: the image where `make image` will put it, "not built yet",
    the command that builds it, the container line (local), the sbatch script and the attempt's srun line (Slurm);
    nothing written."""
    from ..conftest import REPO

    recipe = REPO / "recipes" / "gpu" / "llama3-8b-mi300x.yaml"
    env = {"RKIT_IMAGE_CACHE": str(tmp_path / "empty cache"), "RKIT_APPTAINER": "true"}
    work = tmp_path / "work"
    work.mkdir()
    synthetic = ("-o", "trainer.overrides.dataset_type=synthetic")
    local = cli("run", str(recipe), "--dry-run", *synthetic, "-o", "launcher=local", cwd=work, env=env, check=0)
    image = f"{tmp_path / 'empty cache'}/rocm-"
    assert f"# image {image}" in local.stdout and "(not built yet: `make image FLAVOR=rocm` builds it" in local.stdout
    assert "exec --cleanenv --no-home --rocm" in local.stdout and "model_name=llama3-8b" in local.stdout
    slurm = cli("run", str(recipe), "--dry-run", *synthetic, cwd=work, env=env, check=0)
    assert "(not built yet: `make image FLAVOR=rocm`" in slurm.stdout and "#   --gpus-per-node=8" in slurm.stdout
    step = next(line for line in slurm.stdout.splitlines() if line.startswith("srun "))  # the attempt's job step
    assert "--ntasks=1 --ntasks-per-node=1 '--nodelist=<node 1>' " in step and "--kill-on-bad-exit=1" in step
    assert f" apptainer exec --no-home --rocm --bind {work / 'runs'}/" in step and f"{image}" in step
    assert "model_name=llama3-8b" in step and "  RKIT_NPROCS=1" in slurm.stdout
    assert list(work.iterdir()) == [] and not list((tmp_path / "empty cache").glob("*.sif"))
    done = cli("run", str(recipe), *synthetic, cwd=work, env=env, check=2)  # no dry run: the image is needed
    assert "build it with `make image FLAVOR=rocm`" in done.stderr and list(work.iterdir()) == []


def test_dry_run_prints_what_would_start_and_writes_nothing(tmp_path, cli):
    from ..conftest import TINY

    done = cli("run", str(TINY), "--dry-run", "-o", "env.FOO=bar", "--inject", "kill:rank=1,step=5", cwd=tmp_path,
               check=0)
    assert list(tmp_path.iterdir()) == []  # no run directory, nothing else
    out = done.stdout
    assert "# rank 0: log runs/tiny-cpu/attempts/1/rank-0.log" in out and "# rank 1:" in out
    assert "-m rkit.runtime.agent" in out and "steps=100" in out and "  FOO=bar" in out and "  RKIT_RANK=1" in out
    assert '"kind": "kill"' in out  # the injection reaches the ranks
    slurm = cli("run", str(TINY), "--dry-run", "-o", "launcher=slurm", "-o", "slurm.partition=debug", cwd=tmp_path,
                check=0)
    assert list(tmp_path.iterdir()) == []
    assert "#   --partition=debug" in slurm.stdout and "#!/bin/bash" in slurm.stdout
    assert "-m rkit.cli supervise" in slurm.stdout
    bad = cli("run", str(TINY), "--dry-run", "-o", "trainer.steps=0", cwd=tmp_path, check=2)
    assert "trainer.steps" in bad.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("resolved", ["{}", '{"name": ""}', "[]", '{"name": 5}'])
def test_reproduce_of_a_run_whose_resolved_config_is_damaged_exits_2_and_starts_nothing(tmp_path, cli, resolved):
    """`rkit reproduce` reads the run's resolved.json first: without a run name (a KeyError before) or not an
    object, exit 2 naming the file; nothing is created beside the run."""
    from .damaged_corpus import build_good

    runs = build_good(tmp_path / "case") / "runs"
    (runs / "good" / "resolved.json").write_text(resolved)
    before = sorted(p.name for p in runs.iterdir())
    done = cli("reproduce", str(runs / "good"), cwd=tmp_path, check=2)
    assert "Traceback" not in done.stderr and f"{runs / 'good' / 'resolved.json'}" in done.stderr, done.stderr
    assert sorted(p.name for p in runs.iterdir()) == before
