"""What the Slurm tests share: the recipe, submitting a run to the test bed, waiting for its end, crashing a node,
and the test bed's Slurm timeouts (ci/slurm-testbed.sh timeouts)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from rkit.contract.rundir import RunDir
from rkit.runtime.telemetry.metrics import merged

from ..conftest import REPO, rkit, wait_until

RECIPE = REPO / "recipes" / "tiny-slurm.yaml"
TESTBED = REPO / "ci" / "slurm-testbed.sh"
STEPS = ["-o", "trainer.steps=40", "-o", "checkpoint.period=10"]
FAST_TIMEOUTS = (20, 5)  # the test bed's (SlurmdTimeout, MessageTimeout): a crashed node is DOWN within ~30 s
SLURM_TIMEOUTS = (300, 10)  # Slurm's own defaults, as on most real clusters


def set_timeouts(slurmd: int, message: int) -> None:
    subprocess.run([str(TESTBED), "timeouts", str(slurmd), str(message)], check=True, capture_output=True,
                   timeout=300)


def submit(cluster, workspace: Path, name: str, image: Path, *extra: str) -> RunDir:
    done = rkit("run", str(RECIPE), "-o", f"name={name}", "-o", f"runs_dir={workspace}", "-o", f"image={image}",
                *STEPS, *extra, cwd=workspace, env=cluster, check=0)
    assert "submitted" in done.stdout and "Slurm job" in done.stdout
    return RunDir(workspace / name)


def job_of(run: RunDir) -> str:
    return [e for e in run.events() if e["event"] == "job.submitted"][-1]["job_id"]


def squeue(cluster, job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T|%r"], capture_output=True, text=True,
                          env=dict(os.environ, **cluster), check=False).stdout.strip()


def status(cluster, run: RunDir) -> dict:
    return json.loads(rkit("status", "--json", str(run.path), env=cluster, check=0).stdout)


def wait_finished(cluster, run: RunDir, timeout: float = 900) -> dict:
    """Until the run is in a final state and its job has left the queue; returns `rkit status --json`. A requeued
    job waits out Slurm's cred_expire hold (30 s on the test bed): releasing it sooner (StartTime=now) can kill it
    as "non-startable: Job credential revoked". The wait reads the events file and squeue, and calls the CLI once
    at the end: a CLI call every 2 s cost a third of a core through every Slurm test's waits."""
    job = job_of(run)
    wait_until(lambda: final_event(run) and not squeue(cluster, job), timeout, f"run {run.name} to end", every=2)
    return wait_until(lambda: (s := status(cluster, run))["state"] in ("finished", "gave up") and s, 60,
                      f"rkit status of {run.name} to say it ended", every=1)


def final_loss(run: RunDir) -> float:
    view = merged(run, rank=0)
    assert max(view) == 39
    return view[39]["loss"]


def crash_when_at_step(cluster, run: RunDir, step: int, which: int) -> tuple[str, float]:
    """Crash node `which` of attempt 1's step once rank 0 is past `step`; returns the node and the time."""
    wait_until(lambda: (run.attempt_dir(1) / "attempt.json").exists() and len(merged(run, 0)) >= step, 600,
               f"step {step}")
    victim = json.loads((run.attempt_dir(1) / "attempt.json").read_text())["launch"]["nodes"][which]
    crashed_at = time.time()
    subprocess.run([str(TESTBED), "crash", victim], check=True, capture_output=True)
    return victim, crashed_at


def final_event(run: RunDir) -> dict | None:
    """The run's run.finished or run.gave_up event; None while it goes on."""
    events = run.events() if run.events_file.exists() else []
    return next((e for e in reversed(events) if e["event"] in ("run.finished", "run.gave_up")), None)


def crash_and_wait_finished(cluster, run: RunDir, step: int, which: int) -> tuple[str, float]:
    """crash_when_at_step, then wait for the run's final event, bring the node back (whatever happens) and wait
    until the job left the queue: at Slurm's real timeouts the ended job waits in COMPLETING for the dead node
    until it is back. Returns the node and the crash time."""
    victim, crashed_at = crash_when_at_step(cluster, run, step, which)
    try:
        wait_until(lambda: final_event(run), 900, "the run's final event", every=2)
    finally:
        subprocess.run([str(TESTBED), "restore", victim], check=False, capture_output=True)
    wait_until(lambda: squeue(cluster, job_of(run)) == "", 300, "the job to leave the queue", every=2)
    return victim, crashed_at
