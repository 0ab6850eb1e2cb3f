"""How far `rkit bench gate` can be trusted on this machine (issue 11): its false-alarm rate over identical
baseline/candidate pairs, which real slowdowns it detects, and its wall time. Real MaxText runs of
recipes/bench/tiny-cpu.yaml through the real CLI; the slowdowns are real config changes (wider MLP, one more
decoder layer), their size measured by the gate itself.

    python tests/benchmarks/gate_noise.py --pairs 10 --rounds 3 --repeats 2 --out /tmp/gate_noise.json

Each gate's figures are appended to --out as they come, so an interrupted benchmark keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "bench" / "tiny-cpu.yaml"
SLOWDOWNS = ("trainer.overrides.base_mlp_dim=256", "trainer.overrides.base_num_decoder_layers=3")


def gate(workdir: Path, candidate: list[str], rounds: int, threshold: float) -> dict:
    args = [sys.executable, "-m", "rkit.cli", "bench", "gate", str(RECIPE), "--rounds", str(rounds), "--json",
            "--threshold", str(threshold), *[a for o in candidate for a in ("--candidate", o)]]
    start = time.monotonic()
    done = subprocess.run(args, cwd=workdir, capture_output=True, text=True, check=False)
    wall = time.monotonic() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"gate failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout)
    step = next(m for m in result["performance"] if m["metric"] == "step_time")
    return {"candidate": candidate, "exit": done.returncode, "wall_seconds": wall, "ratio": step["ratio"],
            "interval": step["interval"], "verdict": step["verdict"], "worse": result["worse"]}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a rate k/n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10, help="identical gates (false alarms)")
    parser.add_argument("--repeats", type=int, default=2, help="gates per slowdown")
    parser.add_argument("--rounds", type=int, default=3, help="rkit bench gate --rounds (its default: 3)")
    parser.add_argument("--threshold", type=float, default=0.10, help="rkit bench gate --threshold (default 0.10)")
    parser.add_argument("--slowdowns", nargs="*", default=list(SLOWDOWNS), metavar="KEY=VALUE",
                        help="candidate overrides, one real slowdown each (default: a wider MLP, one more layer)")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "gate_noise.json")
    args = parser.parse_args()
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rkit-gate-") as tmp:
        plan = [[]] * args.pairs + [[s] for s in args.slowdowns for _ in range(args.repeats)]
        for i, candidate in enumerate(plan, 1):
            r = gate(Path(tmp), candidate, args.rounds, args.threshold)
            results.append(r)
            args.out.write_text(json.dumps(results, indent=1))
            print(f"{i}/{len(plan)} {' '.join(candidate) or 'identical'}: exit {r['exit']} ratio {r['ratio']:.3f} "
                  f"[{r['interval'][0]:.3f}, {r['interval'][1]:.3f}] {r['verdict']} ({r['wall_seconds']:.0f} s)",
                  flush=True)
    same = [r for r in results if not r["candidate"]]
    if same:  # --pairs 0: a slowdown ladder only
        alarms = sum(r["exit"] for r in same)
        lo, hi = wilson(alarms, len(same))
        print(f"\nfalse alarms: {alarms}/{len(same)} identical pairs (rate {alarms / len(same):.0%}, 95 % Wilson "
              f"interval [{lo:.0%}, {hi:.0%}]); rounds {args.rounds}, threshold {args.threshold:.0%}")
        print("identical pairs' step-time ratio: median {:.3f}, range [{:.3f}, {:.3f}]".format(
            statistics.median(r["ratio"] for r in same), min(r["ratio"] for r in same),
            max(r["ratio"] for r in same)))
    for s in args.slowdowns:
        rs = [r for r in results if r["candidate"] == [s]]
        print(f"{s}: measured step-time ratio median {statistics.median(r['ratio'] for r in rs):.3f}; "
              f"detected {sum(r['exit'] for r in rs)}/{len(rs)}")
    walls = [r["wall_seconds"] for r in results]
    print(f"gate wall time: median {statistics.median(walls):.0f} s, range [{min(walls):.0f}, {max(walls):.0f}] s "
          f"({2 * args.rounds} runs each)")


if __name__ == "__main__":
    main()
