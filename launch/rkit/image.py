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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import RkitError

REPO = Path(__file__).resolve().parents[2]
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


# The part of rkit that runs inside an image (the agent and what it imports, and the build-time writer of
# /etc/rkit/image.json). Only these files are in the cache key: a change to the host-side CLI, supervisor or
# backends does not rebuild images. tests/unit/test_container_definitions.py checks this list is complete.
IMAGE_SIDE_FILES = ("__init__.py", "agent.py", "config.py", "debianlock.py", "defaults.py", "determinism.py",
                    "devices.py", "envscan.py", "errors.py", "heartbeat.py",
                    "imageinfo.py", "inject.py", "manifest.py", "rundir.py", "safeio.py", "schema/recipe.schema.json",
                    "stamp.py",
                    "standby.py",
                    "telemetry/__init__.py",
                    "telemetry/metrics.py", "telemetry/node.py", "telemetry/health.py", "telemetry/gpu.py",
                    "telemetry/exporter.py", "telemetry/exposure.py",
                    "trainers/__init__.py", "trainers/maxtext.py")


def sha256_tree(root: Path, files: tuple[str, ...] = IMAGE_SIDE_FILES) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
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


def _require_file(path: Path) -> Path:
    if not path.is_file():
        raise RkitError(f"{path}: no such image file. Build one with `make image FLAVOR=cpu` "
                        "(or `rkit image build cpu`), or give the path of a SIF.")
    return path


def inspect(path: Path) -> dict[str, Any]:
    path = _require_file(path)
    found = labels(path)
    info = image_info(path)
    return {"path": str(path.resolve()), "sha256": sha256_file(path), "size_bytes": path.stat().st_size,
            "flavor": found.get(LABEL_PREFIX + "flavor"),
            "labels": {k: v for k, v in sorted(found.items()) if k.startswith(LABEL_PREFIX)},
            "python": info.get("python"), "package_count": len(info.get("packages", {})),
            "rkit_version": info.get("rkit_installed")}


def verify(path: Path, expect: str) -> str:
    """Raise unless the SIF's sha256 is `expect`; return it."""
    found = sha256_file(_require_file(path))
    expected = expect if expect.startswith("sha256:") else f"sha256:{expect}"
    if found != expected:
        raise RkitError(f"{path}: image digest mismatch: expected {expected}, found {found}. The file was rebuilt "
                        "or replaced; use the image the run was made with, or accept the change explicitly.")
    return found


# ---------------------------------------------------------------- resolve (recipes)


@dataclass
class ImageIdentity:
    """What a run records about its image, and checks again before every attempt."""

    reference: str
    path: str
    sha256: str
    flavor: str | None
    labels: dict[str, str] = field(default_factory=dict)
    size_bytes: int = 0
    python: str = "/opt/venv/bin/python"  # the image's Python that runs the ranks (imageagent.probe)
    agent: str = "image"  # "image": its own rkit agent (the same files as this rkit's); "bound": rkit brings it
    environment_sha256: str | None = None  # what it holds (imageenv.identity), beside the file digest
    environment: dict[str, Any] | None = None  # build (Python, definition, lock), python and debian packages

    @property
    def gpu_flags(self) -> list[str]:
        return GPU_FLAGS.get(self.flavor or "cpu", [])

    def as_dict(self) -> dict[str, Any]:
        return {"kind": "sif", **asdict(self)}

    def check_unchanged(self) -> ImageIdentity | None:
        """Before every attempt: the SIF must be the one the run was stamped with, or a rebuild of it that holds
        the same environment (imageenv): None when the file is the same, the rebuilt image's identity when it
        holds the same environment; else RkitError naming the packages that changed."""
        if not Path(self.path).is_file():
            raise RkitError(f"{self.path}: the run's image is gone (expected {self.sha256}); restore it or "
                            "rebuild it with the same definition and lock.")
        found = sha256_file(Path(self.path))
        if found == self.sha256:
            return None
        try:
            other = identify(self.reference, Path(self.path), found)
        except RkitError as exc:
            raise RkitError(f"{self.path}: image digest mismatch: expected {self.sha256}, found {found}, and its "
                            f"environment could not be read ({exc}). Use the image the run was made with.") from None
        return self.same_environment(other)

    def same_environment(self, found: ImageIdentity) -> ImageIdentity:
        """`found` (another file) when it holds this image's environment; else RkitError with what changed."""
        from . import imageenv

        same, _, what = imageenv.compare({"environment_sha256": self.environment_sha256,
                                          "environment": self.environment},
                                         found.environment_sha256, found.environment)
        if same:
            return found
        raise RkitError(f"{found.path}: image digest mismatch: expected {self.sha256}, found {found.sha256}, and "
                        f"it holds another environment: {what}. Use the image the run was made with (or one "
                        "rebuilt from the same definition and lock), or accept the change explicitly.")


