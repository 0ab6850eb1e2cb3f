"""Plan, then execute. `plan()` works out, by reading only (the recipe, the image and its probe, the run directory
as it is now), everything `rkit run` (new or `--resume`) and `rkit reproduce` will do: the image, the run directory
and whether it is new or continued, what a resume changes, the training environment, the container and its binds,
and the request that starts it: the sbatch argv and batch script (Slurm) or the first attempt's ranks (local).
`rkit run --dry-run` prints `LaunchPlan.render()`; `runner.execute` runs the very same plan, once it has checked
under the run's lock that what the plan read has not changed since ("changed since planned")."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rkit.backends.local.launcher import Container, LocalBackend
from rkit.backends.slurm.steps import StepPreview
from rkit.contract.config import Config
from rkit.contract.errors import Problem, RecipeError, RkitError
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir
from rkit.contract.stamp import canonical_json, hashed_config, is_secret_name, redact
from rkit.images import probe as imageagent
from rkit.images.identity import NOT_BUILT, ImageIdentity
from rkit.images.identity import resolve as resolve_image
from rkit.images.store import FLAVORS, apptainer, locked_version
from rkit.recipe import datacheck, maxtext_keys
from rkit.recipe.load import Recipe, load_recipe, placed, recipe_lines
from rkit.recipe.yaml_text import PATH_CHARS_WHY, unsafe_path_chars
from rkit.run import cadence
from rkit.run.attempt import attempt_request, default_jax_cache_dir
from rkit.run.lock import RunLock
from rkit.runtime import determinism, manifest
from rkit.runtime.inject import Injection
from rkit.runtime.trainers import localtier, maxtext

RESOLVE = object()  # plan(image=RESOLVE): resolve the recipe's image (the default)


@dataclass
class LaunchPlan:
    """What one `rkit run` / `--resume` / `reproduce` does; nothing of it is written until `runner.execute`."""

    recipe: Recipe | None  # None: `rkit supervise`'s plan, made from the run directory inside the batch job
    config: Config
    run: RunDir
    continuing: bool  # the run directory exists: --resume continues it
    image: ImageIdentity | None
    injections: list[Injection]
    host_env: dict[str, str]
    base_env: dict[str, str]  # each training process's environment, before what changes per attempt
    jax_cache_dir: str
    first_attempt: int
    changes: dict[str, list] = field(default_factory=dict)  # what --resume changes: {dotted key: [old, new]}
    training_change: str | None = None  # what those changes change in what MaxText derives (the schedule)
    extra_stamp: dict[str, Any] = field(default_factory=dict)  # reproduce: where the run came from
    backend: LocalBackend | None = None  # local: the launcher the supervisor runs the attempts with
    first_request: Any = None  # what the first attempt starts: LaunchRequest (local), StepRequest (slurm, shown)
    batch: Any = None  # slurm: the sbatch request (backends/slurm/launcher.BatchRequest)
    excluded: list[str] = field(default_factory=list)  # supervise: the nodes earlier attempts excluded

    @property
    def launcher(self) -> str:
        return self.config.launcher

    def render(self) -> str:
        """`rkit run --dry-run`: the plan as text, secrets redacted."""
        state = (f"continued by --resume: attempt {self.first_attempt} next" if self.continuing else "new")
        source, config_hash = ((self.recipe.source, self.recipe.config_hash) if self.recipe else
                               (str(self.run.resolved), "of resolved.json"))
        out = [f"# rkit run --dry-run: {source}, config hash {config_hash}",
               f"# run directory {self.run.path.resolve()} ({state})",
               (f"# image {self.image.path} ({self.image.sha256})" if self.image.sha256 != NOT_BUILT else
                f"# image {self.image.path} ({NOT_BUILT}: `make image FLAVOR={self.image.flavor}` builds it)")
               if self.image
               else "# image: none (this Python environment)"]
        out += [f"# --resume changes {key}: {redact(old)!r} -> {redact(new)!r}"
                for key, (old, new) in self.changes.items()]
        if self.training_change:
            out.append(f"# and with it the training: {self.training_change}")
        if self.batch is not None:
            step = self.first_request
            changed = {k: v for k, v in sorted(step.env.items()) if self.host_env.get(k) != v}
            return "\n".join([
                *out, "# sbatch argv, one item per line:", *(f"#   {redact(a)}" for a in self.batch.argv),
                self.batch.script.rstrip("\n"),
                f"# attempt {step.attempt}'s job step, started by the supervisor inside the job on the allocation's "
                f"first {len(step.nodes)} healthy node(s), named when it starts; log {step.log}:",
                shlex.join(redact(step.argv)), *(f"  {k}={shlex.quote(str(v))}" for k, v in redact(changed).items()),
                "# with the job's environment (--export=ALL); each task's rank is its SLURM_PROCID."])
        for rank in self.first_request.ranks:
            changed = {k: v for k, v in sorted(rank.env.items()) if self.host_env.get(k) != v}
            out += [f"# rank {rank.rank}: log {rank.log}", shlex.join(rank.argv),
                    *(f"  {k}={shlex.quote(str(v))}" for k, v in redact(changed).items())]
        return "\n".join(out)


def run_path(recipe: Recipe) -> RunDir:
    return RunDir(Path(recipe.config.runs_dir) / recipe.name)


VIRTUAL_FILE_SYSTEMS = ("/proc", "/sys", "/dev")  # /dev/shm is memory-backed storage: allowed


def runs_dir_problems(recipe: Recipe) -> list[Problem]:
    """runs_dir checked like any path before anything is written: a directory, or one rkit can make (its nearest
    existing part is a writable directory), never on the kernel's virtual file systems."""
    given = Path(recipe.config.runs_dir)
    path = given.expanduser().absolute()
    why = None
    virtual = [v for v in VIRTUAL_FILE_SYSTEMS if path == Path(v) or Path(v) in path.parents]
    if virtual and not (path == Path("/dev/shm") or Path("/dev/shm") in path.parents):
        why = f"is on {virtual[0]}, a virtual file system, not storage"
    else:
        existing = path
        while not os.path.lexists(existing) and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            why = f"is not a directory ({existing} is {'a file' if existing.is_file() else 'not a directory'})"
        elif existing != path and not os.access(existing, os.W_OK | os.X_OK):
            why = f"cannot be made: {existing} is not writable"
    return [Problem("runs_dir", f"{str(given)!r} {why}; set runs_dir to a directory on storage you can write (the "
                                "default is runs, beside the command).")] if why else []


