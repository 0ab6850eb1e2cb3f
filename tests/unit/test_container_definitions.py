"""What can be proved here about the images without building them (rocm, cuda), and about all locks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from spython.main.parse.parsers import SingularityParser

from rkit.contract.errors import RkitError
from rkit.images.build import definition_arguments, plan_build
from rkit.images.store import FLAVORS

from ..conftest import REPO

CONTAINERS = REPO / "containers"
BASES = json.loads((CONTAINERS / "bases.json").read_text())


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_entries(path: Path) -> list[tuple[str, list[str]]]:
    """(requirement, hashes) for every requirement of a `--generate-hashes` lock."""
    text = path.read_text().replace("\\\n", " ")
    entries = []
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        requirement = line.split("--hash")[0].strip()
        entries.append((requirement, re.findall(r"--hash=(sha256:[0-9a-f]{64})", line)))
    return entries


def test_base_definition_is_the_cpu_one_with_setuptools_alone():
    """base.def (built twice from nothing by the reproducibility test) runs every step of cpu.def: the same
    bootstrap, mirror, Debian lock check, pip --require-hashes, compileall, stamps and cleanup; only its lock is
    cpu.txt's setuptools entry alone, and it runs Python rather than the agent."""
    import difflib

    diff = difflib.unified_diff(definition_lines("cpu"), definition_lines("base"), lineterm="", n=0)
    changed = [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    agent = '    exec /opt/venv/bin/python -m rkit.runtime.agent "$@"'
    assert changed == ["-    FLAVOR=cpu", "+    FLAVOR=base", f"-{agent}", '+    exec /opt/venv/bin/python "$@"']
    cpu = dict(lock_entries(CONTAINERS / "lock" / "cpu.txt"))
    base = dict(lock_entries(CONTAINERS / "lock" / "base.txt"))
    assert list(base) == [next(req for req in cpu if req.startswith("setuptools=="))]
    assert base == {req: cpu[req] for req in base}
    assert BASES["base"] == {**BASES["cpu"], "mirror": BASES["base"]["mirror"]}
    assert definition_lines("base")[:4] == definition_lines("cpu")[:4]  # the same dated mirror by default
    from rkit.cli import images as cli

    assert set(cli.image_build.params[0].type.choices) == set(FLAVORS)


@pytest.mark.parametrize("flavor", ["rocm"])
def test_definition_parses_and_installs_only_the_hash_locked_set(flavor):
    """spython's parser reads docker-bootstrap definitions; the cpu one (debootstrap) is built for real, and
    the cuda one is the cpu one with its flavor and GPU environment (below)."""
    recipe = next(iter(SingularityParser(str(CONTAINERS / f"{flavor}.def")).recipe.values()))
    post = " ".join(recipe.install).replace("\\ ", " ")
    pip_lines = [c for c in re.split(r"(?<=\S)\s(?=/opt/venv/bin/)", post) if "pip install" in c]
    assert len(pip_lines) == 2
    assert "--require-hashes --no-deps -r /opt/rkit/lock.txt" in pip_lines[0].replace("  ", " ")
    assert "--no-deps" in pip_lines[1] and pip_lines[1].rstrip().split()[-1].startswith("/opt/rkit/src")
    assert not re.search(r"\b(curl|wget)\b", post), "no download without a checksum"
    labels = " ".join(recipe.labels)
    for label in ("org.rkit.definition.sha256", "org.rkit.lock.sha256", "org.rkit.base.reference",
                  "org.rkit.base.digest", "org.rkit.version", "org.rkit.build.date", "org.rkit.flavor"):
        assert label in labels
    assert any("/etc/rkit/image.json" in line for line in recipe.install)


def definition_lines(flavor: str) -> list[str]:
    return [line for line in (CONTAINERS / f"{flavor}.def").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_cuda_definition_is_the_cpu_one_with_its_flavor_and_gpu_environment():
    """No registry: cuda.def debootstraps Debian like cpu.def (built for real) and installs its own lock;
    NVIDIA's user-space libraries are wheels in cuda.txt, the driver comes from the host (--nv)."""
    import difflib

    diff = difflib.unified_diff(definition_lines("cpu"), definition_lines("cuda"), lineterm="", n=0)
    changed = [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert changed == ["-    FLAVOR=cpu", "+    FLAVOR=cuda", "+    export XLA_PYTHON_CLIENT_PREALLOCATE=false"]
    assert "Bootstrap: debootstrap" in definition_lines("cuda")
    assert "--nv" in (CONTAINERS / "cuda.def").read_text()
    base = BASES["cuda"]
    assert base["bootstrap"] == "debootstrap" and base["digest"] is None
    plan = plan_build("cuda", {"MIRROR": "http://deb.debian.org/debian"})
    assert "BASE" not in plan.build_args and plan.build_args["BASE_DIGEST"] == "none"
    assert plan.lock == CONTAINERS / "lock" / "cuda.txt"
    names = {req.split("==")[0] for req, _ in lock_entries(plan.lock)}
    assert {"nvidia-cuda-runtime", "nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13"} <= names


@pytest.mark.parametrize("flavor", ["rocm"])
def test_gpu_bases_are_pinned_by_digest_in_one_data_file(flavor):
    base = BASES[flavor]
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", base["digest"])
    plan = plan_build(flavor)
    assert plan.build_args["BASE"] == f"{base['reference']}@{base['digest']}"
    # The definition carries no digest of its own: bases.json is the one place to refresh.
    assert base["digest"] not in (CONTAINERS / f"{flavor}.def").read_text()
    assert definition_arguments(CONTAINERS / f"{flavor}.def")["BASE"].startswith("set-by-rkit")
    assert "skopeo inspect" in " ".join(BASES["_about"])


def test_rocm_environment_and_gpu_plugins():
    rocm = (CONTAINERS / "rocm.def").read_text()
    assert "--xla_gpu_enable_command_buffer=" in rocm and "ROCM_PATH=/opt/rocm" in rocm
    names = {req.split("==")[0] for req, _ in lock_entries(CONTAINERS / "lock" / "rocm.txt")}
    assert {"jax-rocm7-plugin", "jax-rocm7-pjrt", "maxtext", "orbax-checkpoint"} <= names
    cuda = {req.split("==")[0] for req, _ in lock_entries(CONTAINERS / "lock" / "cuda.txt")}
    assert {"jax-cuda13-plugin", "jax-cuda13-pjrt", "maxtext"} <= cuda


@pytest.mark.parametrize("flavor", ["cpu", "cuda"])
def test_debootstrap_mirror_default_is_a_dated_snapshot(flavor):
    mirror = definition_arguments(CONTAINERS / f"{flavor}.def")["MIRROR"]
    assert re.match(r"http://snapshot\.debian\.org/archive/debian/\d{8}T\d{6}Z/?$", mirror)


@pytest.mark.parametrize("lock", ["cpu", "dev", "rocm", "cuda", "tools"])
def test_every_package_is_pinned_with_a_hash(lock):
    entries = lock_entries(CONTAINERS / "lock" / f"{lock}.txt")
    assert entries
    for requirement, hashes in entries:
        assert re.match(r"^[A-Za-z0-9._-]+(\[[^\]]+\])?==[^\s;]+", requirement), requirement
        assert hashes, f"{requirement} has no --hash"


def test_cache_key_covers_content_not_location():
    a = plan_build("cpu", {"MIRROR": "http://deb.debian.org/debian"})
    b = plan_build("cpu", {"MIRROR": "http://deb.debian.org/debian"})
    c = plan_build("cpu", {"MIRROR": "http://ftp.debian.org/debian"})
    assert a.key == b.key != c.key
    assert "CONTEXT" not in a.key_material["build_args"]
    # The build's one time is the snapshot date of the definition's mirror, not the clock: in the key like any
    # other input (imagerepro), and so is the Debian lock.
    assert a.key_material["build_args"]["BUILD_DATE"] == "2026-11-01T00:00:00Z"
    assert a.key_material["build_args"]["SOURCE_DATE_EPOCH"] == "1793491200"
    assert a.key_material["debian_lock_sha256"].startswith("sha256:")
    assert a.key_material["definition_sha256"].startswith("sha256:")


PLATFORMS = [arg for n in range(17, 29) for arg in ("--platform", f"manylinux_2_{n}_x86_64")] + [
    "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]


@pytest.mark.slow
@pytest.mark.parametrize(("flavor", "python"), [("rocm", "3.12"), ("cuda", "3.13")])
def test_gpu_lock_resolves_for_its_platform(flavor, python, tmp_path):
    """pip resolves every pinned wheel, hash-checked, for the image's Python on x86_64 manylinux_2_28 (no
    install): 3.12 of AMD's Ubuntu base for rocm, Debian trixie's 3.13 for cuda."""
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--only-binary=:all:", *PLATFORMS, "--python-version", python, "--implementation", "cp",
                           "--require-hashes", "--no-deps", "--target", str(tmp_path / "t"), "--report", str(report),
                           "-r", str(CONTAINERS / "lock" / f"{flavor}.txt")],
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    installed = {normalize(item["metadata"]["name"]) for item in json.loads(report.read_text())["install"]}
    pinned = {normalize(req.split("==")[0].split("[")[0])
              for req, _ in lock_entries(CONTAINERS / "lock" / f"{flavor}.txt")}
    assert installed == pinned


def test_the_rocm_bases_tag_names_the_rocm_its_locked_jax_plugin_is_built_for():
    """The tag a user reads beside the rocm base's digest names the ROCm major that the locked JAX plugin wants
    (jax-rocm7-plugin: ROCm 7), and says where the name of the pinned digest comes from."""
    from rkit.images.store import bases

    rocm = bases()["rocm"]
    lock = (CONTAINERS / "lock" / "rocm.txt").read_text()
    majors = {int(m) for m in re.findall(r"^jax-rocm(\d+)-plugin==", lock, re.M)}
    assert len(majors) == 1 and rocm["tag"].split(".")[0] == str(*majors)
    assert rocm["tag"] in rocm["tag_from"] and "config sha256:" in rocm["tag_from"]
    assert rocm["digest"] == "sha256:439edaa8f0c4be4a3728e528f87b8a2ea1f051f34cf10b27caa4bd94f562eda7"
    assert rocm["tag"] == "7.14.0-full"  # what public pins of that digest call it (not 7.0-complete)


def test_image_side_files_cover_what_the_agent_imports():
    """The cache key covers the rkit modules that run inside an image: the whole import closure of every runtime/
    module (the agent, its standby, the build's helpers), imported for real."""
    from rkit.images.store import PACKAGE, image_side_files

    entries = sorted(".".join(("rkit", *p.relative_to(PACKAGE).with_suffix("").parts))
                     for p in (PACKAGE / "runtime").rglob("*.py") if p.name != "__init__.py")
    assert "rkit.runtime.agent" in entries and "rkit.runtime.standby" in entries
    code = (f"import sys, {', '.join(entries)}; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('rkit'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    for module in done.stdout.split():
        parts = module.split(".")[1:]
        candidates = {"/".join(parts) + ".py", "/".join(parts + ["__init__.py"])} if parts else {"__init__.py"}
        assert candidates & set(image_side_files()), module


@pytest.mark.parametrize("mirror", ["http://deb.debian.org/debian; rm -rf /", "http://u:pw@mirror/debian",
                                    "ftp://deb.debian.org/debian", "http://mirror/debian $(id)",
                                    "http://mirror/deb'ian", "file:///etc", "http://mirror/debian\n"])
def test_mirror_is_only_a_plain_http_url(mirror):
    with pytest.raises(RkitError, match="plain http"):
        plan_build("cpu", {"MIRROR": mirror})
    assert plan_build("cpu", {"MIRROR": "https://snapshot.debian.org/archive/debian/20261101T000000Z/"}).key


def test_a_cached_image_is_used_only_while_its_digest_is_the_recorded_one(tmp_path, monkeypatch):
    from rkit.images import identity as image
    from rkit.images.store import sha256_file

    monkeypatch.setenv("RKIT_IMAGE_CACHE", str(tmp_path))
    sif = tmp_path / "cpu-abc.sif"
    sif.write_bytes(b"an image")
    digest = sha256_file(sif)
    (tmp_path / "cpu-abc.json").write_text(json.dumps({"flavor": "cpu", "path": str(sif), "sha256": digest,
                                                       "key_material": {}, "built": 1}))
    assert image.resolve_flavor("cpu", want_sha256=digest) == sif
    sif.write_bytes(b"a replaced image")
    with pytest.raises(RkitError, match="changed after it was built .* Rebuild it with `rkit image build cpu --force`"):
        image.resolve_flavor("cpu", want_sha256=digest)


def test_an_image_rewritten_in_place_with_its_old_mtime_is_refused_before_the_next_attempt(tmp_path):
    import os

    from rkit.images import identity as image
    from rkit.images.store import sha256_file

    sif = tmp_path / "x.sif"
    sif.write_bytes(b"image one")
    identity = image.ImageIdentity(reference=str(sif), path=str(sif), sha256=sha256_file(sif), flavor=None)
    identity.check_unchanged()  # the stamped image: passes (from the command's memo)
    before = sif.stat()
    for _ in range(100_000):  # same inode, same size, other bytes, the mtime set back; until the kernel's coarse
        with open(sif, "r+b") as fh:  # clock has moved on, so that the ctime differs (as it would on any later day)
            fh.write(b"IMAGE")
        os.utime(sif, ns=(before.st_atime_ns, before.st_mtime_ns))
        if sif.stat().st_ctime_ns != before.st_ctime_ns:
            break
    after = sif.stat()
    assert (after.st_mtime_ns, after.st_ino, after.st_size) == (before.st_mtime_ns, before.st_ino, before.st_size)
    with pytest.raises(RkitError, match="image digest mismatch"):
        identity.check_unchanged()


def test_an_empty_cache_names_the_build_command(tmp_path, monkeypatch):
    from rkit.images import identity as image

    monkeypatch.setenv("RKIT_IMAGE_CACHE", str(tmp_path))
    with pytest.raises(RkitError, match=r"no cpu image built .* `make image FLAVOR=cpu`"):
        image.resolve_flavor("cpu")  # the mirror is not probed and its placeholder passes the MIRROR check
