"""Restart latency against a cold start, measured side by side in one session (median of N).

    python tests/benchmarks/restart_latency.py [--repeats 3] [--steps 30] [--kill-step 25] [--image SIF]

Each repeat runs the tiny recipe with `--inject kill:rank=1,step=K` and reads its events:
  cold start    = attempt 1: process spawn -> first trained step (attempt.started -> attempt.first_step)
  submit->step  = `rkit run` stamped the run -> first trained step (run.submitted -> attempt.first_step)
  restart       = failure noticed -> first step of the resumed attempt (attempt.failed -> attempt.first_step)
  run wall      = run.submitted -> run.finished
The ratio restart / cold start says what the supervisor adds beyond starting MaxText again.
With --image, each repeat also runs the same recipe inside that SIF, interleaved with the host run, and
the ratios image / host are printed side by side.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchruns import events, first, run_tiny


def measure(workdir: Path, name: str, steps: int, kill_step: int, image: str = "none") -> dict[str, float]:
    evs = events(run_tiny(workdir, name, "-o", f"trainer.steps={steps}", "-o", "checkpoint.period=10",
                          "-o", f"image={image}", "--inject", f"kill:rank=1,step={kill_step}"))
    return {
        "cold start": first(evs, "attempt.first_step", attempt=1)["t"] - first(evs, "attempt.started", attempt=1)["t"],
        "submit->step": first(evs, "attempt.first_step", attempt=1)["t"] - first(evs, "run.submitted")["t"],
        "restart": first(evs, "attempt.first_step", attempt=2)["t"] - first(evs, "attempt.failed", attempt=1)["t"],
        "run wall": first(evs, "run.finished")["t"] - first(evs, "run.submitted")["t"],
    }


def summarize(label: str, rows: list[dict[str, float]]) -> dict[str, float]:
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"{label} median of {len(rows)}: " + ", ".join(f"{k} {v:.2f} s" for k, v in medians.items()))
    print(f"{label} restart / cold start = {medians['restart'] / medians['cold start']:.2f}")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=25)
    parser.add_argument("--image", help="also measure inside this SIF, interleaved with the host runs")
    args = parser.parse_args()
    modes = {"host": "none", **({"image": str(Path(args.image).resolve())} if args.image else {})}
    rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="rkit-bench-") as tmp:
        for i in range(args.repeats):
            for mode, image in modes.items():
                row = measure(Path(tmp), f"bench-{mode}-{i}", args.steps, args.kill_step, image)
                rows[mode].append(row)
                print(f"{mode} repeat {i + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in row.items()), flush=True)
    medians = {mode: summarize(mode, r) for mode, r in rows.items()}
    if "image" in medians:
        for key in medians["host"]:
            print(f"image / host {key} = {medians['image'][key] / medians['host'][key]:.2f}")


if __name__ == "__main__":
    main()
