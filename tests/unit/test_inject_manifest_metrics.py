from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rkit.contract.errors import RkitError
from rkit.contract.rundir import RunDir
from rkit.contract.stamp import is_secret_name
from rkit.readers import diff
from rkit.runtime import manifest
from rkit.runtime.inject import parse_injection, parse_injections, pending
from rkit.runtime.telemetry.metrics import MetricsTail, enrich, merged, peak_tflops, ranks, repair_tail
from rkit.runtime.trainers.maxtext import committed_steps, latest_committed_step


def test_parse_injections():
    kill = parse_injection("kill:rank=1,step=60")
    assert (kill.kind, kill.rank, kill.step, kill.repeat, kill.in_trainer) == ("kill", 1, 60, False, True)
    ex = parse_injection("exit:rank=0,step=40,code=3,repeat=true")
    assert (ex.code, ex.repeat) == (3, True)
    term = parse_injection("sigterm:step=80")
    assert term.rank is None and not term.in_trainer


@pytest.mark.parametrize("spec,words", [("boom:step=1", "unknown kind"), ("kill:step=1", "missing rank"),
                                        ("kill:rank=1,step=x", "whole numbers"), ("kill:rank=1,step=2,when=3",
                                                                                   "unknown field"),
                                        ("sigterm:step", "not key=value"), ("kill:rank=-1,step=2", "negative")])
def test_bad_injections(spec, words):
    with pytest.raises(RkitError, match=words):
        parse_injection(spec)


def test_injection_rank_must_exist():
    with pytest.raises(RkitError, match="ranks 0..1"):
        parse_injections(["kill:rank=2,step=5"], processes=2)


def test_one_shot_injections_fire_once_per_rkit_run():
    injs = parse_injections(["kill:rank=1,step=5", "exit:rank=0,step=9,repeat=true"], processes=2)
    events = [{"event": "run.submitted"}, {"event": "inject.fired", "index": 0},
              {"event": "inject.fired", "index": 1}]
    assert [i.index for i in pending(injs, events)] == [1]
    assert [i.index for i in pending(injs, events + [{"event": "run.resumed"}])] == [0, 1]


def test_in_trainer_injections_fire_once_at_their_step_after_the_metrics_before_it(tmp_path, monkeypatch):
    from rkit.runtime import agent

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    injs = tuple(i for i in parse_injections(["hang:rank=1,step=15", "kill:rank=1,step=25"], processes=2))
    ctx = agent.AgentContext(run=run, attempt=1, rank=1, processes=2, coordinator="", base_config="base.yml",
                             injections=injs)
    acted, drained = [], []

    class Pump:
        def drain(self):
            drained.append(len(acted))

    monkeypatch.setattr(agent, "_act", lambda inj, step: acted.append((inj.kind, step)))
    injector = agent.Injector(ctx, Pump())
    for step in range(0, 30):
        injector.at_step(step)
    injector.at_step(15)  # a hung rank that is continued does not fire again
    assert acted == [("hang", 15), ("kill", 25)] and drained == [0, 1]
    fired = [(e["kind"], e["step"], e["rank"], e["attempt"]) for e in run.events() if e["event"] == "inject.fired"]
    assert fired == [("hang", 15, 1, 1), ("kill", 25, 1, 1)]


def test_secrets_are_redacted_and_only_training_variables_kept():
    env = {"XLA_FLAGS": "--x", "JAX_API_KEY": "s3cr3t", "SLURM_JOB_ID": "7", "HF_TOKEN": "hf_abc",
           "CUDA_PASSWORD_FILE": "pw", "HOME": "/root", "NCCL_SECRET": "zz"}
    out = manifest.redact_env(env)
    assert out == {"XLA_FLAGS": "--x", "JAX_API_KEY": manifest.REDACTED, "SLURM_JOB_ID": "7",
                   "CUDA_PASSWORD_FILE": manifest.REDACTED, "NCCL_SECRET": manifest.REDACTED}
    captured = manifest.capture(environ=env)
    text = json.dumps(captured)
    assert "s3cr3t" not in text and "hf_abc" not in text and "zz\"" not in text


