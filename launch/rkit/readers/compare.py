"""rkit compare: did two runs come out the same? Their outcomes (outcome.py) side by side: the loss step by step,
and each performance metric as a ratio B/A with a confidence interval. `rkit diff` compares the inputs.

The interval: a percentile bootstrap of the ratio of medians (2,000 resamples, seeded, 95 %): each resample draws
the rounds with replacement (`rkit bench`: several runs per side; `rkit compare`: one), then the steady-state
per-step samples of each drawn round. A metric is worse only when the whole interval is beyond the threshold: slower
by more than the threshold, beyond noise. Pure functions; the CLI reads the outcomes and prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rkit.readers.outcome import float32_hex

RESAMPLES = 2000
CONFIDENCE = 0.95
MAX_SAMPLES = 2000  # a longer run's samples are thinned evenly to this many: time and memory stay bounded, the
#                     interval can only get wider
METHOD = (f"percentile bootstrap of the ratio of medians, {RESAMPLES} resamples of the rounds and then of their "
          f"per-step samples (at most {MAX_SAMPLES}, evenly thinned), {CONFIDENCE:.0%} interval")
# name -> (the outcome's key, lower is better, the words for worse / better)
METRICS = {
    "step_time": ("step_time", True, ("slower", "faster")),
    "tokens_per_sec_per_device": ("tokens_per_sec_per_device", False, ("slower", "faster")),
    "host_rss": ("host_rss_bytes", True, ("more memory", "less memory")),
    "device_memory_peak": ("device_memory_peak_bytes", True, ("more memory", "less memory")),
}
INFORMATIVE = ("mfu_median", "time_to_first_step_seconds", "checkpoint_save_seconds", "goodput")


@dataclass(frozen=True)
class Limits:
    loss_tolerance: float = 0.0  # absolute; 0 = bit-exact (float32)
    threshold: float = 0.05  # a metric may be this much worse (ratio 1.05) before it counts
    seed: int = 0


def compare_loss(a: dict[str, Any], b: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """Per step: EXACT (same float32), WITHIN (|a-b| <= tolerance), DIFFER; as runs of one status."""
    la = {int(k): v for k, v in a["per_step"].items()}
    lb = {int(k): v for k, v in b["per_step"].items()}
    common = sorted(set(la) & set(lb))
    ranges: list[dict[str, Any]] = []
    counts = {"EXACT": 0, "WITHIN": 0, "DIFFER": 0}
    first: dict[str, Any] | None = None
    max_abs = 0.0
    for step in common:
        x, y = la[step], lb[step]
        diff = abs(x - y)
        max_abs = max(max_abs, diff)
        status = "EXACT" if float32_hex(x) == float32_hex(y) else "WITHIN" if diff <= tolerance else "DIFFER"
        counts[status] += 1
        if status != "EXACT" and first is None:
            first = {"step": step, "a": x, "b": y, "a_hex": float32_hex(x), "b_hex": float32_hex(y),
                     "status": status}
        if ranges and ranges[-1]["status"] == status:
            ranges[-1]["to"] = step
        else:
            ranges.append({"from": step, "to": step, "status": status})
    only_a, only_b = sorted(set(la) - set(lb)), sorted(set(lb) - set(la))
    agree = bool(common) and counts["DIFFER"] == 0 and not only_a and not only_b
    return {"agree": agree, "steps_compared": len(common), "counts": counts, "ranges": ranges,
            "first_divergence": first, "max_abs_diff": max_abs, "tolerance": tolerance,
            "only_in_a": _span(only_a), "only_in_b": _span(only_b),
            "checksums": [a.get("sha256"), b.get("sha256")]}


def compare_data(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """The tokens each step consumed (outcome "data": a fingerprint per step over all processes), on the steps
    both runs recorded: EXACT, or the first step whose batch differs. None when either run has none."""
    if not a or not b:
        return None
    fa, fb = a.get("per_step") or {}, b.get("per_step") or {}
    common = sorted({int(s) for s in fa} & {int(s) for s in fb})
    differ = [s for s in common if fa[str(s)] != fb[str(s)]]
    first = None if not differ else {"step": differ[0], "a": fa[str(differ[0])], "b": fb[str(differ[0])]}
    return {"agree": bool(common) and not differ, "steps_compared": len(common), "exact": len(common) - len(differ),
            "differ": len(differ), "first_difference": first}


def _span(steps: list[int]) -> dict[str, int] | None:
    return {"count": len(steps), "first": steps[0], "last": steps[-1]} if steps else None


def _rounds(samples: list) -> list[list[float]]:
    """Samples as rounds: a run's per-step samples are one round; `rkit bench` gives one list per round."""
    return [list(r) for r in samples if len(r)] if samples and isinstance(samples[0], list) else [list(samples)]


