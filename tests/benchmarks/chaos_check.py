"""The fault campaign's checker and report (tests/benchmarks/chaos.py, `make chaos`): what rkit promises, checked
on a campaign's run against the uninterrupted reference, and the figures per fault and per kind."""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from benchruns import events

if TYPE_CHECKING:
    from chaos import Fault

EXPECTED = {"kill": "task_signal", "exit": "task_exit", "hang": "hang", "preempt": "preempted",
            "lose_local": "task_signal", "kill_restore": "task_signal", "node_crash": "node_fail",
            "crash_in_recovery": "node_fail", "supervisor_kill": "lost", "disk_full": "disk_full",
            "corrupt": "corrupt_checkpoint"}
BY_HARNESS = ("node_crash", "crash_in_recovery", "supervisor_kill", "disk_full", "corrupt")  # the harness fires them
CRASHES = ("node_crash", "crash_in_recovery")


def in_queue(job: str) -> bool:
    return bool(subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip())


def final(evs: list[dict]) -> dict | None:
    """How the run ended, if it has: none when a job was submitted after it (a resume; seed 1 at 78573f6 read the
    full disk's end before the resume as the run's and brought a node back a second after crashing it)."""
    for e in reversed(evs):
        if e["event"] in ("run.finished", "run.gave_up"):
            return e
        if e["event"] == "job.submitted":
            return None
    return None


def status_json(run: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "rkit.cli", "status", "--json", str(run)], capture_output=True,
                          text=True, check=False)
    return json.loads(done.stdout)


# -- the checker ---------------------------------------------------------------------------------------------------

@dataclass
class Verdict:
    checks: dict[str, list[str]] = field(default_factory=dict)  # check -> its failures ([] passed)
    notes: list[str] = field(default_factory=list)  # what passed with a remark

    def add(self, check: str, failure: str | None = None) -> None:
        self.checks.setdefault(check, [])
        if failure:
            self.checks[check].append(failure)

    @property
    def clean(self) -> bool:
        return not any(self.checks.values())


def merged_rank0(run: Path) -> dict[int, dict]:
    from rkit.contract.rundir import RunDir
    from rkit.runtime.telemetry.metrics import merged

    return merged(RunDir(run), 0)


def check(run: Path, reference: Path, faults: list[Fault], jobs: list[str]) -> tuple[Verdict, list[dict]]:
    verdict, evs = Verdict(), events(run)
    status = status_json(run)
    end = final(evs)
    verdict.add("finished", None if status.get("state") == "finished" else
                f"state {status.get('state')!r}: {status.get('reason')}")
    ours, ref = merged_rank0(run), merged_rank0(reference)
    verdict.add("loss")
    # A step whose checkpoint committed as a rank was killed, restored and never trained again, has no line: MaxText
    # writes a step's line once the next one is dispatched (seed 2: step 30, killed with its save in flight).
    resumed = {e.get("resume_from_step") for e in evs if e["event"] == "attempt.started"} | {
        e.get("step") for e in evs if e["event"] == "checkpoint.restored"}  # (a newer step than planned, at times)
    unlogged = sorted(s for s in set(ref) - set(ours) if s in resumed)
    if unlogged:
        verdict.notes.append(f"loss: no line for step(s) {unlogged}, each restored from a checkpoint committed as a "
                             "rank was killed, and never trained again")
    if sorted(ours) != sorted(set(ref) - set(unlogged)):
        verdict.add("loss", f"steps {min(ours, default=None)}..{max(ours, default=None)} ({len(ours)}) against "
                            f"{min(ref)}..{max(ref)} ({len(ref)})")
    for step in sorted(set(ours) & set(ref)):
        a, b = ours[step], ref[step]
        if (a.get("loss"), a.get("data_fingerprint")) != (b.get("loss"), b.get("data_fingerprint")):
            verdict.add("loss", f"step {step}: loss {a.get('loss')} vs {b.get('loss')}, data "
                                f"{a.get('data_fingerprint')} vs {b.get('data_fingerprint')}")
            break
    attempts = {a["attempt"]: a for a in status.get("attempts", [])}
    failed = {e["attempt"]: e for e in evs if e["event"] == "attempt.failed"}
    from rkit.contract.rundir import RunDir
    from rkit.runtime.telemetry.metrics import lines

    rank0 = lines(RunDir(run), 0)
    rows = []
    verdict.add("diagnosed")
    for f in faults:
        if f.attempt is None:
            verdict.add("diagnosed", f"{f.describe()}: never fired")
            continue
        cause = attempts.get(f.attempt, {}).get("cause")
        row = {"fault": f, "cause": cause}
        if cause != EXPECTED[f.kind] and not (f.kind == "crash_in_recovery" and cause == "step_failed"):
            # (a node crashed while srun started its ranks is the step's failure to start on that node: named)
            verdict.add("diagnosed", f"{f.describe()}: attempt {f.attempt} ended as {cause!r}, not "
                                     f"{EXPECTED[f.kind]!r}")
        why = failed.get(f.attempt)
        if why and f.kind in CRASHES and f.node not in (why.get("lost_nodes") or [why.get("node")]):
            blamed = why.get("lost_nodes") or why.get("node")
            verdict.add("diagnosed", f"{f.describe()}: attempt {f.attempt} blamed {blamed}, not {f.node}")
        if why and f.kind in ("kill", "exit", "lose_local", "kill_restore") and why.get("rank") != f.rank:
            verdict.add("diagnosed", f"{f.describe()}: attempt {f.attempt} blamed rank {why.get('rank')}")
        if why and f.kind == "exit" and why.get("exit_code") != f.code:
            verdict.add("diagnosed", f"{f.describe()}: exit code {why.get('exit_code')} recorded")
        row.update(timings(f, evs, rank0))
        rows.append(row)
    reason = status.get("reason") or ""
    if "crash loop" in reason or "budget" in reason:
        verdict.add("diagnosed", f"the run's verdict: {reason}")
    verdict.add("processes")
    for job in jobs:
        if in_queue(job):
            verdict.add("processes", f"job {job} still in the queue")
    verdict.add("processes", leftover_processes(run))
    verdict.add("files")
    for problem in half_written(run):
        verdict.add("files", problem)
    verdict.add("goodput", goodput_problem(run, evs, end))
    return verdict, rows


