"""MaxText: its command line from a recipe, its committed checkpoints, its config files.

Host side only needs the standard library; `resolve_base_config` runs in the training environment.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rkit.contract.errors import RkitError
from rkit.contract.rundir import RunDir
from rkit.contract.stamp import REDACTED, is_secret_name, redact_value
from rkit.runtime.telemetry.metrics import batch_fingerprint
from rkit.runtime.trainers import datapos, localtier
from rkit.runtime.trainers.orbaxdirs import (  # noqa: F401 - readers reach them through this module
    TMP_MARKER,
    check_step,
    committed_in,
    data_position,
    local_step_problem,
    positions_in,
    step_dirs_in,
    step_problem,
    triage,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from rkit.contract.config import Config

MODULE = "maxtext.trainers.pre_train.train"

# MaxText settings that rkit owns (maxtext_overrides and rank_overrides set them); a recipe sets them through
# its own sections, and the recipe loader refuses them in trainer.overrides.
OWNED_KEYS = {
    "steps": "trainer.steps",
    "base_output_directory": "runs_dir (rkit puts MaxText's output in the run directory)",
    "run_name": "name (rkit sets MaxText's run_name so resume is automatic)",
    "metrics_file": "nothing (rkit writes metrics/<rank>.jsonl)",
    "enable_checkpointing": "checkpoint.period (checkpointing is always on: resume needs it)",
    "checkpoint_period": "checkpoint.period",
    "max_num_checkpoints_to_keep": "checkpoint.keep",
    "async_checkpointing": "checkpoint.async",
    "enable_autocheckpoint": "nothing (rkit turns it on: a SIGTERM saves at the preemption sync point)",
    "jax_cache_dir": "the RKIT_JAX_CACHE_DIR environment variable",
    "skip_jax_distributed_system": "resources.processes_per_node (rkit sets up jax.distributed)",
    "enable_emergency_checkpoint": "checkpoint.local_dir (rkit builds the emergency manager so that it works)",
    "local_checkpoint_directory": "checkpoint.local_dir",
    "local_checkpoint_period": "checkpoint.local_period",
}


def _render(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return json.dumps(value)
    return str(value)


def maxtext_overrides(config: Config, run: RunDir, jax_cache_dir: str, gradient_accumulation_steps: int | None = None,
                      checkpoint_period: int | None = None) -> list[str]:
    """MaxText key=value arguments, the same for every rank: the recipe's overrides, then the settings rkit
    owns. Each rank's agent adds its own `metrics_file` (see `rank_overrides`). An attempt on fewer nodes than
    the recipe's (run/elastic.py) gives the accumulation that keeps its global batch; with checkpoint.period
    auto, the period chosen for the attempt (run/cadence.py)."""
    ckpt = config.checkpoint
    overrides = dict(config.trainer.overrides or {})
    if gradient_accumulation_steps is not None:
        overrides["gradient_accumulation_steps"] = gradient_accumulation_steps
    args = [f"{k}={_render(v)}" for k, v in sorted(overrides.items()) if v is not None]
    owned = {
        "steps": config.trainer.steps,
        "base_output_directory": str(run.maxtext_base.resolve()),
        "run_name": run.maxtext_run_name,
        "enable_checkpointing": True,
        "checkpoint_period": checkpoint_period or ckpt.fixed_period or 100,
        "async_checkpointing": ckpt.asynchronous,
        # Without it MaxText stops at the preemption sync point *without* saving (only period steps are saved).
        "enable_autocheckpoint": True,
        "jax_cache_dir": jax_cache_dir,
    }
    if ckpt.keep:
        owned["max_num_checkpoints_to_keep"] = ckpt.keep
    if ckpt.local_dir:  # the node-local tier (localtier.py); each rank adds its own directory (rank_overrides)
        owned["enable_emergency_checkpoint"] = True
        owned["local_checkpoint_period"] = localtier.period(config, int(owned["checkpoint_period"]))
    if config.processes == 1:
        owned["skip_jax_distributed_system"] = True
    args.extend(f"{k}={_render(v)}" for k, v in owned.items())
    return args


def rank_overrides(run: RunDir, attempt: int, rank: int, local_root: Path | None = None) -> list[str]:
    """The per-process part: MaxText's metrics file, one per rank and attempt (two ranks writing one file lose
    lines; MaxText truncates it when it starts from step 0). The agent turns it into metrics/<rank>.jsonl. With a
    local tier, the run's directory on this node (checkpoint.local_dir expanded here: localtier.run_root)."""
    args = [f"metrics_file={run.maxtext_metrics_file(attempt, rank).resolve()}"]
    if local_root is not None:
        args.append(f"local_checkpoint_directory={local_root}")
    return args


