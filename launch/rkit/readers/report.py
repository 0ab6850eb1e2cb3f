"""`rkit report`: PNG plots of a run (loss, tokens/s, step time: against the step, and below against wall-clock
time; goodput) and a one-page summary.md + summary.html, written into <run>/report/ (or --out) from the run
directory alone."""

from __future__ import annotations

import datetime
import html
import io
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rkit import __version__
from rkit.contract.config import Config
from rkit.contract.errors import RkitError
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir, set_access, write_atomic
from rkit.readers import goodput
from rkit.readers.display import progress, resumed_from
from rkit.run.stragglers import SKIP_STEPS, find_stragglers, straggler_events
from rkit.runtime.telemetry import metrics

FAULT_EVENTS = (EV.INJECT_FIRED, EV.ATTEMPT_FAILED, EV.ATTEMPT_HANG, EV.PREEMPT_REQUESTED, EV.PREEMPT_SAVED,
                EV.PREEMPT_UNSAVED, EV.PREEMPT_ESCALATED, EV.NODES_EXCLUDED, EV.JOB_REQUEUED, EV.DISK_LOW,
                EV.NODE_STRAGGLER, EV.ATTEMPT_NO_NODES, EV.CHECKPOINT_QUARANTINED, EV.RUN_RESIZED)
PLOTS = {"loss": "loss", "tokens_per_sec": "tokens/s (all processes)", "step_time": "step time (s)"}
CAUSE_COLORS = ("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


@dataclass
class Series:
    """What the plots draw, in unix seconds: one point per metrics line of the reference rank (rank 0, or the
    lowest rank with lines in that attempt), attempt starts, and failures with their causes."""

    points: list[dict[str, Any]] = field(default_factory=list)   # t, step, attempt, loss, tokens_per_sec, ...
    boundaries: list[tuple[float, int]] = field(default_factory=list)  # (t, attempt) of each attempt.started
    failures: list[tuple[float, str]] = field(default_factory=list)    # (t, cause) of each failed attempt
    # (the last step the failed attempt reached, cause): where the failure sits on the step axis
    failure_steps: list[tuple[int | None, str]] = field(default_factory=list)


@dataclass
class RunFiles:
    """What a report reads from a run directory, each file once: events.jsonl, resolved.json, the manifest, every
    rank's metrics file, and the placed lines (goodput.run_lines) that the plots and the goodput share."""

    events: list[dict]
    config: Config
    stamp: dict
    rank_lines: dict[int, list[dict[str, Any]]]  # metrics.lines of every rank, by rank
    placed: list[dict[str, Any]]

    @classmethod
    def read(cls, run: RunDir) -> RunFiles:
        run.require()
        events = run.events()
        rank_lines = {rank: metrics.lines(run, rank) for rank in metrics.ranks(run)}
        return cls(events=events, config=run.config(), stamp=run.load_manifest(), rank_lines=rank_lines,
                   placed=goodput.run_lines(run, events, every_rank=rank_lines))


def plot_series(run: RunDir, events: list[dict] | None = None, *, config: Config | None = None,
                lines: list[dict[str, Any]] | None = None) -> Series:
    """`events`, `config`, `lines` (goodput.run_lines): what the caller has read already."""
    events = run.events() if events is None else events
    config = run.config() if config is None else config
    # each attempt's processes (an elastic run's shrunk attempts have fewer than the recipe's)
    sizes = {e.get("attempt"): e.get("processes") for e in events if e.get("event") == EV.ATTEMPT_STARTED}
    series = Series()
    lines = goodput.run_lines(run, events) if lines is None else lines
    reference: dict[int, Any] = {}
    for line in lines:
        # rank 0 when it has lines in the attempt, else the first rank seen
        if line["rank"] == 0 or line["attempt"] not in reference:
            reference[line["attempt"]] = line["rank"]
    seen: dict[int, int] = defaultdict(int)
    for line in lines:
        if line["rank"] != reference[line["attempt"]] or line.get("t") is None:
            continue
        tps = line.get("tokens_per_sec_per_device")
        # MaxText's step_time carries compilation into the first steps after a start (tens of seconds against
        # tenths): left out of the time and speed curves, as straggler detection leaves them out.
        warm = seen[line["attempt"]] >= SKIP_STEPS
        seen[line["attempt"]] += 1
        series.points.append({"t": line["t"], "step": line["step"], "attempt": line["attempt"],
                              "loss": line.get("loss"), "recomputed": line.get("recomputed", False),
                              "tokens_per_sec": tps * (sizes.get(line["attempt"]) or config.processes)
                              if warm and isinstance(tps, (int, float)) else None,
                              "step_time": line.get("step_time") if warm else None})
    ended = {e.get("attempt"): e for e in events if e.get("event") == EV.ATTEMPT_ENDED}
    # Where the failure happened: the failure or hang event, else the attempt's end.
    failed: dict[Any, dict] = {}
    for e in events:
        if e.get("event") in (EV.ATTEMPT_FAILED, EV.ATTEMPT_HANG):
            failed.setdefault(e.get("attempt"), e)
    for e in events:
        if e.get("event") == EV.ATTEMPT_STARTED:
            series.boundaries.append((e["t"], e.get("attempt")))
    for n in sorted(set(ended) | set(failed), key=lambda x: (x is None, x or 0)):
        end, fail = ended.get(n), failed.get(n)
        cause = end.get("cause") if end else fail.get("cls", "hang")
        if cause in ("completed", None):
            continue
        series.failures.append(((fail or end)["t"], str(cause)))
        reached = [p["step"] for p in series.points if p["attempt"] == n]
        series.failure_steps.append((max(reached) if reached else None, str(cause)))
    return series


def figure(title: str, ylabel: str) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)  # Agg explicitly: no display, no pyplot global state
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("wall-clock time (UTC)")
    ax.grid(True, alpha=0.3)
    return fig, ax


