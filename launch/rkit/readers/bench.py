"""rkit bench: regression benchmarks of a recipe, saved in pytest-benchmark's own storage.

`run` trains N fresh runs of a recipe and saves one pytest-benchmark result whose samples (stats.data) are the
steady-state step times of all rounds; `compare` and `gate` give `rkit compare`'s verdict (compare.py) on two
saved or freshly measured results; `history` plots one metric across the saved results.

The storage is pytest-benchmark's file storage (default ./.benchmarks, one folder per machine id, files
NNNN_NAME.json), written through its FileStorage with its machine and commit info, so `pytest-benchmark list`
and `pytest-benchmark compare` read what rkit saved. rkit's own fields live in the result's extra_info:

    {"rkit_version", "recipe", "config_hash", "math_sha256", "image_sha256", "hardware", "hardware_sha256",
     "deterministic", "runs", "round_sizes", "loss_sha256", "loss_sha256_per_round", "loss_per_step",
     "tokens_per_sec_per_device": [[...] per round], "host_rss_bytes": [[...] per round],
     "device_memory_peak_bytes", "warmup_steps_excluded"}

The training math (math_sha256) is the resolved trainer, resources, reproducibility and env sections: two results
with the same math must train to the same loss (bit for bit by default), so their loss counts in the verdict;
with different math (another model size, another learning rate) only the performance does.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rkit import __version__
from rkit.contract.errors import RkitError
from rkit.contract.safeio import load_json, private_dir
from rkit.readers import compare as outcomes
from rkit.runtime.telemetry.metrics import WARMUP_STEPS

DEFAULT_STORAGE = Path(".benchmarks")
GROUP = "rkit-bench"
MATH_KEYS = ("trainer", "resources", "reproducibility", "env")
class _Quiet:
    """The logger pytest-benchmark's FileStorage wants; rkit says what it saved itself."""

    def info(self, *args: Any, **kwargs: Any) -> None:
        pass

    warning = info


def storage(path: Path):
    try:
        from pytest_benchmark.storage.file import FileStorage
        from pytest_benchmark.utils import get_machine_id
    except ImportError as exc:  # pragma: no cover - the lock installs it
        raise RkitError(f"rkit bench needs pytest-benchmark ({exc}); `make setup` installs it") from exc
    if path.exists() and not path.is_dir():
        raise RkitError(f"{path}: the benchmark storage must be a directory (--storage)")
    private_dir(path)  # pytest-benchmark would make it 0755
    return FileStorage(str(path), _Quiet(), default_machine_id=get_machine_id())


def canonical_sha256(value: Any) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def math_of(resolved: dict[str, Any]) -> dict[str, Any]:
    return {key: resolved.get(key) for key in MATH_KEYS}


# ---------------------------------------------------------------- one result from the rounds' outcomes
@dataclass(frozen=True)
class Round:
    """One fresh run: its directory, resolved config, manifest and outcome record."""

    path: Path
    resolved: dict[str, Any]
    manifest: dict[str, Any]
    outcome: dict[str, Any]


def result_json(name: str, rounds: list[Round], machine_info: dict[str, Any], commit_info: dict[str, Any],
                now: datetime | None = None) -> dict[str, Any]:
    """pytest-benchmark's saved-result document for these rounds (what FileStorage.save writes)."""
    from pytest_benchmark import __version__ as pb_version
    from pytest_benchmark.stats import Stats

    first = rounds[0]
    stats = Stats()
    sizes = []
    for r in rounds:
        samples = r.outcome["step_time"]["samples"]
        sizes.append(len(samples))
        for value in samples:
            stats.update(value)
    if not stats.data:
        raise RkitError(f"{first.path}: no steady-state step times (a run needs more than {WARMUP_STEPS} steps "
                        "per attempt); raise trainer.steps")
    hardware = first.manifest.get("host", {}).get("hardware", {})
    checksums = [r.outcome["loss"]["sha256"] for r in rounds]
    extra = {
        "rkit_version": __version__,
        "recipe": first.resolved.get("name"),
        "config_hash": first.manifest.get("config_hash"),
        "math_sha256": canonical_sha256(math_of(first.resolved)),
        "image_sha256": (first.manifest.get("image") or {}).get("sha256"),
        "hardware": hardware,
        "hardware_sha256": canonical_sha256(hardware),
        "deterministic": bool((first.resolved.get("reproducibility") or {}).get("deterministic")),
        "runs": [str(r.path) for r in rounds],
        "round_sizes": sizes,
        "loss_sha256": checksums[0],
        "loss_sha256_per_round": checksums,
        "loss_per_step": first.outcome["loss"]["per_step"],
        "tokens_per_sec_per_device": [r.outcome["tokens_per_sec_per_device"]["samples"] for r in rounds],
        "host_rss_bytes": [r.outcome["host_rss_bytes"]["samples"] for r in rounds],
        "device_memory_peak_bytes": max((r.outcome.get("device_memory_peak_bytes") or 0 for r in rounds),
                                        default=0) or None,
        "warmup_steps_excluded": WARMUP_STEPS,
    }
    bench = {
        "group": GROUP, "name": name, "fullname": f"rkit bench::{first.resolved.get('name')}::{name}",
        "params": None, "param": None, "extra_info": extra,
        "options": {"rounds": len(rounds), "timer": "MaxText step_time (per step, steady state)",
                    "warmup": f"first {WARMUP_STEPS} steps of each attempt excluded"},
        "stats": {**stats.as_dict(), "data": stats.data, "iterations": 1},
    }
    return {"machine_info": machine_info, "commit_info": commit_info, "benchmarks": [bench],
            "datetime": (now or datetime.now(timezone.utc)).isoformat(), "version": pb_version}


