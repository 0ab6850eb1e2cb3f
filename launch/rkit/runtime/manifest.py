"""Environment manifests: capture one (host side, or inside the training environment). `rkit diff` compares
them (readers/diff.py).

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

from rkit import __version__
from rkit.contract.stamp import REDACTED, redact  # noqa: F401 - REDACTED: the marker, read from here too

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


# A wheel's installed metadata folder: {name}-{version}.dist-info (PyPA's recorded installs), the version of PEP 440's
# characters. Read from the folder's name, a package costs a directory entry, not the parse of its METADATA file
# (0.5 s for 170 packages, a third of `rkit run`'s own start); any other folder is read as before.
DIST_INFO = re.compile(r"(.+?)-([A-Za-z0-9.+!]+)\.dist-info")


def packages() -> dict[str, str]:
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        folder = getattr(dist, "_path", None)  # PathDistribution's; another finder's has none
        named = DIST_INFO.fullmatch(folder.name) if isinstance(folder, Path) else None
        if named:
            found[_normalize(named.group(1))] = named.group(2)
            continue
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
        "rkit_path": str(Path(__file__).resolve().parents[1]),  # the image's own rkit, or the copy rkit bound in
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