def cached_records(flavor: str) -> list[dict[str, Any]]:
    records = []
    for path in sorted(cache_dir().glob(f"{flavor}-*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            continue
        if record.get("flavor") == flavor and Path(record.get("path", "")).is_file():
            records.append(record)
    return sorted(records, key=lambda r: r.get("built", 0), reverse=True)


def resolve_flavor(flavor: str, want_sha256: str | None = None) -> Path:
    """The cached image of this flavor built from the current definition and lock (or with a given digest)."""
    records = cached_records(flavor)
    if want_sha256:
        for record in records:
            if record["sha256"] == want_sha256:
                return _unchanged(record)
    from .imagebuild import ANY_MIRROR, plan_build

    # Which mirror does not matter here (build_args are not compared below); naming one skips the reachability
    # probe, and it must pass plan_build's MIRROR check like any other.
    plan = plan_build(flavor, {"MIRROR": ANY_MIRROR} if bases()[flavor]["bootstrap"] == "debootstrap" else None)
    same = ("definition_sha256", "lock_sha256", "base_reference", "base_digest", "rkit_agent_sha256")
    current = [r for r in records if all(r["key_material"].get(k) == plan.key_material[k] for k in same)]
    if not current:
        raise RkitError(f"image {flavor!r}: no {flavor} image built from the current containers/{flavor}.def, its "
                        f"lock and this rkit in {cache_dir()}; build it with `make image FLAVOR={flavor}`.")
    return _unchanged(current[0])


def _unchanged(record: dict[str, Any]) -> Path:
    """A cached image is used only while its digest is the one recorded when it was built."""
    path = Path(record["path"])
    found = sha256_file(path)
    if found != record.get("sha256"):
        raise RkitError(f"{path}: the cached {record.get('flavor')} image changed after it was built (recorded "
                        f"{record.get('sha256')}, found {found}); something replaced or damaged it. Rebuild it "
                        f"with `rkit image build {record.get('flavor')} --force`.")
    return path


def locate(reference: str, want_sha256: str | None = None) -> Path | None:
    """Where a recipe's `image:` value points: None for 'none', the cache for a flavor name (the image with
    `want_sha256` if cached), else a SIF path (relative paths are relative to the current directory)."""
    if reference == "none":
        return None
    apptainer()  # missing apptainer: say so before anything is created
    if reference in FLAVORS:
        return resolve_flavor(reference, want_sha256).resolve()
    return _require_file(Path(reference).expanduser()).resolve()


def identify(reference: str, path: Path, sha256: str | None = None) -> ImageIdentity:
    from . import imageenv
    from .imageagent import probe

    sha256 = sha256 or sha256_file(path)
    inside = probe(apptainer(), str(path), sha256)
    # The labels as the image holds them (memoised with the probe: no `apptainer inspect` per run).
    found = inside["labels"] if isinstance(inside.get("labels"), dict) else labels(path)
    env = imageenv.environment(inside, found)
    return ImageIdentity(reference=reference, path=str(path), sha256=sha256,
                         flavor=found.get(LABEL_PREFIX + "flavor") or inside["flavor"],
                         labels={k: v for k, v in sorted(found.items()) if k.startswith(LABEL_PREFIX)},
                         size_bytes=path.stat().st_size, python=inside["python"], agent=inside["agent"],
                         environment_sha256=imageenv.identity(env), environment=env)


def resolve(reference: str) -> ImageIdentity | None:
    path = locate(reference)
    return None if path is None else identify(reference, path)