def machine_and_commit() -> tuple[dict[str, Any], dict[str, Any]]:
    """pytest-benchmark's own machine and commit info (the commit of the directory rkit bench runs in)."""
    from pytest_benchmark.plugin import pytest_benchmark_generate_machine_info
    from pytest_benchmark.utils import get_commit_info

    try:
        machine = pytest_benchmark_generate_machine_info()
    except Exception:  # noqa: BLE001 - cpuinfo can fail in odd sandboxes; the rest is still worth saving
        machine = {"node": platform.node(), "machine": platform.machine(), "system": platform.system()}
    return machine, get_commit_info()


def save(store, name: str, document: dict[str, Any]) -> Path:
    before = set(store.query("[0-9][0-9][0-9][0-9]_*"))
    if store.default_machine_id:
        private_dir(store.path / store.default_machine_id)  # pytest-benchmark would make it 0755
    store.save(document, name)
    (path,) = set(store.query("[0-9][0-9][0-9][0-9]_*")) - before
    path.chmod(0o600)  # pytest-benchmark writes it 0644
    return path


# ---------------------------------------------------------------- saved results as outcomes
def load_saved(store, which: str) -> tuple[Path, dict[str, Any]]:
    """A saved result by file path, number (0003), or name glob (0003_cpu, cpu); the newest when several match."""
    if not which or any(c in which for c in "\n\r\0"):
        raise RkitError(f"{which!r}: name a saved result: a file, its number (0001) or its name")
    candidates = [which] if Path(which).is_file() else [which, f"*_{which}", f"{which}_*"]
    try:
        found = [p for glob in candidates for p in store.query(glob)]
    except ValueError as exc:
        raise RkitError(f"{which!r}: {exc}") from exc
    if not found:
        raise RkitError(f"{which!r}: no saved result of that name in {store.path} (list them: "
                        f"pytest-benchmark --storage {store.path} list)")
    path = sorted(set(found), key=lambda p: p.name)[-1]
    document = load_json(path, "result saved by rkit bench (pytest-benchmark's JSON)")
    benchmarks = document.get("benchmarks") if isinstance(document, dict) else None
    bench = next((b for b in benchmarks if isinstance(b, dict) and b.get("group") == GROUP), None) \
        if isinstance(benchmarks, list) else None
    why = "no benchmark of group 'rkit'" if bench is None else _saved_problem(bench)
    if why is not None:
        raise RkitError(f"{path}: not a result saved by rkit bench ({why}); give one that `rkit bench run` saved")
    return Path(path), bench


def _numbers(values: Any) -> bool:
    """A list of finite numbers."""
    if not isinstance(values, list):
        return False
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def _saved_problem(bench: dict[str, Any]) -> str | None:
    """What in a saved rkit result is not as `rkit bench run` writes it; None when it can be compared."""
    extra, stats = bench.get("extra_info"), bench.get("stats")
    if not isinstance(extra, dict) or not isinstance(stats, dict):
        return "extra_info or stats is not a mapping"
    sizes, data = extra.get("round_sizes"), stats.get("data")
    if not _numbers(data):
        return "stats.data is not a list of numbers"
    if not (isinstance(sizes, list) and sizes and all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                       for n in sizes) and sum(sizes) == len(data)):
        return "extra_info.round_sizes does not split stats.data into rounds"
    for key in ("tokens_per_sec_per_device", "host_rss_bytes"):
        rounds = extra.get(key)
        if rounds is not None and not (isinstance(rounds, list) and all(_numbers(r) for r in rounds)):
            return f"extra_info.{key} is not a list of numbers per round"
    losses = extra.get("loss_per_step")
    if losses is not None and not (isinstance(losses, dict) and all(
            isinstance(k, str) and k.isdigit() and isinstance(v, (int, float)) and not isinstance(v, bool)
            and not abs(v) > 3.4028234663852886e38 for k, v in losses.items())):
        return "extra_info.loss_per_step is not a mapping of step to loss"
    for key in ("config_hash", "image_sha256", "math_sha256", "loss_sha256"):
        if extra.get(key) is not None and not isinstance(extra[key], str):
            return f"extra_info.{key} is not a string"
    peak = extra.get("device_memory_peak_bytes")
    if peak is not None and not _numbers([peak]):
        return "extra_info.device_memory_peak_bytes is not a number"
    checksums = extra.get("loss_sha256_per_round")
    if checksums is not None and not (isinstance(checksums, list) and all(isinstance(c, str) for c in checksums)):
        return "extra_info.loss_sha256_per_round is not a list of strings"
    return None


