"""Executing a launch plan (run/plan.py): make (or reopen) the run directory under its lock, check that nothing
the plan read has changed, stamp it, then run the attempts here under the supervisor or submit the batch job
(`rkit run`, `--resume`, `reproduce`); and `supervise`, the batch job's side."""

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
from rkit.contract.errors import RkitError, RunDirUnwritable
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir, set_access, write_atomic, write_json_atomic
from rkit.contract.safeio import private_dir
from rkit.contract.stamp import hashed_config
from rkit.images import env as imageenv
from rkit.images import probe as imageagent
from rkit.images.identity import ImageIdentity, ImageNotBuilt, identify, locate, unbuilt
from rkit.images.store import sha256_file
from rkit.recipe.load import Recipe, parse_recipe
from rkit.run import access
from rkit.run.lock import RunLock
from rkit.run.plan import LaunchPlan, bound_agent_path, check_resume, plan, plan_supervised
from rkit.run.policy import Progress, RunState
from rkit.run.supervisor import Chronicle, Supervisor
from rkit.runtime import determinism, manifest
from rkit.runtime.inject import Injection
from rkit.runtime.trainers import localtier


class ChangedSincePlanned(RkitError):
    """The run directory changed between the plan and its start (another rkit made or resumed it): nothing run."""


@contextmanager
def open_run(plan: LaunchPlan) -> Iterator[tuple[RunDir, RunLock]]:
    """Create the run directory (atomically: mkdir fails if it exists) or reopen it for --resume, as planned,
    holding the writer lock for as long as the caller runs; refused when the run directory is not as planned."""
    run, recipe, injections = plan.run, plan.recipe, plan.injections
    mask = set_access(recipe.config.access)  # everything written from here on: 0700/0600 (private) or 0750/0640
    run.path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(run.path)
        created = True
    except FileExistsError:
        created = False
    except OSError as exc:
        raise RkitError(f"{run.path}: cannot create the run directory: {exc.strerror}. "
                        "Check runs_dir in the recipe.") from None
    if created == plan.continuing:
        if created:
            os.rmdir(run.path)
        raise ChangedSincePlanned(f"{run.path}: changed since planned: the run directory "
                                  f"{'appeared' if not created else 'went away'} meanwhile (another rkit?); "
                                  "nothing was written. Run the command again.")
    os.chmod(run.path, 0o777 & ~mask)  # also a run made before `access` existed, or under another umask
    run.refuse_planted_links()
    lock = RunLock.of(run).acquire()
    try:
        run.refuse_planted_links()  # again under the lock: nothing is written below a link
        if created:
            stamp(run, recipe, injections, plan.image, plan.extra_stamp)
        else:
            access.restore(run, mask, recipe.config.access)
            changes = check_resume(run, recipe, plan.image)
            first = max(run.attempt_numbers(), default=0) + 1
            if changes != plan.changes or first != plan.first_attempt:
                raise ChangedSincePlanned(
                    f"{run.path}: changed since planned (planned attempt {plan.first_attempt} with changes "
                    f"{sorted(plan.changes)}, found attempt {first} next with {sorted(changes)}); nothing was "
                    "written. Run the command again.")
            if changes:
                apply_changes(run, recipe, changes, training_change=plan.training_change)
                if plan.training_change is not None:
                    print(f"rkit: note: this --resume changes the training: {plan.training_change}. To extend a "
                          "run without it, start runs with trainer.overrides.learning_rate_schedule_steps set to "
                          "their longest length.", file=sys.stderr)
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
                "recipe_source": str(Path(recipe.source).resolve()),
                # what `rkit status` tells the user to type to continue it, from any directory (-o values that
                # hold a credential were refused when the recipe was read)
                "resume_command": recipe.command("--resume", absolute=True)},
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


def run_recipe(recipe: Recipe, *, resume: bool, injections: list[Injection], chronicle: Chronicle,
               on_progress: Callable[[Progress], None] = lambda p: None,
               on_launched: Callable[[], None] = lambda: None) -> tuple[RunDir, RunState]:
    """`rkit run`: plan (a missing apptainer or image fails here, before anything exists), then execute: run here
    (local) or submit the batch job (slurm: RunState.PENDING)."""
    return execute(plan(recipe, resume=resume, injections=injections), chronicle, on_progress=on_progress,
                   on_launched=on_launched)


def execute(launch: LaunchPlan, chronicle: Chronicle, on_progress: Callable[[Progress], None] = lambda p: None,
            on_launched: Callable[[], None] = lambda: None) -> tuple[RunDir, RunState]:
    if launch.launcher == "slurm":
        return submit_slurm(launch), RunState.PENDING
    with open_run(launch) as (run, _lock):
        if launch.image is not None:
            private_dir(launch.jax_cache_dir)
        install_bound_agent(run, launch.image)
        supervisor = Supervisor(run=run, config=launch.recipe.config, injections=launch.injections,
                                backend=launch.backend, base_env=launch.base_env, host_env=launch.host_env,
                                image=launch.image, jax_cache_dir=launch.jax_cache_dir, on_progress=on_progress,
                                chronicle=chronicle, on_launched=on_launched,
                                planned=(launch.first_attempt, [i.index for i in launch.injections if i.in_trainer],
                                         launch.first_request))
        supervisor.install_signal_handlers()
        return run, supervisor.run_to_end()


