"""Apptainer images: build (through spython) into a content-addressed cache, inspect, verify, resolve.

An image is identified by the sha256 of its SIF file. The cache key of a build is the sha256 of what goes
into it: the definition file, the lock, the build arguments that change content, the base image digest,
and the image-side part of rkit (rkit is installed in the image). An unchanged key is not rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import __version__, imagerepro
from .errors import RkitError
from .rundir import write_atomic
from .stamp import canonical_json

REPO = Path(__file__).resolve().parents[2]
FLAVORS = ("cpu", "rocm", "cuda")
GPU_FLAGS = {"cpu": [], "rocm": ["--rocm"], "cuda": ["--nv"]}
# Build arguments that only say where things are, not what goes in: left out of the cache key.
LOCATION_ARGS = ("CONTEXT",)
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
                    "devices.py", "envscan.py", "errors.py",
                    "imageinfo.py", "inject.py", "manifest.py", "rundir.py", "schema/recipe.schema.json", "stamp.py",
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


# ---------------------------------------------------------------- build


@dataclass(frozen=True)
class BuildPlan:
    flavor: str
    definition: Path
    lock: Path
    build_args: dict[str, str]
    key_material: dict[str, Any]
    key: str

    @property
    def sif(self) -> Path:
        return cache_dir() / f"{self.flavor}-{self.key.split(':')[1][:16]}.sif"

    @property
    def record(self) -> Path:
        return self.sif.with_suffix(".json")


def definition_arguments(definition: Path) -> dict[str, str]:
    """Defaults of a definition file's %arguments section (NAME=VALUE lines)."""
    args: dict[str, str] = {}
    section = None
    for line in definition.read_text(encoding="utf-8").splitlines():
        if line.startswith("%"):
            section = line.split()[0]
            continue
        name, sep, value = line.strip().partition("=")
        if section == "%arguments" and sep and name and not name.startswith("#"):
            args[name] = value
    return args


def mirror_reachable(mirror: str, timeout: float = 10) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(mirror.rstrip("/") + "/dists/trixie/Release", timeout=timeout) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


# MIRROR is pasted into the definition's %post and header: only a plain URL, never a shell word or credentials.
ANY_MIRROR = "http://mirror.invalid/debian"  # a placeholder where the mirror does not matter (.invalid: RFC 2606)
PLAIN_URL = re.compile(r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~%/+-]*)?$")


def debian_lock_path(flavor: str) -> Path:
    """The lock of the Debian packages a debootstrapped image installs (bases.json's debian_lock, in
    containers/lock/; debianlock.py)."""
    return containers_dir() / "lock" / bases()[flavor].get("debian_lock", f"{flavor}.debian.txt")


