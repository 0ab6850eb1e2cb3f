"""`rkit bench history`: one metric across the saved results (pytest-benchmark's storage), as a table and a plot:
each result's median and its interval (compare.METHOD, one sample)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rkit.readers import compare as outcomes
from rkit.readers.bench import GROUP, as_outcome

# What `history` can plot: the extra_info key of its per-round samples (None: stats.data, the step times).
HISTORY_METRICS = {"step_time": None, "tokens_per_sec_per_device": "tokens_per_sec_per_device",
                   "host_rss": "host_rss_bytes"}
# How `history` shows each metric: its words, its unit, the factor from the saved samples (seconds, bytes) to it.
HISTORY_UNITS = {"step_time": ("step time", "ms", 1e3), "tokens_per_sec_per_device": ("tokens/s per device",
                                                                                     "tokens/s", 1.0),
                 "host_rss": ("host RSS", "MiB", 1 / 2**20)}


def history_points(store, metric: str, globs: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One point per saved rkit result: the metric's median and its interval (compare.METHOD, one sample)."""
    key = HISTORY_METRICS[metric]
    points = []
    for path, document in store.load(*(globs or ("[0-9][0-9][0-9][0-9]_",))):
        for bench in document.get("benchmarks", []):
            if bench.get("group") != GROUP:
                continue
            o = as_outcome(str(path), bench)
            rounds = o["step_time" if key is None else key]["samples"]
            if not any(rounds):
                continue
            median, lo, hi = outcomes.median_interval(rounds)
            image = (o["image_sha256"] or "sha256:none").split(":", 1)[-1][:12]
            points.append({"file": str(path), "name": bench.get("name"), "datetime": document.get("datetime"),
                           "median": median, "interval": [lo, hi], "image": image,
                           "label": f"{Path(str(path)).name.split('_', 1)[0]} {image}"})
    return points


def plot_history(points: list[dict[str, Any]], metric: str, out: Path) -> None:
    from rkit.readers.report import figure, save_png

    words, unit, factor = HISTORY_UNITS[metric]
    fig, ax = figure(f"rkit bench history: {words} (median, {outcomes.CONFIDENCE:.0%} interval)", f"{words} ({unit})")
    xs = list(range(len(points)))
    med = [p["median"] * factor for p in points]
    ax.errorbar(xs, med, yerr=[[m - p["interval"][0] * factor for m, p in zip(med, points, strict=True)],
                               [p["interval"][1] * factor - m for m, p in zip(med, points, strict=True)]],
                fmt="o", capsize=4)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{p['label'].split()[0]} {p['name']}\n{p['image']}" for p in points], rotation=30,
                       ha="right")
    ax.set_xlabel("saved result (number and --save name; image sha256 prefix)")
    save_png(fig, out)


def render_history(points: list[dict[str, Any]], metric: str) -> str:
    """`rkit bench history`'s table: one row per saved result, the metric in its unit."""
    words, unit, factor = HISTORY_UNITS[metric]
    rows = [("RESULT", "NAME", "IMAGE", f"MEDIAN ({unit})", f"{outcomes.CONFIDENCE:.0%} INTERVAL ({unit})", "FILE")]
    rows += [(p["label"].split()[0], str(p["name"]), p["image"], f"{p['median'] * factor:.4g}",
              f"[{p['interval'][0] * factor:.4g}, {p['interval'][1] * factor:.4g}]", p["file"]) for p in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return f"{words}:\n" + "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                                      for r in rows)
