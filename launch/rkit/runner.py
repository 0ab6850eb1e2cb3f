"""`rkit run`: make (or reopen) the run directory, stamp it, and hand it to the supervisor."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from . import __version__, manifest
from .backends.local import LocalBackend
from .errors import RkitError
from .inject import Injection
from .recipe import Recipe, canonical_json, config_hash, hashed_config
from .rundir import RunDir, RunLock, write_json_atomic
from .supervisor import Progress, RunState, Supervisor, default_jax_cache_dir


def run_path(recipe: Recipe) -> RunDir:
    return RunDir(Path(recipe.resolved["runs_dir"]) / recipe.name)


@contextmanager
def open_run(recipe: Recipe, *, resume: bool, injections: list[Injection]) -> Iterator[tuple[RunDir, RunLock]]:
    """Create the run directory (atomically: mkdir fails if it exists) or reopen it for --resume,
    holding the writer lock for as long as the caller runs."""
    run = run_path(recipe)
    run.path.parent.mkdir(parents=True, exist_ok=True)
    created = False
    try:
        os.mkdir(run.path)
        created = True
    except FileExistsError:
        if not resume:
            raise RkitError(f"{run.path}: a run named {recipe.name!r} already exists. Continue it with "
                            f"`rkit run {recipe.source} --resume`, or pick a new name with -o name=NEW.") from None
        if not run.exists():
            raise RkitError(f"{run.path}: exists but is not an rkit run (no resolved.json); move it away "
                            "or pick a new name with -o name=NEW.") from None
    except OSError as exc:
        raise RkitError(f"{run.path}: cannot create the run directory: {exc.strerror}. "
                        "Check runs_dir in the recipe.") from None
    lock = run.lock().acquire()
    try:
        if created:
            stamp(run, recipe, injections)
        else:
            check_resume(run, recipe)
            run.emit("run.resumed", injections=[i.spec for i in injections], host=manifest.socket.gethostname())
        yield run, lock
    finally:
        lock.release()


def stamp(run: RunDir, recipe: Recipe, injections: list[Injection]) -> None:
    (run.path / "attempts").mkdir()
    run.metrics_dir.mkdir()
    run.recipe.write_text(recipe.text, encoding="utf-8")
    write_json_atomic(run.resolved, recipe.resolved)
    host = manifest.capture(recipe_path=Path(recipe.source))
    stamp_data = {
        "rkit_version": __version__,
        "run": {"name": recipe.name, "path": str(run.path.resolve()), "created": time.time(),
                "recipe_source": str(Path(recipe.source).resolve())},
        "config_hash": recipe.config_hash,
        "hashed_config": hashed_config(recipe.resolved),
        "image": {"kind": "none", "reference": recipe.resolved["image"]},
        "launcher": recipe.resolved["launcher"],
        "injections": [i.as_dict() for i in injections],
        "host": host,
    }
    write_json_atomic(run.manifest, stamp_data)
    run.emit("run.submitted", name=recipe.name, config_hash=recipe.config_hash, launcher="local",
             injections=[i.spec for i in injections], total_steps=recipe.total_steps)


def check_resume(run: RunDir, recipe: Recipe) -> None:
    recorded = run.load_resolved()
    if config_hash(recorded) != recipe.config_hash:
        diff = sorted(_changed_keys(hashed_config(recorded), hashed_config(recipe.resolved)))
        raise RkitError(f"{run.path}: the recipe differs from the one this run was started with "
                        f"(changed: {', '.join(diff)}); a resumed run must train the same config. "
                        "Start a new run with -o name=NEW.")


def _changed_keys(a: object, b: object, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in set(a) | set(b):
            out.extend(_changed_keys(a.get(key), b.get(key), f"{prefix}{key}."))
        return out
    return [prefix.rstrip(".")] if canonical_json(a) != canonical_json(b) else []


def execute(recipe: Recipe, *, resume: bool, injections: list[Injection],
            on_progress: Callable[[Progress], None] = lambda p: None) -> tuple[RunDir, RunState]:
    with open_run(recipe, resume=resume, injections=injections) as (run, _lock):
        env = dict(os.environ)
        env.update({k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in recipe.resolved["env"].items()})
        # The agent is rkit's own module: make sure the training Python can import it.
        package_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        supervisor = Supervisor(run=run, resolved=recipe.resolved, injections=injections,
                                backend=LocalBackend(), base_env=env, jax_cache_dir=default_jax_cache_dir(),
                                on_progress=on_progress)
        supervisor.install_signal_handlers()
        return run, supervisor.run_to_end()
