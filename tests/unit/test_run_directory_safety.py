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
