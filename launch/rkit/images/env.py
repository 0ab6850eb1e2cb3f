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

from rkit.images.store import LABEL_PREFIX
from rkit.runtime import envscan

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