def plan_build(flavor: str, overrides: dict[str, str] | None = None,
               log: Callable[[str], None] = lambda line: None) -> BuildPlan:
    if flavor not in FLAVORS:
        raise RkitError(f"unknown image flavor {flavor!r}; use one of {', '.join(FLAVORS)}.")
    root = containers_dir()
    definition, lock = root / f"{flavor}.def", root / "lock" / f"{flavor}.txt"
    base = bases()[flavor]
    args: dict[str, str] = {}
    if base["bootstrap"] == "debootstrap":
        args["MIRROR"] = definition_arguments(definition)["MIRROR"]
        if "MIRROR" not in (overrides or {}) and not mirror_reachable(args["MIRROR"]):
            # The dated snapshot is what makes the build reproducible; where it cannot be reached, say so and
            # use the plain mirror (recorded in the image's labels and in the cache key).
            log(f"rkit: warning: the snapshot mirror {args['MIRROR']} is unreachable; building from "
                f"{base['fallback_mirror']} instead (not reproducible; choose with --build-arg MIRROR=...)")
            args["MIRROR"] = base["fallback_mirror"]
        base_reference, base_digest = base["reference"], "none"
    else:
        base_reference, base_digest = base["reference"], base["digest"]
        args["BASE"] = f"{base_reference}@{base_digest}"
    declared = definition_arguments(definition)
    unknown = set(overrides or {}) - set(args) - ({"DEBIAN_LOCK_MODE"} & set(declared))
    if (overrides or {}).get("DEBIAN_LOCK_MODE", "check") not in ("check", "refresh"):
        raise RkitError(f"--build-arg DEBIAN_LOCK_MODE={overrides['DEBIAN_LOCK_MODE']!r}: check or refresh.")
    if "MIRROR" in (overrides or {}) and not PLAIN_URL.fullmatch(overrides["MIRROR"]):
        raise RkitError(f"--build-arg MIRROR={overrides['MIRROR']!r}: give a plain http(s) URL of a Debian mirror "
                        "(letters, digits and ._~%/+- in the path; no credentials, spaces or quotes), e.g. "
                        f"{base.get('fallback_mirror', 'http://deb.debian.org/debian')}.")
    if unknown:
        raise RkitError(f"--build-arg {', '.join(sorted(unknown))}: not a build argument of {flavor}.def "
                        f"(it takes {', '.join(sorted(args))}).")
    args.update(overrides or {})
    def_sha, lock_sha = sha256_file(definition), sha256_file(lock)
    args.update({"FLAVOR": flavor, "DEF_SHA256": def_sha, "LOCK_SHA256": lock_sha,
                 "BASE_REFERENCE": base_reference, "BASE_DIGEST": base_digest, "RKIT_VERSION": __version__})
    epoch = imagerepro.source_date_epoch(declared.get("MIRROR", ""))
    args["BUILD_DATE"] = imagerepro.iso(epoch)  # the build's one time, not the clock (imagerepro)
    if "SOURCE_DATE_EPOCH" in declared:
        args["SOURCE_DATE_EPOCH"] = str(epoch)
    material = {"definition_sha256": def_sha, "lock_sha256": lock_sha, "base_reference": base_reference,
                "base_digest": base_digest, "rkit_agent_sha256": sha256_tree(Path(__file__).resolve().parent)}
    debian_lock = debian_lock_path(flavor)
    if "DEBIAN_LOCK_SHA256" in declared:
        args["DEBIAN_LOCK_SHA256"] = material["debian_lock_sha256"] = sha256_file(debian_lock)
        args.setdefault("DEBIAN_LOCK_MODE", "check")
    material["build_args"] = dict(sorted(args.items()))
    key = "sha256:" + hashlib.sha256(canonical_json(material).encode()).hexdigest()
    return BuildPlan(flavor, definition, lock, args, material, key)


# Where a TLS-intercepting proxy sits between the build and PyPI, pip inside the build needs the host's CA
# bundle. It is used for the download only and removed; it cannot change what is installed (every package is
# checked against the lock's sha256), so it is not part of the cache key.
CA_VARIABLES = ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")