def plan(recipe: Recipe, *, resume: bool, injections: list[Injection], image: Any = RESOLVE,
         extra_stamp: dict[str, Any] | None = None) -> LaunchPlan:
    """Everything `runner.execute` will do, read and worked out now; a user mistake is an RkitError here, before
    anything is written. `image`: the recipe's image resolved (RESOLVE) or already identified (reproduce)."""
    image = resolve_image(recipe.config.image) if image is RESOLVE else image
    if (note := refuse_together(recipe, image, unbuilt=image is not None and image.sha256 == NOT_BUILT)) is not None:
        print(f"rkit: {note}", file=sys.stderr)
    run = run_path(recipe)
    if bad := unsafe_path_chars(str(run.path.resolve())):
        raise RkitError(f"{run.path.resolve()}: the run directory's path holds {bad}, {PATH_CHARS_WHY}; set "
                        "runs_dir (or run from) a directory without them.")
    continuing = os.path.lexists(run.path)
    changes: dict[str, list] = {}
    why = None
    if continuing:
        refuse_existing(run, recipe, resume)
        run.refuse_planted_links()
        RunLock.refuse_if_held(run)
        changes = check_resume(run, recipe, image)
        why = maxtext_keys.schedule_change(run.load_resolved(), recipe.resolved) if changes else None
    first = max(run.attempt_numbers(), default=0) + 1 if continuing else 1
    host = dict(os.environ)
    common = dict(recipe=recipe, config=recipe.config, run=run, continuing=continuing, image=image,
                  injections=list(injections), host_env=host, base_env=training_env(recipe.config, image, host),
                  jax_cache_dir=default_jax_cache_dir(), first_attempt=first, changes=changes, training_change=why,
                  extra_stamp=dict(extra_stamp or {}))
    # checkpoint.period auto or a time: the period the first attempt would get, from what the runs directory measured
    period = cadence.for_attempt(run, recipe.config, recipe.resolved)[0].period \
        if recipe.config.checkpoint.auto else None
    in_trainer = [i for i in injections if i.in_trainer]
    res, resilience = recipe.config.resources, recipe.config.resilience
    binds = (str(run.path.resolve()), common["jax_cache_dir"], *localtier.binds(recipe.config))
    if recipe.config.launcher == "slurm":
        from rkit.backends.slurm import launcher as slurm

        if image is not None:
            slurm.check_container_launch(recipe.config.slurm.container_launch)
        python = recipe.config.slurm.python or sys.executable
        batch = slurm.render_batch(run, recipe.config, python)
        step = StepPreview(
            tasks_per_node=res.processes_per_node,
            container_launch=recipe.config.slurm.container_launch, sif=image.path if image else None, binds=binds,
            gpu_flags=tuple(image.gpu_flags) if image else (), python=python,
            image_python=image.python if image else "/opt/venv/bin/python", agent_path=bound_agent_path(run, image))
        request = attempt_request(step, recipe.config, run, image, common["base_env"], host, common["jax_cache_dir"],
                                  first, in_trainer, RunDir(run.path.resolve()).attempt_dir(first), period=period)
        return LaunchPlan(**common, batch=batch, first_request=request)
    if recipe.config.checkpoint.local_dir:  # this machine is the node: an unset variable is a mistake found now
        localtier.expand(recipe.config.checkpoint.local_dir, {**host, **common["base_env"]})
    container = None
    if image is not None:
        container = Container(apptainer=apptainer(), sif=image.path, gpu_flags=tuple(image.gpu_flags), binds=binds,
                              python=image.python, agent_path=bound_agent_path(run, image))
    backend = LocalBackend(container=container,
                           warm_standby=resilience.standby_on(res.processes_per_node * res.nodes, os.cpu_count()),
                           jax_heartbeat_seconds=resilience.local_jax_heartbeat_seconds, nodes=res.nodes,
                           processes_per_node=res.processes_per_node)
    # Every injection is pending at a start: execute's run.submitted / run.resumed event begins their count.
    request = attempt_request(backend, recipe.config, run, image, common["base_env"], host, common["jax_cache_dir"],
                              first, in_trainer, run.attempt_dir(first), period=period)
    return LaunchPlan(**common, backend=backend, first_request=request)


