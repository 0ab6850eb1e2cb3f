"""Building images (through spython) into the content-addressed cache (images/store.py), bit-reproducibly
(images/repro.py) and with the Debian packages checked against their lock (runtime/debianlock.py).

The cache key of a build is the sha256 of what goes into it: the definition file, the locks, the build arguments
that change content, the base image digest, and the image-side part of rkit (rkit is installed in the image).
An unchanged key is not rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rkit import __version__
from rkit.contract.errors import RkitError
from rkit.contract.rundir import write_atomic
from rkit.contract.safeio import private_dir
from rkit.contract.stamp import canonical_json
from rkit.images import repro as imagerepro
from rkit.images.store import (
    FLAVORS,
    PACKAGE,
    REPO,
    apptainer,
    bases,
    cache_dir,
    containers_dir,
    image_side_files,
    sha256_file,
    sha256_tree,
)


@dataclass(frozen=True)
class BuildPlan:
    flavor: str
    definition: Path
    lock: Path
    build_args: dict[str, str]
    key_material: dict[str, Any]
    key: str
    epoch: int  # the build's SOURCE_DATE_EPOCH (imagerepro.source_date_epoch), computed once here

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
                "base_digest": base_digest, "rkit_agent_sha256": sha256_tree(PACKAGE),
                "pyproject_sha256": sha256_file(REPO / "pyproject.toml"),
                "mksquashfs_args": imagerepro.mksquashfs_args()}
    debian_lock = debian_lock_path(flavor)
    if "DEBIAN_LOCK_SHA256" in declared:
        args["DEBIAN_LOCK_SHA256"] = material["debian_lock_sha256"] = sha256_file(debian_lock)
        args.setdefault("DEBIAN_LOCK_MODE", "check")
    material["build_args"] = dict(sorted(args.items()))
    key = "sha256:" + hashlib.sha256(canonical_json(material).encode()).hexdigest()
    return BuildPlan(flavor, definition, lock, args, material, key, epoch)


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
    # rkit's image side only (what the cache key covers: the agent, its standby and the build's helpers), so
    # that the image is a function of its key: the CLI and the supervisor run on the host, and a change to them
    # (or to the README, which would go into the package's metadata) neither rebuilds images nor changes them.
    src = into / "src"
    src.mkdir()
    shutil.copy2(REPO / "pyproject.toml", src / "pyproject.toml")
    (src / "README.md").write_text(README_IN_IMAGE, encoding="utf-8")
    for name in image_side_files():
        (src / "launch" / "rkit" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / "launch" / "rkit" / name, src / "launch" / "rkit" / name)


README_IN_IMAGE = ("rkit's image side (contract/ and runtime/): the agent each rank runs (rkit.runtime.agent), its "
                   "warm standby and the image build's helpers. The CLI and the supervisor run on the host; see the "
                   "rkit repository.\n")


def build(plan: BuildPlan, *, log: Path | None = None, echo: Callable[[str], None] = lambda line: None,
          force: bool = False) -> dict[str, Any]:
    """Build the SIF for `plan` unless the cache already has it; return its record."""
    if plan.sif.is_file() and plan.record.is_file() and not force:
        record = json.loads(plan.record.read_text(encoding="utf-8"))
        record["cached"] = True
        return record
    from spython.utils import stream_command

    exe = apptainer()
    private_dir(plan.sif.parent)
    log = log or plan.sif.with_suffix(".build.log")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="rkit-build-", dir=plan.sif.parent) as tmp:
        context = Path(tmp)
        _stage_context(plan, context)
        args = dict(plan.build_args)
        partial = context / "image.sif"
        # One argv item: Apptainer 1.4's --fakeroot re-exec drops the first "f" of an argument that starts with
        # "-" (it takes it for a cluster of short flags: "-mkfs-time" became "-mks-time").
        argv = [exe, "build", "--fakeroot", "--force", f"--mksquashfs-args={imagerepro.mksquashfs_args()}"]
        for name, value in sorted(args.items()):
            argv += ["--build-arg", f"{name}={value}"]
        argv += [str(partial), str(plan.definition)]
        failed = None
        before = os.environ.get("SOURCE_DATE_EPOCH")
        os.environ["SOURCE_DATE_EPOCH"] = str(plan.epoch)  # mksquashfs, debootstrap's tools, Apptainer >= 1.5
        with os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "w",
                       encoding="utf-8") as fh:
            fh.write(" ".join(argv) + "\n")
            try:
                # In the context: %files takes its sources relative to the build's working directory, so no
                # temporary path is written into the definition the image keeps.
                with contextlib.chdir(context):
                    for line in stream_command(argv, output_type="both"):
                        # Seconds since the build began on each line of the log: where a slow build spends its time.
                        fh.write(f"[{time.time() - started:7.1f}s] {line}")
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
        imagerepro.normalize_sif(partial, plan.epoch)
        os.chmod(partial, 0o600)  # the cache is the user's own (its folder is 0700 when rkit made it)
        os.replace(partial, plan.sif)  # atomic: the cache never holds half an image
    record = {"flavor": plan.flavor, "key": plan.key, "key_material": plan.key_material, "path": str(plan.sif),
              "sha256": sha256_file(plan.sif), "size_bytes": plan.sif.stat().st_size,
              "build_seconds": round(time.time() - started, 1), "built": time.time(), "log": str(log)}
    write_atomic(plan.record, json.dumps(record, indent=2, sort_keys=True) + "\n")
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


