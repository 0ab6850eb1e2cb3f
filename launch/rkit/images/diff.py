"""rkit image diff: two images side by side: file digests, environment identities (images/env.py), labels,
packages and the lines of the definitions they were built from."""

from __future__ import annotations

import difflib
import subprocess
from pathlib import Path
from typing import Any

from rkit.images.env import changes
from rkit.images.identity import identify, locate
from rkit.images.store import apptainer


def definition(path: str) -> list[str]:
    """The definition file an image was built from (Apptainer keeps it inside), as lines; [] when absent."""
    done = subprocess.run([apptainer(), "inspect", "--deffile", path], capture_output=True, text=True,
                          timeout=300, check=False)
    return done.stdout.splitlines() if done.returncode == 0 else []


def diff_images(a: str, b: str) -> dict[str, Any]:
    """`rkit image diff A B`: file digests, environment identities, and what differs: labels, packages (build,
    python, debian: as `changes`), definition lines (a unified diff)."""
    left, right = (identify(p, locate(p)) for p in (a, b))  # locate: a missing file is exit 2 with the fix
    out: dict[str, Any] = {side: {"path": i.path, "sha256": i.sha256, "environment_sha256": i.environment_sha256}
                           for side, i in (("a", left), ("b", right))}
    groups = changes(left.environment, right.environment)
    labels = [{"key": k, "a": left.labels.get(k), "b": right.labels.get(k)}
              for k in sorted(set(left.labels) | set(right.labels)) if left.labels.get(k) != right.labels.get(k)]
    if labels:
        groups = {"labels": labels, **groups}
    lines = list(difflib.unified_diff(definition(left.path), definition(right.path), Path(left.path).name,
                                      Path(right.path).name, lineterm="", n=1))
    out.update({"same_file": left.sha256 == right.sha256,
                "same_environment": left.environment_sha256 == right.environment_sha256,
                "groups": groups, "definition": lines})
    return out


def render_diff(result: dict[str, Any]) -> str:
    out = [f"a: {result['a']['path']}  {result['a']['sha256']}  environment {result['a']['environment_sha256']}",
           f"b: {result['b']['path']}  {result['b']['sha256']}  environment {result['b']['environment_sha256']}"]
    for group, items in result["groups"].items():
        out.append(f"{group} ({len(items)})")
        out.extend(f"  {c['key']}: {c['a'] if c['a'] is not None else '(none)'} -> "
                   f"{c['b'] if c['b'] is not None else '(none)'}" for c in items)
    if result["definition"]:
        out.append("definition")
        out.extend(f"  {line}" for line in result["definition"])
    out.append("same file" if result["same_file"] else
               "same environment (rebuilt)" if result["same_environment"] else "different")
    return "\n".join(out)