def committed_steps(run: RunDir) -> list[int]:
    """Steps with a committed checkpoint in the run directory (the persistent tier)."""
    return committed_in(run.orbax_dir)


def final_committed(run: RunDir, final_step: int) -> bool:
    """Whether the run's final step is committed in the run directory: only there is a run finished (a final
    step held only by the node-local tier is on disks the job's end may wipe: localtier.LocalTier.check)."""
    steps = committed_steps(run)
    return bool(steps) and steps[-1] >= final_step


def latest_committed_step(run: RunDir) -> int | None:
    """The newest committed step in any tier: the run directory's, and the node-local tier's as its ranks
    recorded it (localtier.py: a step one data-parallel replica holds whole)."""
    steps = committed_steps(run)
    local = localtier.newest_restorable(run)
    return max([*steps[-1:], *([] if local is None else [local])], default=None)


def resume_data_position(run: RunDir, step: int | None) -> dict[str, object] | None:
    """Where the data resumes with `step`: Grain's position per process saved with it, in the step's own `iter`
    item, or (the node-local tier's runs, whose Orbax steps have none) in rkit's data-position folder."""
    if step is None:
        return None
    return data_position(run.orbax_dir / str(step)) or positions_in(datapos.directory(run) / str(step))


def step_dirs(run: RunDir) -> dict[int, Path]:
    """Every step directory MaxText would see in the run directory (committed or not)."""
    return step_dirs_in(run.orbax_dir)


def quarantine(run: RunDir, step: int) -> Path | None:
    """Move a step directory MaxText must not restore from to checkpoints/quarantine/<step>[-n]; kept for a
    post-mortem, out of Orbax's sight."""
    source = run.orbax_dir / str(step)
    if not source.is_dir():
        return None
    target = run.quarantine_dir / str(step)
    n = 2
    while target.exists():
        target = run.quarantine_dir / f"{step}-{n}"
        n += 1
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(source, target)
    return target


def prune_quarantine(run: RunDir) -> list[str]:
    """Quarantined steps older than the run directory's newest committed step, removed: no restore can pick them
    (their reason stays in the run's checkpoint.quarantined event). The names removed."""
    steps = committed_steps(run)
    try:
        entries = list(os.scandir(run.quarantine_dir)) if steps else []
    except (FileNotFoundError, NotADirectoryError):
        return []
    gone = []
    for entry in sorted(entries, key=lambda e: e.name):
        step = entry.name.partition("-")[0]
        if entry.is_dir(follow_symlinks=False) and step.isascii() and step.isdigit() and int(step) < steps[-1]:
            shutil.rmtree(entry.path, ignore_errors=True)
            gone.append(entry.name)
    return gone


def resolve_base_config(name: str) -> str:
    """A path as given, else a file inside the installed MaxText's configs directory."""
    if os.path.isfile(name):
        return os.path.abspath(name)
    spec = importlib.util.find_spec("maxtext")
    if spec is None or not spec.submodule_search_locations:
        raise RkitError("MaxText is not installed in the training environment; run `make setup` "
                        "(or use an image that has it).")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "configs" / name
        if candidate.is_file():
            return str(candidate)
    raise RkitError(f"trainer.base_config: {name!r} is neither a file nor a config shipped with MaxText "
                    f"(looked in {', '.join(spec.submodule_search_locations)}/configs).")


