"""An image's environment identity, beside its file digest: what it holds, not how its bytes came out.

Two builds of the same definition, lock and mirror hold the same packages but differ in bytes (timestamps, the
build date), so the file digest alone refuses a rebuilt image. The environment is read from inside the image
(imageagent.probe: every Python distribution with its version, every installed Debian package with its version,
the Python version) plus the definition and lock digests of rkit's labels; its identity is the sha256 of that,
as canonical JSON. `rkit reproduce` and the check before every attempt compare the file digest first, then the
identity: the same identity is "rebuilt, same environment" (the run goes on, and says so); another one is
refused with the packages that changed. `rkit image diff` shows the same for any two images.

What the identity does not cover: file contents that no package version says (a file edited in place in the
image, data or configuration outside a package). A check that must catch those is the file digest, and it is
still what the run records first.
"""

from __future__ import annotations

from typing import Any

from . import envscan
from .image import LABEL_PREFIX

GROUPS = ("build", "python", "debian")


def environment(found: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    """The environment of an image from its probe (imageagent) and labels."""
    return envscan.environment(found.get("python_version"), found.get("packages") or {}, found.get("debian") or {},
                               labels.get(LABEL_PREFIX + "definition.sha256"), labels.get(LABEL_PREFIX + "lock.sha256"),
                               labels.get(LABEL_PREFIX + "debian-lock.sha256"))


def identity(env: dict[str, Any]) -> str:
    return envscan.identity(env)


def changes(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, list[dict[str, Any]]]:
    """Pure: {group: [{key, a, b}]} for what differs between two environments (None: absent)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for group in GROUPS:
        left, right = (a or {}).get(group, {}), (b or {}).get(group, {})
        found = [{"key": k, "a": left.get(k), "b": right.get(k)}
                 for k in sorted(set(left) | set(right)) if left.get(k) != right.get(k)]
        if found:
            out[group] = found
    return out


def compare(recorded: dict[str, Any], found_sha256: str | None, found: dict[str, Any] | None
            ) -> tuple[bool, dict[str, list[dict[str, Any]]], str]:
    """A run's recorded image (its `environment_sha256` and `environment`) against an image found now: whether
    it holds the same environment, what changed (`changes`), and that in one line (`describe`)."""
    same = bool(recorded.get("environment_sha256")) and recorded.get("environment_sha256") == found_sha256
    changed = changes(recorded.get("environment"), found)
    what = (describe(changed) if recorded.get("environment")
            else "unknown (the run recorded no environment for its image)")
    return same, changed, what


def describe(diff: dict[str, list[dict[str, Any]]], limit: int = 12) -> str:
    """One line: `python: rkit 0.1.0 -> (none), numpy 2.5.5 -> 2.5.4; debian: ...` (at most `limit` per group)."""
    parts = []
    for group, items in diff.items():
        shown = ", ".join(f"{c['key']} {c['a'] or '(none)'} -> {c['b'] or '(none)'}" for c in items[:limit])
        more = f" and {len(items) - limit} more" if len(items) > limit else ""
        parts.append(f"{group}: {shown}{more}")
    return "; ".join(parts) or "nothing"


def definition(path: str) -> list[str]:
    """The definition file an image was built from (Apptainer keeps it inside), as lines; [] when absent."""
    import subprocess

    from .image import apptainer

    done = subprocess.run([apptainer(), "inspect", "--deffile", path], capture_output=True, text=True,
                          timeout=300, check=False)
    return done.stdout.splitlines() if done.returncode == 0 else []


def diff_images(a: str, b: str) -> dict[str, Any]:
    """`rkit image diff A B`: file digests, environment identities, and what differs: labels, packages (build,
    python, debian: as `changes`), definition lines (a unified diff)."""
    import difflib
    from pathlib import Path

    from .image import identify, locate

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
