"""rkit diff: what differs between two runs' inputs (their stamps, or two environment manifests), by group:
config, image, packages, environment, hardware; the run's own identity is shown but never counts as a difference.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rkit.contract.errors import RkitError
from rkit.contract.rundir import RunDir
from rkit.contract.safeio import load_json

# Groups compared by `rkit diff`. "run" holds what must differ between two runs (identity, times,
# hosts, where the recipe came from): shown, but it does not make two runs different.
DIFF_GROUPS = ("config", "image", "packages", "environment", "hardware")
INFO_GROUP = "run"


def _flatten(value: Any, prefix: str = "", depth: int = 0) -> dict[str, Any]:
    if isinstance(value, dict) and depth < 32:  # deeper: shown whole, not dotted
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(_flatten(sub, f"{prefix}{key}.", depth + 1))
        return out
    return {prefix.rstrip("."): value}


def _latest_env_manifest(run_path: Path) -> dict[str, Any] | None:
    """The training environment as rank 0 of the newest attempt captured it."""

    run = RunDir(run_path)
    for attempt in reversed(run.attempt_numbers()):
        path = run.env_capture(attempt, 0)
        if os.path.lexists(path):
            value = load_json(path, "environment capture (attempts/<n>/env/rank-<r>.json)")
            if not isinstance(value, dict):
                raise RkitError(f"{path}: damaged, not a JSON object; rkit writes it when a rank starts. Delete "
                                "it, or restore it from a copy of the run directory.")
            return value
    return None


def _d(value: Any) -> dict[str, Any]:
    """A mapping of a manifest as written, or {} where a damaged or foreign file has something else."""
    return value if isinstance(value, dict) else {}


def comparable_view(source: Path) -> dict[str, dict[str, Any]]:
    """A run directory or a manifest file, as the groups `rkit diff` compares. A part of the wrong shape reads as
    absent (a manifest from another version, or damaged): the diff then shows it as such."""
    from rkit.contract.stamp import IDENTITY_KEYS

    stamp: dict[str, Any] = {}
    config: dict[str, Any] = {}
    env: dict[str, Any] | None = None
    if source.is_dir():
        if not os.path.lexists(source / "resolved.json"):
            raise RkitError(f"{source}: not an rkit run directory (no resolved.json) nor a manifest file.")
        run = RunDir(source)
        # Every input but the run's identity: the operational knobs too (out of the hash, not out of the diff).
        config = {k: v for k, v in run.load_resolved().items() if k not in IDENTITY_KEYS}
        stamp = run.load_manifest()
        env = _latest_env_manifest(source)
    else:
        stamp = load_json(source, "manifest (a run's manifest.json, or an environment capture)")
        if not isinstance(stamp, dict):
            raise RkitError(f"{source}: not a manifest (a JSON object); give two run directories or manifest "
                            "files.")
        config = _d(stamp.get("hashed_config"))
    env = _d(stamp.get("host", stamp) if env is None else env)  # a run's stamp, or an environment manifest
    hardware, system = _d(env.get("hardware")), _d(env.get("system"))
    run_info = dict(_d(stamp.get("run")))
    injections = stamp.get("injections") if isinstance(stamp.get("injections"), list) else []
    run_info.update({"hostname": system.get("hostname"), "git": _d(stamp.get("host")).get("git"),
                     "injections": [i.get("spec") for i in injections if isinstance(i, dict)],
                     "python_executable": _d(env.get("python")).get("executable")})
    return {
        "config": _flatten(config),
        "image": _flatten(_d(stamp.get("image"))),
        "packages": {"python": _d(env.get("python")).get("version"), **_d(env.get("packages"))},
        "environment": dict(_d(env.get("environment"))),
        "hardware": _flatten({"cpu": hardware.get("cpu"), "memory_bytes": hardware.get("memory_bytes"),
                              "gpu": hardware.get("gpu"), "machine": hardware.get("machine"),
                              "kernel": system.get("kernel"), "os": system.get("os"),
                              "jax": {k: v for k, v in _d(env.get("jax")).items() if k not in ("process_index",)}}),
        INFO_GROUP: _flatten(run_info),
    }


def diff_views(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for group in (*DIFF_GROUPS, INFO_GROUP):
        left, right = a.get(group, {}), b.get(group, {})
        changes = [{"key": key, "a": left.get(key), "b": right.get(key)}
                   for key in sorted(set(left) | set(right)) if left.get(key) != right.get(key)]
        if changes:
            groups[group] = changes
    return {"identical": not any(g in groups for g in DIFF_GROUPS), "groups": groups}


def diff_sources(a: Path, b: Path) -> dict[str, Any]:
    result = diff_views(comparable_view(Path(a)), comparable_view(Path(b)))
    result.update({"a": str(a), "b": str(b)})
    return result


def render_diff(result: dict[str, Any]) -> str:
    lines = [f"a: {result['a']}", f"b: {result['b']}"]
    for group, changes in result["groups"].items():
        note = " (expected to differ between runs; not counted)" if group == INFO_GROUP else ""
        lines.append(f"{group} ({len(changes)}){note}")
        lines.extend(f"  {c['key']}: {_show(c['a'])} -> {_show(c['b'])}" for c in changes)
    lines.append("identical" if result["identical"] else "different")
    return "\n".join(lines)


def _show(value: Any) -> str:
    return "(absent)" if value is None else repr(value) if isinstance(value, str) else str(value)
