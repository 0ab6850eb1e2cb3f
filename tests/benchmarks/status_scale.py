"""How `rkit status --json` scales with a run's files (issue 12, item 6): a generated run directory with
N metric lines per rank and E events, then the wall time and peak RSS of the command, median of --repeats.

    python tests/benchmarks/status_scale.py --lines 1000000 --events 100000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def generate(path: Path, lines: int, events: int, ranks: int = 2) -> Path:
    path.mkdir(parents=True)
    steps = lines
    resolved = {"name": path.name, "launcher": "local", "trainer": {"kind": "maxtext", "steps": steps},
                "resources": {"nodes": 1, "processes_per_node": ranks}, "checkpoint": {"period": 1000}}
    (path / "resolved.json").write_text(json.dumps(resolved))
    (path / "manifest.json").write_text(json.dumps({"config_hash": "sha256:" + "ab" * 32}))
    (path / "attempts").mkdir()
    (path / "metrics").mkdir()
    t0 = 1_000_000.0
    attempts = max(1, events // 10)
    per_attempt = max(1, steps // attempts)
    with open(path / "events.jsonl", "w") as fh:
        fh.write(json.dumps({"t": t0, "event": "run.submitted", "total_steps": steps}) + "\n")
        written = 1
        for a in range(1, attempts + 1):
            start = (a - 1) * per_attempt
            t = t0 + start * 0.1
            for name, extra in (("attempt.started", {"resume_from_step": start or None, "nodes": ["vm"]}),
                                ("agent.started", {"rank": 0}), ("agent.started", {"rank": 1}),
                                ("attempt.first_step", {"rank": 0, "step": start, "seconds_since_start": 1.0}),
                                ("disk.low", {"node": "vm", "free_bytes": 1}),
                                ("node.straggler", {"node": "vm", "ratio": 1.6}),
                                ("inject.fired", {"rank": 1, "step": start}),
                                ("attempt.failed", {"rank": 1, "cls": "task_exit"}),
                                ("checkpoint.quarantined", {"step": start}),
                                ("attempt.ended", {"cause": "task_exit", "committed_step": start,
                                                   "decision": "restart", "detail": "x"})):
                if written >= events:
                    break
                fh.write(json.dumps({"t": t, "event": name, "attempt": a, **extra}) + "\n")
                written += 1
    for rank in range(ranks):
        with open(path / "metrics" / f"{rank}.jsonl", "w") as fh:
            for step in range(lines):
                attempt = min(attempts, step // per_attempt + 1)
                fh.write(json.dumps({"t": t0 + step * 0.1, "attempt": attempt, "rank": rank, "node": "vm",
                                     "step": step, "loss": 5.0 - step * 1e-6, "step_time": 0.1,
                                     "tokens_per_sec_per_device": 640.0, "host_rss_bytes": 1 << 30}) + "\n")
    return path


def measure(run: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one `rkit status --json RUN` in a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rkit.cli", "status", "--json", str(run)], check=True,
                   capture_output=True)
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, max(peak, before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        made = time.perf_counter()
        run = generate(Path(tmp) / "big", args.lines, args.events)
        print(f"generated {args.lines} metric lines x 2 ranks, {args.events} events in "
              f"{time.perf_counter() - made:.1f} s")
        samples = [measure(run) for _ in range(args.repeats)]
    walls = [w for w, _ in samples]
    print(f"rkit status --json: median {statistics.median(walls):.2f} s (min {min(walls):.2f}, max {max(walls):.2f}),"
          f" peak RSS {max(m for _, m in samples):.0f} MiB, {args.repeats} repeats")


if __name__ == "__main__":
    main()
