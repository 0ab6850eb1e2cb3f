"""The cpu image, built for real with Apptainer from containers/cpu.def (once per test session, then cached),
and the tiny recipe trained inside it with 2 processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from rkit.contract.rundir import RunDir
from rkit.images.store import apptainer, image_info, sha256_file
from rkit.runtime.telemetry.metrics import merged

from ..conftest import MIRROR, REPO, require_maxtext, rkit
from ..unit.test_container_definitions import lock_entries, normalize

pytestmark = [pytest.mark.slow]

SHORT = ["-o", "trainer.steps=30", "-o", "checkpoint.period=10"]
RECIPE = REPO / "recipes" / "tiny-cpu-image.yaml"


@pytest.fixture(scope="session")
def image_workspace(tmp_path_factory, cpu_image: Path) -> Path:
    require_maxtext()
    path = tmp_path_factory.mktemp("images") / "image runs"
    path.mkdir()
    # A second name for the same file: the run records this path, and a test later replaces it.
    os.link(cpu_image, path / "tiny image.sif")
    return path


@pytest.fixture(scope="session")
def image_run(image_workspace: Path) -> RunDir:
    rkit("run", str(RECIPE), "-o", "name=in-image", "-o", f"image={image_workspace / 'tiny image.sif'}", *SHORT,
         "--inject", "kill:rank=1,step=25", cwd=image_workspace, check=0)
    return RunDir(image_workspace / "runs" / "in-image")


def test_second_build_returns_from_the_cache(cpu_image: Path):
    """Budget: its set-up builds the cpu image from nothing: the session's one build, shared by every image and Slurm
    test."""
    before = cpu_image.stat().st_mtime_ns
    done = rkit("image", "build", "cpu", *MIRROR, check=0)
    assert "cached" in done.stderr and done.stdout.strip() == str(cpu_image)
    assert cpu_image.stat().st_mtime_ns == before


def test_inspect_shows_the_labels(cpu_image: Path):
    info = json.loads(rkit("image", "inspect", "--json", str(cpu_image), check=0).stdout)
    labels = info["labels"]
    assert info["sha256"] == sha256_file(cpu_image) and info["flavor"] == "cpu"
    assert labels["org.rkit.definition.sha256"] == sha256_file(REPO / "containers" / "cpu.def")
    assert labels["org.rkit.lock.sha256"] == sha256_file(REPO / "containers" / "lock" / "cpu.txt")
    assert labels["org.rkit.base.reference"] == "debian:trixie"
    assert labels["org.rkit.base.mirror"] == "http://deb.debian.org/debian"
    assert labels["org.rkit.version"] and labels["org.rkit.build.date"].startswith("20")
    assert info["package_count"] > 100
    text = rkit("image", "inspect", str(cpu_image), check=0).stdout
    assert "org.rkit.lock.sha256" in text


def test_in_image_packages_equal_the_lock(cpu_image: Path):
    info = image_info(cpu_image)
    env = default_environment()
    env.update(python_version=".".join(info["python"].split(".")[:2]), python_full_version=info["python"],
               sys_platform="linux", platform_system="Linux", platform_machine="x86_64")
    expected = {}
    for requirement, _ in lock_entries(REPO / "containers" / "lock" / "cpu.txt"):
        req = Requirement(requirement)
        if req.marker is None or req.marker.evaluate(env):
            expected[normalize(req.name)] = str(req.specifier).lstrip("=")
    installed = {k: v for k, v in info["packages"].items() if k not in ("pip", "rkit")}
    assert installed == expected
    assert info["packages"]["rkit"] and info["definition_sha256"] == sha256_file(REPO / "containers" / "cpu.def")


def test_the_images_environment_identity_inside_and_as_a_label_is_what_rkit_reads_from_it(cpu_image: Path):
    from rkit.images.identity import identify
    from rkit.images.store import labels

    found = identify("cpu", cpu_image)
    assert labels(cpu_image)["org.rkit.environment.sha256"] == found.environment_sha256
    info = image_info(cpu_image)
    assert info["environment_sha256"] == found.environment_sha256 and info["environment"] == found.environment
    assert found.environment["build"]["debian_lock_sha256"] == sha256_file(
        REPO / "containers" / "lock" / "debian-trixie.txt")
    # The Debian packages are the lock's, and the image keeps its own record of them (with each .deb's digest).
    from rkit.runtime import debianlock

    locked = debianlock.parse((REPO / "containers" / "lock" / "debian-trixie.txt").read_text())
    assert {name: version for name, (version, _) in locked.items()} == found.environment["debian"]
    inside = subprocess.run([apptainer(), "exec", "--cleanenv", "--no-home", str(cpu_image), "cat",
                             "/etc/rkit/debian.lock"], capture_output=True, text=True, check=True).stdout
    assert debianlock.parse(inside) == locked


PYC_FLAGS = """
import collections, importlib.util, json
from pathlib import Path
flags = collections.Counter()
for root in ("/usr/lib/python3.13", "/opt/venv/lib"):
    for pyc in Path(root).rglob("*.pyc"):
        flags[int.from_bytes(pyc.read_bytes()[4:8], "little")] += 1