def _summary(rounds: list[list[float]]) -> dict[str, Any]:
    flat = sorted(v for r in rounds for v in r)
    from rkit.readers.outcome import summary

    return {**summary(flat), "samples": rounds}


def as_outcome(label: str, bench: dict[str, Any]) -> dict[str, Any]:
    """A saved result in the shape compare.compare reads; samples are per round."""
    extra = bench["extra_info"]
    data = bench["stats"]["data"]
    steps, at = [], 0
    for size in extra["round_sizes"]:
        steps.append(data[at:at + size])
        at += size
    return {"run": label, "state": "finished", "config_hash": extra.get("config_hash"),
            "image_sha256": extra.get("image_sha256"),
            "loss": {"per_step": extra.get("loss_per_step") or {}, "sha256": extra.get("loss_sha256")},
            "step_time": _summary(steps),
            "tokens_per_sec_per_device": _summary(extra.get("tokens_per_sec_per_device") or []),
            "host_rss_bytes": _summary(extra.get("host_rss_bytes") or []),
            "device_memory_peak_bytes": extra.get("device_memory_peak_bytes"),
            "_math": extra.get("math_sha256"), "_rounds": len(steps),
            "_checksums": extra.get("loss_sha256_per_round") or []}


def verdict(a: dict[str, Any], b: dict[str, Any], limits: outcomes.Limits) -> dict[str, Any]:
    """rkit compare's verdict on two bench results; the loss counts only when the training math is the same."""
    same_math = a["_math"] is not None and a["_math"] == b["_math"]
    result = outcomes.compare(a, b, limits, loss_counts=same_math)
    # Rounds of one side that trained to different losses: the math is not deterministic on this stack.
    unsteady = [side for side, o in (("A", a), ("B", b)) if len(set(o["_checksums"])) > 1]
    return {**result, "same_math": same_math, "rounds": [a["_rounds"], b["_rounds"]],
            "loss_varies_within": unsteady}


def render(result: dict[str, Any]) -> str:
    text = outcomes.render(result)
    if result["loss_varies_within"]:
        text += ("\nnote: the rounds of " + " and ".join(result["loss_varies_within"]) + " trained to different "
                 "losses: this stack is not deterministic (reproducibility.deterministic: true)")
    return text


# ---------------------------------------------------------------- running rounds
def run_label(recipe_name: str, label: str, index: int, stamp: str) -> str:
    return f"{recipe_name}-bench-{stamp}-{label}{index}"


def order(rounds: int, sides: list[str]) -> list[tuple[str, int]]:
    """Interleaved: A1 B1 A2 B2 ... so that a drift of the machine hits every side alike."""
    return [(side, i) for i in range(1, rounds + 1) for side in sides]


def run_rounds(train: Callable[[str, int], Round], rounds: int, sides: list[str],
               echo: Callable[[str], None]) -> dict[str, list[Round]]:
    """Train the rounds in interleaved order; `train(side, index)` runs one fresh run to its end."""
    done: dict[str, list[Round]] = {side: [] for side in sides}
    plan = order(rounds, sides)
    for n, (side, index) in enumerate(plan, 1):
        echo(f"rkit bench: round {n}/{len(plan)}: {side} {index} training ...")
        r = train(side, index)
        done[side].append(r)
        st = r.outcome["step_time"]
        echo(f"rkit bench: round {n}/{len(plan)}: {side} {index}: {r.path} step time median "
             f"{(st['median'] or 0) * 1000:.1f} ms over {st['n']} steps, loss {r.outcome['loss']['sha256']}; "
             f"so far {so_far(done)}")
    return done


def so_far(done: dict[str, list[Round]]) -> str:
    """Each side's median step time over all its rounds' steady-state steps so far, e.g.
    `baseline 12.1 ms (2 rounds), candidate 12.9 ms (1 round)`."""
    parts = []
    for side, rs in done.items():
        samples = [v for r in rs for v in r.outcome["step_time"].get("samples") or []]
        if samples:
            parts.append(f"{side} {statistics.median(samples) * 1000:.1f} ms ({len(rs)} round{'s' * (len(rs) > 1)})")
    return ", ".join(parts) or "nothing"


