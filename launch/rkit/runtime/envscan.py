"""What an image holds, read from inside it with the standard library only, and its environment identity.

Runs in two places, as the same source: inside an image rkit builds (`python -m rkit.runtime.imageinfo`, at the end of
the build: the identity goes into /etc/rkit/image.json and the label org.rkit.environment.sha256), and as the
first part of the probe rkit runs in any image (imageagent.PROBE is this file's text plus a few lines), so an
image's own label and what rkit reads from it later are computed by one function. imageenv.py is the host side
(compare, describe, diff).

Standard library only, and no import of rkit: the probe runs it in images that have no rkit.
"""

from __future__ import annotations

import hashlib
import json
import re
from importlib import metadata


def python_packages() -> dict[str, str]:
    """Every Python distribution the interpreter sees, by normalised name (PEP 503), with its version."""
    packages = {}
    for dist in metadata.distributions():
        if dist.metadata["Name"]:
            packages[re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()] = dist.version
    return dict(sorted(packages.items()))


def debian_packages(status: str = "/var/lib/dpkg/status") -> dict[str, str]:
    """Every installed Debian package (dpkg's status file) with its version; a foreign architecture's name is
    qualified (`libc6:i386`); {} without dpkg."""
    try:
        with open(status, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return {}
    found = {}
    for block in text.split("\n\n"):
        stanza = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line[:1].isspace())
        if stanza.get("Package") and stanza.get("Status", "").endswith(" installed"):
            arch = stanza.get("Architecture", "")
            name = stanza["Package"] + (":" + arch if arch not in ("", "all", "amd64") else "")
            found[name] = stanza.get("Version", "")
    return dict(sorted(found.items()))


def environment(python_version: str | None, python: dict[str, str], debian: dict[str, str],
                definition_sha256: str | None, lock_sha256: str | None,
                debian_lock_sha256: str | None = None) -> dict:
    """The environment an identity covers: how it was built (Python version, the definition's and locks'
    digests) and what it holds (Python and Debian packages with versions)."""
    build = {"python_version": python_version, "definition_sha256": definition_sha256, "lock_sha256": lock_sha256}
    if debian_lock_sha256:  # images from before the Debian lock have no such label: their identity is unchanged
        build["debian_lock_sha256"] = debian_lock_sha256
    return {"build": build, "python": dict(python), "debian": dict(debian)}


def identity(env: dict) -> str:
    """sha256 of the environment as canonical JSON (the same canonical form as stamp.canonical_json)."""
    text = json.dumps(env, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
