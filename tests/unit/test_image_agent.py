"""The agent rkit brings into an image without rkit (imageagent), how both launchers run it, and where MaxText's
TensorBoard summaries go."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rkit.contract.rundir import RunDir
from rkit.images import probe as imageagent
from rkit.images.store import PACKAGE, image_side_files, sha256_tree


def test_the_bound_agent_is_a_self_contained_copy_that_needs_only_the_standard_library(tmp_path: Path):
    where = imageagent.install(tmp_path)
    assert where == tmp_path / "agent"
    copied = sorted(str(p.relative_to(where / "rkit")) for p in (where / "rkit").rglob("*") if p.is_file())
    assert copied == sorted(image_side_files())
    assert sha256_tree(where / "rkit") == sha256_tree(PACKAGE)
    # -I -S: no site-packages at all, no PYTHONPATH: only the standard library and the copy.
    done = subprocess.run([sys.executable, "-I", "-S", "-c",
                           f"import sys; sys.path.insert(0, {str(where)!r}); import rkit.runtime.agent, "
                           "rkit.runtime.manifest, rkit.runtime.telemetry.node; print(rkit.__file__)"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(where / "rkit" / "__init__.py")


def test_a_second_install_replaces_the_copy_whole(tmp_path: Path):
    imageagent.install(tmp_path)
    stale = tmp_path / "agent" / "rkit" / "stale.py"
    stale.write_text("raise SystemExit('old agent')\n")
    imageagent.install(tmp_path)
    assert not stale.exists() and (tmp_path / "agent" / "rkit" / "runtime" / "agent.py").is_file()
    assert sorted(p.name for p in (tmp_path / "agent").iterdir()) == ["rkit"]  # no staging left behind


def test_both_launchers_run_the_images_python_with_the_bound_agent_on_its_path(tmp_path: Path, monkeypatch):
    from rkit.backends.local.launcher import Container, LocalBackend
    from rkit.backends.slurm.launcher import SlurmStepBackend

    container = Container(apptainer="apptainer", sif="/images/x.sif", python="/usr/bin/python3",
                          agent_path="/runs/r/agent")
    rank = LocalBackend(container=container).prepare(attempt=1, processes=1, trainer_args=["steps=5"], base_env={},
                                                     attempt_dir=tmp_path, cwd=tmp_path, port=1234,
                                                     host_env={"PATH": "/bin"}).ranks[0]
    at = rank.argv.index("/images/x.sif")
    assert rank.argv[at + 1:at + 4] == ["/usr/bin/python3", "-m", "rkit.runtime.agent"]
    assert rank.env["APPTAINERENV_PYTHONPATH"] == "/runs/r/agent"
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    for launch in ("apptainer", "oci"):
        step = SlurmStepBackend(nodes_per_step=1, tasks_per_node=1, container_launch=launch, sif="/images/x.sif",
                                image_python="/usr/bin/python3", agent_path="/runs/r/agent").prepare(
            attempt=1, processes=1, trainer_args=[], base_env={}, attempt_dir=tmp_path, cwd=tmp_path, port=1,
            host_env={"PYTHONPATH": "/host/venv/launch"})
        at = step.argv.index("/usr/bin/python3")
        assert step.argv[at + 1:at + 3] == ["-m", "rkit.runtime.agent"], launch
        assert step.env["PYTHONPATH"] == "/runs/r/agent", launch  # never the host's
    own = SlurmStepBackend(nodes_per_step=1, tasks_per_node=1, container_launch="oci", sif="/images/x.sif").prepare(
        attempt=1, processes=1, trainer_args=[], base_env={}, attempt_dir=tmp_path, cwd=tmp_path, port=1,
        host_env={"PYTHONPATH": "/host/venv/launch"})
    assert "PYTHONPATH" not in own.env and "/opt/venv/bin/python" in own.argv


def test_maxtexts_tensorboard_summaries_go_to_the_run_directory(tmp_path: Path, monkeypatch):
    pytest.importorskip("maxtext")
    pytest.importorskip("tensorboardX")
    from maxtext.utils import max_utils

    from rkit.runtime.trainers.maxtext import route_tensorboard

    monkeypatch.setattr(max_utils, "initialize_summary_writer", max_utils.initialize_summary_writer)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    monkeypatch.setattr(max_utils, "add_text_to_summary_writer", max_utils.add_text_to_summary_writer)
    monkeypatch.setenv("WANDB_API_KEY", "planted-wandb-key")
    route_tensorboard(run)
    route_tensorboard(run)  # once only
    writer = max_utils.initialize_summary_writer(str(tmp_path / "elsewhere"), "checkpoints", True)
    writer.add_scalar("learning/loss", 1.5, 0)
    max_utils.add_text_to_summary_writer("hf_access_token", "hf_secret_value", writer)
    max_utils.add_text_to_summary_writer("dataset_path", "s3://u:pw-in-url@host/x planted-wandb-key", writer)
    max_utils.add_text_to_summary_writer("model_name", "llama-tiny", writer)
    writer.close()
    data = b"".join(p.read_bytes() for p in run.tensorboard_dir.iterdir())
    assert b"llama-tiny" in data and b"<redacted>" in data
    for secret in (b"hf_secret_value", b"pw-in-url", b"planted-wandb-key"):
        assert secret not in data
    assert [p.name.split(".")[0] for p in run.tensorboard_dir.iterdir()] == ["events"]
    assert not (tmp_path / "elsewhere").exists()
    off = max_utils.initialize_summary_writer(str(tmp_path / "elsewhere"), "checkpoints", False)
    assert type(off).__name__ == "StubSummaryWriter"  # enable_tensorboard: false still writes nothing


# The image side before it had folders (an image built by rkit before contract/ and runtime/): its files, flat.
FLAT_IMAGE_SIDE = ("__init__.py", "agent.py", "config.py", "debianlock.py", "defaults.py", "determinism.py",
                   "devices.py", "envscan.py", "errors.py", "heartbeat.py", "imageinfo.py", "inject.py", "manifest.py",
                   "rundir.py", "safeio.py", "schema/recipe.schema.json", "stamp.py", "standby.py",
                   "telemetry/__init__.py", "telemetry/metrics.py", "telemetry/node.py", "telemetry/health.py",
                   "telemetry/gpu.py", "telemetry/exporter.py", "telemetry/exposure.py", "trainers/__init__.py",
                   "trainers/maxtext.py")


def probe_tree(site: Path) -> str | None:
    """What the image's probe (run here, as the image's Python would) says of the rkit found on `site`."""
    import json

    # -S: no site-packages (this venv's own rkit stays out of sight); PYTHONPATH: the image's rkit.
    done = subprocess.run([sys.executable, "-S", "-c", imageagent.PROBE, json.dumps(image_side_files())],
                          env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])["rkit_agent_sha256"]


def test_an_image_whose_rkit_predates_the_folders_runs_the_bound_agent_and_this_rkits_own_runs_its_own(
        tmp_path: Path):
    old = tmp_path / "old"
    for name in FLAT_IMAGE_SIDE:
        (old / "rkit" / name).parent.mkdir(parents=True, exist_ok=True)
        (old / "rkit" / name).write_text("# rkit's image side before contract/ and runtime/\n")
    assert probe_tree(old) is None  # not this rkit's agent: the launchers put the bound copy first
    (tmp_path / "run").mkdir()
    current = imageagent.install(tmp_path / "run")  # the same files as this rkit's image side
    assert probe_tree(current) == sha256_tree(PACKAGE)
    (current / "rkit" / "runtime" / "agent.py").write_text("# another agent\n")
    assert probe_tree(current) not in (None, sha256_tree(PACKAGE))
