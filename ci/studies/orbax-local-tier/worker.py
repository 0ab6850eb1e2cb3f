"""One JAX CPU process using Orbax's emergency (or p2p) CheckpointManager.

argv: phase(train|restore) nproc pid port base replicas first_step last_step
env:  MGR=emergency|p2p  INIT_IDS=1|0  DIST_PID_FLAG=1|0  LDC=<local devices>
"""
import os, sys, time, json, signal

phase, N, pid, port, base, R, s0, s1 = sys.argv[1:9]
N, pid, R, s0, s1 = int(N), int(pid), int(R), int(s0), int(s1)
LDC = int(os.environ.get("LDC", "2"))
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LDC}"
MGR = os.environ.get("MGR", "emergency")

import numpy as np
import jax, jax.numpy as jnp
from absl import logging as alog, flags
alog.set_verbosity(alog.INFO)
alog.use_absl_handler()
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental.emergency import checkpoint_manager as ecm

flags.FLAGS.mark_as_parsed()
if os.environ.get("DIST_PID_FLAG") == "1":  # what MaxText does (emergency_checkpointing.py:56)
  flags.FLAGS.experimental_orbax_use_distributed_process_id = True


def say(*a):
  print(f"[p{pid}] " + " ".join(str(x) for x in a), flush=True)


jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=N, process_id=pid,
                           initialization_timeout=60, heartbeat_timeout_seconds=30,
                           shutdown_timeout_seconds=20)
if os.environ.get("INIT_IDS", "1") == "1":
  ocp.multihost.initialize_runtime_to_distributed_ids()
  ocp.multihost.initialize_distributed_to_device_ids()

devs = np.array(jax.devices())
M = devs.size // R
mesh = jax.sharding.Mesh(devs.reshape(R, M), ("replica", "model"))
P = jax.sharding.PartitionSpec
shard = {"w": P(None, "model"), "b": P("model"), "step": P()}
shapes = {"w": (4, 8), "b": (8,), "step": ()}


def make_state(step):
  host = {"w": np.arange(32, dtype=np.float32).reshape(4, 8) + 1000.0 * step,
          "b": np.arange(8, dtype=np.float32) - 1000.0 * step,
          "step": np.asarray(step, dtype=np.int32)}
  return {k: jax.make_array_from_callback(shapes[k], jax.sharding.NamedSharding(mesh, shard[k]),
                                          lambda idx, k=k: host[k][idx]) for k in host}


def check_state(st):
  step = int(np.asarray(st["step"].addressable_shards[0].data))
  exp = make_state(step)
  ok = True
  for k in st:
    if st[k].sharding.spec != shard[k] or st[k].sharding.mesh.shape != mesh.shape:
      say("SHARDING_MISMATCH", k, st[k].sharding)
    for a, e in zip(st[k].addressable_shards, exp[k].addressable_shards):
      if not np.array_equal(np.asarray(a.data), np.asarray(e.data)) or a.index != e.index:
        ok = False
  return step, ok


abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), make_state(0))
local_dir = f"{base}/local/shared" if os.environ.get("SHARED_LOCAL") == "1" else f"{base}/local/p{pid}"
pers_dir = f"{base}/persistent"
os.makedirs(local_dir, exist_ok=True)
os.makedirs(pers_dir, exist_ok=True)

t0 = time.time()
if MGR == "emergency":
  opts = ecm.CheckpointManagerOptions(
      local=ecm.LocalCheckpointOptions(save_interval_steps=2, max_to_keep=int(os.environ.get("LOCAL_KEEP", "1"))),
      persistent=ecm.PersistentCheckpointOptions(save_interval_steps=10),
      replica_axis_index=0,
      enable_async_checkpointing=True,
  )
  mgr = ecm.CheckpointManager(local_dir, pers_dir, global_mesh=mesh, abstract_state=abstract, options=opts)
  say("created manager; in_primary_slice=", mgr.in_primary_slice, "type=", type(mgr._checkpoint_manager).__name__)
else:
  from orbax.checkpoint.experimental.emergency.p2p import checkpoint_manager as p2pcm
  from orbax.checkpoint.experimental.emergency.p2p import options as p2popts
  from orbax.checkpoint.experimental.emergency.p2p import args as p2pargs
  opts = p2popts.CheckpointManagerOptions(
      local=p2popts.LocalCheckpointOptions(save_interval_steps=2),
      persistent=p2popts.PersistentCheckpointOptions(save_interval_steps=10),
      replica_axis_index=0)
  mgr = p2pcm.CheckpointManager(mesh, abstract, local_dir, pers_dir, options=opts)
  say("created p2p manager")
say("all_steps=", sorted(mgr.all_steps()), "latest_step=", mgr.latest_step(), f"({time.time()-t0:.1f}s)")


def save_args(st):
  if MGR == "emergency":
    return ocp.args.Composite(state=ocp.args.PyTreeSave(st))
  return p2pargs.Composite(state=ocp.args.PyTreeSave(st))


if phase == "train":
  saved = []
  for step in range(s0, s1 + 1):
    st = make_state(step)
    if mgr.save(step, args=save_args(st)):
      saved.append(step)
  mgr.wait_until_finished()
  say("TRAIN_DONE saved=", saved, "latest_step=", mgr.latest_step())
  say("READY_TO_DIE")
  time.sleep(600)  # launcher SIGKILLs us
else:
  latest = mgr.latest_step()
  say("RESTORE latest_step=", latest)
  try:
    if MGR == "emergency":
      res = mgr.restore(None)
    else:
      res = mgr.restore(None, args=p2pargs.Composite(state=ocp.args.PyTreeRestore(item=abstract)))
    st = res.state if hasattr(res, "state") else res["state"]
    step, ok = check_state(st)
    say(f"RESULT restored_step={step} values_correct={ok}")
  except Exception as e:
    import traceback
    traceback.print_exc()
    say("RESULT EXCEPTION", type(e).__name__, str(e)[:2000])
  say("EXITING")
  os._exit(0)
