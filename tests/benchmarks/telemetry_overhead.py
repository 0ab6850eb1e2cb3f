"""What the node health sampler and the Prometheus exporter cost the training, side by side in one session.

    python tests/benchmarks/telemetry_overhead.py [--repeats 3] [--steps 150] [--interval 1]

Each repeat runs the tiny recipe twice, back to back, in alternating order: telemetry off
(observability.telemetry_interval_seconds=0, prometheus.enabled=false) and on (a sample every --interval
seconds, the exporter serving). The steady-state step time of a run is the median of MaxText's step_time over
its steps after the first 10 (compilation and warm-up) on every rank. Printed: each pair's ratio on / off, and
the median ratio (the target is <= 1.01). Hang detection and metrics lines run in both modes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchruns import REPO, run_tiny

sys.path.insert(0, str(REPO / "launch"))

from rkit.contract.rundir import RunDir  # noqa: E402
from rkit.runtime.telemetry import metrics  # noqa: E402

MODES = {
    "off": ["-o", "observability.telemetry_interval_seconds=0", "-o", "observability.prometheus.enabled=false"],
    "on": ["-o", "observability.prometheus.port=0"],
}


def steady_step_time(run: RunDir, skip: int = 10) -> float:
    times = [line["step_time"] for rank in metrics.ranks(run) for line in metrics.lines(run, rank)
             if line["step"] >= skip and line.get("step_time")]
    return statistics.median(times)


def measure(workdir: Path, name: str, steps: int, interval: float, mode: str) -> float:
    extra = ["-o", f"observability.telemetry_interval_seconds={interval}"] if mode == "on" else []
    run = RunDir(run_tiny(workdir, name, "-o", f"trainer.steps={steps}", "-o", f"checkpoint.period={steps}",
                          *MODES[mode], *extra))
    if mode == "on":
        samples = list((run.path / "telemetry").glob("*.jsonl"))
        assert samples and samples[0].stat().st_size > 0, "telemetry on, but no samples were written"
    return steady_step_time(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory(prefix="rkit-bench-") as tmp:
        for i in range(args.repeats):
            order = ["off", "on"] if i % 2 == 0 else ["on", "off"]
            row = {mode: measure(Path(tmp), f"tel-{mode}-{i}", args.steps, args.interval, mode) for mode in order}
            ratios.append(row["on"] / row["off"])
            print(f"repeat {i + 1}: step time off {row['off'] * 1000:.2f} ms, on {row['on'] * 1000:.2f} ms, "
                  f"ratio on/off {ratios[-1]:.4f}", flush=True)
    print(f"median ratio on/off over {len(ratios)} pairs: {statistics.median(ratios):.4f} "
          f"(sampler every {args.interval:g} s + exporter)")


if __name__ == "__main__":
    main()
