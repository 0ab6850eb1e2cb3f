"""Restart latency against a cold start, warm standbys off and on, measured side by side in one session.

    python tests/benchmarks/restart_latency.py [--repeats 3] [--steps 300] [--kill-step 250] [--image SIF]
                                               [--processes 2]

Each repeat runs the tiny recipe (with --processes: that many ranks) with `--inject kill:rank=<last>,step=K`,
once with resilience.warm_standby=false and once with true (interleaved), and reads its events:
  cold start    = attempt 1: process spawn -> first trained step (attempt.started -> attempt.first_step)
  submit->step  = `rkit run` stamped the run -> first trained step (run.submitted -> attempt.first_step)
  restart       = failure noticed -> first step of the resumed attempt (attempt.failed -> attempt.first_step)
and the restart's parts: launch (failure -> the new ranks' agent.started: process or container start, or a
standby taking the rank), import + distributed (-> agent.ready: MaxText's imports and jax.distributed's set-up),
restore + compile (-> attempt.first_step). The kill comes late enough (step K) for the standbys, started after
the first step, to be ready. The resident memory of one ready standby is read from /proc while the run goes on.
The last line is `restart/cold <ratio>` with standby on (median restart / median cold start).
With --image, both modes run inside that SIF.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
from pathlib import Path

from benchruns import events, first, run_tiny


def rss_of_ready_standby(run: Path, stop: threading.Event, found: list[int]) -> None:
    while not stop.wait(0.2):
        for e in events(run):
            if e["event"] == "standby" and e["what"] == "ready":
                try:
                    status = Path(f"/proc/{e['pid']}/status").read_text()
                except OSError:
                    continue
                found.append(int(next(line.split()[1] for line in status.splitlines()
                                      if line.startswith("VmRSS:"))) * 1024)
                return


def measure(workdir: Path, name: str, steps: int, kill_step: int, image: str, standby: bool,
            rss: list[int], processes: int) -> dict[str, float]:
    stop = threading.Event()
    watcher = threading.Thread(target=rss_of_ready_standby, args=(workdir / "runs" / name, stop, rss), daemon=True)
    watcher.start()
    try:
        run = run_tiny(workdir, name, "-o", f"trainer.steps={steps}", "-o", "checkpoint.period=10",
                       "-o", f"image={image}", "-o", f"resilience.warm_standby={str(standby).lower()}",
                       "-o", f"resources.processes_per_node={processes}",
                       "--inject", f"kill:rank={processes - 1},step={kill_step}")
    finally:
        stop.set()
        watcher.join()
    evs = events(run)
    failed = first(evs, "attempt.failed", attempt=1)["t"]
    started = max(e["t"] for e in evs if e["event"] == "agent.started" and e["attempt"] == 2)
    ready = max(e["t"] for e in evs if e["event"] == "agent.ready" and e["attempt"] == 2)
    step = first(evs, "attempt.first_step", attempt=2)["t"]
    warm = [e["warm"] for e in evs if e["event"] == "agent.started" and e["attempt"] == 2]
    return {
        "cold start": first(evs, "attempt.first_step", attempt=1)["t"] - first(evs, "attempt.started", attempt=1)["t"],
        "submit->step": first(evs, "attempt.first_step", attempt=1)["t"] - first(evs, "run.submitted")["t"],
        "restart": step - failed,
        "launch": started - failed,
        "import+distributed": ready - started,
        "restore+compile": step - ready,
        "warm ranks": float(sum(warm)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-step", type=int, default=250)
    parser.add_argument("--image", default="none", help="run both modes inside this SIF")
    parser.add_argument("--processes", type=int, default=2, help="ranks (the tiny recipe has 2)")
    args = parser.parse_args()
    image = str(Path(args.image).resolve()) if args.image != "none" else "none"
    rows: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    rss: list[int] = []
    with tempfile.TemporaryDirectory(prefix="rkit-bench-") as tmp:
        for i in range(args.repeats):
            for mode in ("off", "on"):
                row = measure(Path(tmp), f"bench-{mode}-{i}", args.steps, args.kill_step, image, mode == "on", rss,
                              args.processes)
                rows[mode].append(row)
                print(f"standby {mode} repeat {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()),
                      flush=True)
    medians = {}
    for mode, r in rows.items():
        medians[mode] = {k: statistics.median(x[k] for x in r) for k in r[0]}
        print(f"standby {mode} median of {len(r)}: " + ", ".join(f"{k} {v:.2f} s" for k, v in medians[mode].items()
                                                                 if k != "warm ranks"))
        print(f"standby {mode}: restart / cold start = {medians[mode]['restart'] / medians[mode]['cold start']:.2f}")
    if rss:
        print(f"resident memory of one ready standby: median {statistics.median(rss) / 2**20:.0f} MiB "
              f"({len(rss)} samples)")
    print(f"restart on / restart off = {medians['on']['restart'] / medians['off']['restart']:.2f}")
    print(f"restart/cold {medians['on']['restart'] / medians['on']['cold start']:.2f}")


if __name__ == "__main__":
    main()
