"""MaxText's emergency checkpointing (`checkpoint.local_dir`), built so that it works: the hook into MaxText and
Orbax that runtime/trainers/localtier.py's LocalTier is the rank's side of.

MaxText 0.2.5's `enable_emergency_checkpoint` builds Orbax's emergency.CheckpointManager; as MaxText builds it, it
does not work (ci/studies/orbax-local-tier/README.md). `hook` carries the four fixes:

1. Orbax's process-id maps after jax.distributed (MaxText sets them up only for hardware=gpu_multiprocess);
2. a local directory per process (MaxText makes <local>/<process> only on GPUs: processes sharing one fail); rkit
   names it by node and local rank (LocalTier.key), so that it follows its node when process indexes move;
3. `replica_axis_index` = MaxText's `data` mesh axis (MaxText passes none, so Orbax takes axis 0, diloco, of size
   1, sees one replica and silently keeps no local checkpoints);
4. typed PRNG keys saved and restored as their raw data (Orbax's local restore broadcasts each leaf with jnp.sum,
   which refuses MaxText's `key<urbg>` leaves, and the processes then hang in jax.distributed's shutdown);
5. a local restore after the process count changed (a shrink onto fewer nodes): Orbax rebuilds the saving
   attempt's mesh from the step's process metadata, process by process, which fails (IndexError) when there are
   fewer processes now. Each replica holds the whole state and a node's processes keep their folders and their
   order (LocalTier.key), so the restoring replica's devices read what the same node's devices wrote in the
   current mesh itself: it is used as the restore mesh.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from rkit.contract.errors import RkitError
from rkit.runtime.trainers import datapos
from rkit.runtime.trainers.localtier import DATA_AXIS, KEEP, LocalTier, records
from rkit.runtime.trainers.orbaxdirs import committed_in


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
        tier.process_dir = Path(local_checkpoint_dir) / tier.key  # fix 2, by node and local rank
        tier.process_dir.mkdir(parents=True, exist_ok=True)
        tier.check()
        persistent = epath.Path(persistent_checkpoint_dir)
        persistent.mkdir(exist_ok=True, parents=True)
        options = ecm.CheckpointManagerOptions(
            local=ecm.LocalCheckpointOptions(save_interval_steps=local_save_interval_steps, max_to_keep=KEEP),
            persistent=ecm.PersistentCheckpointOptions(save_interval_steps=persistent_save_interval_steps,
                                                       max_to_keep=tier.keep),  # checkpoint.keep
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
        for call in tier.on_restore:
            call(int(step))
        began = time.monotonic()
        try:
            restored = restore0(checkpoint_manager, step, jax.tree.map(raw, abstract))
        except Exception as exc:
            # Out at once: raised, the process would wait minutes in jax.distributed's shutdown for peers stuck in
            # the restore's broadcast, and the attempt with it.
            if tier.restore_failed(int(step), exc):
                traceback.print_exc()
                # in the words ranklogs.RESTORE_FAILED reads (the attempt's cause: corrupt_checkpoint)
                sys.stderr.write(f"rkit: Failed to restore step {step} from the {tier.restored_tier} tier "
                                 f"({type(exc).__name__}); this process exits now\n")
            else:  # not the step's bytes: its files check whole and the error is another's
                first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
                source = f" from the {tier.restored_tier} tier" if tier.restored_tier else ""
                # before the traceback, whose lines may read like a damaged step's (ranklogs.RESTORE_BROKEN_OFF)
                sys.stderr.write(f"rkit: the restore of step {step}{source} was broken "
                                 f"off by {type(exc).__name__}: {first} (the step's files check whole: it stays); "
                                 "this process exits now\n")
                sys.stderr.flush()
                traceback.print_exc()
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
        tier._seen = None  # a record for this attempt, also where the steps are the same
        tier.observe()
        tier.restored(int(step), seconds, datapos.restore(tier.run, int(step), jax.process_index(),
                                                          jax.process_count()))
        return jax.tree.map(lambda a, r: jax.random.wrap_key_data(r, impl=a.dtype._impl) if is_key(a) else r,
                            abstract, restored)

    from orbax.checkpoint.experimental.emergency import mesh_consistency

    consistent0 = mesh_consistency.consistent_restore_mesh_from_metadata

    def consistent(global_mesh, current_distributed_to_device_ids, previous_distributed_to_device_ids,
                   previous_device_ids):  # fix 5
        if len(previous_distributed_to_device_ids) != len(current_distributed_to_device_ids):
            return global_mesh
        return consistent0(global_mesh, current_distributed_to_device_ids,
                           previous_distributed_to_device_ids=previous_distributed_to_device_ids,
                           previous_device_ids=previous_device_ids)

    mesh_consistency.consistent_restore_mesh_from_metadata = consistent
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