def set_assets_root(environ: dict[str, str] | os._Environ) -> str | None:
    """MaxText finds a bare tokenizer name (`tokenizer_path: tokenizer.default`) under MAXTEXT_ASSETS_ROOT, which
    it derives from a source checkout's layout (src/maxtext/assets): an installed MaxText has its assets beside
    its modules. Set before MaxText is imported, unless the environment names its own."""
    if environ.get("MAXTEXT_ASSETS_ROOT"):
        return None
    spec = importlib.util.find_spec("maxtext")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(location) / "assets" / "tokenizers").is_dir():
            environ["MAXTEXT_ASSETS_ROOT"] = str(Path(location) / "assets")
            return environ["MAXTEXT_ASSETS_ROOT"]
    return None


def hook_the_train_loop(on_step: Callable[[int], None],
                        on_batch: Callable[[int, tuple[str, int] | None], None] | None = None) -> None:
    """In the training environment, before MaxText's train.main. Three hooks on the loop's per-step calls:

    - `on_batch(step, fingerprint)`: the training batch the step consumed on this process, fingerprinted
      (telemetry.metrics.batch_fingerprint) from the host copy MaxText's multi-host loader keeps of it (Grain,
      TFDS, HF: `last_local_data`); None where there is none (synthetic data is made on the device).

    - `on_step(step)` runs in the loop's own thread once each training step is dispatched, its save (if due)
      started and its metrics buffered: fault injections fire there, at exactly their step (fired from a
      thread that follows the metrics file, they came whole steps late, and a short run could finish first).
    - MaxText raises StopTraining inside the loop's `maybe_save_checkpoint` at the preemption sync point,
      before that step's metrics are buffered, so the step the save ends on had no metrics line. The raise is
      deferred until the step's train metrics are buffered; MaxText's final flush then writes them (an eval
      due at that step still runs first)."""
    from maxtext.common import checkpointing, data_loader, metric_logger
    from maxtext.utils import exceptions

    if getattr(checkpointing.maybe_save_checkpoint, "rkit_hooked", False):
        return
    pending: list[BaseException] = []
    loaded: list[tuple[str, int] | None] = [None]
    save, buffer = checkpointing.maybe_save_checkpoint, metric_logger.MetricLogger.buffer_and_write_metrics
    load = data_loader.DataLoader.load_next_batch_pre_sharding

    def load_next_batch_pre_sharding(self):
        batch = load(self)
        local = getattr(getattr(self, "data_iterator", None), "last_local_data", None)
        inputs = local.get("inputs") if isinstance(local, dict) else None
        loaded[0] = None if inputs is None else batch_fingerprint(inputs)
        return batch

    def maybe_save_checkpoint(checkpoint_manager, state, config, data_iterator, step=None):
        datapos.ITERATOR[0] = data_iterator  # the node-local tier's saves write its position (datapos.py)
        try:
            return save(checkpoint_manager, state, config, data_iterator, step)
        except exceptions.StopTraining as exc:
            if step is None:  # the save after the loop: no step's metrics follow
                raise
            pending.append(exc)
            return None

    def buffer_and_write_metrics(self, metrics, step, step_time_delta=None, is_training=True):
        buffer(self, metrics, step, step_time_delta, is_training)
        if not is_training:
            return
        if on_batch is not None:
            on_batch(int(step), loaded[0])
        on_step(int(step))
        if pending:
            raise pending.pop()

    maybe_save_checkpoint.rkit_hooked = True  # type: ignore[attr-defined]
    checkpointing.maybe_save_checkpoint = maybe_save_checkpoint
    metric_logger.MetricLogger.buffer_and_write_metrics = buffer_and_write_metrics
    data_loader.DataLoader.load_next_batch_pre_sharding = load_next_batch_pre_sharding


