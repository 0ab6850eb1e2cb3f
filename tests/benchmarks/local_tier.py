"""Steps recomputed after a crash, with and without the node-local tier, and restore times of the two tiers,
measured side by side in one session.

    python tests/benchmarks/local_tier.py [--steps 100] [--period 20] [--local-period 4] [--crashes 6] [--seed 0]

Two runs of the tiny recipe (2 processes, each one data-parallel replica) with the same crashes: rank 1 is
SIGKILLed at --crashes steps drawn at random (seeded) past the first period. One run saves every --period steps
to the run directory only; the other also every --local-period steps to node-local storage
(checkpoint.local_dir). For each crash: the steps trained again, the crash's step minus the step restored
(checkpoint.restored's, else attempt.started's resume_from_step). The tier run ends with one more crash that
loses rank 1's local data (lose_local), so that the same run restores once from the run directory: the ratio of
the restore times (Orbax's restore, read and broadcast, rank 0) is local over persistent in one run. The issue's
targets: median recomputed <= half the local period (today: about half the period); the local restore faster.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

from benchruns import events, run_tiny

MESH = ["-o", "trainer.overrides.ici_data_parallelism=-1", "-o", "trainer.overrides.ici_fsdp_parallelism=1",
        "-o", "resilience.max_restarts=50", "-o", "resilience.crash_loop_limit=50"]


def crashes(run: Path) -> list[dict]:
    """Per crash: the step it fired at, the step the next attempt restored, the tier and the restore's seconds."""
    evs = events(run)
    fired = {e["attempt"]: e for e in evs if e["event"] == "inject.fired"}
    restored = {e["attempt"]: e for e in evs if e["event"] == "checkpoint.restored"}
    started = {e["attempt"]: e for e in evs if e["event"] == "attempt.started"}
    out = []
    for attempt, e in sorted(fired.items()):
        nxt = restored.get(attempt + 1)
        step = nxt["step"] if nxt else started[attempt + 1]["resume_from_step"]
        out.append({"kind": e["kind"], "at": e["step"], "restored": step, "recomputed": e["step"] - step,
                    "tier": nxt["tier"] if nxt else "persistent", "seconds": nxt["seconds"] if nxt else None})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--period", type=int, default=20)
    parser.add_argument("--local-period", type=int, default=4)
    parser.add_argument("--crashes", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    steps = sorted(random.Random(args.seed).sample(range(args.period + 1, args.steps - 2), args.crashes))
    kills = [a for s in steps for a in ("--inject", f"kill:rank=1,step={s}")]
    common = ["-o", f"trainer.steps={args.steps}", "-o", f"checkpoint.period={args.period}", *MESH]
    print(f"crashes at steps {steps}; period {args.period}, local period {args.local_period}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rkit-localtier-") as tmp:
        workdir = Path(tmp)
        plain = crashes(run_tiny(workdir, "persistent-only", *common, *kills))
        lose = ["--inject", f"lose_local:rank=1,step={args.steps - 2}"]
        tier = crashes(run_tiny(workdir, "local-tier", *common, "-o", f"checkpoint.local_dir={workdir}/node-local",
                                "-o", f"checkpoint.local_period={args.local_period}", *kills, *lose))
    for name, rows, half in (("persistent only", plain, args.period / 2), ("with the local tier", tier,
                                                                           args.local_period / 2)):
        recomputed = [r["recomputed"] for r in rows if r["kind"] == "kill"]
        print(f"{name}: steps recomputed per crash {recomputed}, median {statistics.median(recomputed)} "
              f"(half its period: {half})", flush=True)
    local = [r["seconds"] for r in tier if r["kind"] == "kill" and r["tier"] == "local"]
    persistent = [r["seconds"] for r in tier if r["kind"] == "lose_local" and r["tier"] == "persistent"]
    if local and persistent:
        print(f"restore (same run): local tier median {statistics.median(local):.3f} s of {len(local)}, run "
              f"directory {persistent[0]:.3f} s; ratio local/persistent "
              f"{statistics.median(local) / persistent[0]:.2f}", flush=True)
    print(f"local-tier run: {[(r['at'], r['restored'], r['tier']) for r in tier]}", flush=True)


if __name__ == "__main__":
    main()
