"""`manifest.git_state` probes a recipe's repository without running anything that repository's config names.

A recipe may come from an unpacked archive whose `.git/config` is hostile: `core.fsmonitor`, a clean filter, an
include of another file. git's safe.directory does not cover trees owned by the same user, so rkit itself must
keep git from running those commands, and say the dirty flag is unknown where it could not safely ask.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rkit.runtime import manifest

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


@pytest.fixture(autouse=True)
def _hermetic_git(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The tests' git reads no system or user config (a developer's own hooks or signing settings)."""
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_CONFIG_PARAMETERS", "GIT_CONFIG_COUNT"):
        monkeypatch.delenv(name, raising=False)


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
                   check=True, capture_output=True, stdin=subprocess.DEVNULL)


def _repo(tmp_path: Path) -> Path:
    """A repository with one committed recipe, r.yaml."""
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True, stdin=subprocess.DEVNULL)
    (repo / "r.yaml").write_text("x: 1\n")
    _git(repo, "add", "r.yaml")
    _git(repo, "commit", "-qm", "recipe")
    return repo


def _head(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL).stdout.strip()


def _evil_script(tmp_path: Path, marker: Path) -> Path:
    """A command that leaves `marker` behind when run, then passes its input through (usable as a filter)."""
    script = tmp_path / "evil.sh"
    script.write_text(f"#!/bin/sh\n: > '{marker}'\nexec cat\n")
    script.chmod(0o755)
    return script


def _same_size_edit(recipe: Path) -> None:
    """Change the content but not the size, so git must read the file (through any clean filter) to compare."""
    recipe.write_text("x: 2\n")
    stat = recipe.stat()
    os.utime(recipe, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))


def test_fsmonitor_in_the_repository_config_is_not_run(tmp_path: Path):
    repo = _repo(tmp_path)
    marker = tmp_path / "PWNED-fsmonitor"
    _git(repo, "config", "core.fsmonitor", str(_evil_script(tmp_path, marker)))
    state = manifest.git_state(repo / "r.yaml")
    assert not marker.exists(), "git ran the repository's core.fsmonitor command"
    assert state["repository"] is True and state["commit"] == _head(repo)
    assert state["dirty"] is None and "core.fsmonitor" in state["dirty_unknown"]


def test_clean_filter_is_not_run_and_dirty_is_unknown(tmp_path: Path):
    repo = _repo(tmp_path)
    marker = tmp_path / "PWNED-filter"
    _git(repo, "config", "filter.evil.clean", str(_evil_script(tmp_path, marker)))
    (repo / ".gitattributes").write_text("* filter=evil\n")
    _same_size_edit(repo / "r.yaml")
    state = manifest.git_state(repo / "r.yaml")
    assert not marker.exists(), "git ran the repository's clean filter"
    assert state["repository"] is True and state["commit"] == _head(repo)
    assert state["dirty"] is None
    assert "filter.evil.clean" in state["dirty_unknown"]


def test_an_include_is_not_followed_into_a_command(tmp_path: Path):
    repo = _repo(tmp_path)
    marker = tmp_path / "PWNED-include"
    included = tmp_path / "elsewhere.gitconfig"
    included.write_text(f"[core]\n\tfsmonitor = {_evil_script(tmp_path, marker)}\n")
    _git(repo, "config", "include.path", str(included))
    state = manifest.git_state(repo)
    assert not marker.exists(), "git ran a command from a file the repository config includes"
    assert state["commit"] == _head(repo)
    assert state["dirty"] is None and "include.path" in state["dirty_unknown"]


def test_plain_repository_clean_then_dirty(tmp_path: Path):
    repo = _repo(tmp_path)
    clean = manifest.git_state(repo / "r.yaml")
    assert clean == {"repository": True, "commit": _head(repo), "dirty": False, "root": str(repo.resolve())}
    _same_size_edit(repo / "r.yaml")
    dirty = manifest.git_state(repo / "r.yaml")
    assert dirty["dirty"] is True and "dirty_unknown" not in dirty


def test_not_a_repository(tmp_path: Path):
    (tmp_path / "r.yaml").write_text("x: 1\n")
    assert manifest.git_state(tmp_path / "r.yaml") == {"repository": False}


def test_every_git_call_is_hardened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    repo = _repo(tmp_path)
    calls: list[tuple[list[str], dict]] = []
    real_run = subprocess.run

    def spy(argv, *args, **kwargs):
        calls.append((list(argv), kwargs))
        return real_run(argv, *args, **kwargs)

    monkeypatch.setattr(manifest.subprocess, "run", spy)
    manifest.git_state(repo / "r.yaml")
    git_calls = [(argv, kw) for argv, kw in calls if Path(argv[0]).name == "git"]
    assert git_calls
    for argv, kw in git_calls:
        assert argv[1:5] == ["-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null"], argv
        assert "--no-optional-locks" in argv
        assert not kw.get("shell") and kw.get("stdin") == subprocess.DEVNULL and kw.get("timeout")
        env = kw["env"]
        assert (env["GIT_TERMINAL_PROMPT"], env["GIT_PAGER"], env["GIT_OPTIONAL_LOCKS"]) == ("0", "cat", "0")
        assert env.get("PATH") == os.environ.get("PATH")
    statuses = [argv for argv, _ in git_calls if "status" in argv]
    assert len(statuses) == 1 and "--ignore-submodules=all" in statuses[0]
    assert any("config" in argv and "--show-scope" in argv for argv, _ in git_calls)