def _when(t: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc)


def save_png(fig: Any, path: Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    write_atomic(path, buffer.getvalue())


def _spaced(marks: list[tuple[float, str]], gap: float) -> list[tuple[float, str]]:
    """Marks at least `gap` apart along x (the later ones that crowd an earlier one are dropped): their labels
    do not overprint each other."""
    kept: list[tuple[float, str]] = []
    for x, label in sorted(marks):
        if not kept or x - kept[-1][0] >= gap:
            kept.append((x, label))
    return kept


def _marks(ax: Any, series: Series, colors: dict[str, str], by_step: bool) -> None:
    """Attempt starts (grey dashed, numbered above the axes), failures (a line in their cause's colour) and, by
    step, recomputed steps (shaded); each kind named once in the legend."""
    from matplotlib import dates as mdates

    if by_step:
        first = {}
        for p in series.points:
            first[p["attempt"]] = min(first.get(p["attempt"], p["step"]), p["step"])
        starts = [(step, attempt) for attempt, step in sorted(first.items())]
        failures = [(step, cause) for step, cause in series.failure_steps if step is not None]
    else:
        starts = [(mdates.date2num(_when(t)), attempt) for t, attempt in series.boundaries]
        failures = [(mdates.date2num(_when(t)), cause) for t, cause in series.failures]
    for i, (x, _) in enumerate(starts):
        ax.axvline(x, color="grey", linestyle="--", linewidth=1, label="attempt start (#n above)" if i == 0 else None)
    lo, hi = ax.get_xlim()
    for x, attempt in _spaced([(x, f"#{a}") for x, a in starts], (hi - lo) * 0.03):
        ax.annotate(attempt, (x, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 2), textcoords="offset points",
                    ha="center", va="bottom", fontsize=7, color="dimgrey")
    named: set[str] = set()
    for x, cause in failures:
        ax.axvline(x, color=colors[cause], linewidth=1.5, label=None if cause in named else f"failed: {cause}")
        named.add(cause)
    if by_step:
        for i, (lo, hi) in enumerate(recomputed_spans(series)):
            ax.axvspan(lo - 0.5, hi + 0.5, color="tab:orange", alpha=0.2, linewidth=0,
                       label="recomputed steps (trained again after a resume)" if i == 0 else None)


def recomputed_spans(series: Series) -> list[tuple[int, int]]:
    """The runs of consecutive recomputed steps (trained a second time: a later attempt resumed from an earlier
    checkpoint), as (first, last) step."""
    spans: list[tuple[int, int]] = []
    for step in sorted({p["step"] for p in series.points if p.get("recomputed")}):
        if spans and step == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], step)
        else:
            spans.append((step, step))
    return spans


