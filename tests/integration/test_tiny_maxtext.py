"""The tiny recipe on the real stack: MaxText trains on the CPU with 2 processes, Orbax checkpoints,
faults are injected, and the supervisor resumes from the last committed checkpoint.

All runs share one workspace (a path with spaces and quotes) and one JAX compile cache.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rkit.contract.rundir import RunDir
from rkit.runtime.telemetry.metrics import lines, merged, read_rank
from rkit.runtime.trainers import localtier, maxtext

from ..conftest import TINY, missing_test_bed, require_maxtext, rkit, wait_until

pytestmark = [pytest.mark.maxtext, pytest.mark.slow]

# 30 steps, a checkpoint every 10: faults land after the first committed checkpoint.
SHORT = ["-o", "trainer.steps=30", "-o", "checkpoint.period=10"]
SECRET = "s3cr3t-value-never-recorded"
# A dozen planted secrets, each its own value: by name (captured prefixes and others) and by value (a URL's
# password, a private key block under a harmless name). None may land anywhere in the run directory.
SECRETS = {"JAX_API_KEY": SECRET, "HF_TOKEN": "hf_planted0001", "SLURM_JWT": "jwt-planted-0002",
           "NCCL_IB_PASSWD": "passwd-planted-0003", "CUDA_AUTH_TOKEN": "auth-planted-0004",
           "AWS_SECRET_ACCESS_KEY": "aws-planted-0005", "GITHUB_PAT": "ghp_planted0006",
           "SLURM_DB_CREDENTIALS": "cred-planted-0007", "XLA_SESSION": "session-planted-0008",
           "JAX_COOKIE": "cookie-planted-0009", "NCCL_DB_URL": "postgres://u:pw-planted-0010@db.example:5432/x",
           "XLA_PEM_TEXT": "-----BEGIN OPENSSH PRIVATE KEY-----\nkey-planted-0011\n-----END OPENSSH PRIVATE KEY-----",
           "HIP_PRIVATE_KEY": "private-planted-0012"}
PLANTED = [v for v in SECRETS.values() if "://" not in v and "BEGIN" not in v] + ["pw-planted-0010",
                                                                                  "key-planted-0011"]
ENV = {**SECRETS, "XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Path:
    require_maxtext()
    path = tmp_path_factory.mktemp("runs") / "it's a workspace"
    path.mkdir()
    return path


def run_tiny(workspace: Path, name: str, *extra: str, expect: int = 0, timeout: float = 600) -> RunDir:
    done = rkit("run", str(TINY), "-o", f"name={name}", *SHORT, *extra, cwd=workspace, env=ENV, check=expect,
                timeout=timeout)
    assert "Traceback" not in done.stderr
    return RunDir(workspace / "runs" / name)


def final_loss(run: RunDir) -> float:
    view = merged(run, rank=0)
    assert max(view) == 29, f"metrics stop at step {max(view)}"
    return view[29]["loss"]


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed process nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def trained_steps(run: RunDir, attempt: int) -> set[int]:
    return {line["step"] for line in lines(run, 0) if line["attempt"] == attempt}


def events(run: RunDir, kind: str) -> list[dict]:
    return [e for e in run.events() if e["event"] == kind]


def status_json(run: RunDir) -> dict:
    return json.loads(rkit("status", "--json", str(run.path), check=0).stdout)


@pytest.fixture(scope="session")
def baseline(workspace: Path) -> RunDir:
    return run_tiny(workspace, "baseline")


def test_uninterrupted_run_is_stamped_and_finished(baseline: RunDir):
    s = status_json(baseline)
    assert s["state"] == "finished" and s["last_committed_step"] == 29 and s["final_step_committed"]
    assert [a["cause"] for a in s["attempts"]] == ["completed"]
    stamp = baseline.load_manifest()
    assert stamp["config_hash"].startswith("sha256:") and stamp["host"]["packages"]["maxtext"] == "0.2.5"
    assert (baseline.path / "recipe.yaml").read_text() == TINY.read_text()
    for rank in (0, 1):
        env = json.loads((baseline.attempt_dir(1) / "env" / f"rank-{rank}.json").read_text())
        assert env["jax"]["process_count"] == 2 and env["jax"]["process_index"] == rank
        assert env["jax"]["backend"] == "cpu" and env["key_packages"]["orbax-checkpoint"]
        assert env["environment"]["JAX_API_KEY"] == "<redacted>"
        assert env["environment"]["XLA_FLAGS"] == ENV["XLA_FLAGS"]
        assert len(merged(baseline, rank)) == 30
    # What it came out as: outcome.json, its loss checksum shown by rkit status.
    outcome = baseline.load_outcome()
    assert outcome["state"] == "finished" and outcome["loss"]["count"] == 30 and outcome["loss"]["last_step"] == 29
    assert s["outcome"]["loss_sha256"] == outcome["loss"]["sha256"] and outcome["loss"]["sha256"].startswith("sha256:")
    assert outcome["step_time"]["n"] == 30 - outcome["warmup_steps_excluded"] and outcome["step_time"]["median"] > 0
    assert outcome["checkpoint_save_seconds"]["n"] >= 4 and outcome["time_to_first_step_seconds"] > 0
    assert outcome["loss"]["sha256"] in rkit("status", str(baseline.path), check=0).stdout
    # The route for a credential MaxText needs: HF_TOKEN in rkit's environment reaches MaxText (its config holds
    # hf_access_token, named in agent.mesh) and, below, its value lands in no file of the run directory.
    mesh = next(e for e in baseline.events() if e["event"] == "agent.mesh")
    assert mesh["credentials"] == ["hf_access_token"] and ENV["HF_TOKEN"] in PLANTED
    # Secrets from the environment land nowhere in the run directory: manifests, events, logs, metrics.
    assert env["environment"]["NCCL_DB_URL"] == "postgres://u:<redacted>@db.example:5432/x"
    files = [path for path in baseline.path.rglob("*") if path.is_file() and path.stat().st_size < 50_000_000]
    assert len(files) > 20 and any(p.name == "rank-0.log" for p in files)
    for path in files:
        data = path.read_bytes()
        for value in PLANTED:
            assert value.encode() not in data, (path, value)


def test_maxtexts_tensorboard_summaries_are_in_the_run_directory(baseline: RunDir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events_files = list(baseline.tensorboard_dir.glob("events.out.tfevents.*"))
    assert events_files and not (baseline.checkpoints / "tensorboard").exists()
    board = EventAccumulator(str(baseline.tensorboard_dir))
    board.Reload()
    loss = {e.step: e.value for e in board.Scalars("learning/loss")}
    view = merged(baseline, rank=0)
    assert sorted(loss) == sorted(view)  # every step, as MaxText's metrics file has it
    for step, value in loss.items():
        assert value == pytest.approx(view[step]["loss"], rel=1e-6), step


def test_rerun_of_a_finished_run_is_reported_done(workspace: Path, baseline: RunDir):
    before = baseline.attempt_numbers()
    done = rkit("run", str(TINY), "-o", "name=baseline", *SHORT, "--resume", cwd=workspace, env=ENV, check=0)
    assert "finished" in done.stdout
    assert baseline.attempt_numbers() == before
    assert "already committed" in events(baseline, "run.finished")[-1]["reason"]


def test_a_finished_run_resumed_with_more_steps_trains_on_to_the_new_end(workspace: Path, baseline: RunDir):
    """--resume with a larger trainer.steps and a larger budget (issue 13, item 3): accepted, recorded as
    run.changed, and the run trains from its last committed step to the new end."""
    run = run_tiny(workspace, "extended", "-o", "trainer.steps=20")
    assert maxtext_committed(run) == 19
    done = rkit("run", str(TINY), "-o", "name=extended", *SHORT, "-o", "resilience.max_restarts=7", "--resume",
                "--quiet", cwd=workspace, env=ENV, check=0)
    assert "finished" in done.stdout
    (changed,) = events(run, "run.changed")
    assert changed["changes"] == {"trainer.steps": [20, 30], "resilience.max_restarts": [3, 7]}
    # MaxText's learning-rate schedule follows trainer.steps: the extension changes the training, and says so.
    assert changed["training_change"].startswith("learning-rate schedule differs: 20 vs 30 steps")
    assert "this --resume changes the training: learning-rate schedule differs" in done.stderr
    assert "learning_rate_schedule_steps" in done.stderr
    [recorded] = run.load_manifest()["training_changes"]
    assert recorded["why"] == changed["training_change"] and recorded["changes"]["trainer.steps"] == [20, 30]
    assert events(run, "attempt.started")[-1]["resume_from_step"] == 19
    assert trained_steps(run, 2) == set(range(20, 30)) and maxtext_committed(run) == 29
    # against the clean 30-step run: compare names the steps trained under the 20-step schedule
    compared = rkit("compare", str(baseline.path), str(run.path), env=ENV, check=1).stdout
    assert "B was changed by a --resume: steps 0-19 trained before it, the later ones after it " \
           "(learning-rate schedule differs: 20 vs 30 steps" in compared and "this explains the divergence" in compared
    refused = rkit("run", str(TINY), "-o", "name=extended", *SHORT, "-o", "trainer.overrides.base_emb_dim=128",
                   "--resume", cwd=workspace, env=ENV, check=2)
    assert "trainer.overrides.base_emb_dim" in refused.stderr and "Traceback" not in refused.stderr


def maxtext_committed(run: RunDir) -> int | None:
    from rkit.runtime.trainers.maxtext import latest_committed_step

    return latest_committed_step(run)


@pytest.mark.parametrize("name,spec,cls,rank,code,signame", [
    ("kill", "kill:rank=1,step=25", "task_signal", 1, None, "SIGKILL"),
    ("exit", "exit:rank=0,step=25,code=3", "task_exit", 0, 3, None),
])
def test_fault_then_resume_matches_uninterrupted_loss(workspace, baseline, name, spec, cls, rank, code, signame):
    run = run_tiny(workspace, name, "--inject", spec)
    fired = events(run, "inject.fired")
    assert len(fired) == 1 and fired[0]["step"] >= 25 and fired[0]["rank"] == rank
    failed = events(run, "attempt.failed")
    assert len(failed) == 1
    assert (failed[0]["cls"], failed[0]["rank"], failed[0]["exit_code"], failed[0]["signal"]) == (cls, rank, code,
                                                                                                 signame)
    started = events(run, "attempt.started")
    assert len(started) == 2 and started[0]["resume_from_step"] is None
    resumed_from = started[1]["resume_from_step"]
    assert resumed_from is not None and 10 <= resumed_from < fired[0]["step"]
    assert events(run, "run.finished")
    # The resumed attempt's first step carries Orbax's restore (from the ranks' logs): goodput's restore, apart
    # from compilation; a fresh start restores nothing.
    first_steps = {e["attempt"]: e for e in events(run, "attempt.first_step")}
    assert "restore_seconds" not in first_steps[1]
    restored = first_steps[2]
    ready = max(e["t"] for e in events(run, "agent.ready") if e["attempt"] == 2)
    assert 0 < restored["restore_seconds"] < restored["t"] - ready
    assert ready - 1 <= restored["restore_started"] <= restored["t"]
    from rkit.readers.goodput import run_goodput

    assert run_goodput(run).seconds["restore"] == pytest.approx(restored["restore_seconds"], abs=0.01)
    # Bit for bit: the same final loss as the run that was never interrupted.
    assert final_loss(run) == final_loss(baseline)
    # TensorBoard's curve (through its own accumulator, as AMD's compare_runs.py reads it): each step once, the
    # recomputed steps with the resumed attempt's values, the same as the uninterrupted run's.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run.tensorboard_dir))
    board.Reload()
    steps = [e.step for e in board.Scalars("learning/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == 29, steps
    clean = EventAccumulator(str(baseline.tensorboard_dir))
    clean.Reload()
    assert [(e.step, e.value) for e in board.Scalars("learning/loss")] == \
        [(e.step, e.value) for e in clean.Scalars("learning/loss")]
    view = merged(run, rank=0)
    lines = [m.step for m in read_rank(run.metrics_file(0))]
    restart_at = next(i for i in range(1, len(lines)) if lines[i] <= lines[i - 1])
    # rank 0's last step of attempt 1: one past the failed rank's or one short of it (synchronous ranks are at
    # most a step apart; rank 0 may be stopped before it writes the line of the step rank 1 wrote last)
    last_before = lines[restart_at - 1]
    assert abs(last_before - failed[0]["last_step"]) <= 1 and lines[restart_at] == resumed_from + 1
    assert [s for s, m in view.items() if m["recomputed"]] == list(range(resumed_from + 1, last_before + 1))
    assert list(view) == list(range(30))  # exactly one line per step in the merged view
    assert all(view[s]["attempt"] == (2 if s > resumed_from else 1) for s in view)  # the newest attempt wins
    assert all(m["host_rss_bytes"] > 0 and m["node"] and m["step_time"] > 0 for m in view.values())
    s = status_json(run)
    assert s["state"] == "finished" and [a["cause"] for a in s["attempts"]] == [cls, "completed"]
    # rkit compare agrees: every step's loss bit for bit (performance is left out: --threshold 10, a shared
    # machine's load is not what this test is about).
    done = rkit("compare", "--json", "--threshold", "10", str(baseline.path), str(run.path), check=0)
    loss = json.loads(done.stdout)["loss"]
    assert loss["counts"] == {"EXACT": 30, "WITHIN": 0, "DIFFER": 0} and loss["first_divergence"] is None
    assert loss["checksums"][0] == loss["checksums"][1]


def test_compare_names_the_first_step_another_learning_rate_changes(workspace: Path, baseline: RunDir):
    run = run_tiny(workspace, "lr", "-o", "trainer.overrides.learning_rate=0.001")
    done = rkit("compare", "--threshold", "10", str(baseline.path), str(run.path), check=1)
    result = json.loads(rkit("compare", "--json", "--threshold", "10", str(baseline.path), str(run.path),
                             check=1).stdout)
    first = result["loss"]["first_divergence"]
    assert first is not None and first["status"] == "DIFFER" and first["a"] != first["b"]
    assert all(r["status"] == "EXACT" for r in result["loss"]["ranges"] if r["to"] < first["step"])
    assert f"first divergence at step {first['step']}" in done.stdout and "verdict: DIFFERENT" in done.stdout
    assert result["config_hashes"][0] != result["config_hashes"][1] and "configs differ" in done.stdout


def test_sigterm_takes_the_preemption_path(workspace: Path, baseline: RunDir):
    run = run_tiny(workspace, "sigterm", "--inject", "sigterm:step=15")
    requested = events(run, "preempt.requested")
    assert len(requested) == 1 and requested[0]["signal"] == "SIGTERM" and requested[0]["step"] >= 15
    ended = events(run, "attempt.ended")
    assert ended[0]["cause"] == "preempted" and ended[0]["tally"]["training_failures"] == 0
    assert events(run, "preempt.saved") or events(run, "preempt.unsaved") or events(run, "preempt.escalated")
    # With jax.distributed, MaxText/Orbax saves at the preemption sync point and stops (then a new attempt
    # resumes from that save); should the sync point come only after the final step, the run just finishes.
    if ended[0]["decision"] == "restart":
        # A preemption answered by its save is a planned end: counted, no budget spent.
        assert ended[0]["planned"] and ended[0]["tally"]["infra_failures"] == 0
        assert ended[0]["tally"]["planned_ends"] == 1 and "a planned end" in ended[0]["reason"]
        # MaxText saved at the sync point (enable_autocheckpoint), not only at a period step: nothing recomputed.
        assert events(run, "preempt.saved") and ended[0]["committed_step"] >= requested[0]["step"]
        assert ended[0]["committed_step"] in trained_steps(run, attempt=1)  # the saved step keeps its line
        started = events(run, "attempt.started")
        assert started[1]["resume_from_step"] == ended[0]["committed_step"] is not None
    else:
        assert ended[0]["decision"] == "finish" and ended[0]["committed_step"] == 29
    assert final_loss(run) == final_loss(baseline)
    assert run.load_manifest()["injections"][0]["spec"] == "sigterm:step=15"


def test_a_one_process_run_saves_at_the_preemption_sync_point(workspace: Path):
    # One process gets jax.distributed too: its preemption service turns the SIGTERM into a save at the sync
    # point (without it the process died on SIGTERM and the next attempt recomputed from the period save).
    run = run_tiny(workspace, "sigterm1", "--inject", "sigterm:step=30", "-o", "resources.processes_per_node=1",
                   "-o", "trainer.steps=300", "-o", "checkpoint.period=100")
    requested, ended = events(run, "preempt.requested")[0], events(run, "attempt.ended")
    assert ended[0]["cause"] == "preempted" and ended[0]["decision"] == "restart"
    assert events(run, "preempt.saved") and ended[0]["committed_step"] >= requested["step"]
    assert "Reached preemption sync point" in run.rank_log(1, 0).read_text()
    assert max(trained_steps(run, attempt=1)) == ended[0]["committed_step"]  # the saved step keeps its line
    assert events(run, "attempt.started")[1]["resume_from_step"] == ended[0]["committed_step"]
    assert status_json(run)["state"] == "finished"


def test_deterministic_failure_stops_at_the_crash_loop_limit(workspace: Path, baseline: RunDir):
    run = run_tiny(workspace, "crashloop", "--inject", "exit:rank=0,step=15,code=3,repeat=true",
                   "-o", "resilience.crash_loop_limit=2", expect=1)
    s = status_json(run)
    assert s["state"] == "gave up" and "crash loop" in s["reason"]
    assert "rank 0 exited with code 3" in s["reason"]
    # The same rank, exit code and step twice in a row, whatever the async save of step 10 did meanwhile.
    assert "2 consecutive attempts failed the same way" in s["reason"]
    assert [a["cause"] for a in s["attempts"]] == ["task_exit", "task_exit"]
    text = rkit("status", str(run.path), check=0).stdout
    assert "gave up: crash loop" in text
    # rkit diff on two real runs that differ in one override: only that key in the config group.
    done = rkit("diff", str(baseline.path), str(run.path))
    assert done.returncode == 1
    result = json.loads(rkit("diff", "--json", str(baseline.path), str(run.path)).stdout)
    assert result["groups"]["config"] == [{"key": "resilience.crash_loop_limit", "a": 3, "b": 2}]
    assert set(result["groups"]) <= {"config", "run"}
    assert "config (1)\n  resilience.crash_loop_limit: 3 -> 2" in done.stdout


def test_diff_of_same_config_is_identical(baseline: RunDir, workspace: Path):
    other = RunDir(workspace / "runs" / "kill")
    if not other.exists():
        pytest.skip("needs the kill run of this session")
    done = rkit("diff", str(baseline.path), str(other.path))
    assert done.returncode == 0, done.stdout
    assert done.stdout.strip().endswith("identical")
    # Manifest files work too.
    assert rkit("diff", str(baseline.manifest), str(other.manifest)).returncode == 0


def test_ctrl_c_stops_cleanly_and_the_run_resumes(workspace: Path, baseline: RunDir):
    env = dict(os.environ, **ENV)
    argv = [sys.executable, "-m", "rkit.cli", "run", str(TINY), "-o", "name=interrupted", *SHORT]
    proc = subprocess.Popen(argv, cwd=workspace, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = RunDir(workspace / "runs" / "interrupted")
    try:
        wait_until(lambda: merged(run, rank=0) or proc.poll() is not None, 300, "the first step", every=0.02)
    finally:
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert events(run, "run.interrupted") and events(run, "stop.requested")
    assert status_json(run)["state"] == "interrupted"
    pids = json.loads((run.attempt_dir(1) / "attempt.json").read_text())["pids"]
    for pid in pids.values():  # nothing left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    rkit("run", str(TINY), "-o", "name=interrupted", *SHORT, "--resume", cwd=workspace, env=ENV, check=0)
    assert final_loss(run) == final_loss(baseline)
    assert status_json(run)["state"] == "finished"


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_supervisor_sigkill_ends_its_trainers_and_resume_finishes(workspace: Path, baseline: RunDir):
    env = dict(os.environ, **ENV)
    argv = [sys.executable, "-m", "rkit.cli", "run", str(TINY), "-o", "name=orphans", *SHORT]
    proc = subprocess.Popen(argv, cwd=workspace, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = RunDir(workspace / "runs" / "orphans")
    try:
        wait_until(lambda: len(merged(run, rank=0)) >= 12 or proc.poll() is not None, 300, "step 12", every=0.05)
        record = json.loads(run.attempt_record(1).read_text())
        assert record["pids"] and record["host"] and all(record["pid_started"].values())
    finally:
        proc.kill()
        proc.wait()
    killed = time.monotonic()
    wait_until(lambda: not any(_running(pid) for pid in record["pids"].values()), 10,
               "every rank to stop after its supervisor was killed", every=0.1)
    print(f"supervisor SIGKILL -> no rank alive: {time.monotonic() - killed:.2f} s")
    s = status_json(run)
    assert s["state"] == "stopped" and s["attempts"][0]["cause"] == "lost"  # not "running" forever
    rkit("run", str(TINY), "-o", "name=orphans", *SHORT, "--resume", cwd=workspace, env=ENV, check=0)
    ended = events(run, "attempt.ended")
    assert (ended[0]["attempt"], ended[0]["cause"]) == (1, "lost") and ended[-1]["cause"] == "completed"
    assert json.loads(run.attempt_record(1).read_text())["cause"] == "lost"  # closed in the record too
    assert final_loss(run) == final_loss(baseline)


def fill_at_step_12(proc: subprocess.Popen, run: RunDir, mount: Path) -> tuple[float, str]:
    """Once rank 0 is past step 12, fill `mount` but for 64 KiB; when that was, and the run's stderr. The run
    writes on meanwhile: where it took the last 64 KiB first, the ballast stops at the full disk (ENOSPC)."""
    wait_until(lambda: len(merged(run, rank=0)) >= 12 or proc.poll() is not None, 300, "step 12", every=0.05)
    assert proc.poll() is None, proc.communicate()
    try:
        (mount / "ballast").write_bytes(b"\0" * (shutil.disk_usage(mount).free - 64 * 1024))
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
    filled = time.time()
    return filled, proc.communicate(timeout=600)[1]


def test_disk_full_on_the_checkpoint_file_system_stops_with_the_diagnosis(workspace: Path):
    if os.geteuid() != 0 or not shutil.which("mount"):
        missing_test_bed("a small tmpfs for the checkpoints needs root (mount -t tmpfs); make test runs as root")
    argv = [sys.executable, "-m", "rkit.cli", "run", str(TINY), "-o", "name=diskfull", *SHORT]
    proc = subprocess.Popen(argv, cwd=workspace, env=dict(os.environ, **ENV), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    run = RunDir(workspace / "runs" / "diskfull")
    mount = run.path / "checkpoints"  # MaxText's output directory: Orbax saves under it
    mounted = False
    try:
        wait_until(lambda: run.path.is_dir() or proc.poll() is not None, 120, "the run directory", every=0.01)
        mount.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], check=True)
        mounted = True
        filled, err = fill_at_step_12(proc, run, mount)  # step 20 cannot fit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if mounted:
            subprocess.run(["umount", "-l", str(mount)], check=False)
    assert proc.returncode == 1 and "Traceback" not in err, err
    ended = events(run, "attempt.ended")
    assert [e["cause"] for e in ended] == ["disk_full"]  # no restart into a full disk, no hang timeout
    assert f"file system {mount}:" in ended[0]["detail"] and "bytes free" in ended[0]["detail"]
    s = status_json(run)
    assert s["state"] == "gave up" and s["reason"].startswith("disk full: ") and "--resume" in s["reason"]
    print(f"disk full -> diagnosis: {ended[0]['t'] - filled:.1f} s")


def test_disk_full_on_the_whole_run_directory_stops_with_one_line_and_resumes(workspace: Path, baseline: RunDir):
    # The run directory itself on a 16 MiB tmpfs, filled at step 12: the ranks' logs, metrics and the
    # supervisor's own records cannot be written either.
    if os.geteuid() != 0 or not shutil.which("mount"):
        missing_test_bed("a small tmpfs for the run directory needs root (mount -t tmpfs); make test runs as root")
    runs = workspace / "full runs"
    runs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(runs)], check=True)
    try:
        argv = [sys.executable, "-m", "rkit.cli", "run", str(TINY), "-o", "name=fullrun", "-o", f"runs_dir={runs}",
                *SHORT]
        proc = subprocess.Popen(argv, cwd=workspace, env=dict(os.environ, **ENV), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        run = RunDir(runs / "fullrun")
        try:
            filled, err = fill_at_step_12(proc, run, runs)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stopped = time.time()
        assert proc.returncode == 1 and "Traceback" not in err, err
        last = err.strip().splitlines()[-1]
        assert "No space left on device" in last and f"(file system {runs}" in last and "--resume" in last
        assert not [p for p in run.path.rglob("*.tmp")]  # nothing half-written
        pids = json.loads(run.attempt_record(1).read_text())["pids"].values()
        assert not [p for p in pids if running(p)]  # no rank trains on unsupervised
        (runs / "ballast").unlink()
        run_tiny(workspace, "fullrun", "-o", f"runs_dir={runs}", "--resume")
        assert status_json(run)["state"] == "finished"
        assert final_loss(run) == final_loss(baseline)
        print(f"run directory full -> stopped: {stopped - filled:.1f} s")
    finally:
        subprocess.run(["umount", "-l", str(runs)], check=False)


@pytest.mark.parametrize("damage", ["data_file", "markers"])
def test_a_corrupt_newest_checkpoint_falls_back_and_finishes(workspace: Path, baseline: RunDir, damage: str):
    # Attempt 1 ends at step 25 with steps 0, 10 and 20 committed; no restart is allowed, so it stops there.
    # Saves are synchronous here: the exit fires in the training loop 5 steps after step 20's save began, and an
    # async save may still be writing then (as in a real crash), which is not what this test is about.
    name = f"corrupt-{damage}"
    budget = ["-o", "resilience.max_restarts=0", "-o", "checkpoint.async=false"]
    run = run_tiny(workspace, name, *budget, "--inject", "exit:rank=0,step=25,code=3", expect=1)
    step20 = run.orbax_dir / "20"
    assert step20.is_dir()
    if damage == "data_file":  # one data file lost: only the restore itself can tell
        victim = max((step20 / "items" / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)
        victim.unlink()
    else:  # the commit markers lost: rkit and MaxText must agree that the step is not there; and step 10's
        # tree metadata emptied (Orbax then fails the restore with a bare exit 1): both moved aside, step 0 used
        (step20 / "_CHECKPOINT_METADATA").unlink()
        (step20 / "commit_success.txt").unlink(missing_ok=True)
        (run.orbax_dir / "10" / "items" / "_METADATA").write_text("")
    resumed = time.time()
    rkit("run", str(TINY), "-o", f"name={name}", *SHORT, *budget, "--resume", cwd=workspace, env=ENV, check=0)
    quarantined = events(run, "checkpoint.quarantined")
    assert [q["step"] for q in quarantined] == ([20] if damage == "data_file" else [20, 10])
    assert (run.checkpoints / "quarantine" / "20").is_dir()
    ended = events(run, "attempt.ended")
    if damage == "data_file":
        assert [e["cause"] for e in ended] == ["task_exit", "corrupt_checkpoint", "completed"]
        assert "the checkpoint of step 20 could not be restored: rank-" in ended[1]["detail"]
        print(f"corrupt checkpoint -> diagnosis: {ended[1]['t'] - resumed:.1f} s after --resume")
    else:
        assert [e["cause"] for e in ended] == ["task_exit", "completed"]
        assert "no commit marker" in quarantined[0]["reason"]
        assert quarantined[1]["reason"] == "items/_METADATA is not readable JSON (emptied or cut)"
    starts = [e["resume_from_step"] for e in events(run, "attempt.started")]
    assert starts[-1] == (10 if damage == "data_file" else 0)
    assert final_loss(run) == final_loss(baseline)


def test_a_failing_ranks_own_error_is_in_status_and_the_events(workspace: Path):
    # A value MaxText's config refuses at start-up (a list key given a word: not one of the simple types rkit
    # checks first). The ranks' own ValidationError is the diagnosis, not "exited with code 1".
    extra = ["-o", "trainer.overrides.ici_parallelism=abc", "-o", "resilience.max_restarts=0"]
    done = rkit("run", str(TINY), "-o", "name=own-words", *SHORT, *extra, cwd=workspace, env=ENV, check=1)
    run = RunDir(workspace / "runs" / "own-words")
    # The hint to continue is the user's own command, -o options included.
    assert f"rkit: continue it with: rkit run {TINY} -o name=own-words {' '.join(SHORT + extra)} --resume" \
        in done.stdout.replace("'", "")
    [failed] = events(run, "attempt.failed")
    assert "ValidationError" in failed["error"] and "ici_parallelism" in failed["error"]
    s = status_json(run)
    assert s["state"] == "gave up" and failed["error"] in s["reason"] and failed["error"] in s["attempts"][0]["detail"]
    text = rkit("status", str(run.path), check=0).stdout
    assert "Input should be a valid list" in text


def memory_capped_cgroup(limit: int) -> Path:
    """A child of this process's memory cgroup with a memory limit (v1 or v2); skips where none can be made."""
    from rkit.run import oomkills

    own = oomkills.memory_cgroup(os.getpid())
    if own is None:
        pytest.skip("no memory cgroup controller here")
    child = own / f"rkit-oom-test-{os.getpid()}"
    try:
        child.mkdir(exist_ok=True)
        limit_file = child / ("memory.limit_in_bytes" if (child / "memory.limit_in_bytes").exists() else "memory.max")
        limit_file.write_text(str(limit))
    except OSError as exc:
        pytest.skip(f"cannot make a memory-capped cgroup under {own}: {exc}")
    return child