@pytest.mark.parametrize("name", ["SLURM_JWT", "NCCL_IB_PASSWD", "AWS_SECRET_ACCESS_KEY", "GITHUB_PAT", "MY_PASS",
                                  "DB_CREDENTIALS", "X_AUTH", "HTTP_AUTHORIZATION", "SSH_PRIVATE", "JAX_COOKIE",
                                  "MY_SESSION", "hf_access_token", "api-key"])
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["PATH", "XLA_FLAGS", "SLURM_JOB_PARTITION", "NCCL_BYPASS_X", "SLURM_PROCID",
                                  "CUDA_VISIBLE_DEVICES", "PASSTHROUGH", "JAX_COMPILATION_CACHE_DIR", "PWD"])
def test_ordinary_names(name):
    assert not is_secret_name(name)


def test_secret_values_are_redacted_whatever_the_name():
    env = {"NCCL_DB": "postgres://u:pw0rd@db.example:5432/x", "XLA_URL": "https://example.org/a:b@c",
           "JAX_KEYFILE_TEXT": "x", "HIP_PEM": "-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n", "SLURM_X": "a:b"}
    out = manifest.redact_env(env)
    assert out["NCCL_DB"] == f"postgres://u:{manifest.REDACTED}@db.example:5432/x"
    assert out["HIP_PEM"] == manifest.REDACTED and out["SLURM_X"] == "a:b"
    assert out["XLA_URL"] == "https://example.org/a:b@c"  # a path, not a password: left alone
    assert "pw0rd" not in json.dumps(manifest.capture(environ=env))


def test_host_capture_has_the_promised_fields(tmp_path: Path):
    m = manifest.capture(recipe_path=tmp_path / "r.yaml")
    assert m["python"]["version"] and m["packages"]["click"]
    assert set(m["key_packages"]) == {"jax", "jaxlib", "maxtext", "orbax-checkpoint", "flax"}
    assert m["hardware"]["cpu"]["count"] >= 1 and m["hardware"]["memory_bytes"] > 0
    assert "present" in m["hardware"]["gpu"]
    assert m["system"]["kernel"] and m["system"]["hostname"]
    assert m["git"] == {"repository": False}


def test_packages_read_from_the_folder_names_are_what_their_metadata_says(tmp_path: Path, monkeypatch):
    """manifest.packages reads a wheel's name and version from its .dist-info folder's name (no METADATA parse):
    on this environment the same as every METADATA file says; a folder whose name is not {name}-{version} (an
    .egg-info, a version of other characters) is read from its metadata."""
    import sys
    from importlib import metadata

    reference = {}
    for dist in metadata.distributions():
        if name := dist.metadata.get("Name"):
            reference[manifest._normalize(name)] = dist.version
    assert manifest.packages() == dict(sorted(reference.items())) and len(reference) > 50
    site = tmp_path / "site"
    for folder, name, version in (("Odd_Name-1.0_rc1.dist-info", "Odd.Name", "1.0-rc1"),
                                  ("plain.egg-info", "Plain", "2.0"), ("Fast_Pkg-3.1+cpu.dist-info", "x", "x")):
        (site / folder).mkdir(parents=True)
        (site / folder / ("METADATA" if "dist-info" in folder else "PKG-INFO")).write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    monkeypatch.setattr(sys, "path", [str(site)])
    assert manifest.packages() == {"fast-pkg": "3.1+cpu", "odd-name": "1.0-rc1", "plain": "2.0"}


def test_git_state_of_a_real_repository(tmp_path: Path):
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "r.yaml").write_text("x: 1\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "r.yaml"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "m"],
                   check=True)
    clean = manifest.git_state(tmp_path / "r.yaml")
    assert clean["repository"] and len(clean["commit"]) == 40 and clean["dirty"] is False
    (tmp_path / "r.yaml").write_text("x: 2\n")
    assert manifest.git_state(tmp_path / "r.yaml")["dirty"] is True


def _line(step, loss):
    return json.dumps({"step": step, "learning/loss": loss, "perf/step_time_seconds": 0.1,
                       "perf/per_device_tokens_per_sec": 100.0}) + "\n"


