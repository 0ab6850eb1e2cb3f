"""`rkit run`: make (or reopen) the run directory, stamp it, and hand it to the supervisor."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from rkit import __version__
from rkit.backends.local.launcher import Container, LocalBackend
from rkit.contract.config import Config
from rkit.contract.errors import RkitError, RunDirUnwritable
from rkit.contract.rundir import EV, RunDir, set_access, write_atomic, write_json_atomic
from rkit.contract.safeio import private_dir
from rkit.contract.stamp import canonical_json, hashed_config, is_secret_name, redact
from rkit.images import env as imageenv
from rkit.images import probe as imageagent
from rkit.images.identity import ImageIdentity, identify, locate
from rkit.images.identity import resolve as resolve_image
from rkit.images.store import apptainer, sha256_file
from rkit.recipe import maxtext_keys
from rkit.recipe.load import Recipe, parse_recipe
from rkit.recipe.yaml_text import PATH_CHARS_WHY, unsafe_path_chars
from rkit.run import access
from rkit.run.lock import RunLock
from rkit.run.policy import Progress, RunState
from rkit.run.supervisor import Supervisor, default_jax_cache_dir
from rkit.runtime import determinism, manifest
from rkit.runtime.inject import Injection
from rkit.runtime.trainers import maxtext


def run_path(recipe: Recipe) -> RunDir:
    return RunDir(Path(recipe.config.runs_dir) / recipe.name)


@contextmanager
def open_run(recipe: Recipe, *, resume: bool, injections: list[Injection], image: ImageIdentity | None = None,
             extra_stamp: dict | None = None) -> Iterator[tuple[RunDir, RunLock]]:
    """Create the run directory (atomically: mkdir fails if it exists) or reopen it for --resume,
    holding the writer lock for as long as the caller runs."""
    run = run_path(recipe)
    if bad := unsafe_path_chars(str(run.path.resolve())):
        raise RkitError(f"{run.path.resolve()}: the run directory's path holds {bad}, {PATH_CHARS_WHY}; set "
                        "runs_dir (or run from) a directory without them.")
    mask = set_access(recipe.config.access)  # everything written from here on: 0700/0600 (private) or 0750/0640
    run.path.parent.mkdir(parents=True, exist_ok=True)
    created = False
    try:
        os.mkdir(run.path)
        created = True
    except FileExistsError:
        if not resume:
            raise RkitError(f"{run.path}: a run named {recipe.name!r} already exists. Continue it with "
                            f"`{recipe.command('--resume')}`, or start another with "
                            f"`{recipe.command('-o', 'name=NEW', drop=('name',))}`.") from None
        if not run.exists():
            raise RkitError(f"{run.path}: exists but is not an rkit run (no resolved.json); move it away "
                            "or pick a new name with -o name=NEW.") from None
    except OSError as exc:
        raise RkitError(f"{run.path}: cannot create the run directory: {exc.strerror}. "
                        "Check runs_dir in the recipe.") from None
    os.chmod(run.path, 0o777 & ~mask)  # also a run made before `access` existed, or under another umask
    run.refuse_planted_links()
    lock = RunLock.of(run).acquire()
    try:
        run.refuse_planted_links()  # again under the lock: nothing is written below a link
        if created:
            stamp(run, recipe, injections, image, extra_stamp or {})
        else:
            access.restore(run, mask, recipe.config.access)
            if changes := check_resume(run, recipe, image):
                why = maxtext_keys.schedule_change(run.load_resolved(), recipe.resolved)
                apply_changes(run, recipe, changes, training_change=why)
                if why is not None:
                    print(f"rkit: note: this --resume changes the training: {why}. To extend a run without it, "
                          "start runs with trainer.overrides.learning_rate_schedule_steps set to their longest "
                          "length.", file=sys.stderr)
            run.emit(EV.RUN_RESUMED, injections=[i.spec for i in injections], host=manifest.socket.gethostname())
        yield run, lock
    finally:
        lock.release()


def stamp(run: RunDir, recipe: Recipe, injections: list[Injection], image: ImageIdentity | None,
          extra: dict) -> None:
    run.attempts_dir.mkdir()
    run.metrics_dir.mkdir()
    write_atomic(run.recipe, recipe.text)
    write_json_atomic(run.resolved, recipe.resolved)
    host = manifest.capture(recipe_path=Path(recipe.source))
    if "reproduced_from" in extra:
        # The recipe comes from the original run, so its provenance (the recipe's repository) is the original's.
        host["git"] = extra["reproduced_from"]["git"]
    stamp_data = {
        "rkit_version": __version__,
        "run": {"name": recipe.name, "path": str(run.path.resolve()), "created": time.time(),
                "recipe_source": str(Path(recipe.source).resolve())},
        "config_hash": recipe.config_hash,
        "hashed_config": hashed_config(recipe.resolved),
        "image": image.as_dict() if image else {"kind": "none", "reference": recipe.config.image},
        "launcher": recipe.config.launcher,
        "injections": [i.as_dict() for i in injections],
        "host": host,
        **({"determinism": determinism.settings()} if recipe.config.reproducibility.deterministic else {}),
        **extra,
    }
    write_json_atomic(run.manifest, stamp_data)
    run.emit(EV.RUN_SUBMITTED, name=recipe.name, config_hash=recipe.config_hash, launcher=recipe.config.launcher,
             injections=[i.spec for i in injections], total_steps=recipe.total_steps)


def check_resume(run: RunDir, recipe: Recipe, image: ImageIdentity | None) -> dict[str, list]:
    """What `--resume` may change, as {dotted key: [old, new]}: the operational knobs (stamp.OPERATIONAL_KEYS:
    budgets, timeouts, observability, Slurm time, partition, ...), `access`, and `trainer.steps` (to extend
    training; never below the committed step). Any other change trains something else: refused, listed."""
    stamped = run.load_manifest().get("image", {})
    if image is not None and stamped.get("sha256") != image.sha256:
        raise RkitError(f"{run.path}: the image differs from the one this run was started with: expected "
                        f"{stamped.get('sha256')}, found {image.sha256} ({image.path}). A resumed run must use the "
                        "same software: restore that image, or start a new run with -o name=NEW.")
    recorded = run.load_resolved()
    training = sorted(k for k in _changed_keys(hashed_config(recorded), hashed_config(recipe.resolved))
                      if k != "trainer.steps")
    if training:
        raise RkitError(f"{run.path}: the recipe differs from the one this run was started with in what it trains "
                        f"(changed: {', '.join(training)}); a resumed run must train the same config. Operational "
                        "settings (resilience, observability, slurm time/partition/account/qos/...) and a longer "
                        "trainer.steps may change on --resume. Start a new run with "
                        f"`{recipe.command('-o', 'name=NEW', drop=('name',))}`.")
    changes = {key: [_at(recorded, key), _at(recipe.resolved, key)]
               for key in sorted(_changed_keys(recorded, recipe.resolved)) if key not in ("name", "runs_dir")}
    if "trainer.steps" in changes:
        committed = maxtext.latest_committed_step(run)
        if committed is not None and int(recipe.config.trainer.steps) - 1 < committed:
            raise RkitError(f"{run.path}: trainer.steps {recipe.config.trainer.steps} ends before the committed step "
                            f"{committed}; a resumed run can extend training, not end before what it saved. Give "
                            f"trainer.steps of at least {committed + 1}.")
    return changes


def apply_changes(run: RunDir, recipe: Recipe, changes: dict[str, list], training_change: str | None = None) -> None:
    """A resume's accepted changes: resolved.json and the stamp's config hash become the new ones (the Slurm job's
    supervisor reads them), and a run.changed event keeps the old and new values. A change of what MaxText
    derives from them (`training_change`: the learning-rate schedule, from trainer.steps) is kept in the
    manifest's `training_changes` and named in the event."""
    why = training_change
    write_json_atomic(run.resolved, recipe.resolved)
    stamp_data = run.load_manifest()
    stamp_data.update(config_hash=recipe.config_hash, hashed_config=hashed_config(recipe.resolved))
    if why is not None:
        stamp_data.setdefault("training_changes", []).append({"t": time.time(), "changes": changes, "why": why})
    write_json_atomic(run.manifest, stamp_data)
    run.emit(EV.RUN_CHANGED, changes=changes, config_hash=recipe.config_hash,
             **({"training_change": why} if why else {}))