def stamp_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")


class RoundFailed(RkitError):
    """A round did not finish: no result is saved; `rkit status RUN` says why (130 when it was interrupted)."""

    exit_code = 1

    def __init__(self, message: str, state: str):
        super().__init__(message)
        self.exit_code = 130 if state == "interrupted" else 1


def check_recipes(recipe_path: Path, sides: dict[str, list[str]]) -> dict[str, Any]:
    """Every side's recipe validated before any run starts (a bad override is exit 2 with nothing run)."""
    from rkit.recipe.load import load_recipe

    return {side: load_recipe(recipe_path, overrides) for side, overrides in sides.items()}


def fresh_round(recipe_path: Path, overrides: list[str], name: str, echo: Callable[[str], None]) -> Round:
    """One fresh run of the recipe through its own launcher (a Slurm recipe as a Slurm job, followed)."""
    from rkit.readers import outcome
    from rkit.readers import status as run_status
    from rkit.recipe.load import load_recipe
    from rkit.run import runner
    from rkit.run.policy import RunState

    recipe = load_recipe(recipe_path, [*overrides, f"name={name}"])  # the round's name wins over any -o name=
    run, state = runner.run_recipe(recipe, resume=False, injections=[], chronicle=outcome.chronicle)
    if state is RunState.PENDING:
        state = run_status.follow(run, echo=echo)
    if state is not RunState.FINISHED:
        raise RoundFailed(f"{run.path}: the round ended {state.value}; nothing saved (rkit status {run.path})",
                          state.value)
    return Round(run.path, run.load_resolved(), run.load_manifest(), outcome.load(run.path))


def measure(recipe_path: Path, sides: dict[str, list[str]], rounds: int,
            echo: Callable[[str], None]) -> dict[str, list[Round]]:
    recipes = check_recipes(recipe_path, sides)
    stamp = stamp_now()
    names = {side: recipes[side].name for side in sides}
    return run_rounds(lambda side, i: fresh_round(recipe_path, sides[side], run_label(names[side], side, i, stamp),
                                                  echo), rounds, list(sides), echo)


def json_of(path: Path) -> dict[str, Any]:
    value = load_json(path, "result saved by rkit bench (pytest-benchmark's JSON)")
    if not isinstance(value, dict):
        raise RkitError(f"{path}: not a result saved by rkit bench (not a JSON object)")
    return value


SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def safe_name(name: str) -> str:
    """A saved result's name is part of its file name: letters, digits, . _ - (no path, no glob)."""
    if not SAFE_NAME.fullmatch(name):
        raise RkitError(f"--save {name!r}: use letters, digits, '.', '_' and '-' (it becomes the file "
                        "NNNN_NAME.json in the storage)")
    return name


def bench_of(document: dict[str, Any]) -> dict[str, Any]:
    return document["benchmarks"][0]


def gate(recipe_path: Path, baseline: list[str], candidate: list[str], rounds: int, limits: outcomes.Limits,
         echo: Callable[[str], None], store=None, save_name: str | None = None) -> dict[str, Any]:
    """`rkit bench gate`: baseline and candidate rounds interleaved, then the verdict on the candidate."""
    done = measure(recipe_path, {"baseline": baseline, "candidate": candidate}, rounds, echo)
    machine, commit = machine_and_commit()
    docs = {side: result_json(f"{save_name or 'gate'}-{side}", done[side], machine, commit) for side in done}
    saved = [str(save(store, f"{save_name}-{side}", docs[side])) for side in docs] if save_name else []
    result = verdict(as_outcome("baseline", bench_of(docs["baseline"])),
                     as_outcome("candidate", bench_of(docs["candidate"])), limits)
    return {**result, "overrides": {"baseline": baseline, "candidate": candidate}, "saved": saved}


def render_gate(result: dict[str, Any]) -> str:
    o = result["overrides"]
    head = [f"gate: {result['rounds'][0]} baseline and {result['rounds'][1]} candidate rounds, interleaved",
            f"  baseline  -o {' -o '.join(o['baseline']) or '(the recipe as written)'}",
            f"  candidate -o {' -o '.join(o['candidate']) or '(the recipe as written)'}"]
    head += [f"  saved {p}" for p in result["saved"]]
    verdict_line = ("gate: PASS, the candidate is no worse" if result["agree"] else
                    "gate: FAIL, " + ("; ".join(filter(None, [
                        "slower or larger: " + ", ".join(result["worse"]) if result["worse"] else "",
                        "trains to a different loss with the same training math"
                        if result["same_math"] and not result["loss"]["agree"] else ""]))))
    return "\n".join([*head, render(result), verdict_line])