def test_a_rank_killed_for_memory_is_out_of_memory_with_its_limit_and_not_retried(workspace: Path):
    # `rkit run` and its ranks in a cgroup capped at 700 MiB, no swap: a rank's JAX and MaxText outgrow it during
    # start-up and the kernel's OOM killer takes it (the largest process). Not a crash loop, not three attempts.
    cgroup = memory_capped_cgroup(700 << 20)
    try:
        done = subprocess.run([sys.executable, "-m", "rkit.cli", "run", str(TINY), "-o", "name=oom", *SHORT,
                               "-o", "resilience.max_restarts=5"], cwd=workspace, env={**os.environ, **ENV},
                              capture_output=True, text=True, timeout=900, check=False,
                              preexec_fn=lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid())))
    finally:
        wait_until(lambda: not (cgroup / "cgroup.procs").read_text().strip(), 60, "the cgroup to empty")
        cgroup.rmdir()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    run = RunDir(workspace / "runs" / "oom")
    ended = events(run, "attempt.ended")
    assert [e["cause"] for e in ended] == ["out_of_memory"]
    assert "the kernel's OOM killer killed" in ended[0]["detail"] and "memory limit 0.68 GiB" in ended[0]["detail"]
    assert "killed by SIGKILL" in ended[0]["detail"]
    s = status_json(run)
    assert s["state"] == "gave up" and "would run out the same way" in s["reason"]