def _at(tree: object, dotted: str) -> object:
    for key in dotted.split("."):
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def _changed_keys(a: object, b: object, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in set(a) | set(b):
            out.extend(_changed_keys(a.get(key), b.get(key), f"{prefix}{key}."))
        return out
    return [prefix.rstrip(".")] if canonical_json(a) != canonical_json(b) else []


def training_env(recipe: Recipe, image: ImageIdentity | None, host: dict[str, str]) -> dict[str, str]:
    """The environment of each training process: the recipe's env on top of the host's. In a container
    (--cleanenv) only the variables that shape training (XLA_*, JAX_*, ...) and secrets such as HF_TOKEN
    are carried in; without one, the whole host environment is inherited."""
    extra = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in recipe.config.env.items()}
    if image is not None:
        carried = {k: v for k, v in host.items() if k.startswith(manifest.ENV_PREFIXES) or is_secret_name(k)}
        return _deterministic(recipe, {**carried, **extra})
    env = _deterministic(recipe, {**host, **extra})
    # The agent is rkit's own module: make sure the training Python can import it.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


def run_recipe(recipe: Recipe, *, resume: bool, injections: list[Injection],
               on_progress: Callable[[Progress], None] = lambda p: None) -> tuple[RunDir, RunState]:
    """`rkit run`: resolve the image (a missing apptainer or image fails here, before anything exists), then run
    here (local) or submit the batch job (slurm)."""
    image = resolve_image(recipe.config.image)
    check_maxtext_keys(recipe, image)
    if recipe.config.launcher == "slurm":
        return submit_slurm(recipe, image=image, resume=resume, injections=injections), RunState.PENDING
    return execute(recipe, image=image, resume=resume, injections=injections, on_progress=on_progress)


