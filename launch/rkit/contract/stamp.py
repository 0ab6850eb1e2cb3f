"""The pure helpers of a run's stamp, shared by the recipe loader, the manifests and the image cache: canonical
JSON (the config hash, the image cache key) and which variable names hold secrets (never recorded).

Imports nothing of rkit, so the image cache key and the trainer's start-up do not pull in the recipe loader.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

# Keys that say which run this is and where and for whom it is kept, not what it trains: left out of the hash.
IDENTITY_KEYS = ("name", "runs_dir", "access")

# A variable (or recipe env key) is secret when its name contains one of SECRET_WORDS anywhere, or one of its
# _-separated parts is one of SECRET_PARTS (short words that are parts of ordinary names too: PATH, BYPASS),
# or starts with AUTH (AUTH, AUTHORIZATION).
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CRED", "JWT", "PRIVATE", "COOKIE")
SECRET_PARTS = ("PASS", "PAT", "SESSION")
# Values that are secret whatever their name: a URL's password (scheme://user:password@host) and key blocks.
SECRET_VALUE = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)(?P<secret>[^@\s/]+)@")
PRIVATE_BLOCK = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")
# Tokens whose shape says what they are, whatever their key: GitHub, GitLab, Hugging Face, AWS access key ids,
# Slack, Google API keys, OpenAI/Anthropic-style keys, JSON Web Tokens.
TOKEN_SHAPE = re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,}|glpat-[A-Za-z0-9_-]{20,}"
                         r"|hf_[A-Za-z0-9]{30,}|(?:AKIA|ASIA)[0-9A-Z]{16}|xox[abposr]-[A-Za-z0-9-]{10,}"
                         r"|AIza[0-9A-Za-z_-]{35}|sk-[A-Za-z0-9_-]{20,}"
                         r"|eyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,})")


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    parts = re.split(r"[^A-Z0-9]+", upper)
    return (any(word in upper for word in SECRET_WORDS) or any(part in SECRET_PARTS for part in parts)
            or any(part.startswith("AUTH") for part in parts))


def redact_value(value: str, marker: str) -> str:
    """A value with its secret parts replaced by `marker`: a URL's password, a token of a known shape, or all of
    a private key block."""
    if PRIVATE_BLOCK.search(value):
        return marker
    return TOKEN_SHAPE.sub(marker, SECRET_VALUE.sub(lambda m: f"{m.group('head')}{marker}@", value))


# A private key block inside a message: up to its END line, or to where a quoted value was cut short ("..."), or to
# the quote's end.
PRIVATE_SPAN = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----(?:.*?-----END [A-Z ]*PRIVATE KEY-----|[^'\"]*?\.\.\.|"
                          r"[^'\"]*)", re.S)


def redact_message(text: str, marker: str) -> str:
    """A message that may quote a value: each private key block replaced by `marker` (the rest, such as the key it
    is under and what is wrong, stays readable), then redact_value's other rules."""
    return redact_value(PRIVATE_SPAN.sub(marker, text), marker)


REDACTED = "<redacted>"


def redact(value: Any, marker: str = REDACTED) -> Any:
    """The one redaction of what rkit records (manifests, environment captures, events, the batch script's
    comments, the report, which reads those): a secret-named key's value becomes `marker`, and every string has
    its URL passwords and private key blocks replaced (redact_value); dicts and lists are walked."""
    if isinstance(value, str):
        return redact_value(value, marker)
    if isinstance(value, dict):
        return {k: (marker if isinstance(k, str) and is_secret_name(k) and isinstance(v, (str, int, float))
                    and not isinstance(v, bool) else redact(v, marker)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, marker) for v in value]
    return value


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


# Operational knobs: how the run is kept going and watched, not what it trains. Out of the config hash, so
# `rkit run --resume` accepts a change to them (recorded as a run.changed event).
OPERATIONAL_KEYS = ("resilience", "observability", "slurm.partition", "slurm.account", "slurm.qos", "slurm.time",
                    "slurm.extra_sbatch", "slurm.signal_lead_seconds", "slurm.spare_nodes", "slurm.exclusive",
                    "slurm.container_launch", "slurm.python")


def hashed_config(resolved: dict) -> dict:
    """The part of a resolved recipe that the config hash covers, what defines the training: everything but the
    run's identity (IDENTITY_KEYS) and the operational knobs (OPERATIONAL_KEYS)."""
    out = {k: v for k, v in resolved.items() if k not in IDENTITY_KEYS and k not in OPERATIONAL_KEYS}
    for dotted in OPERATIONAL_KEYS:
        section, _, key = dotted.partition(".")
        if key and isinstance(out.get(section), dict) and key in out[section]:
            out[section] = {k: v for k, v in out[section].items() if k != key}
    return out


def operational_config(resolved: dict) -> dict:
    """The operational knobs of a resolved recipe, by dotted key."""
    out = {}
    for dotted in OPERATIONAL_KEYS:
        section, _, key = dotted.partition(".")
        value = resolved.get(section)
        if key:
            if isinstance(value, dict) and key in value:
                out[dotted] = value[key]
        elif value is not None:
            out[dotted] = value
    return out


def config_hash(resolved: dict) -> str:
    digest = hashlib.sha256(canonical_json(hashed_config(resolved)).encode("utf-8")).hexdigest()
    return f"sha256:{digest}"
