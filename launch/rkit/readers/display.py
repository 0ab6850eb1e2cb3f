"""What rkit shows a person: the live progress bar of `rkit run` (rich; quiet when output is not a terminal), one
frame of `rkit status --watch`, and the small formatting helpers the text views share (status, ls, diff)."""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rkit.run.policy import Progress as RunProgress

TOP = 5  # stragglers, disk warnings, injections: the text views show this many and count the rest


@contextmanager
def live_progress(*, enabled: bool, total: int) -> Iterator[Callable[[RunProgress], None]]:
    if not enabled:  # before rich's imports: `rkit run --quiet` needs none of it
        yield lambda p: None
        return
    import rich.progress as rp
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        last = {"attempt": 0}

        def log(p: RunProgress) -> None:
            if p.attempt != last["attempt"]:
                last["attempt"] = p.attempt
                start = "from scratch" if p.committed is None else f"from step {p.committed}"
                console.print(f"rkit: attempt {p.attempt} starting {start}")

        yield log
        return
    bar = rp.Progress(rp.TextColumn("[bold]{task.description}"), rp.BarColumn(), rp.MofNCompleteColumn(),
                      rp.TextColumn("{task.fields[tps]}"), rp.TextColumn("ckpt {task.fields[ckpt]}"),
                      rp.TimeElapsedColumn(), rp.TimeRemainingColumn(), console=console, transient=False)
    task = bar.add_task("attempt 1", total=total, tps="", ckpt="-")
    with bar:
        def update(p: RunProgress) -> None:
            bar.update(task, description=f"attempt {p.attempt}",
                       completed=0 if p.step is None else p.step + 1,
                       tps=f"{p.tokens_per_sec:,.0f} tok/s" if p.tokens_per_sec else "",
                       ckpt="-" if p.committed is None else str(p.committed))

        yield update


def resumed_from(a: dict[str, Any]) -> str:
    """Where an attempt (a status row) started: from scratch, the step counted as committed, or (a node-local
    tier) the step and tier rank 0 restored and a newer step that was lost."""
    if a.get("restored_tier"):
        lost = f"; step {a['lost_step']} was lost" if a.get("lost_step") else ""
        return f"step {a.get('restored_step')} ({a['restored_tier']} tier{lost})"
    if a.get("resume_from_step") is None:
        return "from scratch"
    data = data_position_text(a.get("data_position"))
    return f"step {a['resume_from_step']}" + (f", {data}" if data else "")


def data_position_text(position: Any) -> str | None:
    """Grain's saved position per process (attempt.started data_position) in a few words: its next_index where
    Grain keeps one, else the position's JSON cut short."""
    if not isinstance(position, dict) or not position:
        return None

    def short(value: Any) -> str:
        for key in ("next_index", "global_next_index"):  # Grain's per-process position, its elastic iterator's
            if (found := _find_key(value, key)) is not None:
                return f"{key} {found}"
        return json.dumps(value, sort_keys=True)[:60]

    texts = {str(p): short(v) for p, v in sorted(position.items(), key=lambda kv: str(kv[0]))}
    if len(set(texts.values())) == 1:
        return f"data at {next(iter(texts.values()))} on each of {len(texts)} process(es)"
    return "data at " + "; ".join(f"process {p}: {t}" for p, t in list(texts.items())[:4]) + (
        f"; {len(texts) - 4} more" if len(texts) > 4 else "")


def _find_key(value: Any, key: str, depth: int = 0) -> Any:
    if isinstance(value, dict) and depth < 8:
        if isinstance(value.get(key), int):
            return value[key]
        for inner in value.values():
            if (found := _find_key(inner, key, depth + 1)) is not None:
                return found
    return None


def steps_text(steps: Any) -> str:
    """Checkpoint steps as a list for the text views: 10, 20 (none: -)."""
    return ", ".join(str(s) for s in steps) if isinstance(steps, list) and steps else "-"


def num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def progress(step: int | None, total: int) -> str:
    """The step convention of the human views: MaxText's own step numbers (from 0, as the checkpoint directories
    and events name them) and the count done, e.g. `step 39, 40 of 40 steps done`."""
    done = 0 if step is None else step + 1
    return f"step {num(step, '{}')}, {done} of {total} steps done"


