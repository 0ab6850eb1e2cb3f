"""One MaxText process (the tiny model on the CPU) with MaxText's emergency checkpointing, built the way rkit's
hooks would build it: jax.distributed first, Orbax's id maps, a local directory per process, and the replica axis
MaxText leaves out (its `data` axis, so that each data-parallel replica is a full copy).

argv: N pid port BASE steps [kill_at]    env: HOOK=0 runs MaxText's own manager (no replica axis, no id maps)
A kill_at step SIGKILLs this process (every process: the whole job dies) once that step's metrics are buffered.
"""

import os
import signal
import sys

N, pid, port, base, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
kill_at = int(sys.argv[6]) if len(sys.argv) > 6 else None
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=N, process_id=pid, initialization_timeout=120)

import orbax.checkpoint as ocp  # noqa: E402
from absl import app  # noqa: E402
from etils import epath  # noqa: E402
from maxtext.common import emergency_checkpointing as ec  # noqa: E402
from maxtext.common import metric_logger  # noqa: E402
from maxtext.trainers.pre_train import train  # noqa: E402
from maxtext.utils import max_logging  # noqa: E402

HOOK = os.environ.get("HOOK", "1") == "1"
if HOOK:
    ocp.multihost.initialize_runtime_to_distributed_ids()
    ocp.multihost.initialize_distributed_to_device_ids()

    def create(local_checkpoint_dir, persistent_checkpoint_dir, global_mesh, abstract_state,
               local_save_interval_steps, persistent_save_interval_steps, orbax_logger=None):
        from absl import flags
        from flax import nnx
        from maxtext.common import train_state_nnx
        from orbax.checkpoint.experimental.emergency import checkpoint_manager as ecm

        flags.FLAGS.experimental_orbax_use_distributed_process_id = True
        local = epath.Path(f"{local_checkpoint_dir}/{jax.process_index()}")
        local.mkdir(exist_ok=True, parents=True)
        persistent = epath.Path(persistent_checkpoint_dir)
        persistent.mkdir(exist_ok=True, parents=True)
        if isinstance(abstract_state, nnx.State):
            abstract_state = train_state_nnx.to_checkpoint_dict(abstract_state)
        replica_axis = global_mesh.axis_names.index("data")
        max_logging.log(f"rkit-study: emergency manager, replica axis {replica_axis} "
                        f"({dict(global_mesh.shape)}), local {local}")
        return ecm.CheckpointManager(
            local, persistent, global_mesh=global_mesh, abstract_state=abstract_state,
            options=ecm.CheckpointManagerOptions(
                local=ecm.LocalCheckpointOptions(save_interval_steps=local_save_interval_steps, max_to_keep=2),
                persistent=ecm.PersistentCheckpointOptions(save_interval_steps=persistent_save_interval_steps),
                replica_axis_index=replica_axis),
            logger=orbax_logger)

    ec.create_emergency_checkpoint_manager = create

    if os.environ.get("KEYFIX", "1") == "1":
        # Orbax's local restore broadcasts each leaf from the restoring replica with jnp.sum, which refuses
        # MaxText's typed PRNG keys (TypeError: Cannot interpret 'key<urbg>' as a data type): save and restore
        # the keys' raw data instead, and wrap them back afterwards.
        import jax.numpy as jnp  # noqa: F401
        from flax import nnx

        def is_key(x):
            return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)

        def raw(x):
            if not is_key(x):
                return x
            if isinstance(x, jax.ShapeDtypeStruct):
                data = jax.eval_shape(jax.random.key_data, x)
                spec = x.sharding.spec if x.sharding is not None else jax.sharding.PartitionSpec()
                sharding = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec(
                    *spec, *([None] * (data.ndim - x.ndim)))) if x.sharding is not None else None
                return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
            return jax.random.key_data(x)

        save0, restore0, create0 = ec.save, ec.restore, ec.create_emergency_checkpoint_manager

        def tree_map(f, tree):
            if isinstance(tree, nnx.State):
                from maxtext.common import train_state_nnx
                tree = train_state_nnx.to_checkpoint_dict(tree)
            return jax.tree.map(f, tree)

        def save(checkpoint_manager, step, state, config, force):
            return save0(checkpoint_manager, step, tree_map(raw, state), config, force)

        def restore(checkpoint_manager, step, abstract):
            if isinstance(abstract, nnx.State):  # as MaxText's own restore does
                abstract = abstract.to_pure_dict()
            target = jax.tree.map(raw, abstract)
            restored = restore0(checkpoint_manager, step, target)
            if os.environ.get("SHOW"):
                for path, leaf in jax.tree_util.tree_leaves_with_path(restored):
                    if getattr(leaf, "ndim", 1) == 0 or "count" in jax.tree_util.keystr(path):
                        print(f"[p{pid}] restored {jax.tree_util.keystr(path)} = "
                              f"{jax.device_get(leaf.addressable_shards[0].data)}", flush=True)
            keys = abstract
            return jax.tree.map(lambda a, r: jax.random.wrap_key_data(r, impl=a.dtype._impl) if is_key(a) else r,
                                keys, restored)

        def create_raw(local_dir, persistent_dir, mesh, abstract_state, *rest, **kw):
            return create0(local_dir, persistent_dir, mesh, tree_map(raw, abstract_state), *rest, **kw)

        ec.save, ec.restore, ec.create_emergency_checkpoint_manager = save, restore, create_raw

if kill_at is not None:
    buffer = metric_logger.MetricLogger.buffer_and_write_metrics

    def buffer_and_write_metrics(self, metrics, step, step_time_delta=None, is_training=True):
        buffer(self, metrics, step, step_time_delta, is_training)
        if is_training and int(step) >= kill_at:
            print(f"[p{pid}] KILL at step {int(step)}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    metric_logger.MetricLogger.buffer_and_write_metrics = buffer_and_write_metrics

import maxtext  # noqa: E402

base_yml = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
argv = ["maxtext", base_yml, "run_name=study", f"base_output_directory={base}/out", "hardware=cpu",
        "dataset_type=synthetic", "base_emb_dim=64", "base_num_query_heads=2", "base_num_kv_heads=2",
        "base_mlp_dim=128", "base_num_decoder_layers=2", "head_dim=32", "vocab_size=256", "max_target_length=64",
        "per_device_batch_size=1", f"steps={steps}", "enable_checkpointing=true", "async_checkpointing=false",
        "checkpoint_period=10", "ici_data_parallelism=-1", "ici_fsdp_parallelism=1",
        "enable_tensorboard=false", "log_period=1"]
if os.environ.get("EMERGENCY", "1") == "1":  # EMERGENCY=0: MaxText's standard checkpointing, for comparison
    argv += ["enable_emergency_checkpoint=true", f"local_checkpoint_directory={base}/local", "local_checkpoint_period=2"]
app.run(train.main, argv=argv)
