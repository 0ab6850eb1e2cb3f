"""`rkit bench run|compare|gate|history`: regression benchmarks (readers/bench.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from rkit.cli.options import json_option, limits_options, overrides_option
from rkit.contract.errors import RkitError


@click.group()
def bench() -> None:
    """Regression benchmarks of a recipe, saved in pytest-benchmark's storage (`pytest-benchmark list` and
    `pytest-benchmark compare` read them): run, compare, gate a new image or config, history."""


storage_option = click.option("--storage", type=click.Path(path_type=Path), default=Path(".benchmarks"),
                              show_default=True, help="pytest-benchmark's file storage directory.")


def progress(line: str) -> None:
    """A round's progress: on stderr, so that --json's stdout stays one document."""
    click.echo(line, err=True)


def bench_limits(fn):
    return limits_options(fn, threshold=BENCH_THRESHOLD)


BENCH_THRESHOLD = 0.10


@bench.command("run")
@click.argument("recipe", type=click.Path(path_type=Path))
@overrides_option
@click.option("--rounds", type=click.IntRange(1, 100), default=3, show_default=True, help="Fresh runs to train.")
@click.option("--save", "save_name", metavar="NAME", help="Name of the saved result (default: the recipe's name).")
@storage_option
def bench_run(recipe: Path, overrides: tuple[str, ...], rounds: int, save_name: str | None, storage: Path) -> None:
    """Train ROUNDS fresh runs of RECIPE and save one result: its samples are the steady-state step times, its
    extra info the image digest, config hash, rkit version, hardware fingerprint and loss checksum."""
    from rkit.readers import bench as benches

    store = benches.storage(storage)
    done = benches.measure(recipe, {"run": list(overrides)}, rounds, progress)["run"]
    name = save_name or done[0].resolved["name"]
    machine, commit = benches.machine_and_commit()
    path = benches.save(store, benches.safe_name(name), benches.result_json(name, done, machine, commit))
    st = benches.as_outcome(str(path), benches.bench_of(benches.json_of(path)))["step_time"]
    click.echo(f"rkit bench: saved {path}: step time median {st['median'] * 1000:.2f} ms "
               f"(p10 {st['p10'] * 1000:.2f}, p90 {st['p90'] * 1000:.2f}) over {st['n']} steps of {rounds} round(s)")


@bench.command("compare")
@click.argument("a")
@click.argument("b")
@bench_limits
@storage_option
@json_option
def bench_compare(a: str, b: str, loss_tolerance: float, threshold: float, storage: Path, as_json: bool) -> None:
    """Saved result B against saved result A (a file, a number such as 0003, or a name), with `rkit compare`'s
    verdict: exit 0 when B is no worse, 1 when it is."""
    from rkit.readers import bench as benches
    from rkit.readers import compare as outcomes

    store = benches.storage(storage)
    (pa, ba), (pb, bb) = benches.load_saved(store, a), benches.load_saved(store, b)
    result = benches.verdict(benches.as_outcome(str(pa), ba), benches.as_outcome(str(pb), bb),
                             outcomes.Limits(loss_tolerance, threshold))
    click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else benches.render(result))
    sys.exit(0 if result["agree"] else 1)


@bench.command("gate")
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--baseline", multiple=True, metavar="KEY.PATH=VALUE", help="An override of the baseline (repeat).")
@click.option("--candidate", multiple=True, metavar="KEY.PATH=VALUE", help="An override of the candidate (repeat).")
@click.option("--rounds", type=click.IntRange(1, 100), default=3, show_default=True,
              help="Runs per side, interleaved A B A B ...")
@click.option("--save", "save_name", metavar="NAME", help="Also save both results (NAME-baseline, NAME-candidate).")
@bench_limits
@storage_option
@json_option
def bench_gate(recipe: Path, baseline: tuple[str, ...], candidate: tuple[str, ...], rounds: int,
               save_name: str | None, loss_tolerance: float, threshold: float, storage: Path, as_json: bool) -> None:
    """Before promoting an image or a config: is the candidate slower or larger than the baseline beyond the
    threshold and the noise, or does it train to another loss with the same training math? Exit 1 when it is,
    0 when not. E.g. --baseline image=cpu --candidate image=/path/new.sif"""
    from rkit.readers import bench as benches
    from rkit.readers import compare as outcomes

    store = benches.storage(storage) if save_name else None
    result = benches.gate(recipe, list(baseline), list(candidate), rounds, outcomes.Limits(loss_tolerance, threshold),
                          progress, store, benches.safe_name(save_name) if save_name else None)
    click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else benches.render_gate(result))
    sys.exit(0 if result["agree"] else 1)


@bench.command("history")
@click.argument("globs", nargs=-1)
@click.option("--metric", type=click.Choice(["step_time", "tokens_per_sec_per_device", "host_rss"]),
              default="step_time", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="PNG to write (default: bench-history-METRIC.png).")
@storage_option
def bench_history(globs: tuple[str, ...], metric: str, out: Path | None, storage: Path) -> None:
    """A PNG and a table of METRIC (step time in ms, tokens/s per device, host RSS in MiB) across the saved results
    (or those matching GLOBS): one point per result with its interval, labelled by number, name and image."""
    from rkit.readers import bench as benches
    from rkit.readers import bench_history as history

    points = history.history_points(benches.storage(storage), metric, globs)
    if not points:
        raise RkitError(f"{storage}: no saved rkit bench results; save one with: rkit bench run RECIPE")
    out = out or Path(f"bench-history-{metric}.png")
    history.plot_history(points, metric, out)
    click.echo(f"{history.render_history(points, metric)}\nrkit bench: wrote {out}")


COMMANDS = (bench,)