def test_a_hang_is_detected_dumped_and_the_restart_takes_the_warm_standbys(workspace: Path, baseline: RunDir):
    """Budget: the hang timeout (60 s) is the standbys' time to import; the rest is two attempts."""
    # rank 1 stops (SIGSTOP) at step 15; rank 0 then blocks in its next collective: nothing advances. The hang is
    # detected within the timeout and a few seconds, every thread's stack dumped, and the attempt replaced. While
    # the hang timeout runs, the standbys (started after the first step) get ready, the test kills rank 1's as
    # soon as it started, and its replacement gets ready: the new attempt's ranks are the standbys. The hang
    # timeout is the time both have to import (Python, JAX, MaxText): 10 s each on a quiet machine, 27 s each in a
    # CI run beside a CPU hog, where a standby killed only once ready left its replacement not ready when the 40 s
    # timeout fired (discarded, the attempt started cold). (One run for both: the hang's own test, with a 10 s
    # timeout and standbys off, was a second run of the same injection.)
    argv = [sys.executable, "-m", "rkit.cli", "run", str(TINY), "-o", "name=warm", *SHORT,
            "-o", "resilience.warm_standby=true", "-o", "resilience.hang_timeout=60",
            "--inject", "hang:rank=1,step=15"]
    proc = subprocess.Popen(argv, cwd=workspace, env={**os.environ, **ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    run = RunDir(workspace / "runs" / "warm")

    def notes(what: str) -> list[dict]:
        return [e for e in events(run, "standby") if e["what"] == what] if run.events_file.exists() else []

    wait_until(lambda: len(notes("started")) == 2, 120, "both standbys started", alive=proc)
    first = {e["rank"]: e["pid"] for e in notes("started")}
    os.kill(first[1], signal.SIGKILL)
    wait_until(lambda: notes("replaced"), 30, "the killed standby replaced", alive=proc)
    replacement = notes("replaced")[0]["pid"]
    wait_until(lambda: any(e["pid"] == replacement for e in notes("ready")), 120, "the replacement ready",
               alive=proc)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    assert notes("died")[0]["pid"] == first[1] and notes("died")[0]["rank"] == 1
    pids = json.loads((run.attempt_dir(2) / "attempt.json").read_text())["pids"]
    assert pids == {"0": first[0], "1": replacement}  # the resumed attempt's ranks are the standby processes
    started = [e for e in events(run, "agent.started") if e["attempt"] == 2]
    assert sorted(e["pid"] for e in started) == sorted(pids.values()) and all(e["warm"] for e in started)
    ready = [e for e in events(run, "agent.ready") if e["attempt"] == 2]
    assert len(ready) == 2 and all(e["warm"] and e["import_seconds"] < 1 for e in ready)
    fired, hang = events(run, "inject.fired"), events(run, "attempt.hang")
    assert len(fired) == 1 and len(hang) == 1
    assert hang[0]["rank"] == 1 and hang[0]["stopped_ranks"] == [1] and hang[0]["timeout"] == 60
    latency = hang[0]["t"] - fired[0]["t"]
    print(f"hang detection latency: {latency:.1f} s (timeout 60 s)")
    assert 60 <= latency < 60 + 5
    stacks = (run.attempt_dir(1) / "stacks" / "rank-1.txt").read_text()
    assert "Thread 0x" in stacks or "Current thread" in stacks  # faulthandler's dump of every thread
    ended = events(run, "attempt.ended")
    assert [e["cause"] for e in ended] == ["hang", "completed"]
    assert ended[0]["decision"] == "restart" and "rank 1" in ended[0]["reason"]
    assert ended[0]["tally"]["infra_failures"] == 1
    assert ended[0]["tally"]["training_failures"] == 0  # the dead standby was no training failure
    assert final_loss(run) == final_loss(baseline)
    assert [a["cause"] for a in status_json(run)["attempts"]] == ["hang", "completed"]
    # Standby off (the default on this machine's 2 cores for 2 ranks): today's behaviour.
    assert not events(baseline, "standby") and not any(e["warm"] for e in events(baseline, "agent.started"))


# rkit compare's loss tolerance for a run that shrank: the same global batch on half the devices with twice the
# accumulation sums the same gradients in another order, and the difference grows with the steps trained shrunk.
# Measured on this stack, 30 steps, a loss of about 6: 0.00078 shrunk from step 10 (1 device per process), 0.00089
# (2 devices per process), 0.00166 and 0.00178 shrunk from step 0 (the step-10 save not yet committed when the
# node was lost). 0.005 is under 0.1 % of the loss.
SHRINK_TOLERANCE = 0.005


def test_a_lost_node_with_no_spare_shrinks_to_one_process_with_the_same_global_batch(workspace: Path,
                                                                                       baseline: RunDir):
    # Two (virtual) nodes of one process each, as the baseline's two processes; rank 1's node is lost for good at
    # step 15 and no spare is left: the run goes on at once on one process, twice the accumulation.
    run = run_tiny(workspace, "shrink", "-o", "resources.nodes=2", "-o", "resources.processes_per_node=1",
                   "-o", "resources.min_nodes=1", "--inject", "lose_node:rank=1,step=15")
    assert events(run, "run.finished")
    failed = events(run, "attempt.failed")
    assert len(failed) == 1 and failed[0]["cls"] == "node_fail" and failed[0]["lost_nodes"][0].endswith("-node1")
    resized = events(run, "run.resized")
    assert [(e["attempt"], e["node_count"], e["gradient_accumulation_steps"]) for e in resized] == [(2, 1, 2)]
    mesh = {e["attempt"]: e for e in events(run, "agent.mesh")}
    assert [(mesh[a]["devices"], mesh[a]["gradient_accumulation_steps"], mesh[a]["global_batch"]) for a in (1, 2)] \
        == [(2, 1, 2), (1, 2, 2)]  # the global batch MaxText trained on did not change
    assert mesh[1]["mesh"] == {"ici_fsdp": 2} and mesh[2]["mesh"] == {}
    ended = events(run, "attempt.ended")
    assert [(e["cause"], e["decision"]) for e in ended] == [("node_fail", "restart"), ("completed", "finish")]
    second = json.loads((run.attempt_dir(2) / "attempt.json").read_text())
    assert second["shape"]["processes"] == 1 and len(second["launch"]["ranks"]) == 1
    assert "gradient_accumulation_steps=2" in second["launch"]["ranks"][0]["argv"]
    text = rkit("status", str(run.path), check=0).stdout
    assert "on 2 of 2 nodes, devices 2, gradient accumulation 1" in text
    assert "on 1 of 2 nodes, devices 1, gradient accumulation 2, global batch 2: completed" in text
    # The loss per step against the run that never lost a node: bit for bit before the restart, within the
    # tolerance after it.
    done = rkit("compare", "--json", "--threshold", "10", "--loss-tolerance", str(SHRINK_TOLERANCE),
                str(baseline.path), str(run.path), check=0)
    loss = json.loads(done.stdout)["loss"]
    resumed = second["resume_from_step"]
    # the restored step's successor is computed from the same parameters: bit for bit up to it
    assert loss["counts"]["DIFFER"] == 0 and loss["counts"]["EXACT"] >= resumed + 2, loss["counts"]
    a, b = merged(baseline, rank=0), merged(run, rank=0)
    worst = max(abs(a[s]["loss"] - b[s]["loss"]) for s in a)
    first_small = next(e for e in events(run, "attempt.first_step") if e["attempt"] == 2)

    def median_step(attempt: int) -> float:
        times = sorted(m["step_time"] for m in lines(run, 0) if m["attempt"] == attempt and m["step"] > 12)
        return times[len(times) // 2]

    print(f"shrink 2 -> 1 process from step {resumed}: max |loss - baseline| {worst:.6f} (tolerance "
          f"{SHRINK_TOLERANCE}); failure -> "
          f"first step on 1 process {first_small['t'] - failed[0]['t']:.1f} s; median step time 2 processes "
          f"{median_step(1):.4f} s, 1 process {median_step(2):.4f} s")


def test_period_auto_chooses_the_period_from_the_measured_save_and_step(workspace: Path, baseline: RunDir):
    # Attempt 1 chooses from what the workspace's runs alike in cost measured (the baseline's Orbax save stalls and
    # step times: the same model with another period), attempt 2 with attempt 1's own added (Young/Daly), each
    # bounded to max_period 10: a tiny model saves in milliseconds, so the optimum is thousands of steps.
    run = run_tiny(workspace, "auto", "-o", "checkpoint.period=auto", "-o", "checkpoint.max_period=10",
                   "--inject", "kill:rank=1,step=22")
    chosen = events(run, "checkpoint.period")
    assert [(e["attempt"], e["period"]) for e in chosen] == [(1, 10), (2, 10)]
    first, second = chosen
    assert first["saves"] >= 3 and first["reason"].startswith("Young/Daly")  # the baseline's saves at 0, 10, 20, 29
    assert second["saves"] > first["saves"] and 0 < second["save_seconds"] < 30 and 0 < second["step_seconds"] < 30
    assert second["failures"] >= first["failures"] + 1  # attempt 1's kill, counted with every run of the workspace
    assert second["interval_seconds"] == pytest.approx((2 * second["save_seconds"] * second["mtbf_seconds"]) ** 0.5,
                                                       abs=1e-2)
    assert second["reason"].startswith("Young/Daly") and "bounded to 10 by checkpoint.max_period" in second["reason"]
    assert [e["checkpoint_period"] for e in events(run, "attempt.started")] == [10, 10]
    attempt2 = json.loads((run.attempt_dir(2) / "attempt.json").read_text())
    assert all("checkpoint_period=10" in r["argv"] for r in attempt2["launch"]["ranks"])
    # saved on the chosen period's steps (step 20's async save may not have committed before the kill at 22)
    assert events(run, "attempt.started")[1]["resume_from_step"] in (10, 20)
    assert "checkpoint every 10 steps from attempt 2 (period: auto; Young/Daly" in \
        rkit("status", str(run.path), check=0).stdout
    assert final_loss(run) == final_loss(baseline)
    print(f"period auto: save stall {second['save_seconds']} s (median of {second['saves']}), step "
          f"{second['step_seconds']} s, MTBF {second['mtbf_seconds'] / 3600:.1f} h -> Young/Daly "
          f"{second['interval_seconds']} s")


# The node-local tier (checkpoint.local_dir): each of the two processes is one data-parallel replica holding the
# whole state; the first saves every 10 steps to the run directory, the second every 2 to "its node's" storage.
LOCAL_TIER = ["-o", "checkpoint.local_period=2", "-o", "trainer.overrides.ici_data_parallelism=-1",
              "-o", "trainer.overrides.ici_fsdp_parallelism=1"]


def local_tier_run(workspace: Path, name: str, *extra: str, expect: int = 0,
                   timeout: float = 600) -> tuple[RunDir, Path]:
    local = workspace.parent / f"node-local {name}"
    return run_tiny(workspace, name, *LOCAL_TIER, "-o", f"checkpoint.local_dir={local}", *extra,
                    expect=expect, timeout=timeout), local


def outcome_sha(run: RunDir) -> str:
    return json.loads(run.outcome_file.read_text())["loss"]["sha256"]


@pytest.fixture(scope="session")
def local_baseline(workspace: Path, baseline: RunDir) -> RunDir:
    """The local tier's mesh (two data-parallel replicas) uninterrupted: what a resumed local-tier run must equal
    bit for bit. The baseline's fsdp mesh sums in another order: on this 2-core machine the two agree to the bit
    for 22 steps, then by at most 8e-4 (measured; the same at commit 488af76, before the real-data work)."""
    run, local = local_tier_run(workspace, "local-clean")
    assert [e["cause"] for e in events(run, "attempt.ended")] == ["completed"]
    assert not local.exists() or not list(local.rglob("*"))  # served: removed at the end
    steady = {int(k): v for k, v in run.load_outcome()["loss"]["per_step"].items()}
    fsdp = {int(k): v for k, v in baseline.load_outcome()["loss"]["per_step"].items()}
    assert sorted(steady) == sorted(fsdp) == list(range(30))
    assert max(abs(steady[s] - fsdp[s]) for s in steady) < 5e-3
    return run


def test_a_crash_restores_from_the_node_local_tier_to_the_clean_runs_loss(workspace: Path, local_baseline: RunDir):
    run, local = local_tier_run(workspace, "local-crash", "--inject", "kill:rank=1,step=19")
    [restored] = events(run, "checkpoint.restored")
    # the run directory's newest is step 10; the local tier had 12..18 (18's save may not have committed)
    assert restored["attempt"] == 2 and restored["tier"] == "local" and 12 <= restored["step"] <= 18, restored
    assert "lost_step" not in restored
    # the supervisor counted the local steps the ranks recorded as committed
    resumed = events(run, "attempt.started")[1]["resume_from_step"]
    assert 10 < resumed <= restored["step"]
    assert [(e["cause"], e["decision"]) for e in events(run, "attempt.ended")] == [("task_signal", "restart"),
                                                                                 ("completed", "finish")]
    # the same loss as the uninterrupted run on the same mesh: every step bit for bit
    assert outcome_sha(run) == outcome_sha(local_baseline)
    text = rkit("status", str(run.path), check=0).stdout
    assert f"#2  resumed from step {restored['step']} (local tier): completed" in text
    # served: each process removed its local checkpoints when it ended with the final step trained
    assert "local (node storage) -" in text
    assert not local.exists() or not list(local.rglob("*"))
    print(f"local tier: crash at 19, restored step {restored['step']} from the local tier in "
          f"{restored['seconds']} s")


def test_a_nodes_lost_local_data_restores_the_run_directorys_step_and_says_so(workspace: Path,
                                                                           local_baseline: RunDir):
    # rank 1's node is replaced at step 15: its local steps 12 and 14 are gone, and it held the only copy
    run, _ = local_tier_run(workspace, "local-lost", "--inject", "lose_local:rank=1,step=15")
    [restored] = events(run, "checkpoint.restored")
    assert (restored["tier"], restored["step"], restored["lost_step"]) == ("persistent", 10, 14), restored
    assert "restored step 10 from the persistent tier, 4 steps older" in restored["reason"]
    assert outcome_sha(run) == outcome_sha(local_baseline)
    assert "#2  resumed from step 10 (persistent tier; step 14 was lost): completed" in \
        rkit("status", str(run.path), check=0).stdout
    print(f"local tier lost: restored step 10 from the run directory in {restored['seconds']} s")


def test_a_replica_left_holding_newer_local_steps_drops_them_and_saves_on(workspace: Path):
    """Budget: three cold attempts with the node-local tier (the replica's newer steps are made, then dropped)."""
    # 4 processes, 2 replicas of 2 (fsdp within each): rank 3's local data is lost, rank 2 (its replica's other
    # half) still holds steps 12 and 14. Restored from step 10, rank 2 must drop them: holding them, it would skip
    # saving step 12 while rank 3 saves it, and the save's collective would never complete.
    # Four JAX processes on two busy cores: in CI (stop 47) and beside a CPU hog (2026-12-06) an attempt hung
    # before its first step: the stacks showed all four ranks inside the allgather of Orbax's emergency
    # checkpointer (`sync_global_data`, the first save's `all_steps`), two at one line of JAX's process_allgather
    # and two at another; twice in a row there. A hang is rkit's to survive (the hang watch restarts the attempt),
    # so the start-up allowance here is 180 s (the first step came 69 s after the attempt started in that run's good
    # attempts), the run has 15 minutes, and the restore asserted is the one after the loss, whichever attempt.
    run, _ = local_tier_run(workspace, "local-purge", "-o", "resources.processes_per_node=4",
                            "-o", "trainer.overrides.ici_data_parallelism=2",
                            "-o", "trainer.overrides.ici_fsdp_parallelism=2",
                            "-o", "resilience.hang_startup_seconds=180",
                            "--inject", "lose_local:rank=3,step=15", timeout=900)
    [restored] = [e for e in events(run, "checkpoint.restored") if e.get("lost_step") is not None]
    assert (restored["tier"], restored["step"]) == ("persistent", 10) and restored["lost_step"] >= 12
    causes = [e["cause"] for e in events(run, "attempt.ended")]
    assert causes[-1] == "completed" and set(causes[:-1]) <= {"task_signal", "task_exit", "hang"}, causes
    assert events(run, "run.finished") and final_loss(run) > 0
    log = (run.attempt_dir(restored["attempt"]) / "rank-2.log").read_text(errors="replace")
    [said] = [line for line in log.splitlines() if "removed this process's local checkpoints of steps" in line]
    assert "newer than the restored step 10" in said and "12" in said, said


def test_a_damaged_local_step_is_quarantined_and_the_previous_one_restored(workspace: Path,
                                                                          local_baseline: RunDir):
    # Stopped after the crash (no restart allowed), rank 1's newest local step has its data files overwritten:
    # Orbax's files look whole, so only the restore finds it. The resumed run's attempt fails as a corrupt
    # checkpoint within seconds (the rank exits at once instead of waiting in jax.distributed's shutdown), the
    # step is moved aside, and the next attempt restores the previous local step.
    stop = ["-o", "resilience.max_restarts=0", "--inject", "kill:rank=1,step=19"]
    run, local = local_tier_run(workspace, "local-damaged", *stop, expect=1)
    [record] = [r for r in localtier.records(run) if r["rank"] == 1]
    newest = max(record["steps"])
    step_dir = Path(record["path"]) / str(newest)
    damaged = [f for f in step_dir.rglob("*") if f.is_file() and f.parent.name == "d"]
    assert damaged
    for f in damaged:
        f.write_bytes(os.urandom(100))
    run, _ = local_tier_run(workspace, "local-damaged", "-o", "resilience.max_restarts=3", "--resume")
    [quarantined] = events(run, "checkpoint.quarantined")
    assert (quarantined["tier"], quarantined["step"]) == ("local", newest) and "the restore failed" in \
        quarantined["reason"]
    assert Path(quarantined["moved_to"]).is_dir() and not step_dir.exists()  # kept for a post-mortem
    ended = events(run, "attempt.ended")
    assert [e["cause"] for e in ended] == ["task_signal", "corrupt_checkpoint", "completed"]
    failed = ended[1]["t"] - events(run, "attempt.started")[1]["t"]
    [restored] = events(run, "checkpoint.restored")
    assert (restored["attempt"], restored["tier"], restored["step"]) == (3, "local", newest - 2)
    assert outcome_sha(run) == outcome_sha(local_baseline)
    print(f"damaged local step {newest}: the attempt failed {failed:.1f} s after it started; restored step "
          f"{newest - 2} from the local tier")


def test_a_lost_first_node_leaves_each_survivor_its_own_local_step_and_a_peer_lost_in_the_restore_no_quarantine(
        workspace: Path):
    """Budget: four processes on three virtual nodes, a lost node and a rank killed inside the next restore: three cold
    attempts."""
    # Three virtual nodes, one process each (three replicas: the first saves to the run directory, the others to
    # their node's storage every 2 steps). Node 0 is lost at step 15 with no spare: the attempt shrinks onto
    # nodes 1 and 2, now processes 0 and 1, and each finds the local steps its node saved as process 1 or 2.
    # As attempt 2's restore begins, rank 1 is killed: rank 0's restore breaks off in the restore's collectives
    # (its peer is gone), which is not the step's damage: nothing is quarantined, the attempt is rank 1's
    # failure, and attempt 3 restores the same local step.
    run, local = local_tier_run(workspace, "local-node-lost", "-o", "resources.nodes=3",
                                "-o", "resources.processes_per_node=1", "-o", "resources.min_nodes=2",
                                "-o", "trainer.overrides.gradient_accumulation_steps=2",
                                "--inject", "lose_node:rank=0,step=15", "--inject", "kill_restore:rank=1")
    ended = events(run, "attempt.ended")
    assert [(e["cause"], e["decision"]) for e in ended] == [("node_fail", "restart"), ("task_signal", "restart"),
                                                          ("completed", "finish")], ended
    assert ended[1]["detail"].startswith("rank 1 killed by SIGKILL before its first step"), ended[1]
    assert not events(run, "checkpoint.quarantined")
    said = [line for line in (run.attempt_dir(2) / "rank-0.log").read_text(errors="replace").splitlines()
            if line.startswith("rkit: ") and "restore" in line]
    assert not [line for line in said if "Failed to restore" in line], said
    [restored] = events(run, "checkpoint.restored")
    # the supervisor's injection fires once it reads step 15: the node's processes die a step or two later
    assert restored["attempt"] == 3 and restored["tier"] == "local" and 12 <= restored["step"] <= 18, restored
    assert "lost_step" not in restored  # no "step N was lost"
    started = events(run, "attempt.started")
    assert [s["nodes"] for s in started][1:] == [started[0]["nodes"][1:]] * 2
    assert 10 < started[1]["resume_from_step"] <= restored["step"]
    assert trained_steps(run, 3) == set(range(restored["step"] + 1, 30))
    assert events(run, "run.finished") and final_loss(run) > 0
    # the lost node's record is forgotten; the survivors' folders are named by node, not by their new index
    assert sorted(r["key"] for r in localtier.records(run)) == [f"{n}-0" for n in started[0]["nodes"][1:]]
    assert not local.exists() or not list(local.rglob("*"))  # served: removed at the end
    print(f"lost node 0 of 3 ({ended[0]['detail']}), then {ended[1]['detail']!r} (rank 0 said {said}): restored "
          f"step {restored['step']} from the local tier in {restored['seconds']} s")


def test_a_final_step_the_run_directory_could_not_take_does_not_finish_the_run(workspace: Path):
    # The run directory's checkpoints on a tmpfs, made read-only once step 20 is committed: the final save
    # (step 29) fails there while the local replica holds its steps. Not finished; resumed once it is writable,
    # the run trains the last steps again from the local tier and saves step 29 in the run directory.
    if os.geteuid() != 0 or not shutil.which("mount"):
        missing_test_bed("a read-only tmpfs for the checkpoints needs root (mount -o remount,ro); make test runs as "
                         "root")
    name = "local-final-ro"
    local = workspace.parent / f"node-local {name}"
    args = ["run", str(TINY), "-o", f"name={name}", *SHORT, *LOCAL_TIER, "-o", f"checkpoint.local_dir={local}",
            "-o", "resilience.max_restarts=0"]
    proc = subprocess.Popen([sys.executable, "-m", "rkit.cli", *args], cwd=workspace, env=dict(os.environ, **ENV),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = RunDir(workspace / "runs" / name)
    mounted = False
    try:
        wait_until(lambda: run.orbax_dir.is_dir() or proc.poll() is not None, 120, "the run directory", every=0.01)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(run.orbax_dir)], check=True)
        mounted = True
        wait_until(lambda: 20 in maxtext.committed_steps(run), 300, "step 20 committed", alive=proc, every=0.05)
        subprocess.run(["mount", "-o", "remount,ro", str(run.orbax_dir)], check=True)
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 1 and "Traceback" not in err, err
        assert not events(run, "run.finished") and events(run, "run.gave_up")
        assert maxtext.committed_steps(run)[-1] == 20 and not maxtext.final_committed(run, 29)
        assert status_json(run)["state"] != "finished"
        subprocess.run(["mount", "-o", "remount,rw", str(run.orbax_dir)], check=True)
        done = rkit(*args, "--resume", "-o", "resilience.max_restarts=3", cwd=workspace, env=ENV, check=0)
        assert "Traceback" not in done.stderr
        assert maxtext.final_committed(run, 29) and events(run, "run.finished")
        restored = events(run, "checkpoint.restored")[-1]
        assert restored["tier"] == "local" and restored["step"] >= 22, restored
        assert min(trained_steps(run, restored["attempt"])) == restored["step"] + 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if mounted:
            subprocess.run(["umount", "-l", str(run.orbax_dir)], check=False)
    print(f"final save refused by a read-only run directory: not finished; resumed from local step "
          f"{restored['step']}, {29 - restored['step']} step(s) recomputed")
