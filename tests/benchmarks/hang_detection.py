"""Hang detection latency against the configured timeout (median of N).

    python tests/benchmarks/hang_detection.py [--repeats 3] [--timeout 10] [--steps 40] [--hang-step 20]

Each repeat runs the tiny recipe with `--inject hang:rank=1,step=S` (SIGSTOP of rank 1) and
`resilience.hang_timeout=T`, and reads its events:
  detection  = the hang fired -> the supervisor declared it (inject.fired -> attempt.hang)
  replaced   = the hang fired -> first step of the new attempt (inject.fired -> attempt.first_step of attempt 2)
The ratio detection / timeout says how late after the timeout the watchdog acts (its poll, MaxText's one-step
delay in writing a step's metrics).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchruns import events, first, run_tiny


def measure(workdir: Path, name: str, steps: int, hang_step: int, timeout: float) -> dict[str, float]:
    evs = events(run_tiny(workdir, name, "-o", f"trainer.steps={steps}", "-o", "checkpoint.period=10",
                          "-o", f"resilience.hang_timeout={timeout}", "--inject", f"hang:rank=1,step={hang_step}"))
    fired = first(evs, "inject.fired")["t"]
    return {"detection": first(evs, "attempt.hang")["t"] - fired,
            "replaced": first(evs, "attempt.first_step", attempt=2)["t"] - fired}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hang-step", type=int, default=20)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rkit-bench-") as tmp:
        for i in range(args.repeats):
            rows.append(measure(Path(tmp), f"hang-{i}", args.steps, args.hang_step, args.timeout))
            print(f"repeat {i + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in rows[-1].items()), flush=True)
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"median of {len(rows)}: " + ", ".join(f"{k} {v:.2f} s" for k, v in medians.items()))
    print(f"detection / timeout ({args.timeout:g} s) = {medians['detection'] / args.timeout:.3f}")


if __name__ == "__main__":
    main()