def draw(series: Series, key: str, run_name: str) -> Any:
    """One metric in two views (a matplotlib Figure): against the step (MaxText's numbering), and below against
    wall-clock time. Attempt starts, failures by cause and recomputed steps are marked; the legend sits outside
    the axes and the attempt numbers above them, clear of the curves."""
    from matplotlib import dates as mdates
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 7.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # Agg explicitly: no display, no pyplot global state
    by_step, by_time = fig.subplots(2, 1, height_ratios=[3, 2])
    note = "" if key == "loss" else f" (first {SKIP_STEPS} steps of each attempt, compilation, left out)"
    fig.suptitle(f"{run_name}: {PLOTS[key]}{note}")
    causes = sorted({cause for _, cause in series.failures})
    colors = {cause: CAUSE_COLORS[i % len(CAUSE_COLORS)] for i, cause in enumerate(causes)}
    attempts = sorted({p["attempt"] for p in series.points})
    for ax, xlabel in ((by_step, "step (MaxText's numbering, from 0)"), (by_time, "wall-clock time (UTC)")):
        ax.set_ylabel(PLOTS[key])
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="y", useOffset=False)  # an offset label would sit where the attempt numbers do
        for attempt in attempts:
            pts = [p for p in series.points if p["attempt"] == attempt and p[key] is not None]
            if pts:
                xs = [p["step"] for p in pts] if ax is by_step else [_when(p["t"]) for p in pts]
                ax.plot(xs, [p[key] for p in pts], marker=".", markersize=3, linewidth=1,
                        color=f"C{(attempt - 1) % 10}",
                        label=f"attempt {attempt}" if ax is by_step and len(attempts) <= 12 else None)
        _marks(ax, series, colors, by_step=ax is by_step)
        if not series.points:
            ax.text(0.5, 0.5, "no steps recorded", transform=ax.transAxes, ha="center", va="center")
    by_step.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_time.xaxis.set_major_formatter(mdates.ConciseDateFormatter(by_time.xaxis.get_major_locator()))
    if by_step.get_legend_handles_labels()[0]:
        by_step.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=8)
    return fig


def plot(series: Series, key: str, path: Path, run_name: str) -> None:
    save_png(draw(series, key, run_name), path)


def plot_goodput(g: goodput.Goodput, path: Path, run_name: str) -> None:
    fig, ax = figure(f"{run_name}: where the wall time went ({_pct(g.goodput)} goodput)", "")
    ax.set_xlabel("seconds")
    items = [(c, s) for c, s in g.seconds.items() if s > 0] or [("productive", 0.0)]
    ax.barh([goodput.CATEGORIES[c] for c, _ in items], [s for _, s in items],
            color=["tab:green" if c == "productive" else "tab:red" for c, _ in items])
    ax.invert_yaxis()
    save_png(fig, path)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _fmt(value: Any, spec: str = "{}") -> str:
    return "-" if value is None else spec.format(value)


def summary(run: RunDir, files: RunFiles | None = None) -> dict[str, Any]:
    """Everything the one-page summary says, as plain data (rendered to Markdown and HTML). `files`: what the
    caller has read already (RunFiles.read)."""
    from rkit.readers import status

    files = RunFiles.read(run) if files is None else files
    events, stamp, config = files.events, files.stamp, files.config
    s = status.status(run, events=events, config=config, stamp=stamp, rank_lines=files.rank_lines,
                      placed=files.placed)
    start = next((e["t"] for e in events if isinstance(e.get("t"), (int, float))), None)
    image = stamp.get("image") or {}
    factor = float(config.observability.straggler_factor)
    every_rank = [line for rank in sorted(files.rank_lines) for line in files.rank_lines[rank]]
    found = find_stragglers(goodput.place_lines(events, every_rank), factor)
    faults = [{"at": _since(e["t"], start), "event": e["event"], "detail": _fields(e)}
              for e in events if e.get("event") in FAULT_EVENTS]
    return {
        "status": s,
        "started": _when(start).isoformat(timespec="seconds") if start else None,
        "image": image.get("sha256") or ("none (the host's Python)" if image.get("kind") == "none"
                                         else f"unknown ({image.get('reference', '?')})"),
        "image_path": image.get("path"),
        "rkit_version": stamp.get("rkit_version"),
        "faults": faults,
        "stragglers_seen": straggler_events(events),
        "stragglers_found": [st.as_dict() for st in found],
        "straggler_factor": factor,
        "goodput": s["goodput"],
    }


def _fields(e: dict[str, Any]) -> str:
    """An event's own fields as k=v (nested tallies and argv lists are left to events.jsonl)."""
    out = []
    for key, value in sorted(e.items()):
        if key in ("t", "event") or value in (None, [], {}) or isinstance(value, dict):
            continue
        if isinstance(value, list):
            if not all(isinstance(v, (str, int, float)) for v in value):
                continue
            value = "[" + ", ".join(map(str, value)) + "]"
        out.append(f"{key}={value}")
    return ", ".join(out)


def _since(t: float, start: float | None) -> str:
    return "-" if start is None else f"+{t - start:.1f} s"