def plan_supervised(run: RunDir, host: dict[str, str]) -> LaunchPlan:
    """`rkit supervise`, inside the batch job: the plan from the run directory (the config and image it was
    stamped with, the injections its submission carried, the nodes earlier attempts excluded). Its attempts'
    requests are made when they start (attempt_request): which nodes are healthy is known only then."""
    run.refuse_planted_links()
    config = Config.from_resolved(run.load_resolved())
    stamp = run.load_manifest()
    events = run.events()
    submitted = [e for e in events if e.get("event") == EV.JOB_SUBMITTED]
    injections = [Injection.from_dict(d) for d in (submitted[-1].get("injections", []) if submitted else [])]
    excluded = next((e.get("excluded") or [] for e in reversed(events) if e.get("event") in (
        EV.NODES_EXCLUDED, EV.NODES_REJOINED)), [])
    excluded = [n for n in excluded if isinstance(n, str)]  # a damaged event names no node
    image = None
    if stamp.get("image", {}).get("kind") == "sif":
        image = ImageIdentity(**{k: v for k, v in stamp["image"].items() if k != "kind"})
    return LaunchPlan(recipe=None, config=config, run=run, continuing=True, image=image, injections=injections,
                      host_env=host, base_env=training_env(config, image, host),
                      jax_cache_dir=default_jax_cache_dir(), first_attempt=max(run.attempt_numbers(), default=0) + 1,
                      excluded=list(excluded))


def refuse_existing(run: RunDir, recipe: Recipe, resume: bool) -> None:
    """A run directory that exists: only --resume continues it, and only an rkit run."""
    if not resume:
        raise RkitError(f"{run.path}: a run named {recipe.name!r} already exists. Continue it with "
                        f"`{recipe.command('--resume')}`, or start another with "
                        f"`{recipe.command('-o', 'name=NEW', drop=('name',))}`.")
    if not run.exists():
        raise RkitError(f"{run.path}: exists but is not an rkit run (no resolved.json); move it away "
                        "or pick a new name with -o name=NEW.")