def check_maxtext_keys(recipe: Recipe, image: ImageIdentity | None) -> None:
    """trainer.overrides against the MaxText that will train (maxtext_keys.py): a RecipeError before anything
    exists; a note on stderr where the keys cannot be read here."""
    if (note := maxtext_keys.safe_check(recipe, image)) is not None:
        print(f"rkit: {note}", file=sys.stderr)


def validate_maxtext_keys(recipe: Recipe) -> str | None:
    """`rkit validate`: the same check as `run`, where the image is at hand; otherwise a note (validating a
    recipe needs no apptainer and no built image)."""
    try:
        image = resolve_image(recipe.config.image)
    except RkitError as exc:
        return f"note: trainer.overrides not checked against MaxText: the image is not at hand ({exc})"
    return maxtext_keys.safe_check(recipe, image)


def submit_slurm(recipe: Recipe, *, image: ImageIdentity | None, resume: bool,
                 injections: list[Injection], extra_stamp: dict | None = None) -> RunDir:
    """Stamp the run, render the batch script into it and submit it; the job's `rkit supervise` does the rest."""
    from rkit.backends.slurm import launcher as slurm

    python = recipe.config.slurm.python or sys.executable
    if image is not None:
        slurm.check_container_launch(recipe.config.slurm.container_launch)
    with open_run(recipe, resume=resume, injections=injections, image=image,
                  extra_stamp=extra_stamp) as (run, _lock):
        live = slurm_job(run)
        if live and slurm.job_state(live):
            raise RkitError(f"{run.path}: already submitted as Slurm job {live} "
                            f"({slurm.job_state(live)['state']}); follow it with `rkit status {run.path}`.")
        request = slurm.render_batch(run, recipe.config, python)
        job_id = slurm.submit(request)
        run.emit(EV.JOB_SUBMITTED, job_id=job_id, argv=request.argv, script=str(request.script_path),
                 injections=[i.as_dict() for i in injections])
    return run


def slurm_job(run: RunDir) -> str | None:
    """The Slurm job id this run was last submitted as."""
    from rkit.backends.slurm.launcher import submitted_job_id

    return submitted_job_id(run.events(), str(run.events_file))


def _deterministic(recipe: Recipe, env: dict[str, str]) -> dict[str, str]:
    """reproducibility.deterministic: its switches on top of everything else (determinism.py)."""
    return determinism.apply(env) if recipe.config.reproducibility.deterministic else env