def submit_slurm(launch: LaunchPlan) -> RunDir:
    """Stamp the run, write the planned batch script into it and submit it; the job's `rkit supervise` does the
    rest."""
    from rkit.backends.slurm import launcher as slurm

    with open_run(launch) as (run, _lock):
        live = slurm_job(run)
        if live and slurm.job_state(live):
            raise RkitError(f"{run.path}: already submitted as Slurm job {live} "
                            f"({slurm.job_state(live)['state']}); follow it with `rkit status {run.path}`.")
        job_id = slurm.submit(launch.batch)
        run.emit(EV.JOB_SUBMITTED, job_id=job_id, argv=launch.batch.argv, script=str(launch.batch.script_path),
                 injections=[i.as_dict() for i in launch.injections])
    return run


def slurm_job(run: RunDir) -> str | None:
    """The Slurm job id this run was last submitted as."""
    from rkit.backends.slurm.launcher import submitted_job_id

    return submitted_job_id(run.events(), str(run.events_file))


def supervise(run_path: Path, chronicle: Chronicle) -> RunState:
    """Inside the batch job: plan from the run directory, then run the attempts as job steps; on a requeue
    decision, requeue this very job."""
    return execute_supervised(plan_supervised(RunDir(run_path).require(), dict(os.environ)), chronicle)


def execute_supervised(launch: LaunchPlan, chronicle: Chronicle) -> RunState:
    from rkit.backends.slurm import launcher as slurm

    run, config, image, jax_cache = launch.run, launch.config, launch.image, launch.jax_cache_dir
    job_id = launch.host_env.get("SLURM_JOB_ID", "")
    excluded = launch.excluded
    private_dir(jax_cache)
    set_access(config.access)
    res = config.resources
    backend = slurm.SlurmStepBackend(
        nodes_per_step=res.nodes, tasks_per_node=res.processes_per_node,
        container_launch=config.slurm.container_launch, sif=image.path if image else None,
        binds=(str(run.path.resolve()), jax_cache, *localtier.binds(config)),
        gpu_flags=tuple(image.gpu_flags) if image else (),
        python=sys.executable, exclude=tuple(excluded), image_python=image.python if image else "/opt/venv/bin/python",
        agent_path=install_bound_agent(run, image),
        warm_standby=config.resilience.standby_on(res.processes_per_node, slurm.cpus_on_node()),
        liveness=config.resilience)
    lock = _acquire_with_patience(run)
    try:
        run.emit(EV.JOB_STARTED, job_id=job_id, restart_count=int(launch.host_env.get("SLURM_RESTART_COUNT", "0") or 0),
                 batch_host=manifest.socket.gethostname(), allocation=backend.allocation(), excluded=excluded)
        supervisor = Supervisor(run=run, config=config, injections=launch.injections, backend=backend,
                                base_env=launch.base_env, host_env=launch.host_env, image=image,
                                jax_cache_dir=jax_cache, chronicle=chronicle)
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
            kept = slurm.exclusion_that_fits(job_id, list(backend.exclude)) if backend.exclude else []
            left_in = [n for n in backend.exclude if n not in kept]
            run.emit(EV.JOB_REQUEUED, job_id=job_id, excluded=kept,
                     **({"not_excluded": left_in, "why": "excluding them would leave the partition fewer nodes than "
                         "the job asks for (Slurm: BadConstraints, pending for ever); Slurm keeps it off nodes it "
                         "holds down itself"} if left_in else {}))
            lock.release()
            # Requeue first: Slurm changes ExcNodeList only for a pending job ("Job is no longer pending
            # execution" while it runs). The requeue's SIGTERM to this script is caught (request_stop), so the
            # update right after it still runs.
            slurm.requeue(job_id)
            if kept:
                slurm.exclude_nodes(job_id, kept)
        return state
    finally:
        lock.release()


def install_bound_agent(run: RunDir, image: ImageIdentity | None) -> str | None:
    """For an image without rkit's agent: write the agent's copy into the run directory (plan.bound_agent_path,
    the ranks' PYTHONPATH) and return its directory; None when the image brings its own."""
    if bound_agent_path(run, image) is None:
        return None
    return str(imageagent.install(run.path.resolve()))


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


def reproduce(source: Path, *, name: str | None, allow_drift: bool, chronicle: Chronicle,
              on_progress: Callable[[Progress], None] = lambda p: None) -> tuple[RunDir, RunState]:
    """Relaunch a run with its resolved config and the same image digest, as a new run beside it, through the
    run's own launcher (a Slurm run is submitted as a Slurm job: RunState.PENDING)."""
    src = RunDir(source).require()
    resolved = src.load_resolved()
    stamp = src.load_manifest()
    if not isinstance(resolved.get("name"), str) or not resolved["name"]:
        raise RkitError(f"{src.resolved}: holds no run name (name:); it is not the resolved config rkit wrote for "
                        "this run. Restore it from a copy of the run directory, or rerun the recipe with rkit run.")
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
    return execute(plan(recipe, resume=False, injections=[], image=image, extra_stamp=extra), chronicle,
                   on_progress=on_progress)


def dry_run(recipe: Recipe, injections: list[Injection], resume: bool = False) -> str:
    """`rkit run --dry-run`: the plan `rkit run` would execute (the sbatch argv and batch script, or each rank's
    command line and the variables rkit sets for it), redacted, written nowhere."""
    try:
        return plan(recipe, resume=resume, injections=injections).render()
    except ImageNotBuilt:  # the plan with the image the build will make
        image = unbuilt(recipe.config.image)
    return plan(recipe, resume=resume, injections=injections, image=image).render()


def _free_name(runs_dir: Path, base: str) -> str:
    if not (runs_dir / base).exists():
        return base
    n = 2
    while (runs_dir / f"{base}-{n}").exists():
        n += 1
    return f"{base}-{n}"
