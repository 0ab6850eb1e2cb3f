# Probe: what replica count does Orbax's emergency manager see on a default MaxText mesh? (1 process, 4 fake CPU devices)
import os
os.environ["JAX_PLATFORMS"]="cpu"; os.environ["XLA_FLAGS"]="--xla_force_host_platform_device_count=4"
import jax
from maxtext.configs import pyconfig
from maxtext.utils import maxtext_utils
from orbax.checkpoint._src.multihost import multislice
import maxtext, os.path as p
base = p.join(p.dirname(maxtext.__file__), "configs", "base.yml")
cfg = pyconfig.initialize(["x", base, "run_name=probe", "hardware=cpu", "skip_jax_distributed_system=True",
                           "enable_checkpointing=False", "base_output_directory=/tmp/orbax-local-tier-probe"])
mesh = maxtext_utils.get_mesh_from_config(cfg) if hasattr(maxtext_utils, "get_mesh_from_config") else None
print("mesh axis_names:", mesh.axis_names)
print("mesh shape:", dict(mesh.shape))
print("replica_count(replica_axis_index=0) =", multislice.replica_count(mesh, replica_axis_index=0))
print("replica_count on 'data' axis =", multislice.replica_count(mesh, replica_axis_index=mesh.axis_names.index("data")))