def _stage_context(plan: BuildPlan, into: Path) -> None:
    shutil.copy2(plan.lock, into / "lock.txt")
    debian_lock = debian_lock_path(plan.flavor)
    (into / "debian.lock").write_bytes(debian_lock.read_bytes() if debian_lock.is_file() else b"")
    ca = next((os.environ[v] for v in CA_VARIABLES if os.path.isfile(os.environ.get(v, ""))), None)
    if ca:
        shutil.copy2(ca, into / "ca.pem")
    else:
        (into / "ca.pem").write_bytes(b"")
    src = into / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "launch" / "rkit", src / "launch" / "rkit",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def build(plan: BuildPlan, *, log: Path | None = None, echo: Callable[[str], None] = lambda line: None,
          force: bool = False) -> dict[str, Any]:
    """Build the SIF for `plan` unless the cache already has it; return its record."""
    if plan.sif.is_file() and plan.record.is_file() and not force:
        record = json.loads(plan.record.read_text(encoding="utf-8"))
        record["cached"] = True
        return record
    from spython.utils import stream_command

    exe = apptainer()
    plan.sif.parent.mkdir(parents=True, exist_ok=True)
    log = log or plan.sif.with_suffix(".build.log")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="rkit-build-", dir=plan.sif.parent) as tmp:
        context = Path(tmp)
        _stage_context(plan, context)
        args = dict(plan.build_args, CONTEXT=str(context))
        epoch = imagerepro.source_date_epoch(definition_arguments(plan.definition).get("MIRROR", ""))
        partial = context / "image.sif"
        argv = [exe, "build", "--fakeroot", "--force", "--mksquashfs-args", imagerepro.mksquashfs_args(epoch)]
        for name, value in sorted(args.items()):
            argv += ["--build-arg", f"{name}={value}"]
        argv += [str(partial), str(plan.definition)]
        failed = None
        before = os.environ.get("SOURCE_DATE_EPOCH")
        os.environ["SOURCE_DATE_EPOCH"] = str(epoch)  # debootstrap's tools, and Apptainer >= 1.5 itself
        with open(log, "w", encoding="utf-8") as fh:
            fh.write(" ".join(argv) + "\n")
            try:
                for line in stream_command(argv, output_type="both"):
                    fh.write(line)
                    echo(line.rstrip("\n"))
            except subprocess.CalledProcessError as exc:
                failed = exc.returncode
            finally:
                if before is None:
                    os.environ.pop("SOURCE_DATE_EPOCH", None)
                else:
                    os.environ["SOURCE_DATE_EPOCH"] = before
        if failed is not None:
            raise RkitError(f"apptainer build of {plan.definition.name} failed (exit {failed}); "
                            f"the last lines of {log}:\n{_tail(log)}")
        imagerepro.normalize_sif(partial, epoch)
        os.replace(partial, plan.sif)  # atomic: the cache never holds half an image
    record = {"flavor": plan.flavor, "key": plan.key, "key_material": plan.key_material, "path": str(plan.sif),
              "sha256": sha256_file(plan.sif), "size_bytes": plan.sif.stat().st_size,
              "build_seconds": round(time.time() - started, 1), "built": time.time(), "log": str(log)}
    plan.record.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    record["cached"] = False
    return record


def refresh_debian_lock(flavor: str, overrides: dict[str, str] | None = None, **build_options: Any) -> Path:
    """`make lock`: build FLAVOR taking whatever Debian packages the mirror gives (DEBIAN_LOCK_MODE=refresh), then
    write the image's own record of them (/etc/rkit/debian.lock) to containers/lock/<flavor>.debian.txt."""
    plan = plan_build(flavor, {**(overrides or {}), "DEBIAN_LOCK_MODE": "refresh"})
    record = build(plan, **build_options)
    done = subprocess.run([apptainer(), "exec", "--cleanenv", "--no-home", record["path"], "cat",
                           "/etc/rkit/debian.lock"], capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0 or not done.stdout.strip():
        raise RkitError(f"{record['path']}: no /etc/rkit/debian.lock in it ({done.stderr.strip()[-300:]})")
    target = debian_lock_path(flavor)
    write_atomic(target, done.stdout)
    return target


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


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

    found = labels(path)
    sha256 = sha256 or sha256_file(path)
    inside = probe(apptainer(), str(path), sha256)
    env = imageenv.environment(inside, found)
    return ImageIdentity(reference=reference, path=str(path), sha256=sha256,
                         flavor=found.get(LABEL_PREFIX + "flavor") or inside["flavor"],
                         labels={k: v for k, v in sorted(found.items()) if k.startswith(LABEL_PREFIX)},
                         size_bytes=path.stat().st_size, python=inside["python"], agent=inside["agent"],
                         environment_sha256=imageenv.identity(env), environment=env)


def resolve(reference: str) -> ImageIdentity | None:
    path = locate(reference)
    return None if path is None else identify(reference, path)
