"""`rkit status`: what a run directory says about where the run is and why, read from its files alone."""

from __future__ import annotations

import statistics
import time
from typing import Any

from .rundir import RunDir
from .supervisor import RunState
from .telemetry import metrics
from .trainers import maxtext

TERMINAL_EVENTS = {"run.finished": RunState.FINISHED, "run.gave_up": RunState.GAVE_UP,
                   "run.interrupted": RunState.INTERRUPTED}


def run_state(run: RunDir, events: list[dict]) -> tuple[RunState, str]:
    if run.is_locked():
        return RunState.RUNNING, "a supervisor is running this run"
    for e in reversed(events):
        kind = e.get("event")
        if kind in TERMINAL_EVENTS:
            return TERMINAL_EVENTS[kind], e.get("reason", "")
        if kind in ("run.submitted", "run.resumed"):
            break
    if not events:
        return RunState.PENDING, "nothing has happened yet"
    return RunState.STOPPED, ("the supervisor ended without a final word (killed or machine lost); "
                              "resume with `rkit run RECIPE --resume`")


def attempts(events: list[dict]) -> list[dict[str, Any]]:
    table: dict[int, dict[str, Any]] = {}
    for e in events:
        n = e.get("attempt")
        if n is None:
            continue
        row = table.setdefault(n, {"attempt": n})
        kind = e.get("event")
        if kind == "attempt.started":
            row.update(started=e["t"], resume_from_step=e.get("resume_from_step"), nodes=e.get("nodes"))
        elif kind == "attempt.first_step":
            row["first_step_seconds"] = e.get("seconds_since_start")
        elif kind == "attempt.ended":
            row.update(ended=e["t"], cause=e.get("cause"), detail=e.get("detail"), decision=e.get("decision"),
                       committed_step=e.get("committed_step"))
    return [table[n] for n in sorted(table)]


def status(run: RunDir) -> dict[str, Any]:
    run.require()
    resolved = run.load_resolved()
    stamp = run.load_manifest()
    events = run.events()
    state, reason = run_state(run, events)
    total = int(resolved["trainer"]["steps"])
    processes = resolved["resources"]["nodes"] * resolved["resources"]["processes_per_node"]
    view = metrics.merged(run, rank=0)
    steps = list(view.values())
    recent = [s for s in steps[-20:] if s["step_time"]]
    step_time = statistics.median(s["step_time"] for s in recent) if recent else None
    tps = [s["tokens_per_sec_per_device"] for s in steps[-20:] if s["tokens_per_sec_per_device"]]
    started = next((e["t"] for e in events if e.get("event") == "run.submitted"), None)
    ended = events[-1]["t"] if events and state is not RunState.RUNNING else time.time()
    current = steps[-1]["step"] if steps else None
    committed = maxtext.latest_committed_step(run)
    done_steps = (current + 1) if current is not None else 0
    eta = (total - done_steps) * step_time if state is RunState.RUNNING and step_time else None
    final_loss = steps[-1]["loss"] if steps else None
    return {
        "name": run.name,
        "path": str(run.path),
        "state": state.value,
        "reason": reason,
        "config_hash": stamp.get("config_hash"),
        "step": current,
        "total_steps": total,
        "last_committed_step": committed,
        "final_step_committed": committed is not None and committed >= maxtext.final_step(resolved),
        "loss": final_loss,
        "tokens_per_sec": statistics.median(tps) * processes if tps else None,
        "step_time_seconds": step_time,
        "elapsed_seconds": round(ended - started, 1) if started else None,
        "eta_seconds": round(eta, 1) if eta is not None else None,
        "recomputed_steps": sum(1 for s in steps if s["recomputed"]),
        "attempts": attempts(events),
        "injections": [e.get("spec") for e in events if e.get("event") == "inject.fired"],
    }


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def render_status(s: dict[str, Any]) -> str:
    state = s["state"]
    lines = [f"run        {s['name']}  ({s['path']})",
             f"state      {state}" + (f": {s['reason']}" if s["reason"] and state != "running" else "")]
    step = "-" if s["step"] is None else s["step"] + 1
    lines.append(f"progress   step {step}/{s['total_steps']}, last committed step "
                 f"{_num(s['last_committed_step'], '{}')}, loss {_num(s['loss'], '{:.4f}')}")
    lines.append(f"speed      {_num(s['tokens_per_sec'], '{:.0f}')} tokens/s, step time "
                 f"{_num(s['step_time_seconds'], '{:.3f}')} s (median of recent steps)")
    lines.append(f"time       elapsed {_num(s['elapsed_seconds'])} s" +
                 (f", ETA {_num(s['eta_seconds'])} s" if s["eta_seconds"] is not None else ""))
    lines.append(f"config     {s['config_hash']}")
    if s["injections"]:
        lines.append(f"injected   {', '.join(s['injections'])}")
    lines.append(f"attempts   {len(s['attempts'])}" +
                 (f" ({s['recomputed_steps']} step(s) recomputed after restarts)" if s["recomputed_steps"] else ""))
    for a in s["attempts"]:
        resume = a.get("resume_from_step")
        start = "from scratch" if resume is None else f"resumed from step {resume}"
        end = a.get("cause", "running")
        detail = f" ({a['detail']})" if a.get("detail") else ""
        lines.append(f"  #{a['attempt']}  {start}: {end}{detail}")
    return "\n".join(lines)
