"""A run directory on a shared file system: private modes whatever the umask, no writes through planted links."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from rkit.contract.errors import RkitError
from rkit.contract.rundir import PlantedLink, RunDir, write_json_atomic
from rkit.recipe.load import load_recipe
from rkit.run import runner
from rkit.run.lock import RunLock
from rkit.run.plan import plan

from ..conftest import TINY


@pytest.fixture
def umask_000():
    before = os.umask(0)
    yield
    os.umask(before)


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)) or ".": stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("access,dirs,files", [("private", 0o700, 0o600), ("group", 0o750, 0o640)])
def test_the_run_directory_gets_its_access_modes_under_umask_000(tmp_path, umask_000, access, dirs, files):
    recipe = load_recipe(TINY, [f"runs_dir={tmp_path}", "name=m", f"access={access}"])
    with runner.open_run(plan(recipe, resume=False, injections=[])) as (run, _lock):
        run.emit("test.event")
        run.attempt_dir(1).mkdir(parents=True)
        write_json_atomic(run.attempt_dir(1) / "attempt.json", {"a": 1})
    found = modes(run.path)
    assert {"events.jsonl", "manifest.json", "resolved.json", "recipe.yaml", ".lock"} <= set(found)
    for name, mode in found.items():
        want = dirs if (run.path / name).is_dir() else files
        assert mode == want, (name, oct(mode))


def test_access_is_not_part_of_the_config_hash():
    private = load_recipe(TINY)
    group = load_recipe(TINY, ["access=group"])
    assert private.config_hash == group.config_hash and group.config.access == "group"


def test_a_planted_link_is_never_written_through(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run.events_file.symlink_to(victim)
    with pytest.raises(PlantedLink, match="events.jsonl: is a symbolic link"):
        run.emit("x")
    (run.path / ".lock").symlink_to(victim)
    with pytest.raises(PlantedLink, match=r"\.lock: is a symbolic link"):
        RunLock.of(run).acquire()
    run.resolved.symlink_to(victim)  # an atomic write replaces the link itself
    write_json_atomic(run.resolved, {"a": 1})
    assert not run.resolved.is_symlink() and victim.read_text() == "precious\n"
    assert issubclass(PlantedLink, RkitError) and PlantedLink(victim).exit_code == 2


def test_temp_files_of_atomic_writes_have_unique_names(tmp_path):
    planted = tmp_path / ".attempt.json.tmp"  # the old fixed temp name, planted as a link: never followed
    planted.symlink_to(tmp_path / "elsewhere")
    write_json_atomic(tmp_path / "attempt.json", {"a": 1})
    assert not (tmp_path / "elsewhere").exists() and planted.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".attempt.json.tmp", "attempt.json"]


@pytest.mark.parametrize("planted", ["metrics", "attempts", "attempts/1", "attempts/1/env", "checkpoints",
                                     "tensorboard", "agent", "standby"])
def test_a_link_planted_as_a_directory_stops_a_resume_before_any_write(tmp_path, planted, cli):
    recipe = load_recipe(TINY, [f"runs_dir={tmp_path}", "name=p"])
    with runner.open_run(plan(recipe, resume=False, injections=[])) as (run, _lock):
        run.attempt_dir(1).mkdir(parents=True)
        (run.attempt_dir(1) / "env").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = run.path / planted
    if target.exists():
        os.rename(target, tmp_path / "moved")
    target.symlink_to(elsewhere, target_is_directory=True)
    before = run.events_file.read_bytes()
    with pytest.raises(PlantedLink, match=f"{planted}: is a symbolic link"):
        with runner.open_run(plan(recipe, resume=True, injections=[])):
            pass
    assert run.events_file.read_bytes() == before and list(elsewhere.iterdir()) == []
    done = cli("report", str(run.path), check=2)
    assert f"{planted}: is a symbolic link" in done.stderr and "Traceback" not in done.stderr
    assert list(elsewhere.iterdir()) == []


def test_one_redaction_for_events_manifests_and_the_batch_script(tmp_path):
    from rkit.backends.slurm import launcher as slurm
    from rkit.contract.stamp import REDACTED, redact

    assert redact({"SLURM_JWT": "eyJ", "nested": [{"url": "https://u:pw@h/x"}], "ok": "https://h/x", "n": 3}) == {
        "SLURM_JWT": REDACTED, "nested": [{"url": f"https://u:{REDACTED}@h/x"}], "ok": "https://h/x", "n": 3}
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.emit("x", reason="could not reach https://bob:hunter2@db/x", api_token="abc")
    text = run.events_file.read_text()
    assert "hunter2" not in text and '"abc"' not in text and REDACTED in text
    from rkit.recipe.load import RecipeError, parse_recipe

    recipe = parse_recipe("r.yaml", TINY.read_text(), [f"runs_dir={tmp_path}", "name=s", "launcher=slurm"])
    import dataclasses

    config = recipe.config  # past validation (which refuses it): the batch script's own redaction
    config = dataclasses.replace(config, slurm=dataclasses.replace(config.slurm, extra_sbatch=(
        "--comment=https://ann:s3cret@h/x",)))
    script = slurm.render_batch(RunDir(tmp_path / "s"), config, "python3").script
    assert "s3cret" not in script and f"ann:{REDACTED}@h" in script
    text = TINY.read_text() + "slurm:\n  extra_sbatch: ['--comment=https://ann:s3cret@h/x']\n"
    with pytest.raises(RecipeError, match=r"slurm\.extra_sbatch\[0\]: holds a credential"):
        parse_recipe("r.yaml", text, [f"runs_dir={tmp_path}", "name=s", "launcher=slurm"])


@pytest.mark.parametrize("where,value", [
    ("trainer.overrides.tokenizer_path", "hf_" + "A" * 34),
    ("trainer.overrides.dataset_path", "gs://alice:pw@bucket/data"),
    ("trainer.overrides.tokenizer_path", "https://bob:pw@host/tok"),
    ("trainer.overrides.hf_data_files", "ghp_" + "b" * 36),
    ("observability.prometheus.interface", "AKIAABCDEFGHIJKLMNOP"),
])
def test_a_credential_anywhere_in_a_recipe_or_an_override_is_refused_and_never_recorded(tmp_path, where, value):
    from rkit.recipe.load import RecipeError

    with pytest.raises(RecipeError) as caught:
        load_recipe(TINY, [f"runs_dir={tmp_path}", "name=c", f"{where}={value}"])
    assert f"{where}: holds a credential" in str(caught.value) and value not in str(caught.value)
    assert not (tmp_path / "c").exists()  # nothing recorded: no recipe.yaml, resolved.json, manifest, argv


@pytest.mark.parametrize("planted", ["metrics/0.jsonl", "telemetry/c1.jsonl", "attempts/1/rank-0.log",
                                     "events.jsonl"])
def test_a_file_link_where_rkit_or_a_rank_writes_is_one_diagnosis_before_an_attempt(tmp_path, planted, cli):
    from rkit.run import preflight

    recipe = load_recipe(TINY, [f"runs_dir={tmp_path}", "name=f"])
    with runner.open_run(plan(recipe, resume=False, injections=[])) as (run, _lock):
        for d in (run.attempt_dir(1), run.metrics_dir, run.telemetry_dir):
            d.mkdir(parents=True, exist_ok=True)
    victim = tmp_path / "victim.jsonl"
    victim.write_text("")
    (run.path / planted).unlink(missing_ok=True)
    (run.path / planted).symlink_to(victim)
    with pytest.raises(PlantedLink, match=f"{planted}: is a symbolic link"):
        with runner.open_run(plan(recipe, resume=True, injections=[])):
            pass
    if planted != "events.jsonl":  # before each attempt of a live supervisor too: a stop that names it
        with pytest.raises(RkitError, match=f"planted link before attempt 2: .*{planted} is a symbolic link"):
            preflight.no_planted_links(run, 2)
        assert run.events()[-1]["event"] == "run.gave_up" and planted in run.events()[-1]["reason"]
    assert victim.read_text() == ""


def test_resume_restores_the_modes_of_what_rkit_owns_and_names_what_another_user_owns(tmp_path, capsys):
    recipe = load_recipe(TINY, [f"runs_dir={tmp_path}", "name=r"])
    with runner.open_run(plan(recipe, resume=False, injections=[])) as (run, _lock):
        run.attempt_dir(1).mkdir(parents=True)
        write_json_atomic(run.attempt_dir(1) / "attempt.json", {"a": 1})
    for p in [run.attempts_dir, run.attempt_dir(1), run.attempt_dir(1) / "attempt.json", run.resolved]:
        p.chmod(0o777)
    theirs = run.path / "left-by-bob.txt"
    theirs.write_text("x")
    if os.geteuid() == 0:
        os.chown(theirs, 4242, 4242)
    capsys.readouterr()
    with runner.open_run(plan(recipe, resume=True, injections=[])):
        pass
    err = capsys.readouterr().err
    found = modes(run.path)
    assert found["attempts"] == found["attempts/1"] == 0o700
    assert found["attempts/1/attempt.json"] == found["resolved.json"] == 0o600
    assert "modes are restored" in err
    if os.geteuid() == 0:
        assert "belong to another user (first: " in err and "left-by-bob.txt" in err


def test_caches_and_the_benchmark_storage_are_created_private(tmp_path, umask_000):
    from rkit.contract.safeio import private_dir
    from rkit.readers import bench

    (tmp_path / "home").mkdir(mode=0o755)
    made = private_dir(tmp_path / "home" / ".cache" / "rkit" / "images")
    assert made.is_dir() and stat.S_IMODE((tmp_path / "home").stat().st_mode) == 0o755  # there before: kept
    for p in (made, made.parent, made.parent.parent):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p
    store = bench.storage(tmp_path / "bench")
    saved = bench.save(store, "cpu", {"benchmarks": [], "machine_info": {}, "commit_info": {}})
    assert stat.S_IMODE((tmp_path / "bench").stat().st_mode) == 0o700
    assert stat.S_IMODE(saved.parent.stat().st_mode) == 0o700 and stat.S_IMODE(saved.stat().st_mode) == 0o600