missing = [str(p) for p in Path("/opt/venv/lib").rglob("*.py")
           if not Path(importlib.util.cache_from_source(str(p))).is_file()]
print(json.dumps({"flags": flags, "missing": missing}))
"""


def test_every_pyc_in_the_image_is_unchecked_so_imports_never_hash_the_sources(cpu_image: Path):
    # PEP 552's flags word: 1 = hash-based and unchecked (the image is read-only), 3 = checked (every import reads
    # and hashes the module's source), 0 = timestamp-based. And no module of the venv is left without its .pyc.
    out = subprocess.run([apptainer(), "exec", "--cleanenv", "--no-home", str(cpu_image), "/opt/venv/bin/python",
                          "-c", PYC_FLAGS], capture_output=True, text=True, check=True).stdout
    found = json.loads(out)
    assert set(found["flags"]) == {"1"} and found["flags"]["1"] > 10000, found["flags"]
    assert found["missing"] == []


@pytest.mark.verify_image
def test_a_second_cold_build_of_the_same_inputs_is_the_same_bytes(cpu_image: Path, tmp_path: Path):
    # Another cache: the same definition, locks and mirror, built from nothing (debootstrap, pip, squashfs).
    from rkit.images import repro as imagerepro

    done = rkit("image", "build", "cpu", *MIRROR, env={"RKIT_IMAGE_CACHE": str(tmp_path / "cache")},
                timeout=3600, check=0)
    second = Path(done.stdout.strip().splitlines()[-1])
    assert second.parent == tmp_path / "cache" and "built in" in done.stderr
    first_objects, second_objects = imagerepro.objects(cpu_image), imagerepro.objects(second)
    assert sha256_file(second) == sha256_file(cpu_image), (first_objects, second_objects)
    assert first_objects["header"]["id"] == "0" * 32  # nil UUID, times at SOURCE_DATE_EPOCH


def test_verify(cpu_image: Path):
    digest = sha256_file(cpu_image)
    assert rkit("image", "verify", str(cpu_image), "--expect", digest).returncode == 0
    wrong = "sha256:" + "0" * 64
    done = rkit("image", "verify", str(cpu_image), "--expect", wrong)
    assert done.returncode == 2 and wrong in done.stderr and digest in done.stderr


def test_run_inside_the_image_survives_a_kill(image_run: RunDir, image_workspace: Path):
    s = json.loads(rkit("status", "--json", str(image_run.path), check=0).stdout)
    assert s["state"] == "finished" and [a["cause"] for a in s["attempts"]] == ["task_signal", "completed"]
    assert len(merged(image_run, 0)) == 30
    stamp = image_run.load_manifest()
    sif = image_workspace / "tiny image.sif"
    assert stamp["image"]["sha256"] == sha256_file(sif) and stamp["image"]["flavor"] == "cpu"
    assert stamp["image"]["labels"]["org.rkit.lock.sha256"]
    image_packages = image_info(sif)["packages"]
    for attempt in (1, 2):
        for rank in (0, 1):
            env = json.loads((image_run.attempt_dir(attempt) / "env" / f"rank-{rank}.json").read_text())
            assert env["python"]["executable"] == "/opt/venv/bin/python"  # the image's Python, not the host's
            assert env["rkit_path"].startswith("/opt/venv/lib/")  # and the image's own rkit agent
            assert env["packages"] == image_packages and "pytest" not in env["packages"]
            assert env["jax"]["process_count"] == 2
    argv = json.loads((image_run.attempt_dir(1) / "attempt.json").read_text())["launch"]["ranks"][0]["argv"]
    assert argv[1:4] == ["exec", "--cleanenv", "--no-home"] and str(sif.resolve()) in argv


def test_an_image_without_rkit_trains_with_the_agent_rkit_brings(image_without_rkit: Path, image_workspace: Path,
                                                                  image_run: RunDir, cpu_image: Path):
    rkit("run", str(RECIPE), "-o", "name=without-rkit", "-o", f"image={image_without_rkit}", *SHORT,
         cwd=image_workspace, check=0)
    run = RunDir(image_workspace / "runs" / "without-rkit")
    s = json.loads(rkit("status", "--json", str(run.path), check=0).stdout)
    assert s["state"] == "finished" and [a["cause"] for a in s["attempts"]] == ["completed"]
    stamp = run.load_manifest()
    assert stamp["image"]["agent"] == "bound" and stamp["image"]["python"] == "/opt/venv/bin/python"
    assert image_run.load_manifest()["image"]["agent"] == "image"  # rkit's own image brings its own
    assert (run.path / "agent" / "rkit" / "runtime" / "agent.py").is_file()
    own = {k: v for k, v in image_info(cpu_image)["packages"].items() if k != "rkit"}
    for rank in (0, 1):
        env = json.loads((run.attempt_dir(1) / "env" / f"rank-{rank}.json").read_text())
        assert env["rkit_path"] == str((run.path / "agent" / "rkit").resolve())  # the copy, not the host's
        assert env["python"]["executable"] == "/opt/venv/bin/python"
        assert env["packages"] == own  # the image's own package list, recorded per rank
        assert env["jax"]["process_count"] == 2
    argv = json.loads((run.attempt_dir(1) / "attempt.json").read_text())["launch"]["ranks"][0]["argv"]
    assert argv[argv.index(str(image_without_rkit)) + 1:][:3] == ["/opt/venv/bin/python", "-m", "rkit.runtime.agent"]
    # Same lock, same config: the same training as in rkit's own image.
    assert merged(run, 0)[29]["loss"] == merged(image_run, 0)[29]["loss"]


def test_reproduce_then_diff_shows_only_what_must_differ(image_run: RunDir, image_workspace: Path):
    # The verdict on the loss only (--threshold 10): a shared machine's load is not what this test is about.
    done = rkit("reproduce", str(image_run.path), "--name", "again", "--threshold", "10", cwd=image_workspace,
                check=0)
    assert "steps 0-29: EXACT" in done.stdout and "verdict: the same outcome" in done.stdout
    again = RunDir(image_workspace / "runs" / "again")
    assert again.load_manifest()["reproduced_from"]["image_sha256"] == image_run.load_manifest()["image"]["sha256"]
    assert merged(again, 0)[29]["loss"] == merged(image_run, 0)[29]["loss"]
    done = rkit("diff", str(image_run.path), str(again.path))
    assert done.returncode == 0, done.stdout
    result = json.loads(rkit("diff", "--json", str(image_run.path), str(again.path)).stdout)
    assert set(result["groups"]) == {"run"}
    assert {c["key"] for c in result["groups"]["run"]} <= {"name", "path", "created", "injections", "recipe_source",
                                                        "resume_command"}


def test_a_rebuilt_image_is_the_same_environment_and_reproduce_goes_on(image_run: RunDir, image_workspace: Path,
                                                                        cpu_image: Path):
    # A rebuild: the same content in other bytes (the cpu image re-squashed with lz4).
    rebuilt = image_workspace / "rebuilt.sif"
    done = subprocess.run([apptainer(), "build", "--fakeroot", "--force", "--mksquashfs-args", "-comp lz4",
                           str(rebuilt), str(cpu_image)], capture_output=True, text=True, timeout=1800, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sha256_file(rebuilt) != sha256_file(cpu_image)
    diff = rkit("image", "diff", str(cpu_image), str(rebuilt))
    assert diff.returncode == 0 and diff.stdout.strip().endswith("same environment (rebuilt)"), diff.stdout
    os.replace(rebuilt, image_workspace / "tiny image.sif")
    done = rkit("reproduce", str(image_run.path), "--name", "rebuilt", "--threshold", "10", cwd=image_workspace,
                check=0)
    again = RunDir(image_workspace / "runs" / "rebuilt")
    stamp = again.load_manifest()
    assert stamp["rebuilt"]["verdict"] == "rebuilt, same environment"
    assert stamp["rebuilt"]["expected"] == image_run.load_manifest()["image"]["sha256"]
    assert stamp["image"]["environment_sha256"] == image_run.load_manifest()["image"]["environment_sha256"]
    assert merged(again, 0)[29]["loss"] == merged(image_run, 0)[29]["loss"]


def test_reproduce_refuses_an_image_with_a_package_changed_and_names_it(image_run: RunDir, image_workspace: Path,
                                                                         image_without_rkit: Path, cpu_image: Path):
    sif = image_workspace / "tiny image.sif"
    expected = image_run.load_manifest()["image"]["sha256"]
    shutil.copyfile(image_without_rkit, image_workspace / "replacement.sif")
    os.replace(image_workspace / "replacement.sif", sif)
    found = sha256_file(sif)
    done = rkit("reproduce", str(image_run.path), "--name", "drifted", cwd=image_workspace)
    assert done.returncode == 2 and expected in done.stderr and found in done.stderr
    assert "packages changed: python: rkit 0.1.0 -> (none)" in done.stderr, done.stderr
    assert "--allow-drift" in done.stderr and "Traceback" not in done.stderr
    assert not (image_workspace / "runs" / "drifted").exists()
    diff = rkit("image", "diff", "--json", str(cpu_image), str(image_without_rkit))
    result = json.loads(diff.stdout)
    assert diff.returncode == 1 and not result["same_environment"]
    assert result["groups"]["python"] == [{"key": "rkit", "a": "0.1.0", "b": None}]
    assert "debian" not in result["groups"]  # the same Debian packages: only rkit was removed


def test_missing_apptainer_or_image_fails_before_anything(image_workspace: Path, tmp_path: Path):
    done = rkit("run", str(RECIPE), "-o", "name=noapp", cwd=image_workspace,
                env={"RKIT_APPTAINER": "/nonexistent/apptainer"})
    assert done.returncode == 2 and "install-apptainer.sh" in done.stderr
    done = rkit("run", str(RECIPE), "-o", "name=nosif", "-o", "image=/nonexistent/x.sif", cwd=image_workspace)
    assert done.returncode == 2 and "make image FLAVOR=cpu" in done.stderr
    done = rkit("run", str(RECIPE), "-o", "name=nocache", cwd=image_workspace,
                env={"RKIT_IMAGE_CACHE": str(tmp_path)})
    assert done.returncode == 2 and "make image FLAVOR=cpu" in done.stderr
    for name in ("noapp", "nosif", "nocache"):
        assert not (image_workspace / "runs" / name).exists()
