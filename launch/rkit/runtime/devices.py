"""A GPU set per process: with k processes on a node of G GPUs, local rank r sees GPUs [r*G/k, (r+1)*G/k).

The agent applies it before JAX starts, through the vendor's visibility variable, so each process's JAX sees only
its share and jax.distributed's local devices are exactly those (local_device_ids is left to JAX: with the
variable set, every visible device is the process's own):
- NVIDIA: CUDA_VISIBLE_DEVICES (CUDA C Programming Guide, "CUDA Environment Variables");
- AMD: HIP_VISIBLE_DEVICES (ROCm docs, "GPU isolation techniques": the HIP-level filter; ROCR_VISIBLE_DEVICES,
  the runtime-level one, is left as the job's allocation set it);
- unknown (no image, `image: none`): both, as HIP also reads CUDA_VISIBLE_DEVICES.
When the launcher already narrowed the node's GPUs (Slurm's --gpus-per-node sets CUDA_VISIBLE_DEVICES or
ROCR/HIP_VISIBLE_DEVICES for the step), the share is taken from that list, not from 0..G-1.

Image side: imports nothing of rkit, nothing beyond the standard library.
"""

from __future__ import annotations

GPUS_ENV = "RKIT_GPUS_PER_NODE"
PER_NODE_ENV = "RKIT_PROCS_PER_NODE"
VENDOR_ENV = "RKIT_GPU_VENDOR"
VARIABLES = {"nvidia": ("CUDA_VISIBLE_DEVICES",), "amd": ("HIP_VISIBLE_DEVICES",),
             "": ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")}


def vendor_of(gpu_flags: tuple[str, ...] | list[str]) -> str:
    """From the image's Apptainer GPU flags: --nv (NVIDIA), --rocm (AMD); '' when unknown."""
    return "nvidia" if "--nv" in gpu_flags else "amd" if "--rocm" in gpu_flags else ""


def share(node_gpus: list[str], processes_per_node: int, local_rank: int) -> list[str]:
    """Local rank r's contiguous slice of the node's GPUs (an equal share each; the recipe checks G % k == 0)."""
    each = len(node_gpus) // processes_per_node
    return node_gpus[local_rank * each:(local_rank + 1) * each]


def binding(environ: dict[str, str], local_rank: int) -> dict[str, str]:
    """The visibility variables this process should have (empty: nothing to bind: one process per node, or no
    GPU count given)."""
    gpus, per_node = int(environ.get(GPUS_ENV) or 0), int(environ.get(PER_NODE_ENV) or 1)
    if gpus <= 0 or per_node <= 1:
        return {}
    names = VARIABLES.get(environ.get(VENDOR_ENV, ""), VARIABLES[""])
    narrowed = next((environ[n] for n in (*names, "ROCR_VISIBLE_DEVICES") if environ.get(n)), None)
    node = [g.strip() for g in narrowed.split(",") if g.strip()] if narrowed else [str(i) for i in range(gpus)]
    mine = ",".join(share(node, per_node, local_rank))
    return {name: mine for name in names}


def local_rank(environ: dict[str, str], rank: int) -> int:
    """Slurm's SLURM_LOCALID, else the rank's place on its node (the local launcher: one node)."""
    if (slurm := environ.get("SLURM_LOCALID", "")).isdigit():
        return int(slurm)
    return rank % max(1, int(environ.get(PER_NODE_ENV) or 1))
