"""The node-local checkpoint tier (`checkpoint.local_dir`): MaxText's emergency checkpointing, built so that it
works, and rkit's records of what each tier holds.

MaxText 0.2.5's `enable_emergency_checkpoint` builds Orbax's emergency.CheckpointManager: the first data-parallel
replica saves every `checkpoint_period` steps to the shared run directory (the persistent tier), every other
replica every `local_checkpoint_period` steps to its own node's storage (the local tier); a restore takes the
newest step that one replica holds whole, from local storage, else the newest persistent step. As MaxText builds
it, it does not work (ci/studies/orbax-local-tier/README.md); `hook` carries the four fixes:

1. Orbax's process-id maps after jax.distributed (MaxText sets them up only for hardware=gpu_multiprocess);
2. a local directory per process (MaxText makes <local>/<process> only on GPUs: processes sharing one fail);
3. `replica_axis_index` = MaxText's `data` mesh axis (MaxText passes none, so Orbax takes axis 0, diloco, of size
   1, sees one replica and silently keeps no local checkpoints);
4. typed PRNG keys saved and restored as their raw data (Orbax's local restore broadcasts each leaf with jnp.sum,
   which refuses MaxText's `key<urbg>` leaves, and the processes then hang in jax.distributed's shutdown).

And two of rkit's own: after a restore of step S every process deletes its local steps newer than S (a replica
left holding a newer step skips saving it while the others save it: a deadlock in the next save's collective);
each rank records its committed local steps in <run>/checkpoints/local-tier/rank-<r>.json, so that the
supervisor (which cannot read another node's disk) counts them as committed, `rkit status` says which tier each
step is in, and a restore from an older step than the local tier had is said (`checkpoint.restored`), not silent.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rkit.contract.errors import RkitError
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir, write_json_atomic
from rkit.contract.safeio import load_json
from rkit.runtime.trainers import datapos
from rkit.runtime.trainers.orbaxdirs import committed_in, local_step_problem, step_dirs_in

if TYPE_CHECKING:
    from collections.abc import Callable

    from rkit.contract.config import Config

RECORD_PREFIX = "rank-"
DATA_AXIS = "data"  # MaxText's data-parallel axis whose every index holds the whole state (fsdp shards it)
KEEP = 2  # local steps each process keeps: a damaged newest still leaves one


def period(config: Config, persistent_period: int) -> int:
    """The local tier's period: checkpoint.local_period, else a tenth of the persistent period (at least 1)."""
    given = config.checkpoint.local_period
    return int(given) if given else max(1, int(persistent_period) // 10)


def expand(local_dir: str, environ: dict[str, str] | os._Environ | None = None) -> Path:
    """checkpoint.local_dir on this node: its $VAR / ${VAR} expanded from this process's environment (Slurm's
    $SLURM_TMPDIR, $TMPDIR); an unset variable is an error, never a directory named after it."""
    env = os.environ if environ is None else environ

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if not env.get(name):
            raise RkitError(f"checkpoint.local_dir: {local_dir!r}: ${name} is not set on this node; set it in the "
                            "job's environment or give a path.")
        return env[name]

    path = Path(re.sub(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))", value, local_dir))
    if not path.is_absolute():
        raise RkitError(f"checkpoint.local_dir: {local_dir!r} is {str(path)!r} here, not an absolute path.")
    return path


def run_root(local_dir: str, run: RunDir, environ: dict[str, str] | os._Environ | None = None) -> Path:
    """This run's directory in the node's local storage; Orbax keeps one directory per process under it."""
    return expand(local_dir, environ) / f"rkit-{run.name}"


def binds(config: Config) -> tuple[str, ...]:
    """What an image needs bound for the local tier: a plain checkpoint.local_dir (it must exist on every node).
    One with a variable is expanded only on the node, where srun starts Apptainer without a shell: it must lie
    where Apptainer mounts by itself (/tmp, /var/tmp: $SLURM_TMPDIR and $TMPDIR usually do)."""
    local = config.checkpoint.local_dir
    return (str(local),) if local and "$" not in local else ()


# ------------------------------------------------------------------ records (host side: the shared run directory)

def record_path(run: RunDir, rank: int) -> Path:
    return run.local_tier_dir / f"{RECORD_PREFIX}{rank}.json"


# records() per directory: its mtime when read, and what was read. The supervisor asks every poll (0.1 s) and a
# run has a record per rank on a shared file system: read again only when a rank rewrote one (a rename changes the
# directory's mtime), or while the last change is under RECENT_SECONDS old (two renames within the file system's
# mtime granularity would leave it unchanged).
_READ: dict[str, tuple[int, list[dict]]] = {}
RECENT_SECONDS = 2.0


def records(run: RunDir) -> list[dict]:
    """Each rank's last record of its local tier: rank, node, process, replica, replica_size, steps, path."""
    try:
        seen = os.stat(run.local_tier_dir)
    except OSError:
        return []
    key = str(run.local_tier_dir)
    cached = _READ.get(key)
    if cached is not None and cached[0] == seen.st_mtime_ns and time.time() - seen.st_mtime > RECENT_SECONDS:
        return cached[1]
    found = []
    try:
        paths = sorted(run.local_tier_dir.glob(f"{RECORD_PREFIX}*.json"))
    except OSError:
        return []
    for path in paths:
        try:  # a regular file only (a FIFO or device planted there must not hang a reader)
            value = load_json(path, "local-tier record", limit=1 << 20)
        except (RkitError, OSError):
            continue
        if isinstance(value, dict) and isinstance(value.get("steps"), list) \
                and all(isinstance(s, int) and not isinstance(s, bool) for s in value["steps"]):
            found.append(value)
    _READ[key] = (seen.st_mtime_ns, found)
    return found


def restorable(found: list[dict]) -> list[int]:
    """Steps one replica holds whole, as recorded: every process of the replica lists the step."""
    by_replica: dict[Any, list[dict]] = {}
    for rec in found:
        by_replica.setdefault(rec.get("replica"), []).append(rec)
    steps: set[int] = set()
    for replica, members in by_replica.items():
        size = members[0].get("replica_size")
        if replica is None or not isinstance(size, int) or len(members) < size:
            continue
        steps |= set.intersection(*(set(m["steps"]) for m in members))
    return sorted(steps)


def newest_restorable(run: RunDir) -> int | None:
    steps = restorable(records(run))
    return steps[-1] if steps else None


def tiers(run: RunDir) -> dict[str, Any]:
    """`rkit status`: the committed steps of each tier (the newest few) and each rank's local steps."""
    found = records(run)
    return {"persistent": committed_in(run.orbax_dir)[-3:], "local": restorable(found)[-3:],
            "ranks": [{k: r.get(k) for k in ("rank", "node", "replica", "steps")} for r in found if r.get("steps")]}


# ------------------------------------------------------------------ in the training environment

class LocalTier:
    """One rank's side of the local tier: the hooks into MaxText and Orbax, and its record."""

    def __init__(self, run: RunDir, attempt: int, rank: int, final_step: int, root: Path,
                 emit: Callable[..., Any]):
        self.run, self.attempt, self.rank, self.root, self.emit = run, attempt, rank, root, emit
        self.final_step = final_step
        self.last_step: int | None = None  # the newest step this process trained
        self.process_dir: Path | None = None
        self.replica: int | None = None
        self.replica_size: int | None = None
        self.manager: Any = None
        self.restored_tier: str | None = None
        self._seen: list[int] | None = None

    # -- the record

    def local_steps(self) -> list[int]:
        return committed_in(self.process_dir) if self.process_dir is not None else []

    def observe(self, step: int | None = None) -> None:
        """Rewrite this rank's record when its committed local steps changed (the loop calls it every step)."""
        if step is not None:
            self.last_step = step
        if self.process_dir is None:
            return
        steps = self.local_steps()
        if steps == self._seen:
            return
        self._seen = steps
        from rkit.runtime.telemetry.node import node_name

        self.run.local_tier_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(record_path(self.run, self.rank), {
            "rank": self.rank, "node": node_name(), "process": self.process, "replica": self.replica,
            "replica_size": self.replica_size, "steps": steps, "path": str(self.process_dir),
            "attempt": self.attempt, "t": time.time()})

    def wait_and_observe(self) -> None:
        """Pending local saves finished, then recorded (an injection that loses the local data waits for it)."""
        if self.manager is not None:
            self.manager.wait_until_finished()
        self.observe()

    def lose(self) -> None:
        """The rehearsal of a replaced node: this process's local data is gone."""
        self.wait_and_observe()
        if self.process_dir is not None:
            shutil.rmtree(self.process_dir, ignore_errors=True)

    def finish(self) -> None:
        """This process ends normally having trained the run's final step (whose save goes to the run directory,
        from the first replica): its local checkpoints have served and are removed (its record then lists none).
        A preempted process (stopped before the final step) keeps them."""
        if self.process_dir is None or self.last_step is None or self.last_step < self.final_step:
            return
        shutil.rmtree(self.process_dir, ignore_errors=True)
        self.observe()
        try:
            self.root.rmdir()  # the last process of this node to finish removes the run's directory
        except OSError:
            pass

    @property
    def process(self) -> int:
        import jax

        return int(jax.process_index())

    # -- integrity, before Orbax sees the directory

    def check(self) -> None:
        """Each local step Orbax would see but could not restore is moved to <local>/quarantine/ (a
        `checkpoint.quarantined` event with tier local)."""
        assert self.process_dir is not None
        for step, path in sorted(step_dirs_in(self.process_dir).items(), reverse=True):
            problem = local_step_problem(path)
            if problem is not None:
                self.quarantine(step, path, problem)

    def quarantine(self, step: int, path: Path, problem: str) -> None:
        target = self.root / "quarantine" / f"{self.process}-{step}"
        n = 2
        while target.exists():
            target = self.root / "quarantine" / f"{self.process}-{step}-{n}"
            n += 1
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        self.emit(EV.CHECKPOINT_QUARANTINED, step=step, tier="local", reason=problem, rank=self.rank,
                  attempt=self.attempt, moved_to=str(target))
        self.observe()

    def restore_failed(self, step: int, exc: BaseException) -> None:
        """Orbax could not restore this process's local step (a data file damaged where the files look whole):
        the step is moved aside, so that the next attempt restores from another replica or the run directory."""
        path = step_dirs_in(self.process_dir).get(step)
        if self.restored_tier == "local" and path is not None:
            self.quarantine(step, path, f"the restore failed: {type(exc).__name__}: {str(exc)[:300]}")

    # -- after a restore

    def purge_newer(self, step: int) -> list[int]:
        gone = []
        for s, path in step_dirs_in(self.process_dir).items() if self.process_dir is not None else ():
            if s > step:
                shutil.rmtree(path, ignore_errors=True)
                gone.append(s)
        return sorted(gone)

    def restored(self, step: int, seconds: float, data: str = "none") -> None:
        """Rank 0's `checkpoint.restored` event (`data`: its data position restored, missing or none). A restore
        older than the newest step the supervisor counted as
        committed when it started this attempt (attempt.started's resume_from_step: either tier's, the local one
        from the ranks' records) says which step was lost."""
        if self.rank != 0:
            return
        started = [e for e in self.run.events() if e.get("event") == EV.ATTEMPT_STARTED
                   and e.get("attempt") == self.attempt]
        recorded = started[-1].get("resume_from_step") if started else None
        recorded = recorded if isinstance(recorded, int) and not isinstance(recorded, bool) else None
        tier = self.restored_tier or "persistent"
        fields: dict[str, Any] = {"attempt": self.attempt, "rank": self.rank, "step": step, "tier": tier,
                                  "seconds": round(seconds, 3), "data_position": data}
        if recorded is not None and recorded > step:
            fields["lost_step"] = recorded
            fields["reason"] = (f"step {recorded} is gone (a node's local checkpoints were lost or damaged): "
                                f"restored step {step} from the {tier} tier, {recorded - step} steps older")
            sys.stderr.write(f"rkit: WARNING: {fields['reason']}\n")
            sys.stderr.flush()
        self.emit(EV.CHECKPOINT_RESTORED, **fields)


def _replica_of(mesh: Any, axis: int) -> tuple[int, int]:
    """This process's replica along `axis` and how many processes the replica spans; an RkitError when this
    process's devices lie in more than one replica, or there are fewer than 2 replicas."""
    import jax
    import numpy as np

    devices = np.asarray(mesh.devices)
    mine = {i for i, d in np.ndenumerate(devices) if d.process_index == jax.process_index()}
    replicas = {index[axis] for index in mine}
    if len(replicas) != 1 or devices.shape[axis] < 2:
        raise RkitError(f"checkpoint.local_dir: the mesh {dict(mesh.shape)} gives this process devices in "
                        f"{len(replicas)} data-parallel replicas of {devices.shape[axis]}; the local tier needs "
                        "2 or more replicas with each process in one: set ici_data_parallelism to the number of "
                        "processes (or -1) and the other ici axes to what one process's devices hold.")
    replica = replicas.pop()
    members = {devices[index].process_index for index in np.ndindex(devices.shape) if index[axis] == replica}
    return replica, len(members)


def hook(tier: LocalTier) -> None:
    """In the training environment, after jax.distributed and before MaxText's train.main: MaxText's emergency
    manager built with the four fixes, its save and restore through raw PRNG keys, and rkit's records."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath
    from maxtext.common import emergency_checkpointing as ec
    from orbax.checkpoint.experimental.emergency import checkpoint_manager as ecm

    if getattr(ec.create_emergency_checkpoint_manager, "rkit_hooked", False):
        return
    if jax.process_count() > 1:  # fix 1
        ocp.multihost.initialize_runtime_to_distributed_ids()
        ocp.multihost.initialize_distributed_to_device_ids()
    save0, restore0 = ec.save, ec.restore

    def is_key(x: Any) -> bool:
        return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)

    def raw(x: Any) -> Any:  # fix 4
        if not is_key(x):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            data = jax.eval_shape(jax.random.key_data, x)
            sharding = None
            if x.sharding is not None:
                spec = x.sharding.spec
                sharding = jax.sharding.NamedSharding(
                    x.sharding.mesh, jax.sharding.PartitionSpec(*spec, *([None] * (data.ndim - x.ndim))))
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
        return jax.random.key_data(x)

    def as_dict(tree: Any) -> Any:
        from flax import nnx
        from maxtext.common import train_state_nnx

        return train_state_nnx.to_checkpoint_dict(tree) if isinstance(tree, nnx.State) else tree

    def create(local_checkpoint_dir, persistent_checkpoint_dir, global_mesh, abstract_state,
               local_save_interval_steps, persistent_save_interval_steps, orbax_logger=None):
        from absl import flags

        flags.FLAGS.experimental_orbax_use_distributed_process_id = True
        axis = list(global_mesh.axis_names).index(DATA_AXIS)  # fix 3
        tier.replica, tier.replica_size = _replica_of(global_mesh, axis)
        tier.process_dir = Path(local_checkpoint_dir) / str(jax.process_index())  # fix 2
        tier.process_dir.mkdir(parents=True, exist_ok=True)
        tier.check()
        persistent = epath.Path(persistent_checkpoint_dir)
        persistent.mkdir(exist_ok=True, parents=True)
        options = ecm.CheckpointManagerOptions(
            local=ecm.LocalCheckpointOptions(save_interval_steps=local_save_interval_steps, max_to_keep=KEEP),
            persistent=ecm.PersistentCheckpointOptions(save_interval_steps=persistent_save_interval_steps),
            replica_axis_index=axis)
        tier.manager = ecm.CheckpointManager(
            epath.Path(tier.process_dir), persistent, global_mesh=global_mesh,
            abstract_state=jax.tree.map(raw, as_dict(abstract_state)), options=options, logger=orbax_logger)
        return tier.manager

    def save(checkpoint_manager, step, state, config, force):
        # MaxText calls this on every process at a step either tier saves (or a forced, preemption save): each
        # process's data position first, then the state's save
        datapos.save(tier.run, int(step), jax.process_index(), jax.process_count())
        if tier.rank == 0:
            held = set(committed_in(tier.run.orbax_dir)) | {s for r in records(tier.run) for s in r["steps"]}
            datapos.prune(tier.run, held)
        return save0(checkpoint_manager, step, jax.tree.map(raw, as_dict(state)), config, force)

    def restore(checkpoint_manager, step, abstract):
        from flax import nnx

        if isinstance(abstract, nnx.State):  # as MaxText's own restore does
            abstract = abstract.to_pure_dict()
        began = time.monotonic()
        try:
            restored = restore0(checkpoint_manager, step, jax.tree.map(raw, abstract))
        except Exception as exc:
            tier.restore_failed(int(step), exc)
            traceback.print_exc()
            # Said in the words ranklogs.RESTORE_FAILED reads (the attempt's cause: corrupt_checkpoint); then out at
            # once: raised, the process would wait minutes in jax.distributed's shutdown for peers stuck in the
            # restore's broadcast, and the attempt with it.
            sys.stderr.write(f"rkit: Failed to restore step {step} from the {tier.restored_tier} tier "
                             f"({type(exc).__name__}); this process exits now\n")
            sys.stderr.flush()
            os._exit(1)
        seconds = time.monotonic() - began
        if gone := tier.purge_newer(int(step)):
            sys.stderr.write(f"rkit: removed this process's local checkpoints of steps {', '.join(map(str, gone))}, "
                             f"newer than the restored step {int(step)} (holding them, it would skip saving those "
                             "steps while its replica's other processes save them)\n")
            sys.stderr.flush()
        checkpoint_manager.reload()
        checkpoint_manager.all_steps(read=True)  # every process: the step cache should_save reads, refreshed
        tier.observe()
        tier.restored(int(step), seconds, datapos.restore(tier.run, int(step), jax.process_index(),
                                                          jax.process_count()))
        return jax.tree.map(lambda a, r: jax.random.wrap_key_data(r, impl=a.dtype._impl) if is_key(a) else r,
                            abstract, restored)

    from_local, from_persistent = ecm._MultisliceCheckpointManager._restore_from_local, \
        ecm._MultisliceCheckpointManager._restore_from_persistent

    def restore_from_local(self, *args, **kwargs):
        tier.restored_tier = "local"
        return from_local(self, *args, **kwargs)

    def restore_from_persistent(self, *args, **kwargs):
        tier.restored_tier = "persistent"
        return from_persistent(self, *args, **kwargs)

    from maxtext.common import checkpointing

    load0 = checkpointing.load_state_if_possible

    def load_state_if_possible(checkpoint_manager, data_iterator, *args, **kwargs):
        datapos.ITERATOR[0] = data_iterator  # restore() sets its position
        return load0(checkpoint_manager, data_iterator, *args, **kwargs)

    checkpointing.load_state_if_possible = load_state_if_possible
    create.rkit_hooked = True  # type: ignore[attr-defined]
    ec.create_emergency_checkpoint_manager, ec.save, ec.restore = create, save, restore
    ecm._MultisliceCheckpointManager._restore_from_local = restore_from_local
    ecm._MultisliceCheckpointManager._restore_from_persistent = restore_from_persistent