def supervise(run_path: Path) -> RunState:
    """Inside the batch job: run the attempts as job steps; on a requeue decision, requeue this very job."""
    from rkit.backends.slurm import launcher as slurm

    run = RunDir(run_path).require()
    run.refuse_planted_links()
    resolved = run.load_resolved()
    stamp = run.load_manifest()
    job_id = os.environ.get("SLURM_JOB_ID", "")
    events = run.events()
    submitted = [e for e in events if e.get("event") == EV.JOB_SUBMITTED]
    injections = [Injection.from_dict(d) for d in (submitted[-1].get("injections", []) if submitted else [])]
    excluded = next((e["excluded"] for e in reversed(events) if e.get("event") == EV.NODES_EXCLUDED), [])
    image = None
    if stamp.get("image", {}).get("kind") == "sif":
        fields = {k: v for k, v in stamp["image"].items() if k != "kind"}
        image = ImageIdentity(**fields)
    jax_cache = default_jax_cache_dir()
    private_dir(jax_cache)
    config = Config.from_resolved(resolved)
    set_access(config.access)
    res = config.resources
    backend = slurm.SlurmStepBackend(
        nodes_per_step=res.nodes, tasks_per_node=res.processes_per_node,
        container_launch=config.slurm.container_launch, sif=image.path if image else None,
        binds=(str(run.path.resolve()), jax_cache), gpu_flags=tuple(image.gpu_flags) if image else (),
        python=sys.executable, exclude=tuple(excluded), image_python=image.python if image else "/opt/venv/bin/python",
        agent_path=bound_agent(run, image),
        warm_standby=config.resilience.standby_on(res.processes_per_node, slurm.cpus_on_node()),
        liveness=config.resilience)
    lock = _acquire_with_patience(run)
    try:
        run.emit(EV.JOB_STARTED, job_id=job_id, restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                 batch_host=manifest.socket.gethostname(), allocation=backend.allocation(), excluded=excluded)
        recipe = Recipe(source=str(run.resolved), text="", resolved=resolved)
        supervisor = Supervisor(run=run, config=config, injections=injections, backend=backend,
                                base_env=training_env(recipe, image, dict(os.environ)), host_env=dict(os.environ),
                                image=image, jax_cache_dir=jax_cache)
        supervisor.install_signal_handlers()
        signal.signal(signal.SIGUSR1, supervisor.request_preempt)
        try:
            state = supervisor.run_to_end()
        except RunDirUnwritable:
            raise  # nothing more can be recorded: the one line on stderr (the job's log) says why
        except Exception as exc:
            run.emit(EV.RUN_GAVE_UP, reason=f"the supervisor failed: {type(exc).__name__}: {exc}")
            raise
        if state is RunState.REQUEUED and job_id:
            run.emit(EV.JOB_REQUEUED, job_id=job_id, excluded=list(backend.exclude))
            lock.release()
            # Requeue first: Slurm changes ExcNodeList only for a pending job ("Job is no longer pending
            # execution" while it runs). The requeue's SIGTERM to this script is caught (request_stop), so the
            # update right after it still runs.
            slurm.requeue(job_id)
            if backend.exclude:
                slurm.exclude_nodes(job_id, backend.exclude)
        return state
    finally:
        lock.release()


def bound_agent(run: RunDir, image: ImageIdentity | None, write: bool = True) -> str | None:
    """For an image without rkit's agent: the directory of the agent's copy in the run directory (written now
    unless `write` is false), for the ranks' PYTHONPATH; None when the image brings its own."""
    if image is None or image.agent != "bound":
        return None
    path = run.path.resolve() / imageagent.AGENT_DIR
    return str(imageagent.install(run.path.resolve()) if write else path)


def _acquire_with_patience(run: RunDir, seconds: float = 60) -> RunLock:
    """After a node crash the previous supervisor may take a moment to be gone; then the lock is free."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return RunLock.of(run).acquire()
        except RkitError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def reproduce(source: Path, *, name: str | None, allow_drift: bool,
              on_progress: Callable[[Progress], None] = lambda p: None) -> tuple[RunDir, RunState]:
    """Relaunch a run with its resolved config and the same image digest, as a new run beside it, through the
    run's own launcher (a Slurm run is submitted as a Slurm job: RunState.PENDING)."""
    src = RunDir(source).require()
    resolved = src.load_resolved()
    stamp = src.load_manifest()
    new_name = name or _free_name(src.path.parent, f"{resolved['name']}-reproduce")
    resolved = {**resolved, "name": new_name, "runs_dir": str(src.path.parent)}
    text = (f"# reproduced from {src.path} (config hash {stamp.get('config_hash')})\n"
            + yaml.safe_dump(resolved, sort_keys=True))
    recipe = parse_recipe(str(src.resolved), text)
    expected = stamp.get("image", {}).get("sha256")
    extra: dict = {"reproduced_from": {"run": str(src.path.resolve()), "config_hash": stamp.get("config_hash"),
                                       "image_sha256": expected, "git": stamp.get("host", {}).get("git")}}
    path = locate(recipe.config.image, want_sha256=expected)
    image = None
    if path is not None:
        found = sha256_file(path)
        image = identify(recipe.config.image, path, found)
        if expected and found != expected:
            same, changed, what = imageenv.compare(stamp.get("image", {}), image.environment_sha256,
                                                   image.environment)
            note = {"expected": expected, "found": found, "path": str(path),
                    "environment_sha256": image.environment_sha256}
            if same:
                extra["rebuilt"] = {**note, "verdict": "rebuilt, same environment"}
            elif not allow_drift:
                raise RkitError(f"{src.path}: the image differs from the one the run used: expected {expected}, "
                                f"found {found} ({path}); packages changed: {what}. Restore that image, or pass "
                                "--allow-drift to run anyway (the drift is recorded in the new manifest).")
            else:
                extra["drift"] = {"image": note, "changed": changed}
    if recipe.config.launcher == "slurm":
        run = submit_slurm(recipe, image=image, resume=False, injections=[], extra_stamp=extra)
        return run, RunState.PENDING
    return execute(recipe, image=image, resume=False, injections=[], on_progress=on_progress, extra_stamp=extra)