def guard_the_preemption_sync_point() -> None:
    """In the training environment, before MaxText's train.main. JAX's preemption sync point is the fastest
    process's last step given to `reached_preemption_sync_point` + 1, and it is reached only by a call with exactly
    that step. Orbax's CheckpointManager asks too, from its save-finalize thread, with the step it saved: when an
    async save finishes just after the loop asked for the next step, JAX's counter goes back to the saved step,
    and a SIGTERM then sets the sync point to a step the loop has passed. The save never comes, and the ranks train
    on to the next period (the fault campaign, seed 1: a preemption as step 230's save finished saved at 250, 20
    steps later; at a real step time, past the signal's grace). A step below the highest asked is answered here,
    False, without reaching JAX's counter."""
    import threading

    from jax.experimental import multihost_utils

    reached = multihost_utils.reached_preemption_sync_point
    if getattr(reached, "rkit_hooked", False):
        return
    lock, highest = threading.Lock(), [-1]

    def reached_preemption_sync_point(step_id: int) -> bool:
        with lock:
            if step_id < highest[0]:
                return False  # a step already passed (a save's finalize thread): JAX's counter stays the loop's
            highest[0] = step_id
            return reached(step_id)

    reached_preemption_sync_point.rkit_hooked = True  # type: ignore[attr-defined]
    multihost_utils.reached_preemption_sync_point = reached_preemption_sync_point


def restore_elastic_positions_at_any_count() -> None:
    """In the training environment, before MaxText's train.main. Grain's ElasticIterator keeps one global
    position (global_next_index) that is meant to restore on any process count, but MaxText 0.2.5 only knows it by
    its dataset type, while its loader holds the iterator made from it: each process saves the global position as
    its own process_<i>-of-<n>.json, and a restore on another process count fails MaxText's count check. An elastic
    position saved by n processes is restored here from process 0's file, once every file is seen to hold the same
    global position (a per-process position is never carried over: resources.min_nodes refuses it)."""
    import jax
    from maxtext.common import grain_utility

    if getattr(grain_utility.for_restore, "rkit_hooked", False):
        return
    for_restore = grain_utility.for_restore

    def restore(checkpoint_manager, step, data_iterator, expansion_factor_real_data):
        local = getattr(data_iterator, "local_iterator", None)
        state = local.get_state() if hasattr(local, "get_state") else None
        if not (isinstance(state, dict) and "global_next_index" in state):  # a per-process position: MaxText's
            return for_restore(checkpoint_manager, step, data_iterator, expansion_factor_real_data)
        directory = Path(str(checkpoint_manager.directory)) / str(step) / "iter"
        stored = sorted(directory.glob("process_*-of-*.json"))
        if stored and len(stored) != jax.process_count():
            saved = {json.dumps(json.loads(path.read_text()), sort_keys=True) for path in stored}
            if len(saved) != 1:
                raise RkitError(f"{directory}: the {len(stored)} processes saved different elastic positions; "
                                "the data order cannot be carried over to another process count")
            return grain_utility.GrainCheckpointable(local, restore_process_index=0,
                                                     restore_process_count=len(stored))
        return for_restore(checkpoint_manager, step, data_iterator, expansion_factor_real_data)

    restore.rkit_hooked = True  # type: ignore[attr-defined]
    grain_utility.for_restore = restore


