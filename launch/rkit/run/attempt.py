"""What one attempt starts: each rank's command line and environment (attempt_request), the same function for the
plan's first attempt (run/plan.py, what `--dry-run` prints) and the supervisor's later ones; and where the ranks
keep JAX's compile cache."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rkit.backends.base import Backend, Request
from rkit.contract.config import Config
from rkit.contract.rundir import UMASK_ENV, RunDir, umask_for
from rkit.images.identity import ImageIdentity
from rkit.run import elastic
from rkit.runtime import devices
from rkit.runtime.inject import Injection
from rkit.runtime.trainers import maxtext


def attempt_request(backend: Backend[Any, Any], config: Config, run: RunDir, image: ImageIdentity | None,
                    base_env: dict[str, str], host_env: dict[str, str], jax_cache_dir: str, attempt: int,
                    in_trainer: list[Injection], attempt_dir: Path, shape: elastic.Shape | None = None,
                    period: int | None = None) -> Request:
    """What the backend starts for one attempt: each rank's command line and environment (pure but for the
    coordinator port a local backend picks). The plan (run/plan.py) makes the first attempt's; the supervisor
    every later one, at the size it chose (`shape`: run/elastic.py; the recipe's full size by default) and, with
    checkpoint.period auto, the period it chose (`period`: run/cadence.py)."""
    shape = shape or elastic.shape(config)
    env = dict(base_env)
    env.update({"RKIT_RUN_DIR": str(run.path.resolve()), "RKIT_ATTEMPT": str(attempt),
                "RKIT_BASE_CONFIG": config.trainer.base_config, UMASK_ENV: f"{umask_for(config.access):03o}",
                "RKIT_INJECT": json.dumps([i.as_dict() for i in in_trainer]),
                devices.GPUS_ENV: str(config.gpus_per_node),
                devices.PER_NODE_ENV: str(config.resources.processes_per_node),
                devices.VENDOR_ENV: devices.vendor_of(image.gpu_flags if image else ())})
    args = maxtext.maxtext_overrides(config, run, jax_cache_dir,
                                     shape.gradient_accumulation_steps if shape.shrunk else None, period)
    return backend.prepare(attempt=attempt, processes=shape.processes, trainer_args=args, base_env=env,
                           attempt_dir=attempt_dir, cwd=Path.cwd(), host_env=host_env)


def default_jax_cache_dir() -> str:
    return os.environ.get("RKIT_JAX_CACHE_DIR") or str(Path.home() / ".cache" / "rkit" / "jax")