def dry_run(recipe: Recipe, injections: list[Injection]) -> str:
    """`rkit run --dry-run`: what `rkit run` would start, written nowhere: the sbatch argv and batch script
    (Slurm), or each rank's command line and the variables rkit sets for it, redacted (local). The image is
    resolved as for a run (a missing one fails here the same way)."""
    import shlex

    image = resolve_image(recipe.config.image)
    check_maxtext_keys(recipe, image)
    run = run_path(recipe)
    head = [f"# rkit run --dry-run: {recipe.source}, config hash {recipe.config_hash}",
            f"# run directory {run.path.resolve()} ({'exists: --resume continues it' if run.exists() else 'new'})",
            f"# image {image.path} ({image.sha256})" if image else "# image: none (this Python environment)"]
    if recipe.config.launcher == "slurm":
        from rkit.backends.slurm import launcher as slurm

        request = slurm.render_batch(run, recipe.config, recipe.config.slurm.python or sys.executable)
        return "\n".join([*head, "# sbatch argv, one item per line:",
                          *(f"#   {redact(a)}" for a in request.argv), request.script.rstrip("\n")])
    host = dict(os.environ)
    container = None
    if image is not None:
        container = Container(apptainer=apptainer(), sif=image.path, gpu_flags=tuple(image.gpu_flags),
                              binds=(str(run.path.resolve()), default_jax_cache_dir()), python=image.python,
                              agent_path=bound_agent(run, image, write=False))
    supervisor = Supervisor(run=run, config=recipe.config, injections=injections,
                            backend=LocalBackend(container=container), base_env=training_env(recipe, image, host),
                            host_env=host, image=image, jax_cache_dir=default_jax_cache_dir())
    request = supervisor.launch_request(1, [i for i in injections if i.in_trainer], run.attempt_dir(1))
    out = head
    for rank in request.ranks:
        changed = {k: v for k, v in sorted(rank.env.items()) if host.get(k) != v}
        out += [f"# rank {rank.rank}: log {rank.log}", shlex.join(rank.argv),
                *(f"  {k}={shlex.quote(str(v))}" for k, v in redact(changed).items())]
    return "\n".join(out)


def _free_name(runs_dir: Path, base: str) -> str:
    if not (runs_dir / base).exists():
        return base
    n = 2
    while (runs_dir / f"{base}-{n}").exists():
        n += 1
    return f"{base}-{n}"


def execute(recipe: Recipe, *, image: ImageIdentity | None, resume: bool, injections: list[Injection],
            on_progress: Callable[[Progress], None] = lambda p: None,
            extra_stamp: dict | None = None) -> tuple[RunDir, RunState]:
    jax_cache = default_jax_cache_dir()
    with open_run(recipe, resume=resume, injections=injections, image=image,
                  extra_stamp=extra_stamp) as (run, _lock):
        host = dict(os.environ)
        container = None
        if image is not None:
            private_dir(jax_cache)
            container = Container(apptainer=apptainer(), sif=image.path, gpu_flags=tuple(image.gpu_flags),
                                  binds=(str(run.path.resolve()), jax_cache), python=image.python,
                                  agent_path=bound_agent(run, image))
        res = recipe.config.resources
        warm = recipe.config.resilience.standby_on(res.processes_per_node * res.nodes, os.cpu_count())
        supervisor = Supervisor(run=run, config=recipe.config, injections=injections,
                                backend=LocalBackend(container=container, warm_standby=warm),
                                base_env=training_env(recipe, image, host), host_env=host, image=image,
                                jax_cache_dir=jax_cache, on_progress=on_progress)
        supervisor.install_signal_handlers()
        return run, supervisor.run_to_end()
