"""Apptainer images: the content-addressed cache, inspect, verify, and what a run records about its image
(ImageIdentity, checked before every attempt). Building is imagebuild.py.

An image is identified by the sha256 of its SIF file, and beside it by its environment identity (imageenv).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from rkit.contract.errors import RkitError

REPO = Path(__file__).resolve().parents[3]
FLAVORS = ("cpu", "rocm", "cuda", "base")
GPU_FLAGS = {"cpu": [], "rocm": ["--rocm"], "cuda": ["--nv"], "base": []}
LABEL_PREFIX = "org.rkit."
INSTALL_HINT = ("install it: on Debian 12 run `sudo ci/install-apptainer.sh` from the rkit checkout; elsewhere see "
                "https://apptainer.org/docs/admin/main/installation.html (or set RKIT_APPTAINER to its path)")


def apptainer() -> str:
    name = os.environ.get("RKIT_APPTAINER", "apptainer")
    found = shutil.which(name)
    if not found:
        raise RkitError(f"apptainer not found (looked for {name!r} on PATH); {INSTALL_HINT}.")
    return found


# (device, inode, size, mtime, ctime): an image is hashed once per command, not per check. The ctime is in the key
# because anyone who can write the file can set its mtime back (touch -d), but only the kernel sets its ctime:
# a SIF rewritten in place between two attempts is hashed again, and refused.
_DIGESTS: dict[tuple, str] = {}


def sha256_file(path: Path) -> str:
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if key in _DIGESTS:
            return _DIGESTS[key]
        digest = hashlib.sha256()
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    _DIGESTS[key] = found = f"sha256:{digest.hexdigest()}"
    return found


# The image side: the part of rkit that runs inside an image (the agent, its standby, the build's helpers and what
# they import) is exactly the package's __init__.py and its contract/ and runtime/ folders
# (tests/unit/test_layering.py proves that nothing there imports the host side). Only these files are in the cache
# key and in the agent rkit binds into images that lack it: a change to the host-side CLI, supervisor, backends or
# readers does not rebuild images.
PACKAGE = Path(__file__).resolve().parents[1]
IMAGE_SIDE = ("contract", "runtime")


def image_side_files(root: Path = PACKAGE) -> tuple[str, ...]:
    """The image side's files, relative to the package, sorted: sources and data (the schema), no bytecode."""
    found = ["__init__.py"]
    for folder in IMAGE_SIDE:
        found += [path.relative_to(root).as_posix() for path in (root / folder).rglob("*")
                  if path.is_file() and path.suffix in (".py", ".json") and "__pycache__" not in path.parts]
    return tuple(sorted(found))


def sha256_tree(root: Path, files: tuple[str, ...] | None = None) -> str:
    """The image side's digest: its files (this rkit's list unless given) as found under `root`."""
    digest = hashlib.sha256()
    for name in sorted(image_side_files() if files is None else files):
        digest.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    return f"sha256:{digest.hexdigest()}"


def cache_dir() -> Path:
    return Path(os.environ.get("RKIT_IMAGE_CACHE") or Path.home() / ".cache" / "rkit" / "images")


def containers_dir() -> Path:
    path = REPO / "containers"
    if not (path / "bases.json").is_file():
        raise RkitError(f"{path}: no container definitions here; `rkit image build` runs from an rkit checkout.")
    return path


def bases() -> dict[str, Any]:
    return json.loads((containers_dir() / "bases.json").read_text(encoding="utf-8"))


# ---------------------------------------------------------------- inspect / verify


def locked_version(flavor: str, package: str) -> str | None:
    """The version of `package` that the image flavor's lock (containers/lock/FLAVOR.txt) pins; None when it pins
    none or there is no lock here."""
    import re

    try:
        text = (containers_dir() / "lock" / f"{flavor}.txt").read_text(encoding="utf-8")
    except (OSError, RkitError):
        return None
    found = re.search(rf"^{re.escape(package)}==([^\s;\\]+)", text, re.M)
    return found.group(1) if found else None


def _apptainer_json(*args: str) -> dict:
    done = subprocess.run([apptainer(), *args], capture_output=True, text=True, check=False, timeout=300)
    if done.returncode != 0:
        raise RkitError(f"apptainer {' '.join(args[:-1])} {args[-1]} failed: {done.stderr.strip()[-500:]}")
    try:
        return json.loads(done.stdout)
    except ValueError:
        raise RkitError(f"apptainer {args[0]} of {args[-1]} printed no JSON: {done.stdout[:200]!r}") from None


def labels(path: Path) -> dict[str, str]:
    data = _apptainer_json("inspect", "--json", "--labels", str(path))
    return data.get("data", {}).get("attributes", {}).get("labels", {}) or {}


def image_info(path: Path) -> dict[str, Any]:
    """/etc/rkit/image.json from inside the image ({} for an image rkit did not build)."""
    try:
        return _apptainer_json("exec", "--cleanenv", "--no-home", str(path), "cat", "/etc/rkit/image.json")
    except RkitError as exc:
        if "No such file or directory" in str(exc):  # cat's own complaint: one container start, not two
            return {}
        raise


def require_file(path: Path) -> Path:
    if not path.is_file():
        raise RkitError(f"{path}: no such image file. Build one with `make image FLAVOR=cpu` "
                        "(or `rkit image build cpu`), or give the path of a SIF.")
    return path


def inspect(path: Path) -> dict[str, Any]:
    path = require_file(path)
    found = labels(path)
    info = image_info(path)
    return {"path": str(path.resolve()), "sha256": sha256_file(path), "size_bytes": path.stat().st_size,
            "flavor": found.get(LABEL_PREFIX + "flavor"),
            "labels": {k: v for k, v in sorted(found.items()) if k.startswith(LABEL_PREFIX)},
            "python": info.get("python"), "package_count": len(info.get("packages", {})),
            "rkit_version": info.get("rkit_installed")}


def verify(path: Path, expect: str) -> str:
    """Raise unless the SIF's sha256 is `expect`; return it."""
    found = sha256_file(require_file(path))
    expected = expect if expect.startswith("sha256:") else f"sha256:{expect}"
    if found != expected:
        raise RkitError(f"{path}: image digest mismatch: expected {expected}, found {found}. The file was rebuilt "
                        "or replaced; use the image the run was made with, or accept the change explicitly.")
    return found
