"""The pure helpers of a run's stamp, shared by the recipe loader, the manifests and the image cache: canonical
JSON (the config hash, the image cache key) and which variable names hold secrets (never recorded).

Imports nothing of rkit, so the image cache key and the trainer's start-up do not pull in the recipe loader.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Keys that identify a run rather than describe its training: left out of the config hash.
IDENTITY_KEYS = ("name", "runs_dir")

SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def hashed_config(resolved: dict) -> dict:
    """The part of a resolved recipe that the config hash covers: everything but the run's identity."""
    return {k: v for k, v in resolved.items() if k not in IDENTITY_KEYS}


def config_hash(resolved: dict) -> str:
    digest = hashlib.sha256(canonical_json(hashed_config(resolved)).encode("utf-8")).hexdigest()
    return f"sha256:{digest}"
