"""A run directory on a shared file system: private modes whatever the umask, no writes through planted links."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from rkit import runner
from rkit.errors import RkitError
from rkit.recipe import load_recipe
from rkit.rundir import PlantedLink, RunDir, write_json_atomic

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
    with runner.open_run(recipe, resume=False, injections=[]) as (run, _lock):
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
        run.lock().acquire()
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


@pytest.mark.parametrize("planted", ["metrics", "attempts", "attempts/1", "attempts/1/env", "checkpoints"])
def test_a_link_planted_as_a_directory_stops_a_resume_before_any_write(tmp_path, planted, cli):
    recipe = load_recipe(TINY, [f"runs_dir={tmp_path}", "name=p"])
    with runner.open_run(recipe, resume=False, injections=[]) as (run, _lock):
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
        with runner.open_run(recipe, resume=True, injections=[]):
            pass
    assert run.events_file.read_bytes() == before and list(elsewhere.iterdir()) == []
    done = cli("report", str(run.path), check=2)
    assert f"{planted}: is a symbolic link" in done.stderr and "Traceback" not in done.stderr
    assert list(elsewhere.iterdir()) == []


def test_one_redaction_for_events_manifests_and_the_batch_script(tmp_path):
    from rkit.backends import slurm
    from rkit.stamp import REDACTED, redact

    assert redact({"SLURM_JWT": "eyJ", "nested": [{"url": "https://u:pw@h/x"}], "ok": "https://h/x", "n": 3}) == {
        "SLURM_JWT": REDACTED, "nested": [{"url": f"https://u:{REDACTED}@h/x"}], "ok": "https://h/x", "n": 3}
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.emit("x", reason="could not reach https://bob:hunter2@db/x", api_token="abc")
    text = run.events_file.read_text()
    assert "hunter2" not in text and '"abc"' not in text and REDACTED in text
    from rkit.recipe import parse_recipe

    text = TINY.read_text() + "slurm:\n  extra_sbatch: ['--comment=https://ann:s3cret@h/x']\n"
    recipe = parse_recipe("r.yaml", text, [f"runs_dir={tmp_path}", "name=s", "launcher=slurm"])
    script = slurm.render_batch(RunDir(tmp_path / "s"), recipe.config, "python3").script
    assert "s3cret" not in script and f"ann:{REDACTED}@h" in script