def bound_agent_path(run: RunDir, image: ImageIdentity | None) -> str | None:
    """For an image without this rkit's agent: where execute writes the agent's copy (the ranks' PYTHONPATH);
    None when the image brings its own."""
    if image is None or image.agent != "bound":
        return None
    return str(run.path.resolve() / imageagent.AGENT_DIR)


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
    # checkpoint.keep is retention, not training: a run started when it defaulted to null resumes with 3
    training = sorted(k for k in _changed_keys(hashed_config(recorded), hashed_config(recipe.resolved))
                      if k not in ("trainer.steps", "checkpoint.keep"))
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


def training_env(config: Config, image: ImageIdentity | None, host: dict[str, str]) -> dict[str, str]:
    """The environment of each training process: the recipe's env on top of the host's. In a container
    (--cleanenv) only the variables that shape training (XLA_*, JAX_*, ...) and secrets such as HF_TOKEN
    are carried in; without one, the whole host environment is inherited."""
    extra = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in config.env.items()}
    if image is not None:
        carried = {k: v for k, v in host.items() if k.startswith(manifest.ENV_PREFIXES) or is_secret_name(k)}
        return _deterministic(config, {**carried, **extra})
    env = _deterministic(config, {**host, **extra})
    # The agent is rkit's own module: make sure the training Python can import it.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


def _deterministic(config: Config, env: dict[str, str]) -> dict[str, str]:
    """reproducibility.deterministic: its switches on top of everything else (determinism.py)."""
    return determinism.apply(env) if config.reproducibility.deterministic else env


def refuse_together(recipe: Recipe, image: ImageIdentity | None, before: list[Problem] | None = None, *,
                    unbuilt: bool = False) -> str | None:
    """The data settings (recipe/datacheck.py) and trainer.overrides against the MaxText that will train
    (recipe/maxtext_keys.py; `unbuilt`: the recipe's image is not at hand, so the host's MaxText answers when it
    is the version the image's lock pins), with `before` (the schema's problems): one RecipeError naming every
    problem, each at its line or -o option, before anything exists. Returns the note of a check that cannot be
    made here (no MaxText to ask): MaxText checks its keys at start-up."""
    found = placed(runs_dir_problems(recipe) + datacheck.problems(recipe.config, recipe.config.launcher),
                   recipe_lines(recipe), recipe.overrides)
    note = None
    flavor = recipe.config.image if unbuilt and recipe.config.image in FLAVORS else None
    locked = locked_version(flavor, "maxtext") if flavor else None
    if unbuilt and locked is None:
        note = ("note: trainer.overrides not checked against MaxText: the image is not at hand" +
                (f" and containers/lock/{flavor}.txt pins no MaxText" if flavor else ""))
    else:
        try:
            note = maxtext_keys.safe_check(recipe, None if unbuilt else image, locked)
        except RecipeError as exc:
            found += exc.problems
    named = {p.path for p in before or []}
    if problems := [*(before or []), *(p for p in found if p.path not in named)]:
        raise RecipeError(recipe.source, problems)
    return note


def load_checked(path: Path, overrides: tuple[str, ...], *, whole: bool = False) -> tuple[Recipe, str | None]:
    """`rkit validate` (`whole`) and `rkit run`: the recipe loaded and checked as a whole, every problem at once
    (the schema's, the data settings', MaxText's keys'): one RecipeError, exit 2. MaxText's keys are asked of the
    recipe's image where it is at hand, else of this host's MaxText when it is the version the image locks (a note
    says which, or that they were not checked). `run` checks a recipe the schema takes in plan(), as `reproduce`
    does. Returns the recipe and the note."""
    try:
        recipe, before = load_recipe(path, overrides), None
    except RecipeError as exc:
        if exc.partial is None:
            raise
        recipe, before = exc.partial, exc.problems
    if before is None and not whole:
        return recipe, None
    try:
        image = resolve_image(recipe.config.image)
    except RkitError as exc:
        note = refuse_together(recipe, None, before, unbuilt=True)
        return recipe, note and f"{note}: {exc}"
    return recipe, refuse_together(recipe, image, before)
