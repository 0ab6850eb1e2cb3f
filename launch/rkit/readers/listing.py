"""`rkit ls [RUNS_DIR]`: one line per run directory found there: name, state, step and steps done, loss, config hash and
image digest prefixes, launcher, Slurm job id, age. Reads little per run (the events through status's digest:
only what was appended since the last read; the newest metrics line; the checkpoint directory), so a directory
of many long runs lists fast; `rkit status RUN` tells the rest."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rkit.contract.errors import RkitError
from rkit.contract.rundir import RunDir, last_jsonl
from rkit.readers.status import new_digest, run_state, slurm_info
from rkit.runtime.trainers import maxtext


def runs_in(root: Path) -> list[RunDir]:
    """The run directories directly in `root` (or `root` itself when it is one), by name."""
    root = Path(root)
    if RunDir(root).exists():
        return [RunDir(root)]
    if not root.is_dir():
        raise RkitError(f"{root}: not a directory; give the runs directory (default: runs), e.g. rkit ls runs")
    try:
        children = sorted(root.iterdir(), key=lambda p: p.name)
    except OSError as exc:
        raise RkitError(f"{root}: cannot be listed: {exc.strerror}") from None
    # A run directory: one that holds a resolved.json in any form (a damaged one is listed as unreadable).
    return [RunDir(p) for p in children
            if p.is_dir() and not p.is_symlink() and os.path.lexists(RunDir(p).resolved)]


def row(run: RunDir, now: float | None = None) -> dict[str, Any]:
    """One run's line as data; a run whose files cannot be read says so instead of failing the listing."""
    now = time.time() if now is None else now
    try:
        return _row(run, now)
    except RkitError as exc:
        return {"name": run.name, "path": str(run.path), "state": "unreadable", "reason": str(exc)}


def _row(run: RunDir, now: float) -> dict[str, Any]:
    config = run.config()
    stamp = run.load_manifest()
    digest = new_digest(run)
    events = digest.fold()
    slurm = slurm_info(events) if config.launcher == "slurm" else None
    committed = maxtext.latest_committed_step(run)
    state, reason = run_state(run, events, slurm,
                              final_committed=maxtext.final_committed(run, config.trainer.final_step))
    # The furthest step, as `rkit status` counts it (the merged view's newest), from rank 0's digest; rank 0's last
    # line where the digest cannot stand in (a resumed attempt's last line is behind the steps trained before it).
    rank0 = digest.rank0()
    newest = rank0.newest_steps(1) if not rank0.legacy else []
    last = newest[0] if newest else last_jsonl(run.metrics_file(0)) or {}
    digest.save()
    image = (stamp.get("image") or {}).get("sha256")
    image = image if isinstance(image, str) else None  # a damaged stamp's other value: not shown
    return {
        "name": run.name, "path": str(run.path), "state": state.value, "reason": reason,
        # MaxText's own step number (from 0), and how many of total_steps are done (step + 1)
        "step": last.get("step"), "steps_done": last["step"] + 1 if isinstance(last.get("step"), int) else 0,
        "total_steps": config.trainer.final_step + 1, "last_committed_step": committed,
        "loss": last.get("loss"), "config_hash": stamp.get("config_hash"), "image_sha256": image,
        "launcher": config.launcher, "job_id": slurm["job_id"] if slurm else None,
        "age_seconds": round(now - events.last["t"], 1) if events.last and "t" in events.last else None,
    }


def _prefix(digest: str | None) -> str:
    return digest.split(":", 1)[-1][:12] if digest else "-"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def render(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no runs"
    header = ("NAME", "STATE", "STEP", "DONE", "LOSS", "CONFIG", "IMAGE", "LAUNCHER", "JOB", "AGE")
    table = [header]
    for r in rows:
        if r["state"] == "unreadable":
            table.append((r["name"], "unreadable", "-", "-", "-", "-", "-", "-", "-", "-"))
            continue
        step = "-" if r["step"] is None else str(r["step"])
        loss = "-" if not isinstance(r["loss"], (int, float)) else f"{r['loss']:.4g}"
        table.append((r["name"], r["state"], step, f"{r['steps_done']}/{r['total_steps']}", loss,
                      _prefix(r["config_hash"]), _prefix(r["image_sha256"]),
                      r["launcher"], r["job_id"] or "-", _age(r["age_seconds"])))
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                     for line in table)