def test_merged_view_newest_wins_and_marks_recomputed(tmp_path: Path):
    run = RunDir(tmp_path)
    run.metrics_dir.mkdir()
    path = run.metrics_file(0)
    path.write_text(_line(0, 5.0) + _line(1, 4.0) + _line(2, 3.0) + '{"step": 3, "learn')  # cut by a crash
    repair_tail(path)
    with open(path, "a") as fh:
        fh.write(_line(2, 3.5) + _line(3, 2.0))
    view = merged(run)
    assert list(view) == [0, 1, 2, 3]
    assert view[2]["loss"] == 3.5 and view[2]["recomputed"] and not view[1]["recomputed"]


def test_metrics_tail_follows_growth_and_truncation(tmp_path: Path):
    path = tmp_path / "0.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == []
    path.write_text(_line(0, 1.0) + '{"step": 1')
    assert [m.step for m in tail.poll()] == [0]
    with open(path, "a") as fh:
        fh.write(', "learning/loss": 2.0}\n')
    assert [m.step for m in tail.poll()] == [1]
    path.write_text(_line(0, 9.0))  # MaxText truncates when it starts over from step 0
    assert [m.loss for m in tail.poll()] == [9.0]


def test_committed_steps_skip_temporary_and_uncommitted(tmp_path: Path):
    run = RunDir(tmp_path)
    for name, marker in [("0", "commit_success.txt"), ("10", "_CHECKPOINT_METADATA"),
                         ("20.orbax-checkpoint-tmp-123", "commit_success.txt"), ("30", None)]:
        d = run.orbax_dir / name
        d.mkdir(parents=True)
        if marker:
            (d / marker).write_text("")
    assert committed_steps(run) == [0, 10]
    assert latest_committed_step(run) == 10
    assert latest_committed_step(RunDir(tmp_path / "none")) is None


def test_diff_views_groups_and_identity():
    a = {"config": {"x": 1}, "packages": {"jax": "1"}, "run": {"name": "a"}}
    b = {"config": {"x": 2}, "packages": {"jax": "1"}, "run": {"name": "b"}}
    result = diff.diff_views(a, b)
    assert not result["identical"]
    assert result["groups"]["config"] == [{"key": "x", "a": 1, "b": 2}]
    assert "packages" not in result["groups"] and result["groups"]["run"][0]["key"] == "name"
    same = diff.diff_views(a, dict(a, run={"name": "c"}))
    assert same["identical"] and list(same["groups"]) == ["run"]


def test_hang_injection_acts_in_the_trainer():
    hang = parse_injection("hang:rank=1,step=30")
    assert (hang.kind, hang.rank, hang.step, hang.in_trainer) == ("hang", 1, 30, True)
    with pytest.raises(RkitError, match="missing rank"):
        parse_injection("hang:step=3")


def test_enrich_turns_a_maxtext_line_into_an_rkit_line():
    raw = {"step": 7, "learning/loss": 5.5, "perf/step_time_seconds": 0.25, "perf/per_device_tokens_per_sec": 512.0,
           "perf/per_device_tflops": 494.5, "learning/grad_norm": 1.0}
    line = enrich(raw, t=1000.0, attempt=2, rank=1, node="n 1", peak=peak_tflops("NVIDIA H200"),
                  device_memory=(10, 20), host_rss=30)
    assert line == {"t": 1000.0, "attempt": 2, "rank": 1, "node": "n 1", "step": 7, "loss": 5.5, "step_time": 0.25,
                    "tokens_per_sec_per_device": 512.0, "tflops_per_device": 494.5, "mfu": 0.5,
                    "device_memory_bytes": 10, "device_memory_peak_bytes": 20, "host_rss_bytes": 30}
    assert enrich({"loss": 1.0}, t=0, attempt=1, rank=0, node="x", peak=None, device_memory=(None, None),
                  host_rss=None) is None
    cpu = enrich(raw, t=0, attempt=1, rank=0, node="x", peak=peak_tflops("cpu"), device_memory=(None, None),
                 host_rss=None)
    assert cpu["mfu"] is None  # no peak for the device: no MFU rather than a guess
    fed = enrich(raw, t=0, attempt=1, rank=0, node="x", peak=None, device_memory=(None, None), host_rss=None,
                 data=("00ff00ff00ff00ff", 2))
    assert (fed["data_fingerprint"], fed["data_rows"]) == ("00ff00ff00ff00ff", 2)


