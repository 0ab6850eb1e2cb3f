"""What the per-step batch fingerprint costs the training (docs/data.md), measured side by side in one session.

    python tests/benchmarks/data_fingerprint.py [--repeats 200] [--steps 30]

The tiny recipe on real data (recipes/tiny-grain.yaml on data made here) trains once: its steady-state step time
is the median of MaxText's step_time over its steps after the first 10 on every rank. The fingerprint (the work the
train loop's hook adds to each step: telemetry.metrics.batch_fingerprint of the process's host batch) is then
timed --repeats times on that recipe's batch (1 sequence of 64 tokens per process) and on a large model's (16
sequences of 4096 tokens per process: 8 devices x per_device_batch_size 2). Printed: the medians with their 10th
and 90th percentiles, and the ratio of the tiny batch's median to the step time (the target: under 1 %). The
fingerprint runs on the host copy of the batch: nothing is read back from a device.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchruns import REPO

sys.path.insert(0, str(REPO / "launch"))

import numpy as np  # noqa: E402

from rkit.contract.rundir import RunDir  # noqa: E402
from rkit.recipe import sampledata  # noqa: E402
from rkit.runtime.telemetry import metrics  # noqa: E402


def steady_step_time(run: RunDir, skip: int = 10) -> float:
    times = [line["step_time"] for rank in metrics.ranks(run) for line in metrics.lines(run, rank)
             if line["step"] >= skip and line.get("step_time")]
    return statistics.median(times)


def timed(batch: np.ndarray, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        began = time.perf_counter()
        metrics.batch_fingerprint(batch)
        out.append(time.perf_counter() - began)
    return sorted(out)


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rkit-fingerprint-") as tmp:
        work = Path(tmp)
        sampledata.make(work / "data")
        subprocess.run([sys.executable, "-m", "rkit.cli", "run", str(REPO / "recipes" / "tiny-grain.yaml"), "--quiet",
                        "-o", "name=fp", "-o", f"trainer.steps={args.steps}",
                        "-o", f"trainer.overrides.grain_train_files={work / 'data'}/train-*.array_record"],
                       cwd=work, check=True, capture_output=True)
        run = RunDir(work / "runs" / "fp")
        step = steady_step_time(run)
        fingerprinted = sum(1 for r in metrics.ranks(run) for line in metrics.lines(run, r)
                            if line.get("data_fingerprint"))
    rng = np.random.default_rng(0)
    print(f"tiny model on real data: steady step time {step * 1000:.1f} ms (median, steps >= 10, 2 ranks); "
          f"{fingerprinted} metrics lines carry a fingerprint")
    for label, shape in (("tiny recipe's batch (1 x 64 tokens)", (1, 64)), ("large batch (16 x 4096 tokens)",
                                                                         (16, 4096))):
        times = timed(rng.integers(0, 32768, size=shape, dtype=np.int32), args.repeats)
        median = statistics.median(times)
        print(f"{label}: median {median * 1e6:.1f} us [p10 {pct(times, 0.1) * 1e6:.1f}, p90 "
              f"{pct(times, 0.9) * 1e6:.1f}] over {args.repeats}; "
              f"{median / step * 100:.4f} % of the tiny model's step time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
