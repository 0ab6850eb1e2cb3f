"""The save overhead of checkpoint.period: auto against a fixed period, measured side by side in one session.

    python tests/benchmarks/checkpoint_cadence.py [--steps 9000] [--fixed 10] [--repeats 1]

First a short run with period auto measures the save stall and the step time (its only attempt saves every 100
steps: nothing was measured before it). Then, per repeat, two runs of --steps steps alike in cost (same model,
mesh and image; runs of another length or period count: run/cadence.py's cost_key), interleaved: period auto,
which chooses Young/Daly's period from those measurements and the runs directory's failure rate (none here: the
prior of one failure in 24 h), and the fixed period. For each: the chosen period, the number of saves, and
goodput's checkpoint part (the time saves stalled training) as a share of the time in training (productive +
checkpoint). The issue's target: at most 3.5 % with period auto.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchruns import REPO, events, run_tiny

from rkit.contract.rundir import RunDir
from rkit.runtime.trainers.maxtext import committed_steps


def goodput(run: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "rkit.cli", "status", "--json", str(run)], cwd=REPO, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout)["goodput"]["seconds"]


def measure(workdir: Path, name: str, steps: int, period: str) -> dict:
    run = run_tiny(workdir, name, "-o", f"trainer.steps={steps}", "-o", f"checkpoint.period={period}")
    evs = events(run)
    chosen = [e for e in evs if e["event"] == "checkpoint.period"]
    seconds = goodput(run)
    saves = len(committed_steps(RunDir(run)))  # checkpoint.keep is null in the tiny recipe: every save is kept
    share = seconds["checkpoint"] / (seconds["productive"] + seconds["checkpoint"])
    return {"period": chosen[-1]["period"] if chosen else int(period), "why": chosen[-1]["reason"] if chosen else "",
            "checkpoint": seconds["checkpoint"], "productive": seconds["productive"], "share": share, "saves": saves}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=9000)
    parser.add_argument("--fixed", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rkit-cadence-") as tmp:
        workdir = Path(tmp)
        first = measure(workdir, "measure", 300, "auto")
        print(f"measuring run: period {first['period']} ({first['why']})", flush=True)
        shares: dict[str, list[float]] = {"auto": [], "fixed": []}
        for i in range(args.repeats):
            for mode, period in (("auto", "auto"), ("fixed", str(args.fixed))):
                row = measure(workdir, f"{mode}-{i}", args.steps, period)
                shares[mode].append(row["share"])
                print(f"repeat {i + 1} {mode}: period {row['period']}, checkpoint {row['checkpoint']:.2f} s, "
                      f"training {row['productive']:.2f} s, {row['saves']} saves, "
                      f"save overhead {100 * row['share']:.2f} %"
                      + (f" ({row['why']})" if row["why"] else ""), flush=True)
        auto, fixed = statistics.median(shares["auto"]), statistics.median(shares["fixed"])
        print(f"median save overhead over {args.repeats} repeat(s): auto {100 * auto:.2f} %, fixed period "
              f"{args.fixed} {100 * fixed:.2f} %, ratio fixed/auto {fixed / auto if auto else float('inf'):.1f}")


if __name__ == "__main__":
    main()
