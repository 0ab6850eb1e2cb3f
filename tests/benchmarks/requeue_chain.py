"""A run chained through many time limits at default budgets (issue 39): real Slurm, real Apptainer, real MaxText.

    eval "$(ci/slurm-testbed.sh env)"
    python tests/benchmarks/requeue_chain.py --image SIF [--minutes 2] [--lead 10] [--requeues 12] [--steps N]

Without --steps, a 300-step calibration run measures the step time and start-up, and the chain gets steps for
--requeues + 1 jobs. Then an uninterrupted run of those steps (slurm.time an hour); then the same recipe with
`slurm.time` of --minutes
and `slurm.signal_lead_seconds` --lead, so that Slurm signals (USR1) every job before its time limit, rkit saves and
requeues, and the next job resumes; `resilience` at its defaults (max_infra_restarts 10). It prints the requeues,
the planned ends and the budgets spent (from the last attempt.ended's tally), whether the run finished, whether
its loss (outcome.json's checksum over every step) equals the uninterrupted run's, the steps recomputed, the wall
times and the chain's overhead per requeue. It fails unless the chain had at least --requeues requeues (raise
--steps) and finished with the same loss. Each job trains for about minutes x 60 - lead - its start-up (imports,
restore, compilation: ~30 s on the test bed) seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchruns import REPO, events, first

RECIPE = REPO / "recipes" / "tiny-slurm.yaml"


def submit(workdir: Path, name: str, image: str, steps: int, *extra: str) -> tuple[Path, str]:
    subprocess.run([sys.executable, "-m", "rkit.cli", "run", str(RECIPE), "-o", f"name={name}",
                    "-o", f"runs_dir={workdir}", "-o", f"image={image}", "-o", f"trainer.steps={steps}",
                    "-o", "checkpoint.period=100", *extra], check=True, capture_output=True)
    run = workdir / name
    return run, first(events(run), "job.submitted")["job_id"]


def wait_done(run: Path, job: str, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queue = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout
        if not queue.strip() and any(e["event"] in ("run.finished", "run.gave_up") for e in events(run)):
            return time.time()
        time.sleep(2)
    raise TimeoutError(f"{run}: not done in {timeout:.0f} s")


def loss_sha(run: Path) -> str | None:
    try:
        return json.loads((run / "outcome.json").read_text())["loss"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def steps_trained_again(run: Path) -> int:
    """Steps rank 0 trained in more than one attempt (its metrics lines: one per step and attempt)."""
    seen: dict[int, set[int]] = {}
    with open(run / "metrics" / "0.jsonl", encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            seen.setdefault(row.get("step"), set()).add(row.get("attempt"))
    return sum(1 for attempts in seen.values() if len(attempts) > 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", required=True)
    parser.add_argument("--steps", type=int, default=None, help="default: calibrated for --requeues + 1 jobs")
    parser.add_argument("--minutes", type=int, default=2, help="slurm.time of each job of the chain")
    parser.add_argument("--lead", type=int, default=10, help="slurm.signal_lead_seconds")
    parser.add_argument("--requeues", type=int, default=12, help="fewest requeues the chain must have")
    parser.add_argument("--keep", type=Path, help="make the runs here and keep them (else a temporary folder)")
    args = parser.parse_args()
    image = str(Path(args.image).resolve())
    with contextlib.nullcontext(str(args.keep)) if args.keep else \
            tempfile.TemporaryDirectory(prefix="rkit-chain-", dir="/tmp") as tmp:
        if args.steps is None:
            probe, job = submit(Path(tmp), "calibrate", image, 300, "-o", "slurm.time=00:30:00")
            wait_done(probe, job, 1800)
            evs = events(probe)
            first_step = first(evs, "attempt.first_step")
            began_training = first_step["t"]
            startup = first_step["seconds_since_start"]
            last = max(e["t"] for e in evs if e["event"] == "attempt.ended")
            per_step = max(1e-3, (last - began_training) / 300)
            per_job = args.minutes * 60 - args.lead - startup
            args.steps = int((args.requeues + 1.5) * per_job / per_step)
            print(f"calibration: {per_step:.4f} s a step (with its saves), start-up {startup:.0f} s; each job "
                  f"trains ~{per_job:.0f} s: {args.steps} steps", flush=True)
        began = time.time()
        clean, job = submit(Path(tmp), "clean", image, args.steps, "-o", "slurm.time=01:00:00")
        clean_wall = wait_done(clean, job, 3600) - began
        began = time.time()
        chain, job = submit(Path(tmp), "chain", image, args.steps, "-o", f"slurm.time=00:{args.minutes:02d}:00",
                            "-o", f"slurm.signal_lead_seconds={args.lead}")
        chain_wall = wait_done(chain, job, 6 * 3600) - began
        evs = events(chain)
        if loss_sha(chain) != loss_sha(clean):  # where they part: rkit compare's words
            print(subprocess.run([sys.executable, "-m", "rkit.cli", "compare", str(clean), str(chain),
                                  "--threshold", "10"], capture_output=True, text=True).stdout[-3000:])
    ended = [e for e in evs if e["event"] == "attempt.ended"]
    tally = ended[-1].get("tally", {}) if ended else {}
    requeues = sum(e["event"] == "job.requeued" for e in evs)
    planned = sum(bool(e.get("planned")) for e in ended)
    starts = [e for e in evs if e["event"] == "attempt.started"]
    recomputed = steps_trained_again(chain)
    finished = any(e["event"] == "run.finished" for e in evs)
    same = loss_sha(chain) is not None and loss_sha(chain) == loss_sha(clean)
    print(f"chain: {len(starts)} attempts, {requeues} requeues, {planned} planned ends; budgets spent: "
          f"infrastructure {tally.get('infra_failures')}, training {tally.get('training_failures')}, planned "
          f"{tally.get('planned_ends')}; {'finished' if finished else 'NOT finished'}; loss "
          f"{'the same as' if same else 'DIFFERENT from'} the uninterrupted run's; {recomputed} step(s) recomputed")
    print(f"wall: uninterrupted {clean_wall:.0f} s, chain {chain_wall:.0f} s, "
          f"{(chain_wall - clean_wall) / max(1, requeues):.1f} s more per requeue")
    if requeues < args.requeues or not (finished and same):
        sys.exit(f"requeue_chain: {requeues} requeues (wanted >= {args.requeues}), finished {finished}, same loss "
                 f"{same}" + ("; raise --steps" if requeues < args.requeues else ""))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
