"""Which Python of an image runs the ranks, and whether the agent comes from the image or from rkit.

An image rkit built holds rkit (`/opt/venv/bin/python -m rkit.runtime.agent`). Any other image with Python, JAX and
MaxText (AMD's and NVIDIA's MaxText images, a team's own) does not: then rkit brings its agent in. The agent
needs only the standard library and what MaxText already imports, so a copy of its files (the image side:
`rkit/__init__.py`, `contract/` and `runtime/`, the files the image cache key covers), written into
the run directory (`<run>/agent/rkit/`, which every rank already sees: the run directory is bound into the
container and checked on every node) and put on the ranks' PYTHONPATH, is all it takes. The copy is rewritten
on every supervisor start, so the agent always matches the supervisor that reads its files.

The probe runs the image's Python once per image (memoised by digest, in the image cache's probes/ folder):
its path, version, whether it holds rkit's agent (the same files as this rkit's), JAX and MaxText, and which JAX
plugin (cuda, rocm or none: the flavor of an image without rkit's labels, for `--nv` / `--rocm`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from rkit.contract.errors import RkitError
from rkit.contract.rundir import write_json_atomic
from rkit.contract.safeio import private_dir
from rkit.images.store import PACKAGE, cache_dir, image_side_files, sha256_tree

IMAGE_PYTHONS = ("/opt/venv/bin/python", "python3")  # rkit's images first, then the image's own PATH
AGENT_DIR = "agent"  # <run>/agent: holds the bound copy of the rkit package

# Run by the image's Python with the agent's file list as argv[1]: envscan.py's text (what the image holds, the
# same code an image rkit builds labels itself with), then the image's own rkit agent, used only when its files
# hash as this rkit's do (images/store.sha256_tree: the same function, inlined; the version string alone says nothing,
# it is the same for every build).
PROBE_MAIN = r"""
import importlib.util as u, os, sys
def version(name):
    try:
        return metadata.version(name)
    except Exception:
        return None
def tree():
    spec = u.find_spec("rkit")
    if spec is None or not spec.submodule_search_locations:
        return None
    root, digest = list(spec.submodule_search_locations)[0], hashlib.sha256()
    for name in sorted(json.loads(sys.argv[1])):
        try:
            data = open(os.path.join(root, name), "rb").read()
        except OSError:
            return None
        digest.update(name.encode() + b"\0" + data + b"\0")
    return "sha256:" + digest.hexdigest()
packages = python_packages()
try:
    labels = json.load(open("/.singularity.d/labels.json"))
except (OSError, ValueError):
    labels = None
vendor = ("cuda" if any(n.startswith("jax-cuda") for n in packages) else
          "rocm" if any(n.startswith("jax-rocm") for n in packages) else "cpu")
print(json.dumps({"python": sys.executable, "flavor": vendor, "python_version": sys.version.split()[0],
                  "rkit_agent_sha256": tree(), "packages": packages, "debian": debian_packages(), "labels": labels,
                  "jax": version("jax"), "maxtext": bool(u.find_spec("maxtext") or u.find_spec("MaxText"))}))
"""
PROBE = (PACKAGE / "runtime" / "envscan.py").read_text(encoding="utf-8") + PROBE_MAIN

_probed: dict[str, dict[str, Any]] = {}


def probe(apptainer: str, sif: str, sha256: str) -> dict[str, Any]:
    """What the image's Python holds; raises RkitError when no Python in it can run, or it has no JAX or
    MaxText (nothing could train there)."""
    if sha256 in _probed:
        return _probed[sha256]
    memo = cache_dir() / "probes" / f"{sha256.split(':')[-1]}.v3.json"  # an image's content does not change
    try:
        found = json.loads(memo.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        found = _run_probe(apptainer, sif)
        try:
            private_dir(memo.parent)
            write_json_atomic(memo, found)
        except OSError:
            pass  # a read-only cache: probe again next time
    found = {**found, "agent": "image" if found.get("rkit_agent_sha256") == sha256_tree(PACKAGE) else "bound"}
    _probed[sha256] = found
    return found


def _run_probe(apptainer: str, sif: str) -> dict[str, Any]:
    tried = []
    for python in IMAGE_PYTHONS:
        try:
            done = subprocess.run([apptainer, "exec", "--cleanenv", "--no-home", sif, python, "-c", PROBE,
                                   json.dumps(image_side_files())],
                                  capture_output=True, text=True, timeout=300, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            tried.append(f"{python}: {exc}")
            continue
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            try:
                found = json.loads(lines[-1])
            except ValueError:
                tried.append(f"{python}: printed {lines[-1][:100]!r}")
                continue
            break
        tried.append(f"{python}: exit {done.returncode} {done.stderr.strip()[-200:]}")
    else:
        raise RkitError(f"image {sif}: no Python in it could run ({'; '.join(tried)}). rkit runs the ranks with "
                        f"{' or '.join(IMAGE_PYTHONS)} inside the image; use an image with Python, JAX and MaxText.")
    missing = [name for name in ("jax", "maxtext") if not found.get(name)]
    if missing:
        raise RkitError(f"image {sif}: its Python ({found['python']}) has no {' and no '.join(missing)}; rkit "
                        "trains with MaxText on JAX inside the image. Use an image that holds both (e.g. "
                        "`make image FLAVOR=cpu`, or a vendor's MaxText image).")
    return found


def install(run_path: Path) -> Path:
    """Write this rkit package into `<run>/agent/rkit` (replacing an older copy whole); returns `<run>/agent`,
    the directory to put on the ranks' PYTHONPATH."""
    dest = run_path / AGENT_DIR
    dest.mkdir(exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".rkit-", dir=dest))
    try:
        for name in image_side_files():
            target = staging / "rkit" / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(PACKAGE / name, target)
        old = dest / "rkit"
        if old.exists():
            trash = Path(tempfile.mkdtemp(prefix=".old-", dir=dest))
            old.rename(trash / "rkit")
            shutil.rmtree(trash, ignore_errors=True)
        (staging / "rkit").rename(old)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest
