"""Every RKIT_* environment variable, in one table: who sets it, who reads it, what it holds. The modules name them
where they use them; tests/unit/test_envvars.py fails on a name used in the package that is not here, or listed
here and used nowhere. docs/modules.md shows the table (ci/module_table.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Var:
    name: str
    set_by: str
    read_by: str
    holds: str


RANK = "each rank (runtime/agent.py)"
SUPERVISOR = "the supervisor (run/attempt.py, the backends)"
USER = "the user"

VARIABLES = (
    # In every rank's environment, for one attempt.
    Var("RKIT_RUN_DIR", SUPERVISOR, RANK, "the run directory"),
    Var("RKIT_ATTEMPT", SUPERVISOR, RANK, "the attempt's number"),
    Var("RKIT_RANK", "the backends", RANK, "the process's rank, from 0"),
    Var("RKIT_NPROCS", "the backends", RANK, "the number of processes of the attempt"),
    Var("RKIT_NODE_INDEX", "the Slurm backend", RANK + " and its node's telemetry", "the node's index in the attempt"),
    Var("RKIT_NODE", "the local backend (virtual nodes)", RANK + " (node-local tier)",
        "the rank's virtual node: its node-local folder's name (on Slurm: SLURMD_NODENAME)"),
    Var("RKIT_NODES", "the local backend (virtual nodes)", RANK + " (node-local tier)",
        "the attempt's virtual nodes, comma-separated: the folders no process maps to"),
    Var("RKIT_COORDINATOR", "the backends", RANK, "jax.distributed's coordinator, host:port"),
    Var("RKIT_BASE_CONFIG", SUPERVISOR, RANK, "MaxText's base config (trainer.base_config)"),
    Var("RKIT_INJECT", SUPERVISOR, RANK, "the faults to inject in this attempt, as JSON (--inject)"),
    Var("RKIT_UMASK", SUPERVISOR, RANK, "the umask of what the rank writes (the recipe's `access`)"),
    Var("RKIT_GPUS_PER_NODE", SUPERVISOR, "runtime/devices.py", "the recipe's GPUs per node"),
    Var("RKIT_PROCS_PER_NODE", SUPERVISOR, "runtime/devices.py", "processes per node"),
    Var("RKIT_GPU_VENDOR", SUPERVISOR, "runtime/devices.py", "nvidia, amd or empty: which visible-devices variable"),
    Var("RKIT_DETERMINISTIC", "runtime/determinism.py (reproducibility.deterministic)", RANK,
        "the deterministic settings, as JSON, for each rank to check"),
    Var("RKIT_JAX_HEARTBEAT_SECONDS", "the Slurm and local backends", RANK, "jax.distributed's heartbeat timeout"),
    Var("RKIT_LIVENESS_ADDRESS", "the Slurm backend", "each node's heartbeat sender (contract/heartbeat.py)",
        "host:port of the supervisor's heartbeat socket"),
    Var("RKIT_LIVENESS_TOKEN", "the Slurm backend", "each node's heartbeat sender", "the key that signs heartbeats"),
    # The pipe a local rank watches to die with its supervisor.
    Var("RKIT_SUPERVISOR_FD", "the local backend", RANK, "the read end of the supervisor's pipe"),
    Var("RKIT_SUPERVISOR_TOKEN", "the local backend", RANK, "what the supervisor wrote into that pipe"),
    # Warm standbys.
    Var("RKIT_WARM", "runtime/standby.py", RANK, "1 when the rank started as a standby"),
    Var("RKIT_STANDBY_IMPORT_SECONDS", "runtime/standby.py", RANK, "how long the standby's imports took"),
    Var("RKIT_STANDBY_READY_FD", "the local standby pool", "runtime/standby.py", "where a standby says it is ready"),
    Var("RKIT_STANDBY_ADDRESS", "the Slurm standby pool", "runtime/standby.py",
        "host:port of the supervisor's standby listener"),
    Var("RKIT_STANDBY_TOKEN", "the Slurm standby pool", "runtime/standby.py", "the key of the standby's protocol"),
    # Set by the user (or the tests) for the host side.
    Var("RKIT_APPTAINER", USER, "images/store.py", "the apptainer program (default: apptainer on PATH)"),
    Var("RKIT_IMAGE_CACHE", USER, "images/store.py", "the image cache (default: ~/.cache/rkit/images)"),
    Var("RKIT_JAX_CACHE_DIR", USER, "run/attempt.py", "JAX's compile cache (default: ~/.cache/rkit/jax)"),
    Var("RKIT_STATUS_CACHE", USER, "readers/digest.py", "rkit status's digests (default: ~/.cache/rkit/status)"),
    Var("RKIT_PYTHON", USER, "the Slurm backend", "the Python of `rkit supervise` on the nodes (default: python3)"),
    Var("RKIT_NVIDIA_SMI", USER, "backends/gpu_health.py", "the nvidia-smi program"),
    Var("RKIT_AMD_SMI", USER, "backends/gpu_health.py", "the amd-smi program"),
    Var("RKIT_GPU_BACKEND", USER, "runtime/telemetry/gpu.py", "force one GPU probe (absent: none)"),
    # The image build.
    Var("RKIT_VERSION", "images/build.py", "the image definitions (a build argument)", "rkit's version, a label"),
)
BY_NAME = {var.name: var for var in VARIABLES}