def top(items: list[dict[str, Any]], key: str | None = None, n: int = TOP) -> tuple[list[dict[str, Any]], int]:
    """The first `n` items (by `key`, largest first, when given; else the newest) and how many are left out."""
    ranked = sorted(items, key=lambda x: -(x.get(key) or 0)) if key else items[::-1]
    return ranked[:n], max(0, len(items) - n)


def more(left: int, what: str) -> list[str]:
    return [f"           ... and {left} more {what} (--json lists them all)"] if left else []


def render_goodput(g: dict[str, Any]) -> str:
    """Goodput in one line, e.g. `87.2% of 120.3 s; lost: compilation and MaxText's set-up 9.1 s, ...` (top losses)."""
    if g["goodput"] is None:
        return "-"
    losses = ", ".join(f"{x['label']} {x['seconds']:.1f} s" for x in g["top_losses"])
    return f"{g['goodput']:.1%} of {g['wall_seconds']:.1f} s" + (f"; lost: {losses}" if losses else "")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def render_watch(s: dict[str, Any], now: float) -> Any:
    """One frame of `rkit status --watch` (a rich renderable): progress with ETA, speed, nodes, the top stragglers,
    last event."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    done = 0 if s["step"] is None else s["step"] + 1
    head = Text.assemble((s["name"], "bold"), f"  {s['state']}",
                         f": {s['reason']}" if s["reason"] and s["state"] != "running" else "")
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=max(s["total_steps"], 1), completed=done, width=40),
                f"step {num(s['step'], '{}')}, {done}/{s['total_steps']} done", f"ETA {_duration(s['eta_seconds'])}",
                f"{num(s['tokens_per_sec'], '{:,.0f}')} tokens/s",
                f"committed {num(s['last_committed_step'], '{}')}", f"attempt {len(s['attempts']) or '-'}")
    nodes = Table(box=None, padding=(0, 2), show_edge=False)
    for column in ("node", "ranks", "last step", "telemetry sample"):
        nodes.add_column(column)
    for row in s["nodes"]:
        age = row["telemetry_age_seconds"]
        nodes.add_row(row["node"], ",".join(map(str, row["ranks"])) or "-", num(row["last_step"], "{}"),
                      "-" if age is None else f"{age:.0f} s ago")
    parts: list[Any] = [head, bar, nodes, Text("goodput  " + (render_goodput(s["goodput"]) if s["goodput"] else
                                                             "(reading the run's history: in the next frame)"))]
    shown, left = top(s["stragglers"], "ratio")
    parts.extend(Text(f"straggler  {st['node']} (attempt {st['attempt']}): {num(st['ratio'], '{:.2f}')}x",
                      style="yellow") for st in shown)
    parts.extend(Text(line.strip(), style="yellow") for line in more(left, "stragglers"))
    last = s.get("last_event")
    if last:
        fields = " ".join(f"{k}={v}" for k, v in sorted(last.items()) if k not in ("t", "event")
                          and isinstance(v, (str, int, float)))
        parts.append(Text(f"last event  {now - last['t']:.0f} s ago: {last['event']} {fields}"[:300]))
    return Group(*parts)


TIME_KEY = re.compile(r"(^|\.)(created|built|started|ended|[a-z_]+_at)$")


class _Text(str):
    """A string that manifest.render_diff shows as it is (it quotes other strings: repr)."""

    __repr__ = str.__str__


def readable_times(diff: dict[str, Any]) -> dict[str, Any]:
    """`rkit diff`'s result with the Unix times of its time keys (run.created, ...) as ISO-8601 UTC, for the text
    view (--json keeps the numbers)."""
    def iso(value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e11:
            when = datetime.datetime.fromtimestamp(value, tz=datetime.timezone.utc)
            return _Text(when.strftime("%Y-%m-%dT%H:%M:%SZ"))
        return value

    groups = {group: [{**c, "a": iso(c["a"]), "b": iso(c["b"])} if TIME_KEY.search(c["key"]) else c
                      for c in changes] for group, changes in diff["groups"].items()}
    return {**diff, "groups": groups}
