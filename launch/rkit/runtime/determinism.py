"""Deterministic mode (`reproducibility.deterministic: true`): the switches XLA, JAX, CUDA and ROCm need for
bit-exact reruns on GPUs, set into every rank's environment (runner.training_env), recorded in the manifest, and
checked by each rank at start (agent): one `determinism.clobbered` event per switch that did not survive.

Each switch, what it does and where it is documented (docs/outcomes.md, "Deterministic mode", has the costs):

- XLA_FLAGS --xla_gpu_deterministic_ops=true: "Guarantees run-to-run determinism on GPU" (xla/debug_options_flags.cc;
  https://openxla.org/xla/determinism): deterministic scatter, GEMM, convolution and fused attention, and no
  autotuning. A superset of --xla_gpu_exclude_nondeterministic_ops.
- XLA_FLAGS --xla_gpu_autotune_level=0: the autotuner takes the first config (AMD's MaxText-on-Slurm
  deterministic mode, AMD-AGI/maxtext-slurm train_env.sh).
- JAX default PRNG threefry2x32: MaxText's train.initialize() switches it to unsafe_rbg; rkit switches it back
  right after (trainers/maxtext.pin_prng), as AMD's utils/deterministic.py does.
- NVTE_ALLOW_NONDETERMINISTIC_ALGO=0: Transformer Engine (CUDA, and ROCm TE with its PR #508) uses deterministic
  fused-attention kernels; AMD's images default it to 1. The one switch AMD's ablation found required on ROCm.
- CUBLAS_WORKSPACE_CONFIG=:4096:8: cuBLAS is bitwise reproducible with several streams only with a fixed
  workspace (cuBLAS guide, "Results reproducibility").
- NCCL_ALGO=Ring: ring reductions have a fixed order (NCCL and RCCL); Tree does not (Megatron-LM,
  docs/user-guide/deterministic-training.md).
- RCCL_MSCCLPP_ENABLE=0: MSCCL++ bypasses NCCL_ALGO on ROCm (AMD-AGI/maxtext-slurm).
- TF_DETERMINISTIC_OPS=1: XLA on ROCm disallows rocBLAS atomics and asks MIOpen for deterministic convolutions.
- ROCBLAS_DEFAULT_ATOMICS_MODE=0: rocBLAS handles are created with atomics not allowed (rocBLAS env variables).
- HIPBLASLT_DETERMINISTIC=1: read only by AMD's patched hipBLASLt (no effect upstream); set as AMD does.

Image side: imports nothing of rkit, nothing beyond the standard library.
"""

from __future__ import annotations

import json
from typing import Any

XLA_FLAGS = ("--xla_gpu_deterministic_ops=true", "--xla_gpu_autotune_level=0")
ENV = {
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NCCL_ALGO": "Ring",
    "RCCL_MSCCLPP_ENABLE": "0",
    "TF_DETERMINISTIC_OPS": "1",
    "ROCBLAS_DEFAULT_ATOMICS_MODE": "0",
    "HIPBLASLT_DETERMINISTIC": "1",
}
PRNG_IMPL = "threefry2x32"
EXPECTED_ENV = "RKIT_DETERMINISTIC"  # the settings, as JSON, for each rank to check


def settings() -> dict[str, Any]:
    """What deterministic mode sets: the manifest's record and the ranks' expectation."""
    return {"xla_flags": list(XLA_FLAGS), "env": dict(ENV), "jax_default_prng_impl": PRNG_IMPL}


def apply(env: dict[str, str]) -> dict[str, str]:
    """`env` with the switches set: the variables replaced, the XLA flags appended to XLA_FLAGS (XLA reads the
    last value of a flag given twice, so a recipe's or image's own value is overridden, not dropped)."""
    out = {**env, **ENV, EXPECTED_ENV: json.dumps(settings(), sort_keys=True)}
    out["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS", "").strip(), *XLA_FLAGS]))
    return out


def xla_flag_values(xla_flags: str) -> dict[str, str]:
    """Each flag's effective value in an XLA_FLAGS string (the last one given wins)."""
    values: dict[str, str] = {}
    for token in xla_flags.split():
        name, _, value = token.partition("=")
        values[name] = value if _ else "true"
    return values


def clobbered(environ: dict[str, str], prng_impl: str | None) -> list[dict[str, str | None]]:
    """The switches this process does not have as deterministic mode set them (empty: all survived)."""
    expected = json.loads(environ.get(EXPECTED_ENV) or "null") or settings()
    found: list[dict[str, str | None]] = []
    flags = xla_flag_values(environ.get("XLA_FLAGS", ""))
    for flag in expected["xla_flags"]:
        name, _, value = flag.partition("=")
        if flags.get(name) != value:
            found.append({"switch": f"XLA_FLAGS {name}", "expected": value, "found": flags.get(name)})
    for name, value in expected["env"].items():
        if environ.get(name) != value:
            found.append({"switch": name, "expected": value, "found": environ.get(name)})
    if prng_impl is not None and prng_impl != expected["jax_default_prng_impl"]:
        found.append({"switch": "jax_default_prng_impl", "expected": expected["jax_default_prng_impl"],
                      "found": prng_impl})
    return found
