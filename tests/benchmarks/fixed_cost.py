"""rkit's fixed cost per run: `rkit run` of the tiny recipe against MaxText run directly with the same settings,
whole process against whole process, in interleaved pairs (issue 45, item 5).

    python tests/benchmarks/fixed_cost.py [--pairs 4] [--steps 300]

Both run one process (resources.processes_per_node=1, image none), the same number of steps and the same MaxText
arguments: MaxText's are the ones `rkit run --dry-run` shows for rank 0 (checkpointing, the compile cache, the
model), with the variables rkit sets for it, and a metrics file as rkit's agent gives it; the direct run is
`python -m maxtext.trainers.pre_train.train <MaxText's configs/base.yml> ARGS` in a fresh output directory. One
warm-up run of each fills the JAX compile cache first. Each pair runs in alternating order (rkit first, then
MaxText first). Printed: each pair's wall seconds and ratio, the median ratio with its range, and each side's
median steady step time (from the metrics lines), so that a ratio is read
against equal training.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchruns import TINY


def rank0_plan(workdir: Path, overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """MaxText's arguments and the variables rkit sets for rank 0, from `rkit run --dry-run`."""
    done = subprocess.run([sys.executable, "-m", "rkit.cli", "run", str(TINY), "--dry-run", *overrides],
                          cwd=workdir, check=True, capture_output=True, text=True)
    lines = done.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# rank 0:"))
    argv = shlex.split(lines[at + 1])
    args = argv[argv.index("rkit.runtime.agent") + 1:]
    env = {}
    for line in lines[at + 2:]:
        if not line.startswith("  "):
            break
        key, _, value = line.strip().partition("=")
        env[key] = shlex.split(value)[0] if value else ""
    return args, env


def maxtext_base() -> str:
    import maxtext

    return str(Path(maxtext.__file__).parent / "configs" / "base.yml")


def run_rkit(workdir: Path, name: str, overrides: list[str]) -> tuple[float, Path]:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rkit.cli", "run", str(TINY), "--quiet", "-o", f"name={name}", *overrides],
                   cwd=workdir, check=True, capture_output=True)
    return time.perf_counter() - start, workdir / "runs" / name / "metrics" / "0.jsonl"


def run_direct(workdir: Path, name: str, args: list[str], env: dict[str, str], run_dir: str) -> tuple[float, Path]:
    out = workdir / "direct" / name
    out.mkdir(parents=True)
    metrics = out / "metrics.jsonl"
    args = [a.replace(run_dir, str(out)) for a in args] + [f"metrics_file={metrics}"]
    environment = {**os.environ, **{k: v for k, v in env.items() if not k.startswith("RKIT_")}}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "maxtext.trainers.pre_train.train", maxtext_base(), *args], cwd=out,
                   env=environment, check=True, capture_output=True)
    return time.perf_counter() - start, metrics


def steady_step(metrics: Path) -> float | None:
    """The median steady step time (past the first 10 steps) from a metrics file, rkit's or MaxText's."""
    times = []
    for line in metrics.read_text().splitlines():
        value = json.loads(line)
        t = value.get("step_time", value.get("perf/step_time_seconds"))
        if isinstance(t, (int, float)) and value.get("step", 0) >= 10:
            times.append(t)
    return statistics.median(times) if times else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        overrides = ["-o", "resources.processes_per_node=1", "-o", f"trainer.steps={args.steps}"]
        plan_args, env = rank0_plan(workdir, [*overrides, "-o", "name=planned"])
        run_dir = str((workdir / "runs" / "planned").resolve())
        run_rkit(workdir, "warm", overrides)
        run_direct(workdir, "warm", plan_args, env, run_dir)
        rows = []
        for pair in range(args.pairs):
            order = ("rkit", "direct") if pair % 2 == 0 else ("direct", "rkit")
            got = {}
            for side in order:
                got[side] = run_rkit(workdir, f"p{pair}", overrides) if side == "rkit" else \
                    run_direct(workdir, f"p{pair}", plan_args, env, run_dir)
            ratio = got["rkit"][0] / got["direct"][0]
            steps = {side: steady_step(got[side][1]) for side in got}
            rows.append((got["rkit"][0], got["direct"][0], ratio, steps["rkit"], steps["direct"]))
            print(f"pair {pair + 1} ({order[0]} first): rkit {got['rkit'][0]:.2f} s, MaxText directly "
                  f"{got['direct'][0]:.2f} s, ratio {ratio:.3f}; steady step {steps['rkit']:.4f} s against "
                  f"{steps['direct']:.4f} s", flush=True)
    ratios = [r[2] for r in rows]
    print(f"whole-process wall, rkit / MaxText directly: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {len(rows)} pairs; medians rkit "
          f"{statistics.median(r[0] for r in rows):.2f} s, MaxText {statistics.median(r[1] for r in rows):.2f} s, "
          f"difference {statistics.median(r[0] - r[1] for r in rows):.2f} s; steady step "
          f"{statistics.median(r[3] for r in rows):.4f} s against {statistics.median(r[4] for r in rows):.4f} s")


if __name__ == "__main__":
    main()
