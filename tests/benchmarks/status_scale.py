"""How `rkit status --json` scales with a run's files (issue 12, item 6): a generated run directory with
N metric lines per rank and E events, then the wall time, CPU time and peak RSS of the command, median of
--repeats, in three cases: cold (no digest in the reader's cache: the first `rkit status` of a run on this
account), warm (nothing new since the last call) and after 1,000 more steps and 100 more events were appended
(a live run between two calls). Each case in its own child process; the cache is a temporary folder. Then two
cases of a real run's first look: `rkit status --watch`'s first frame (drawn from the files' tails, before the
history is read), and a cold `rkit status --json` of a run whose supervisor kept its digest in <run>/digest/ (as
rkit's supervisor does at each attempt's end; 1,000 steps appended since).

    python tests/benchmarks/status_scale.py --lines 1000000 --events 100000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
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


def measure(run: Path, cache: Path, child: str | None = None) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and peak RSS (MiB) of one `rkit status --json RUN` (or `child`) in a child
    process."""
    import os

    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", child or CHILD, str(run)], check=True, capture_output=True, text=True,
                          env={**os.environ, "RKIT_STATUS_CACHE": str(cache)})
    wall = time.perf_counter() - start
    cpu, peak = json.loads(done.stdout.strip().splitlines()[-1])
    return wall, cpu, peak / 1024


# The command in a child that reports its own CPU time and peak RSS (a getrusage of the children would keep the
# largest child's peak: the cold call's).
CHILD = """
import json, resource, sys, io, contextlib
from rkit.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["status", "--json", sys.argv[1]], standalone_mode=False)
u = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps([u.ru_utime + u.ru_stime, u.ru_maxrss]))
"""


# `rkit status --watch`'s first frame in a child: the imports of the command and the frame drawn from the tails.
FIRST_FRAME = """
import io, json, resource, sys, time
from rich.console import Console
from rkit.contract.rundir import RunDir
from rkit.readers.watch import glance, render_watch
Console(file=io.StringIO(), width=120).print(render_watch(glance(RunDir(sys.argv[1])), time.time()))
u = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps([u.ru_utime + u.ru_stime, u.ru_maxrss]))
"""


def append(run: Path, steps: int, events: int) -> None:
    """A live run between two calls: `steps` more steps on every rank, `events` more events. Reads only the files'
    last lines: Linux keeps a process's peak RSS across exec, so a large read here would show as every later
    child's peak."""
    from rkit.contract.rundir import last_jsonl

    last = last_jsonl(run / "events.jsonl")
    with open(run / "events.jsonl", "a") as fh:
        for i in range(events):
            fh.write(json.dumps({"t": last["t"] + i, "event": "agent.started", "attempt": last.get("attempt"),
                                 "rank": i % 2}) + "\n")
    for rank_file in sorted((run / "metrics").glob("*.jsonl")):
        tail = last_jsonl(rank_file)
        with open(rank_file, "a") as fh:
            for i in range(1, steps + 1):
                fh.write(json.dumps({**tail, "step": tail["step"] + i, "t": tail["t"] + i * 0.1}) + "\n")


def summary(samples: list[tuple[float, float, float]]) -> str:
    walls = [w for w, _, _ in samples]
    return (f"median {statistics.median(walls):.2f} s (min {min(walls):.2f}, max {max(walls):.2f}), CPU "
            f"{statistics.median(c for _, c, _ in samples):.2f} s, peak RSS {max(m for _, _, m in samples):.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cases: dict[str, list[tuple[float, float, float]]] = {"cold": [], "warm": [], "appended": []}
    with tempfile.TemporaryDirectory() as tmp:
        made = time.perf_counter()
        run = generate(Path(tmp) / "big", args.lines, args.events)
        print(f"generated {args.lines} metric lines x 2 ranks, {args.events} events in "
              f"{time.perf_counter() - made:.1f} s")
        for i in range(args.repeats):
            cache = Path(tmp) / f"cache{i}"
            for case in ("cold", "warm", "appended"):
                if case == "appended":
                    append(run, 1000, 100)
                cases[case].append(measure(run, cache))
                wall, cpu, peak = cases[case][-1]
                print(f"  repeat {i + 1} {case}: {wall:.2f} s, CPU {cpu:.2f} s, peak RSS {peak:.0f} MiB", flush=True)
        for i in range(args.repeats):
            cases.setdefault("watch, first frame", []).append(measure(run, Path(tmp) / f"frame{i}", FIRST_FRAME))
            print(f"  repeat {i + 1} watch, first frame: {cases['watch, first frame'][-1][0]:.2f} s", flush=True)
        from rkit.contract.rundir import RunDir
        from rkit.readers.digest import keep_in_run
        from rkit.readers.status import StatusFold

        keep_in_run(RunDir(run), StatusFold)  # as the supervisor leaves it at an attempt's end
        append(run, 1000, 100)
        for i in range(args.repeats):
            case = "cold, the supervisor's digest in the run"
            cases.setdefault(case, []).append(measure(run, Path(tmp) / f"kept{i}"))
            print(f"  repeat {i + 1} {case}: {cases[case][-1][0]:.2f} s", flush=True)
    for case, samples in cases.items():
        label = case if case.startswith("watch") else f"rkit status --json, {case}"
        print(f"{label}: {summary(samples)}, {args.repeats} repeats")


if __name__ == "__main__":
    main()