def timings(f: Fault, evs: list[dict], rank0: list[dict]) -> dict:
    out: dict = {}
    failed = next((e for e in evs if (e["event"] in ("attempt.failed", "attempt.hang", "preempt.requested")
                                      or e["event"] == "attempt.ended" and e.get("cause") == "disk_full")
                   and e["attempt"] == f.attempt), None)
    nxt = next((e for e in evs if e["event"] == "attempt.first_step" and e["attempt"] > f.attempt), None)
    started = next((e for e in evs if e["event"] == "attempt.started" and e["attempt"] > f.attempt), None)
    if failed and f.at is not None:
        out["detection"] = failed["t"] - f.at
    if nxt and f.at is not None:
        out["recovery"] = nxt["t"] - f.at
    trained = [line["step"] for line in rank0 if line.get("attempt") == f.attempt]
    if started and started.get("resume_from_step") is not None and trained:
        out["recomputed"] = max(0, max(trained) - started["resume_from_step"])
    return out


def leftover_processes(run: Path) -> str | None:
    import psutil

    mark = str(run.resolve())
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(mark in part for part in proc.info["cmdline"] or []):
                left.append(f"{proc.info['pid']} {' '.join(proc.info['cmdline'])[:120]}")
    return f"processes left: {left}" if left else None


def half_written(run: Path) -> list[str]:
    problems = []
    for path in run.rglob("*"):
        if path.is_dir():
            continue
        name = path.name
        if ".tmp" in name or name.endswith((".partial", ".part")) or name.startswith(".rkit-tmp"):
            problems.append(f"temporary file left: {path.relative_to(run)}")
        elif name.endswith(".json"):
            try:
                json.loads(path.read_text())
            except (ValueError, UnicodeDecodeError, OSError) as exc:
                problems.append(f"{path.relative_to(run)} does not parse: {exc}")
    return problems


def goodput_problem(run: Path, evs: list[dict], end: dict | None) -> str | None:
    from rkit.contract.rundir import RunDir
    from rkit.readers.goodput import run_goodput

    good = run_goodput(RunDir(run)).as_dict()
    parts = sum(good["seconds"].values())
    elapsed = (end or evs[-1])["t"] - evs[0]["t"]
    if abs(parts - good["wall_seconds"]) > 0.5 or good["wall_seconds"] > elapsed + 1:
        return f"goodput's parts {parts:.1f} s, its wall {good['wall_seconds']:.1f} s, the run's {elapsed:.1f} s"
    return None


def report(seed: int, faults: list[Fault], rows: list[dict], verdict: Verdict, wall: float, ref_wall: float) -> None:
    diagnosed = sum(1 for r in rows if r["cause"] == EXPECTED[r["fault"].kind])
    print(f"seed {seed}: {len(faults)} faults injected, {len(rows)} fired, {diagnosed} diagnosed as what they were; "
          f"wall {wall:.0f} s against {ref_wall:.0f} s uninterrupted ({wall / ref_wall:.1f}x)")
    for r in rows:
        f = r["fault"]
        times = ", ".join(f"{k} {r[k]:.1f} s" for k in ("detection", "recovery") if k in r)
        print(f"  {f.describe()}: attempt {f.attempt} -> {r['cause']}; {times}; recomputed {r.get('recomputed', '?')}")
    by_kind: dict[str, list[dict]] = {}
    for r in rows:
        by_kind.setdefault(r["fault"].kind, []).append(r)
    for kind, group in sorted(by_kind.items()):
        parts = []
        for key in ("detection", "recovery", "recomputed"):
            values = [r[key] for r in group if key in r]
            if values:
                parts.append(f"{key} {statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]")
        print(f"  {kind} x{len(group)}: " + ", ".join(parts))
    for note in verdict.notes:
        print(f"  note {note}")
    for name, failures in verdict.checks.items():
        print(f"  check {name}: " + ("ok" if not failures else "FAILED: " + "; ".join(failures)))