def _boot_medians(rounds: list[list[float]], rng) -> Any:
    """RESAMPLES medians: each resample draws the rounds with replacement, then each drawn round's steps with
    replacement, and takes the median of what it drew (so the spread between rounds counts, not only between
    steps)."""
    import numpy as np

    per = max(1, MAX_SAMPLES // len(rounds))
    thinned = [np.asarray(r, dtype=float)[np.linspace(0, len(r) - 1, min(len(r), per)).astype(int)] for r in rounds]
    width = max(len(r) for r in thinned)
    drawn = [r[rng.integers(0, len(r), (RESAMPLES, width))] for r in thinned]  # resampled steps, per round
    for r, d in zip(thinned, drawn, strict=True):
        d[:, len(r):] = np.nan  # a shorter round keeps its own number of samples
    pick = rng.integers(0, len(rounds), (RESAMPLES, len(rounds)))
    pooled = np.concatenate([np.stack(drawn)[pick[:, j], np.arange(RESAMPLES)] for j in range(len(rounds))], axis=1)
    return np.nanmedian(pooled, axis=1)


def median_interval(samples: list, seed: int = 0) -> tuple[float, float, float]:
    """The median of one side's samples (or rounds) and its bootstrap interval (METHOD, one side)."""
    import numpy as np

    rounds = _rounds(samples)
    medians = _boot_medians(rounds, np.random.default_rng(seed))
    tail = (1 - CONFIDENCE) / 2 * 100
    lo, hi = np.percentile(medians, [tail, 100 - tail])
    return float(np.median(np.concatenate(rounds))), float(lo), float(hi)


def ratio_interval(a: list, b: list, seed: int = 0) -> tuple[float, float, float]:
    """median(b) / median(a) and its bootstrap interval (METHOD). `a`, `b`: one run's per-step samples, or a list
    of rounds (lists of samples) each."""
    import numpy as np

    ra, rb = _rounds(a), _rounds(b)
    rng = np.random.default_rng(seed)
    ma, mb = _boot_medians(ra, rng), _boot_medians(rb, rng)
    tail = (1 - CONFIDENCE) / 2 * 100
    lo, hi = np.percentile(mb / ma, [tail, 100 - tail])
    return float(np.median(np.concatenate(rb)) / np.median(np.concatenate(ra))), float(lo), float(hi)


def compare_metric(name: str, a: dict[str, Any], b: dict[str, Any], limits: Limits) -> dict[str, Any]:
    key, lower_better, (worse_word, better_word) = METRICS[name]
    va, vb = a.get(key), b.get(key)
    row: dict[str, Any] = {"metric": name, "lower_is_better": lower_better}
    if isinstance(va, dict) and isinstance(vb, dict) and va.get("n") and vb.get("n"):
        ratio, lo, hi = ratio_interval(va["samples"], vb["samples"], limits.seed)
        row.update(a=va["median"], b=vb["median"], n=[va["n"], vb["n"]])
    elif isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va > 0:
        ratio = lo = hi = vb / va  # one value each (a peak): no interval
        row.update(a=va, b=vb, n=[1, 1])
    else:
        return {**row, "verdict": "unknown", "ratio": None, "interval": None}
    # As a factor of "worse": > 1 is worse whichever way the metric goes.
    worse_lo, worse_hi = (lo, hi) if lower_better else (1 / hi, 1 / lo)
    limit = 1 + limits.threshold
    verdict = worse_word if worse_lo > limit else better_word if worse_hi < 1 / limit else "same"
    # "same" but the interval reaches past the threshold: the noise hides what the threshold asks about.
    inconclusive = verdict == "same" and worse_hi > limit
    return {**row, "ratio": ratio, "interval": [lo, hi], "verdict": verdict, "worse": verdict == worse_word,
            "inconclusive": inconclusive}


def compare(a: dict[str, Any], b: dict[str, Any], limits: Limits = Limits(), *, loss_counts: bool = True
            ) -> dict[str, Any]:
    """Outcome B against outcome A. `loss_counts=False` (rkit bench, when the two sides' training math differs):
    the loss is shown but does not decide the verdict."""
    loss = {**compare_loss(a["loss"], b["loss"], limits.loss_tolerance), "counts_in_verdict": loss_counts}
    data = compare_data(a.get("data"), b.get("data"))
    perf = [compare_metric(name, a, b, limits) for name in METRICS]
    info = {key: [_scalar(a.get(key)), _scalar(b.get(key))] for key in INFORMATIVE}
    worse = [m["metric"] for m in perf if m.get("worse")]
    same_data = data is None or data["agree"] or not loss_counts
    return {"a": a.get("run"), "b": b.get("run"), "agree": (loss["agree"] or not loss_counts) and not worse
            and same_data, "loss": loss, "data": data,
            "performance": perf, "worse": worse, "informative": info, "threshold": limits.threshold,
            "method": METHOD, "states": [a.get("state"), b.get("state")],
            "config_hashes": [a.get("config_hash"), b.get("config_hash")],
            "images": [a.get("image_sha256"), b.get("image_sha256")]}


def with_training_differences(result: dict[str, Any], run_a: Path, run_b: Path) -> dict[str, Any]:
    """`result` with why the two runs' losses part although their configs may look alike: what MaxText derives
    differently from them (the learning-rate schedule, from trainer.steps). Read from each run's resolved.json;
    a run directory whose file cannot be read adds nothing here (rkit diff names it)."""
    from rkit.contract.errors import RkitError
    from rkit.contract.rundir import RunDir
    from rkit.recipe.maxtext_keys import schedule_change

    try:
        why = schedule_change(RunDir(run_a).load_resolved(), RunDir(run_b).load_resolved())
    except (RkitError, OSError, ValueError):
        why = None
    said = [why] if why else []
    first = (result.get("loss") or {}).get("first_divergence") or {}
    for side, path in (("A", run_a), ("B", run_b)):
        for change in changed_training(RunDir(path)):
            line = (f"{side} was changed by a --resume: steps {change['from']}-{change['until']} trained before it, "
                    f"the later ones after it ({change['why']})")
            if isinstance(first.get("step"), int) and first["step"] <= change["until"]:
                line += f"; this explains the divergence from step {first['step']}"
            said.append(line)
    return {**result, "training_differences": said}


def changed_training(run: Any) -> list[dict[str, Any]]:
    """The run's recorded training changes (manifest `training_changes`: a --resume that changed what MaxText
    derives, the learning-rate schedule), each with the steps trained before it: up to the step the next attempt
    resumed from. [] where none is recorded or the files cannot be read."""
    from rkit.contract.errors import RkitError

    try:
        changes = run.load_manifest().get("training_changes") or []
        events = run.events()
    except (RkitError, OSError, ValueError, AttributeError):
        return []
    out = []
    for change in changes if isinstance(changes, list) else []:
        t = change.get("t") if isinstance(change, dict) else None
        if not isinstance(t, (int, float)):
            continue
        resumed = next((e.get("resume_from_step") for e in events if e.get("event") == "attempt.started"
                        and e.get("t", 0) >= t), None)
        if isinstance(resumed, int):
            out.append({"from": 0, "until": resumed, "why": str(change.get("why") or "the training changed")})
    return out


def _scalar(value: Any) -> Any:
    return value.get("median") if isinstance(value, dict) else value


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render(result: dict[str, Any]) -> str:
    loss = result["loss"]
    sa, sb = (state or "state not recorded" for state in result["states"])
    out = [f"A {result['a']} ({sa})  vs  B {result['b']} ({sb})"]
    if result["config_hashes"][0] != result["config_hashes"][1]:
        out.append("  configs differ (rkit diff A B says how)")
    out.extend(f"  {why}" for why in result.get("training_differences", []))
    if result["images"][0] != result["images"][1]:
        ia, ib = (str(i)[:19] if i else "no image (the host's Python)" for i in result["images"])
        out.append(f"  images differ: {ia} vs {ib}")
    tol = "bit-exact" if loss["tolerance"] == 0 else f"tolerance {loss['tolerance']:g}"
    if not loss["counts_in_verdict"]:
        tol += "; not in the verdict: the training math differs"
    out.append(f"loss ({tol}): {loss['steps_compared']} steps compared, " +
               ", ".join(f"{n} {k}" for k, n in loss["counts"].items() if n) +
               f"; max |A-B| {loss['max_abs_diff']:.3g}")
    for r in loss["ranges"][:12]:
        span = f"step {r['from']}" if r["from"] == r["to"] else f"steps {r['from']}-{r['to']}"
        out.append(f"  {span}: {r['status']}")
    if len(loss["ranges"]) > 12:
        out.append(f"  ... {len(loss['ranges']) - 12} more ranges (--json)")
    first = loss["first_divergence"]
    if first:
        out.append(f"  first divergence at step {first['step']}: A {first['a']!r} (0x{first['a_hex']}) "
                   f"B {first['b']!r} (0x{first['b_hex']}) {first['status']}")
    for side in ("a", "b"):
        if loss[f"only_in_{side}"]:
            s = loss[f"only_in_{side}"]
            out.append(f"  only in {side.upper()}: {s['count']} steps ({s['first']}-{s['last']})")
    data = result.get("data")
    if data is None:
        out.append("same data: not recorded for both runs (a batch fingerprint per step needs a host-side loader: "
                   "Grain, TFDS, HF)")
    elif data["differ"] == 0:
        out.append(f"same data: EXACT over {data['steps_compared']} steps")
    else:
        first = data["first_difference"]
        out.append(f"same data: DIFFERENT at {data['differ']} of {data['steps_compared']} steps; first at step "
                   f"{first['step']} (A {first['a']} B {first['b']})")
    out.append(f"performance (B/A, {result['method']}; threshold {result['threshold']:.0%}):")
    for m in result["performance"]:
        if m["ratio"] is None:
            out.append(f"  {m['metric']:<26} n/a (not recorded for both runs)")
            continue
        lo, hi = m["interval"]
        ci = "" if lo == hi else f" [{lo:.3f}, {hi:.3f}]"
        out.append(f"  {m['metric']:<26} A {_num(m['a'])}  B {_num(m['b'])}  ratio {m['ratio']:.3f}{ci}  "
                   f"{m['verdict']}" + (" (inconclusive: the interval reaches past the threshold; more rounds or "
                                        "a quieter machine)" if m.get("inconclusive") else ""))
    for key, (va, vb) in result["informative"].items():
        if va is None and vb is None:
            continue
        out.append(f"  {key:<26} A {_num(va)}  B {_num(vb)}")
    why = []
    if not loss["agree"] and loss["counts_in_verdict"]:
        why.append("the loss differs")
    if data is not None and data["differ"] and loss["counts_in_verdict"]:
        why.append("the data differs")
    if result["worse"]:
        why.append("worse: " + ", ".join(result["worse"]))
    out.append("verdict: the same outcome" if result["agree"] else "verdict: DIFFERENT (" + "; ".join(why) + ")")
    return "\n".join(out)
