"""`rkit status --watch`: `rkit status`, live. Its first frame comes from the tails of the run's files (`glance`):
a long run's whole history (a month of metrics lines, read into the status digest) takes seconds to read cold, and
the view should not stay blank meanwhile. What the tails say (the newest steps, the committed step, the last
event, whether a supervisor holds the run) is drawn at once; goodput, the attempts' table and the nodes follow in
the next frame, from the full read.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from rkit.contract.events import valid_event
from rkit.contract.rundir import RunDir
from rkit.contract.safeio import last_jsonl, tail_jsonl
from rkit.readers import status as run_status
from rkit.readers.display import render_watch
from rkit.run.policy import FINAL_EVENTS, RunState
from rkit.runtime.telemetry import metrics
from rkit.runtime.trainers import maxtext

TAIL_BYTES = 16384  # rank 0's newest lines: some 60 steps


def glance(run: RunDir) -> dict[str, Any]:
    """The fields of status.status that render_watch draws, from the files' tails (goodput None: not read yet)."""
    config = run.config()
    last = last_jsonl(run.events_file)
    last = last if last is not None and valid_event(last) else None  # a damaged last line is not shown
    kind = last.get("event") if last else None
    if run.is_locked():
        state, reason = RunState.RUNNING.value, "a supervisor is running this run"
    elif kind in FINAL_EVENTS:
        state, reason = FINAL_EVENTS[kind].value, str(last.get("reason", ""))
    else:
        state, reason = "reading", "reading the run's history"
    lines = [line for value in tail_jsonl(run.metrics_file(0), TAIL_BYTES)
             if (line := metrics.normalize(value)) is not None]
    recent = list(metrics.merge(lines).values())[-20:]  # the newest line of each step, by step
    times = [s["step_time"] for s in recent if s["step_time"]]
    tokens = [s["tokens_per_sec_per_device"] for s in recent if s["tokens_per_sec_per_device"]]
    step = recent[-1]["step"] if recent else None
    total = config.trainer.final_step + 1
    step_time = statistics.median(times) if times else None
    return {"name": run.name, "state": state, "reason": reason, "step": step, "total_steps": total,
            "eta_seconds": (total - step - 1) * step_time if step is not None and step_time and
            state == RunState.RUNNING.value else None,
            "tokens_per_sec": statistics.median(tokens) * config.processes if tokens else None,
            "last_committed_step": maxtext.latest_committed_step(run),
            "attempts": [{"attempt": n} for n in run.attempt_numbers()], "nodes": [], "goodput": None,
            "stragglers": [], "last_event": last}


def watch(run: RunDir, console: Any = None, interval: float = 2.0, clock: Callable[[], float] = time.time,
          sleep: Callable[[float], None] = time.sleep) -> RunState | None:
    """`rkit status --watch`: redraw the run's state every `interval` seconds, counted from the start of each
    read (a read that takes 1.5 s is followed by 0.5 s of sleep), until it ends or Ctrl-C; the run's state at the
    end (None when Ctrl-C came before the first full read)."""
    from rich.console import Console
    from rich.live import Live

    digest = run_status.new_digest(run)
    console = console or Console()
    s = None
    with Live(render_watch(glance(run), clock()), console=console, auto_refresh=False) as live:
        live.refresh()  # the first frame from the files' tails, before a long run's history is read
        try:
            began = clock()
            s = run_status.status(run, digest=digest)
            while True:
                live.update(render_watch(s, clock()), refresh=True)
                slurm_done = not s["slurm"] or s["slurm"]["state"] not in run_status.SLURM_ACTIVE
                if RunState(s["state"]).is_final() and slurm_done:
                    break
                sleep(max(0.0, interval - (clock() - began)))
                began = clock()
                s = run_status.status(run, digest=digest)
                digest.save()
        except KeyboardInterrupt:
            pass
    if not console.is_terminal:  # Live ends a terminal's last frame with a newline, not a file's
        console.line()
    return RunState(s["state"]) if s is not None else None
