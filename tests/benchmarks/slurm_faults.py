"""Recovery times on the Slurm test bed, median of N (real Slurm, real Apptainer, real MaxText).

    eval "$(ci/slurm-testbed.sh env)"
    python tests/benchmarks/slurm_faults.py --image SIF [--repeats 3] [--timeouts 300,10]

--timeouts SLURMD,MESSAGE: the test bed's SlurmdTimeout and MessageTimeout for this measurement (Slurm's defaults
are 300,10; the test bed's own 20,5), set back afterwards.

node crash: the node running rank 1 (not the batch host) is crashed at step >= 25; a spare node replaces it.
  (node-crash-warm: with resilience.warm_standby=true, 600 steps, crashed once a standby step is ready on every
  node: the attempt on the spare starts warm)
  detection  crash -> the attempt ends as a node failure (rkit's heartbeats and probe step, or Slurm through srun:
             `by` says which saw it first)
  stop       -> the attempt's step cancelled and its srun gone (attempt.ended)
  relaunch   -> the next step launched on healthy nodes
  container  step launched -> agents running in the container
  imports    -> the agents' imports done; distributed: jax.distributed set up (agent.ready)
  restore    Orbax's restore; compile: the rest up to the first step (MaxText's set-up and compilation)
  total      crash -> first resumed step
batch host crash: the node running the batch script (and rkit's supervisor) is crashed at step >= 25, no spare;
  detection  crash -> Slurm takes the job off the node (squeue leaves RUNNING: NODE_FAIL, requeue)
  requeue wait  -> the batch script runs again (Slurm's requeue hold, cred_expire) on healthy nodes
  supervisor    batch script -> the new attempt's step launched (lock, lost attempt recorded, srun)
  container, maxtext  as above
usr1: `scancel --signal=USR1 --batch` at step >= 15 (what --signal=B:USR1@lead sends before the time limit).
  usr1->requeue  signal -> the job requeued itself (save requested, tasks stopped)
  requeue wait   requeued -> the batch script runs again (Slurm holds a requeued job for cred_expire: 30 s on
                 the test bed; releasing it sooner can kill it as "Job credential revoked")
task exit, cold / warm: rank 1 stops itself at step 15 (hang detection off) and is killed once it has stopped
(warm: once the standby step beside the attempt is ready, resilience.warm_standby=true): a task failure on the
same nodes.
  restart    failure noticed -> the resumed attempt's first step
  launch     failure noticed -> its agents started (a new step and containers, or the standby step's order)
  import     -> the agents' imports and jax.distributed set-up done (agent.ready)
  restore    -> first step (MaxText's restore and compilation)
Steps recomputed: steps trained before the fault that the resumed attempt trains again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchruns import REPO, events, first

RECIPE = REPO / "recipes" / "tiny-slurm.yaml"


def max_step(run: Path) -> int:
    steps = []
    for line in (run / "metrics" / "0.jsonl").read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass
    return max(steps, default=-1)


def submit(workdir: Path, name: str, image: str, steps: int = 40, extra: tuple[str, ...] = ()) -> Path:
    subprocess.run([sys.executable, "-m", "rkit.cli", "run", str(RECIPE), "-o", f"name={name}",
                    "-o", f"runs_dir={workdir}", "-o", f"image={image}", "-o", f"trainer.steps={steps}",
                    "-o", "checkpoint.period=10", *extra], check=True, capture_output=True)
    return workdir / name


def wait(predicate, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError


def finished(run: Path, job: str) -> bool:
    queue = subprocess.run(["squeue", "-h", "-j", job, "-o", "%r"], capture_output=True, text=True).stdout
    return not queue.strip() and any(e["event"] in ("run.finished", "run.gave_up") for e in events(run))


@contextlib.contextmanager
def crashed(run: Path, which: int) -> Iterator[dict[str, float]]:
    """Crash node `which` of attempt 1's step once rank 0 is past step 25; the node is restored on the way out.
    Yields the crash time and the last step trained before it."""
    wait(lambda: (run / "metrics" / "0.jsonl").exists() and max_step(run) >= 25)
    victim = json.loads((run / "attempts" / "1" / "attempt.json").read_text())["launch"]["nodes"][which]
    fault = {"last_before": max_step(run), "crashed": time.time()}
    subprocess.run([str(REPO / "ci" / "slurm-testbed.sh"), "crash", victim], check=True, capture_output=True)
    try:
        yield fault
    finally:
        subprocess.run([str(REPO / "ci" / "slurm-testbed.sh"), "restore", victim], capture_output=True)


def resumed(evs: list[dict], fault: dict[str, float]) -> dict[str, float]:
    """Attempt 2 from its step launch: container start, MaxText start + restore, the total, steps recomputed."""
    started = first(evs, "attempt.started", attempt=2)
    agent = min(e["t"] for e in evs if e["event"] == "agent.started" and e["attempt"] == 2)
    step = first(evs, "attempt.first_step", attempt=2)
    return {"container": agent - started["t"], "maxtext": step["t"] - agent, "total": step["t"] - fault["crashed"],
            "recomputed": max(0, fault["last_before"] - started["resume_from_step"])}


def final(run: Path) -> bool:
    return any(e["event"] in ("run.finished", "run.gave_up") for e in events(run))


def node_crash(workdir: Path, i: int, image: str, warm: bool = False) -> dict[str, float]:
    # warm: standby steps on every node, the spare's too; 600 steps, so that they are ready before the crash
    extra = ("-o", "resilience.warm_standby=true") if warm else ()
    run = submit(workdir, f"crash-{'warm-' if warm else ''}{i}", image, steps=600 if warm else 40, extra=extra)
    job = first(events(run), "job.submitted")["job_id"]
    if warm:
        wait(lambda: sum(e["event"] == "standby" and e["what"] == "ready" for e in events(run)) >= 3, timeout=600)
    with crashed(run, which=1) as fault:
        wait(lambda: final(run), timeout=900)  # at SlurmdTimeout=300 the job then waits for the dead node
    wait(lambda: finished(run, job), timeout=600)
    evs = events(run)
    assert first(evs, "run.finished"), "the run did not finish"
    failed = first(evs, "attempt.failed")
    ended = first(evs, "attempt.ended", attempt=1)
    started = first(evs, "attempt.started", attempt=2)
    agent = max(e["t"] for e in evs if e["event"] == "agent.started" and e["attempt"] == 2)
    ready = [e for e in evs if e["event"] == "agent.ready" and e["attempt"] == 2]
    step = first(evs, "attempt.first_step", attempt=2)
    restore = step.get("restore_seconds", 0.0)
    return {"detection": failed["t"] - fault["crashed"], "stop": ended["t"] - failed["t"],
            "relaunch": started["t"] - ended["t"], "container": agent - started["t"],
            "imports": max(e["import_seconds"] for e in ready),
            "distributed": max(e["distributed_seconds"] for e in ready),
            "restore": restore, "compile": step["t"] - max(e["t"] for e in ready) - restore,
            "total": step["t"] - fault["crashed"], "by rkit": float(failed.get("detected_by") == "rkit"),
            "recomputed": max(0, fault["last_before"] - started["resume_from_step"])}


def job_state(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def batch_host_crash(workdir: Path, i: int, image: str) -> dict[str, float]:
    run = submit(workdir, f"batch-{i}", image, extra=("-o", "slurm.spare_nodes=0"))
    job = first(events(run), "job.submitted")["job_id"]
    with crashed(run, which=0) as fault:  # the batch script and the supervisor run on the first node
        wait(lambda: job_state(job) != "RUNNING", timeout=120)
        detected = time.time()
        wait(lambda: finished(run, job), timeout=600)
    evs = events(run)
    restarted = first(evs, "job.started", restart_count=1)
    started = first(evs, "attempt.started", attempt=2)
    return {"detection": detected - fault["crashed"], "requeue wait": restarted["t"] - detected,
            "supervisor": started["t"] - restarted["t"], **resumed(evs, fault)}


def usr1(workdir: Path, i: int, image: str) -> dict[str, float]:
    # Enough steps after the signal for JAX's preemption sync point (as in tests/integration/test_slurm.py).
    run = submit(workdir, f"usr1-{i}", image, steps=200)
    job = first(events(run), "job.submitted")["job_id"]
    wait(lambda: (run / "metrics" / "0.jsonl").exists() and max_step(run) >= 15)
    signalled = time.time()
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    wait(lambda: finished(run, job))
    evs = events(run)
    requested = first(evs, "preempt.requested")
    requeued = first(evs, "job.requeued")
    restarted = first(evs, "job.started", restart_count=1)
    resumed = first(evs, "attempt.started", attempt=2)
    step = first(evs, "attempt.first_step", attempt=2)
    return {"usr1->requeue": requeued["t"] - signalled, "requeue wait": restarted["t"] - requeued["t"],
            "usr1->first step": step["t"] - signalled,
            "recomputed": max(0, requested["step"] - resumed["resume_from_step"])}


def task_exit(workdir: Path, i: int, image: str, warm: bool) -> dict[str, float]:
    import psutil

    name = f"{'warm' if warm else 'cold'}-{i}"
    # node_silence_seconds=60: JAX's heartbeat timeout above the time rank 1 stays stopped (tests/integration).
    run = submit(workdir, name, image, extra=("-o", f"resilience.warm_standby={str(warm).lower()}",
                                              "-o", "resilience.hang_timeout=null",
                                              "-o", "resilience.node_silence_seconds=60",
                                              "--inject", "hang:rank=1,step=15"))
    job = first(events(run), "job.submitted")["job_id"]
    mark = f"base_output_directory={run.resolve()}"

    def hung() -> psutil.Process | None:
        return next((p for p in psutil.process_iter(["cmdline", "status"]) if p.info["status"] ==
                     psutil.STATUS_STOPPED and mark in (p.info["cmdline"] or [])), None)

    if warm:
        wait(lambda: any(e["event"] == "standby" and e["what"] == "ready" for e in events(run)))
    wait(lambda: hung() is not None)
    hung().kill()
    wait(lambda: finished(run, job))
    evs = events(run)
    failed = first(evs, "attempt.failed")["t"]
    agents = [e for e in evs if e["event"] == "agent.started" and e["attempt"] == 2]
    ready = max(e["t"] for e in evs if e["event"] == "agent.ready" and e["attempt"] == 2)
    step = first(evs, "attempt.first_step", attempt=2)["t"]
    assert all(e["warm"] == warm for e in agents), agents
    return {"restart": step - failed, "launch": max(e["t"] for e in agents) - failed,
            "import": ready - max(e["t"] for e in agents), "restore": step - ready}


FAULTS = {"node-crash": node_crash, "node-crash-warm": lambda w, i, image: node_crash(w, i, image, True),
          "batch-host-crash": batch_host_crash, "usr1": usr1,
          "task-exit-cold": lambda w, i, image: task_exit(w, i, image, False),
          "task-exit-warm": lambda w, i, image: task_exit(w, i, image, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=sorted(FAULTS), action="append", help="measure only these (repeatable)")
    parser.add_argument("--timeouts", default=None, help="SLURMD,MESSAGE: the test bed's Slurm timeouts meanwhile")
    args = parser.parse_args()
    if args.timeouts:
        with slurm_timeouts(*args.timeouts.split(",")):
            measure_all(args)
    else:
        measure_all(args)


@contextlib.contextmanager
def slurm_timeouts(slurmd: str, message: str) -> Iterator[None]:
    testbed = str(REPO / "ci" / "slurm-testbed.sh")
    subprocess.run([testbed, "timeouts", slurmd, message], check=True)
    try:
        yield
    finally:
        subprocess.run([testbed, "timeouts", "20", "5"], check=True)


def measure_all(args: argparse.Namespace) -> None:
    image = str(Path(args.image).resolve())
    kinds = args.only or list(FAULTS)
    results: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory(prefix="rkit-slurm-bench-", dir="/tmp") as tmp:
        for i in range(args.repeats):
            for kind in kinds:
                measure = FAULTS[kind]
                row = measure(Path(tmp), i, image)
                results[kind].append(row)
                print(f"{kind} {i + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    for kind, rows in results.items():
        spans = {k: (statistics.median(r[k] for r in rows), min(r[k] for r in rows), max(r[k] for r in rows))
                 for k in rows[0]}
        print(f"{kind} median [range] of {len(rows)}: " + ", ".join(f"{k} {m:.1f} [{lo:.1f}-{hi:.1f}]"
                                                                    for k, (m, lo, hi) in spans.items()))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
