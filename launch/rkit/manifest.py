"""Environment manifests: capture one (host side, or inside the training environment), and diff two.

Capture never fails because a tool is missing: absent GPUs, absent git, absent JAX read as absent.
Importing this module needs no JAX; `capture(with_jax=True)` imports it only when asked.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from . import __version__
from .stamp import REDACTED, redact  # noqa: F401 - REDACTED: the marker, read from here too

ENV_PREFIXES = ("XLA_", "JAX_", "NCCL_", "RCCL_", "HSA_", "HIP_", "ROCR_", "CUDA_", "SLURM_")
KEY_PACKAGES = ("jax", "jaxlib", "maxtext", "orbax-checkpoint", "flax")
_TOOL_TIMEOUT = 10


def _run(argv: list[str], env: dict[str, str] | None = None) -> str | None:
    """Output of a probe command, or None when it is absent, fails or hangs. An argv list, never a shell; no stdin."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=_TOOL_TIMEOUT,
                              check=False, stdin=subprocess.DEVNULL, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def redact_env(environ: dict[str, str]) -> dict[str, str]:
    """The variables that shape training, with any secret-looking value replaced by a marker."""
    return redact({name: value for name, value in sorted(environ.items()) if name.startswith(ENV_PREFIXES)})


def packages() -> dict[str, str]:
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata.get("Name")
        if name:
            found[_normalize(name)] = dist.version
    return dict(sorted(found.items()))


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def cpu_info() -> dict[str, Any]:
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"model": model or platform.processor() or None, "count": os.cpu_count()}
    try:
        info["affinity"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    return info


def memory_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - a probe must not fail the capture
        return None


def gpu_info() -> dict[str, Any]:
    """GPUs through nvidia-smi, amd-smi or rocm-smi; {"present": False} when none answers."""
    nvidia = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if nvidia:
        rows = [[c.strip() for c in line.split(",")] for line in nvidia.splitlines() if line.strip()]
        cuda = None
        header = _run(["nvidia-smi"]) or ""
        match = re.search(r"CUDA Version:\s*([\d.]+)", header)
        if match:
            cuda = match.group(1)
        return {"present": True, "vendor": "nvidia", "count": len(rows),
                "models": sorted({r[0] for r in rows}), "driver": rows[0][1] if rows and len(rows[0]) > 1 else None,
                "memory": rows[0][2] if rows and len(rows[0]) > 2 else None, "cuda": cuda}
    amd = _run(["amd-smi", "static", "--asic", "--driver", "--json"]) or _run(["rocm-smi", "--showproductname"])
    if amd:
        rocm = None
        version_file = Path("/opt/rocm/.info/version")
        if version_file.is_file():
            rocm = version_file.read_text().strip()
        names = sorted(set(re.findall(r'"market_name":\s*"([^"]+)"', amd))
                       or set(re.findall(r"Card [Ss]eries:\s*(.+)", amd)))
        count = len(re.findall(r'"market_name"', amd)) or len(re.findall(r"Card [Ss]eries", amd))
        driver = re.search(r'"driver_version":\s*"([^"]+)"|Driver version:\s*(\S+)', amd)
        return {"present": True, "vendor": "amd", "count": count, "models": [n.strip() for n in names],
                "driver": next((g for g in driver.groups() if g), None) if driver else None, "rocm": rocm}
    return {"present": False}


def os_release() -> str | None:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return None


# Every git rkit runs on a recipe's repository: that repository may be hostile (an unpacked archive), and git's
# safe.directory does not cover trees owned by the same user. The -c options come first so they win over its config.
_GIT_HARDENED = ("git", "-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "--no-optional-locks")
_GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_PAGER": "cat", "GIT_OPTIONAL_LOCKS": "0"}
# Config keys (section.[subsection.]variable, subsection as "*") naming a command git could run, or (includes) a
# file that could name one. Found in the repository's own config, they keep rkit from running `git status`.
_COMMAND_KEYS = frozenset({
    "filter.*.clean", "filter.*.smudge", "filter.*.process", "core.fsmonitor", "diff.*.textconv", "diff.*.command",
    "diff.external", "core.sshcommand", "core.pager", "core.editor", "include.path", "includeif.*.path",
    "core.hookspath"})
_GIT_BOOLEANS = frozenset({"", "true", "false", "yes", "no", "on", "off", "1", "0"})


def _git(where: str, *args: str) -> str | None:
    return _run([*_GIT_HARDENED, "-C", where, *args], env={**os.environ, **_GIT_ENV})


def _command_keys(listing: str) -> list[str]:
    """The keys of `git config --list --show-scope -z` output, of the repository's own (local, worktree) scopes,
    that name commands. Entries pulled in by an include from the local config show the local scope too."""
    fields = listing.split("\0")
    found: list[str] = []
    for scope, entry in zip(fields[0::2], fields[1::2], strict=False):
        key, _, value = entry.partition("\n")
        if scope not in ("local", "worktree"):
            continue
        section, _, rest = key.partition(".")
        subsection, _, variable = rest.rpartition(".")
        shape = ".".join(p for p in (section.lower(), "*" if subsection else "", variable.lower()) if p)
        if shape == "core.fsmonitor" and value.strip().lower() in _GIT_BOOLEANS:
            continue  # on/off (git's own daemon, which -c core.fsmonitor=false turns off anyway), not a command
        if shape in _COMMAND_KEYS and key not in found:
            found.append(key)
    return found


def git_state(path: Path) -> dict[str, Any]:
    """Commit and dirty flag of the repository holding `path` (a recipe), or {"repository": False}.

    "dirty" is None, with "dirty_unknown" saying why, where rkit could not safely ask: `git status` would run
    commands the repository's own config names (a clean filter, an fsmonitor), or git could not answer."""
    where = str(path if path.is_dir() else path.parent)
    commit = _git(where, "rev-parse", "HEAD")
    if commit is None:
        return {"repository": False}
    state: dict[str, Any] = {"repository": True, "commit": commit, "dirty": None}
    listing = _git(where, "config", "--list", "--show-scope", "-z")  # runs nothing config-driven; git >= 2.26
    unsafe = _command_keys(listing) if listing is not None else []
    if listing is None:
        state["dirty_unknown"] = ("git could not list the repository's config (git older than 2.26, or a damaged "
                                  "config), so rkit did not run git status")
    elif unsafe:
        state["dirty_unknown"] = (f"the repository's own config names commands ({', '.join(unsafe)}); rkit runs "
                                  "none of them, so it did not run git status")
    else:
        status = _git(where, "status", "--porcelain", "--untracked-files=no", "--ignore-submodules=all")
        if status is None:
            state["dirty_unknown"] = "git status failed or timed out"
        else:
            state["dirty"] = bool(status)
    state["root"] = _git(where, "rev-parse", "--show-toplevel")
    return state


def jax_info() -> dict[str, Any]:
    """Backend and devices as JAX sees them (call after jax.distributed.initialize for the global view)."""
    try:
        import jax

        devices = jax.devices()
        return {
            "backend": jax.default_backend(),
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "device_count": len(devices),
            "local_device_count": jax.local_device_count(),
            "devices": [str(d) for d in devices],
            "device_kinds": sorted({d.device_kind for d in devices}),
        }
    except Exception as exc:  # noqa: BLE001 - recorded, not raised: the manifest says why JAX was absent
        return {"error": f"{type(exc).__name__}: {exc}"}


def capture(*, with_jax: bool = False, recipe_path: Path | None = None,
            environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything that can make two runs of the same config behave differently."""
    environ = dict(os.environ if environ is None else environ)
    pkgs = packages()
    uname = platform.uname()
    manifest: dict[str, Any] = {
        "rkit_version": __version__,
        "rkit_path": str(Path(__file__).resolve().parent),  # the image's own rkit, or the copy rkit bound in
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "packages": pkgs,
        "key_packages": {name: pkgs.get(name) for name in KEY_PACKAGES},
        "hardware": {"cpu": cpu_info(), "memory_bytes": memory_bytes(), "gpu": gpu_info(),
                     "machine": uname.machine},
        "system": {"kernel": uname.release, "os": os_release(), "hostname": socket.gethostname()},
        "environment": redact_env(environ),
    }
    if recipe_path is not None:
        manifest["git"] = git_state(Path(recipe_path).resolve())
    if with_jax:
        manifest["jax"] = jax_info()
    return manifest


# ---------------------------------------------------------------- diff

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
    from .errors import RkitError
    from .rundir import RunDir
    from .safeio import load_json

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
    from .errors import RkitError
    from .rundir import RunDir
    from .safeio import load_json
    from .stamp import IDENTITY_KEYS

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
