"""What an image adds to a run's start and to a restart, measured side by side in one session.

    python tests/benchmarks/image_start.py SIF [SIF...] [--repeats 3] [--steps 40] [--kill-step 30]

Each repeat runs the tiny recipe interleaved: without an image (the host's venv) and inside each SIF, each with
`--inject kill:rank=1,step=K` and warm standbys off, and reads the clock and the events:
  start         = `rkit run` launched -> first trained step (the image's digest, its probe, the stamp, the
                  container start and everything a run without an image does too)
  stamp         = `rkit run` launched -> attempt.started (recipe, image identity, manifests)
  restart       = failure noticed -> first step of the resumed attempt (the image check between attempts and
                  the container start are in it)
  launch        = failure noticed -> the new ranks' agent.started (process or container start)
and the first attempt's parts, the slowest rank's each (from its agent.started and agent.ready events):
  spawn         = attempt.started -> agent.started (container start, Python's start, the agent's own imports)
  imports       = MaxText's, JAX's and Orbax's imports (agent.ready's import_seconds)
  distributed   = jax.distributed's set-up (agent.ready's distributed_seconds)
  to step       = agent.ready -> first trained step (MaxText's config, restore or init, compilation)
Each line gives the median and, in brackets, the lowest and highest of the repeats.
The last lines are the medians' differences, each image minus none: `<image> start +<s>`, `restart +<s>`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchruns import TINY, events, first


def measure(workdir: Path, name: str, steps: int, kill_step: int, image: str) -> dict[str, float]:
    launched = time.time()
    subprocess.run([sys.executable, "-m", "rkit.cli", "run", str(TINY), "--quiet", "-o", f"name={name}",
                    "-o", f"trainer.steps={steps}", "-o", "checkpoint.period=10", "-o", f"image={image}",
                    "-o", "resilience.warm_standby=false", "--inject", f"kill:rank=1,step={kill_step}"],
                   cwd=workdir, check=True, capture_output=True)
    evs = events(workdir / "runs" / name)
    failed = first(evs, "attempt.failed", attempt=1)["t"]
    attempt_started = first(evs, "attempt.started", attempt=1)["t"]
    first_step = first(evs, "attempt.first_step", attempt=1)["t"]

    def agents(kind: str, attempt: int) -> list[dict]:
        return [e for e in evs if e["event"] == kind and e["attempt"] == attempt]

    ready = agents("agent.ready", 1)
    return {
        "start": first_step - launched,
        "stamp": attempt_started - launched,
        "restart": first(evs, "attempt.first_step", attempt=2)["t"] - failed,
        "launch": max(e["t"] for e in agents("agent.started", 2)) - failed,
        "spawn": max(e["t"] for e in agents("agent.started", 1)) - attempt_started,
        "imports": max(e["import_seconds"] for e in ready),
        "distributed": max(e["distributed_seconds"] for e in ready),
        "to step": first_step - max(e["t"] for e in ready),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("images", nargs="+")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-step", type=int, default=30)
    args = parser.parse_args()
    modes = {"none": "none", **{Path(image).name: str(Path(image).resolve()) for image in args.images}}
    rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="rkit-bench-") as tmp:
        for i in range(args.repeats):
            for mode, image in modes.items():
                row = measure(Path(tmp), f"bench-{mode}-{i}", args.steps, args.kill_step, image)
                rows[mode].append(row)
                print(f"{mode} repeat {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    medians = {mode: {k: statistics.median(x[k] for x in r) for k in r[0]} for mode, r in rows.items()}
    for mode, m in medians.items():
        print(f"{mode} median of {args.repeats}: " + ", ".join(
            f"{k} {v:.2f} s [{min(x[k] for x in rows[mode]):.2f}, {max(x[k] for x in rows[mode]):.2f}]"
            for k, v in m.items()))
    for mode in list(modes)[1:]:
        for key in ("stamp", "spawn", "imports", "distributed", "to step", "launch", "start", "restart"):
            print(f"{mode} {key} +{medians[mode][key] - medians['none'][key]:.2f} s "
                  f"(image / none {medians[mode][key] / medians['none'][key]:.2f})")


if __name__ == "__main__":
    main()
