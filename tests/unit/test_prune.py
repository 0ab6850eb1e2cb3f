"""`rkit prune` (issue 39): an ended run keeps what it still needs (a finished run its final step, a resumable one
its newest 3), a run a supervisor holds is left whole, images no run was made with go (each flavor's newest stays),
idle cache entries go; --dry-run removes nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

from click.testing import CliRunner

from rkit.cli import main
from rkit.readers import prune
from rkit.run.lock import RunLock
from rkit.run.policy import RunState
from rkit.runtime.trainers import maxtext

from .test_attempt_loop import Script, commit, make


def runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    root.mkdir()

    def made(name: str, script: Script, *overrides: str, end: RunState):
        (tmp_path / f"make-{name}").mkdir()
        sup, _ = make(tmp_path / f"make-{name}", script, *overrides)
        assert sup.run_to_end() is end
        os.replace(sup.run.path, root / name)

    made("a", Script(), end=RunState.FINISHED)  # finished: its steps, a quarantined one, an unfinished save
    (root / "a" / "checkpoints" / "quarantine" / "6").mkdir(parents=True)
    for step in (8, 11, 14):  # the local tier's data positions: of a step not kept, of the final step, newer
        (root / "a" / "checkpoints" / "data-position" / str(step)).mkdir(parents=True)
    (root / "a" / "checkpoints" / "checkpoints" / "12.orbax-checkpoint-tmp-1").mkdir()
    made("b", Script(exit=(None, 6, 3)), "resilience.crash_loop_limit=2", end=RunState.GAVE_UP)
    from rkit.contract.rundir import RunDir

    for step in (1, 2, 3):
        commit(RunDir(root / "b"), step)
    made("c", Script(), end=RunState.FINISHED)
    return root


def test_an_ended_run_keeps_what_it_needs_and_a_held_one_is_left_whole(tmp_path):
    root = runs(tmp_path)
    from rkit.contract.rundir import RunDir

    a, b, c = (RunDir(root / n) for n in "abc")
    before = {n: maxtext.committed_steps(r) for n, r in zip("abc", (a, b, c), strict=True)}
    assert before["a"] == [0, 4, 8, 11] and before["b"] == [0, 1, 2, 3, 4], before
    with RunLock.of(c):  # a supervisor is on it
        found = prune.plan(root, images=False, caches=False)
        assert [Path(r.path).relative_to(root).as_posix() for r in found.removals] == [
            *(f"a/checkpoints/checkpoints/{s}" for s in before["a"][:-1]),
            "a/checkpoints/checkpoints/12.orbax-checkpoint-tmp-1", "a/checkpoints/quarantine/6",
            "a/checkpoints/data-position/8",
            *(f"b/checkpoints/checkpoints/{s}" for s in before["b"][:-3])]
        assert found.kept == ("c: running (a supervisor is running this run)",)
        text = CliRunner().invoke(main, ["prune", str(root), "--dry-run"]).output
        assert "would remove" in text and "left whole  c: running" in text
        assert maxtext.committed_steps(a) == before["a"]  # the dry run touched nothing
        assert prune.remove(found) == []
    assert maxtext.committed_steps(a) == before["a"][-1:] and not any(a.quarantine_dir.iterdir())
    assert maxtext.committed_steps(b) == before["b"][-3:]
    assert maxtext.committed_steps(c) == before["c"]
    assert not (a.orbax_dir / "12.orbax-checkpoint-tmp-1").exists()
    assert sorted(p.name for p in (a.checkpoints / "data-position").iterdir()) == ["11", "14"]


def test_images_no_run_was_made_with_and_idle_cache_entries_go(tmp_path):
    root = runs(tmp_path)
    cache = tmp_path / "images"
    cache.mkdir()
    for name, built in (("cpu-old", 1), ("cpu-used", 2), ("cpu-new", 3), ("rocm-only", 1)):
        (cache / f"{name}.sif").write_bytes(b"s" * 10)
        (cache / f"{name}.build.log").write_text("log")
        record = {"flavor": name.split("-")[0], "built": built, "sha256": f"sha256:{name}",
                  "path": str(cache / f"{name}.sif")}
        (cache / f"{name}.json").write_text(json.dumps(record))
    stamp = json.loads((root / "a" / "manifest.json").read_text()) if (root / "a" / "manifest.json").exists() else {}
    stamp["image"] = {"sha256": "sha256:cpu-used", "path": "/elsewhere/cpu-used.sif"}
    (root / "a" / "manifest.json").write_text(json.dumps(stamp))
    jax, status = tmp_path / "jax", tmp_path / "status"
    (status / "digest-old").mkdir(parents=True)
    (status / "digest-old" / "events.pickle").write_bytes(b"p")
    (status / "digest-new").mkdir()
    (status / "digest-new" / "events.pickle").write_bytes(b"p")
    jax.mkdir()
    for name in ("old-cache", "new-cache", "other-file"):
        (jax / name).write_bytes(b"x" * 100)
    now = 100 * 86400.0
    for path in (jax / "old-cache", jax / "other-file", status / "digest-old" / "events.pickle"):
        os.utime(path, (now - 40 * 86400, now - 40 * 86400))
    for path in (jax / "new-cache", status / "digest-new" / "events.pickle"):
        os.utime(path, (now - 86400, now - 86400))
    found = prune.plan(root, images=True, caches=True, image_cache=cache, jax_cache=jax, status_cache=status,
                       now=now)
    gone = {Path(r.path).name for r in found.removals if not str(r.path).startswith(str(root))}
    assert gone == {"cpu-old.sif", "cpu-old.build.log", "cpu-old.json", "old-cache", "digest-old"}
    assert prune.remove(found) == []
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        f"{n}{s}" for n in ("cpu-used", "cpu-new", "rocm-only") for s in (".sif", ".build.log", ".json"))
    assert sorted(p.name for p in jax.iterdir()) == ["new-cache", "other-file"]