def _tables(d: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    s, g = d["status"], d["goodput"]
    overview = [["state", s["state"] + (f": {s['reason']}" if s["reason"] else "")],
                ["config hash", str(s["config_hash"])], ["image", d["image"] + (f" ({d['image_path']})"
                                                                                 if d["image_path"] else "")],
                ["rkit", str(d["rkit_version"]) + f" (report by {__version__})"], ["started (UTC)", str(d["started"])],
                ["steps", f"{progress(s['step'], s['total_steps'])}; last committed {_fmt(s['last_committed_step'])}"],
                ["final loss", _fmt(s["loss"], "{:.4f}")],
                ["throughput", f"{_fmt(s['tokens_per_sec'], '{:,.0f}')} tokens/s, step time "
                               f"{_fmt(s['step_time_seconds'], '{:.3f}')} s (median of recent steps)"],
                ["wall time", f"{g['wall_seconds']:.1f} s"], ["goodput", _pct(g["goodput"])]]
    attempts = [[str(a["attempt"]), resumed_from(a), ", ".join(a.get("nodes") or []) or "-",
                 _fmt(a.get("gradient_accumulation_steps"), "{}"),
                 _fmt(a.get("first_step_seconds"), "{:.1f} s"), str(a.get("cause", "running")),
                 str(a.get("detail") or ""), str(a.get("decision") or "")] for a in s["attempts"]]
    faults = [[f["at"], f["event"], f["detail"]] for f in d["faults"]]
    wall = g["wall_seconds"]
    breakdown = [[goodput.CATEGORIES[c], f"{sec:.1f}", _pct(sec / wall if wall else None)]
                 for c, sec in sorted(g["seconds"].items(), key=lambda item: (item[0] != "productive", -item[1]))]
    stragglers = [[str(x.get("attempt")), str(x.get("node")), _fmt(x.get("ratio"), "{:.2f}x"), "live (event)"]
                  for x in d["stragglers_seen"]]
    stragglers += [[str(x["attempt"]), x["node"], f"{x['ratio']:.2f}x", f"from metrics (median {x['median']:.3f} s "
                    f"vs {x['others_median']:.3f} s)"] for x in d["stragglers_found"]]
    return [("Run", ["", ""], overview),
            ("Attempts", ["#", "resumed from", "nodes", "grad. accumulation", "first step after", "cause", "detail",
                          "decision"], attempts),
            ("Faults", ["at", "event", "detail"], faults),
            ("Goodput", ["category", "seconds", "share"], breakdown),
            (f"Stragglers (factor {d['straggler_factor']})", ["attempt", "node", "ratio", "seen"], stragglers)]


def _md_cell(text: str) -> str:
    # Backslash escapes keep a '|' from splitting a cell and a '<' from starting an HTML tag.
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "\\<").replace("\n", " ")


def render_markdown(d: dict[str, Any], images: list[str]) -> str:
    out = [f"# rkit report: {_md_cell(d['status']['name'])}", ""]
    for title, header, rows in _tables(d):
        out += [f"## {title}", ""]
        if not rows:
            out += ["none", ""]
            continue
        out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
        out.append("")
    out += ["## Plots", ""] + [f"![{Path(name).stem}]({name})" for name in images] + [""]
    return "\n".join(out)


def render_html(d: dict[str, Any], images: list[str]) -> str:
    e = html.escape
    out = ["<!doctype html>", "<html><head><meta charset='utf-8'>", f"<title>rkit report: {e(d['status']['name'])}"
           "</title>", "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:"
           "collapse;margin-bottom:1em}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}</style>",
           "</head><body>", f"<h1>rkit report: {e(d['status']['name'])}</h1>"]
    for title, header, rows in _tables(d):
        out.append(f"<h2>{e(title)}</h2>")
        if not rows:
            out.append("<p>none</p>")
            continue
        out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
        out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows]
        out.append("</table>")
    out.append("<h2>Plots</h2>")
    out += [f"<p><img src='{e(name, quote=True)}' alt='{e(name, quote=True)}'></p>" for name in images]
    out.append("</body></html>\n")
    return "\n".join(out)


def write_report(run: RunDir, out: Path | None = None) -> list[Path]:
    """Write the plots and summaries (each file atomically: temp + rename); returns the paths written."""
    run.require().refuse_planted_links()
    out = run.report_dir if out is None else Path(out)
    if out.exists() and not out.is_dir():
        raise RkitError(f"{out}: exists and is not a directory; give --out a directory (it is created if missing).")
    files = RunFiles.read(run)
    set_access(files.config.access)  # the report is as private as the run
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RkitError(f"{out}: cannot create the report directory: {exc.strerror}.") from None
    series = plot_series(run, files.events, config=files.config, lines=files.placed)
    d = summary(run, files)
    written = []
    for key in PLOTS:
        path = out / f"{key}.png"
        plot(series, key, path, run.name)
        written.append(path)
    g = goodput.Goodput(wall_seconds=d["goodput"]["wall_seconds"], seconds=d["goodput"]["seconds"])
    plot_goodput(g, out / "goodput.png", run.name)
    written.append(out / "goodput.png")
    images = [p.name for p in written]
    for name, text in (("summary.md", render_markdown(d, images)), ("summary.html", render_html(d, images))):
        write_atomic(out / name, text)
        written.append(out / name)
    return written