def route_tensorboard(run: RunDir) -> None:
    """In the training environment, before MaxText's train.main: MaxText's TensorBoard summaries go to
    <run>/tensorboard/ (`tensorboard --logdir runs/` shows one line per run, every attempt of it on one
    curve), not to the tensorboard_dir MaxText derives from base_output_directory and run_name
    (<run>/checkpoints/tensorboard/checkpoints/). MaxText's own switch, enable_tensorboard, still decides
    whether anything is written; its Vertex AI upload is not touched. Its text summaries are redacted."""
    from maxtext.utils import max_utils

    if getattr(max_utils.initialize_summary_writer, "rkit_hooked", False):
        return
    initialize = max_utils.initialize_summary_writer

    def initialize_summary_writer(tensorboard_dir, run_name, enable_tensorboard=True):
        # MaxText joins the two: <run>/tensorboard
        return initialize(str(run.path.resolve()), run.tensorboard_dir.name, enable_tensorboard)

    add_text = max_utils.add_text_to_summary_writer
    # MaxText writes its whole config as text summaries, hf_access_token (read from HF_TOKEN) included: the run
    # directory holds no secret, so a secret-named key's value, a URL's password, a private key block and the
    # value of any secret-named variable of this process are replaced, as in every manifest (stamp.redact).
    planted = sorted({v for k, v in os.environ.items() if is_secret_name(k) and len(v) >= 4}, key=len, reverse=True)

    def add_text_to_summary_writer(key, value, summary_writer):
        text = REDACTED if is_secret_name(str(key)) else redact_value(str(value), REDACTED)
        for secret in planted:
            text = text.replace(secret, REDACTED)
        return add_text(key, text, summary_writer)

    initialize_summary_writer.rkit_hooked = True  # type: ignore[attr-defined]
    max_utils.initialize_summary_writer = initialize_summary_writer
    max_utils.add_text_to_summary_writer = add_text_to_summary_writer


def after_initialize(then: Callable[[Any], None]) -> None:
    """In the training environment, before MaxText's train.main: `then(config)` runs right after MaxText's
    train.initialize (which sets JAX's default PRNG to unsafe_rbg) and before the model is built."""
    from maxtext.trainers.pre_train import train

    if getattr(train.initialize, "rkit_hooked", False):
        return
    initialize = train.initialize

    def initialize_then(argv):
        out = initialize(argv)
        then(out[0] if isinstance(out, tuple) and out else None)
        return out

    initialize_then.rkit_hooked = True  # type: ignore[attr-defined]
    train.initialize = initialize_then


def credentials_given(config: Any) -> list[str]:
    """The credential settings MaxText holds after its set-up (of the keys it never logs itself), by name, never by
    value: hf_access_token, which MaxText reads from HF_TOKEN in the rank's environment (the route for a
    credential; the recipe refuses them)."""
    from maxtext.configs import pyconfig

    get_keys = getattr(config, "get_keys", None)  # MaxText's HyperParameters
    keys = get_keys() if callable(get_keys) else {}
    secret = set(getattr(pyconfig, "KEYS_NO_LOGGING", ("hf_access_token",)))  # the keys MaxText itself never logs
    return sorted(str(k) for k, v in keys.items() if k in secret and v)


def mesh_record(config: Any, devices: int) -> dict[str, Any]:
    """What an attempt trains on, from MaxText's resolved config: its devices, the mesh's axes that are not 1
    (an auto axis, -1, as the size it takes: within a slice for ici_*, across slices for dcn_*) and the batch
    (per device, accumulation, global): an elastic run's attempts differ here (run/elastic.py)."""
    slices = max(1, int(getattr(config, "num_slices", 1) or 1))
    mesh: dict[str, int] = {}
    for prefix, total in (("ici", max(1, devices // slices)), ("dcn", slices)):
        sizes = {name: int(getattr(config, f"{prefix}_{name}_parallelism", 1) or 1)
                 for name in getattr(config, "mesh_axes", ()) or ()}
        fixed = math.prod(value for value in sizes.values() if value > 0)  # the auto axis (-1) takes the rest
        for name, value in sizes.items():
            size = total // fixed if value == -1 else value
            if size != 1:
                mesh[f"{prefix}_{name}"] = size
    return {"devices": devices, "mesh": mesh,
            "per_device_batch_size": float(getattr(config, "per_device_batch_size", 0) or 0),
            "gradient_accumulation_steps": int(getattr(config, "gradient_accumulation_steps", 1) or 1),
            "global_batch": int(getattr(config, "global_batch_size_to_train_on", 0) or 0)}