@pytest.mark.parametrize("kind, peak", [("NVIDIA H200", 989.0), ("AMD Instinct MI300X", 1307.4),
                                        ("AMD Instinct MI250X", 383.0), ("TFRT_CPU_0", None), (None, None)])
def test_peak_tflops_by_device_kind(kind, peak):
    assert peak_tflops(kind) == peak


def test_merged_view_of_rkit_lines_across_attempts(tmp_path: Path):
    run = RunDir(tmp_path / "a run")
    run.metrics_dir.mkdir(parents=True)
    rows = [(1, 0, 5.0), (1, 1, 4.0), (1, 2, 3.0), (2, 1, 4.1), (2, 2, 3.1), (2, 3, 2.0)]
    run.metrics_file(0).write_text("".join(json.dumps({"t": i, "attempt": a, "rank": 0, "node": "n", "step": s,
                                                       "loss": loss}) + "\n" for i, (a, s, loss) in enumerate(rows)))
    view = merged(run)
    assert [(s, v["attempt"], v["loss"], v["recomputed"]) for s, v in view.items()] == [
        (0, 1, 5.0, False), (1, 2, 4.1, True), (2, 2, 3.1, True), (3, 2, 2.0, False)]
    assert ranks(run) == [0]


def test_a_rank_stops_when_its_supervisor_pipe_closes():
    import os
    import threading

    from rkit.runtime.agent import watch_supervisor

    read_end, write_end = os.pipe()
    os.write(write_end, b"tok3n")
    gone = threading.Event()
    env = {"RKIT_SUPERVISOR_FD": str(read_end), "RKIT_SUPERVISOR_TOKEN": "tok3n"}
    thread = watch_supervisor(env, on_gone=gone.set)
    assert thread is not None and not gone.wait(0.2)  # alive while the write end is open
    os.close(write_end)  # what the kernel does when the supervisor dies, even by SIGKILL
    assert gone.wait(10)
    os.close(read_end)


def test_no_pipe_or_a_wrong_token_watches_nothing():
    import os

    from rkit.runtime.agent import watch_supervisor

    assert watch_supervisor({}) is None
    read_end, write_end = os.pipe()
    os.write(write_end, b"other")
    assert watch_supervisor({"RKIT_SUPERVISOR_FD": str(read_end), "RKIT_SUPERVISOR_TOKEN": "tok3n"}) is None
    os.close(write_end)
    os.close(read_end)
    assert watch_supervisor({"RKIT_SUPERVISOR_FD": "9999", "RKIT_SUPERVISOR_TOKEN": "x"}) is None


def test_maxtext_settings_from_the_environment_are_dropped():
    from rkit.runtime import agent

    env = {"M_STEPS": "5", "M_LEARNING_RATE": "1", "MAXTEXT_HOME": "/x", "XLA_FLAGS": "--y", "HOME": "/root"}
    assert agent.drop_maxtext_settings_from_env(env) == ["M_LEARNING_RATE", "M_STEPS"]
    assert env == {"MAXTEXT_HOME": "/x", "XLA_FLAGS": "--y", "HOME": "/root"}


@pytest.mark.parametrize("spec,says", [
    ("exit:rank=0,step=5,code=300", "code 300 is not an exit code of a failure; give 1..255"),
    ("exit:rank=0,step=5,code=0", "code 0 is not an exit code of a failure"),
    ("exit:rank=0,step=30", "step 30 is never reached; this run trains steps 0..29 (trainer.steps=30)"),
    ("kill:rank=1,step=" + "9" * 30, "is never reached"),
])
def test_injections_are_checked_against_the_run(spec, says):
    with pytest.raises(RkitError, match=re.escape(says)):
        parse_injections([spec], processes=2, steps=30)
    assert parse_injections(["exit:rank=0,step=29,code=255"], processes=2, steps=30)[0].code == 255
