"""rkit's command line: parse, call the library, print. No logic lives here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from rkit import __version__
from rkit.cliopts import json_option, limits_options, overrides_option
from rkit.contract.errors import RecipeError, RkitError


class RkitGroup(click.Group):
    """Turns an RkitError into one readable message and exit code 2 (no traceback for user mistakes)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except RkitError as exc:
            click.echo(f"rkit: error: {exc}", err=True)
            ctx.exit(exc.exit_code)



@click.group(cls=RkitGroup)
@click.version_option(__version__, prog_name="rkit")
def main() -> None:
    """Resilient, reproducible MaxText training: rkit run RECIPE, then rkit status RUN."""


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@overrides_option
@json_option
def validate(recipe: Path, overrides: tuple[str, ...], as_json: bool) -> None:
    """Check RECIPE against the schema; report every problem with its key and line."""
    from rkit.recipe.load import load_recipe
    from rkit.run.runner import validate_maxtext_keys

    try:
        loaded = load_recipe(recipe, overrides)
        note = validate_maxtext_keys(loaded)
    except RecipeError as exc:
        if as_json:
            click.echo(json.dumps({"valid": False, "file": exc.source,
                                   "problems": [p.as_dict() for p in exc.problems]}, indent=2))
            sys.exit(2)
        raise
    if as_json:
        click.echo(json.dumps({"valid": True, "file": str(recipe), "config_hash": loaded.config_hash,
                               "resolved": loaded.resolved}, indent=2, sort_keys=True))
    else:
        click.echo(f"{recipe}: valid; config hash {loaded.config_hash}")
    if note:
        click.echo(f"rkit: {note}", err=True)


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@overrides_option
@click.option("--resume", is_flag=True, help="Continue an existing run of the same name and config.")
@click.option("--inject", "injects", multiple=True, metavar="SPEC",
              help="Inject a fault: kill:rank=R,step=S | exit:rank=R,step=S[,code=C] | hang:rank=R,step=S "
                   "| sigterm:step=S (add ,repeat=true to fire every attempt).")
@click.option("--quiet", is_flag=True, help="No live progress display.")
@click.option("--wait", is_flag=True, help="launcher: slurm: follow the job until the run ends.")
@click.option("--dry-run", is_flag=True, help="Print the sbatch script (Slurm) or each rank's command line and "
              "the variables rkit sets (local); write nothing, start nothing.")
def run(recipe: Path, overrides: tuple[str, ...], resume: bool, injects: tuple[str, ...], quiet: bool,
        wait: bool, dry_run: bool) -> None:
    """Validate RECIPE, stamp a run directory and train under the supervisor (here, or as a Slurm job)."""
    from rkit.readers import status as run_status
    from rkit.readers.display import live_progress
    from rkit.recipe.load import load_recipe
    from rkit.run import runner
    from rkit.run.policy import RunState
    from rkit.runtime.inject import parse_injections

    loaded = load_recipe(recipe, overrides)
    injections = parse_injections(injects, loaded.processes, loaded.total_steps)
    if dry_run:
        click.echo(runner.dry_run(loaded, injections))
        return
    with live_progress(enabled=not quiet and loaded.config.launcher == "local",
                       total=loaded.total_steps) as on_progress:
        run_dir, state = runner.run_recipe(loaded, resume=resume, injections=injections, on_progress=on_progress)
    if state is RunState.PENDING:
        click.echo(f"rkit: submitted {run_dir.path} as Slurm job {runner.slurm_job(run_dir)}; "
                   f"follow it with: rkit status {run_dir.path}")
        if not wait:
            return
        state = run_status.follow(run_dir, echo=click.echo)
    click.echo(run_status.render_status(run_status.status(run_dir)))
    if state in (RunState.GAVE_UP, RunState.INTERRUPTED):  # the user's own command, their -o options included
        click.echo(f"rkit: continue it with: {loaded.command('--resume')}")
    sys.exit(state.exit_code())


@main.command(hidden=True)
@click.argument("run_dir", type=click.Path(path_type=Path))
def supervise(run_dir: Path) -> None:
    """(Inside a Slurm batch job) run RUN's attempts as job steps."""
    from rkit.run import runner
    from rkit.run.policy import RunState

    state = runner.supervise(run_dir)
    sys.exit(0 if state is RunState.REQUEUED else state.exit_code())  # requeued: the batch job ends cleanly


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
def cancel(run_dir: Path) -> None:
    """Cancel RUN's Slurm job (scancel); the run stays resumable with `rkit run RECIPE --resume`."""
    from rkit.backends.slurm import launcher as slurm
    from rkit.contract.rundir import EV, RunDir
    from rkit.run import runner

    run = RunDir(run_dir).require()
    job = runner.slurm_job(run)
    if not job:
        raise RkitError(f"{run_dir}: this run was never submitted to Slurm; stop a local run with Ctrl-C.")
    run.emit(EV.JOB_CANCEL_REQUESTED, job_id=job)
    ok = slurm.cancel(job)
    click.echo(f"rkit: {'cancelled' if ok else 'could not cancel'} Slurm job {job}")
    sys.exit(0 if ok else 1)


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--rank", type=int, default=0, show_default=True, help="Whose log: the process's rank (from 0).")
@click.option("--attempt", type=int, default=None, help="Default: the newest.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing as the log grows (Ctrl-C to stop).")
def logs(run_dir: Path, rank: int, attempt: int | None, follow: bool) -> None:
    """Print one process's log of one attempt."""
    from rkit.contract.rundir import RunDir
    from rkit.readers import status as run_status

    run_status.print_log(RunDir(run_dir).require(), rank=rank, attempt=attempt, follow=follow, echo=click.echo)


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--name", help="Name of the new run (default: <name>-reproduce, next to RUN).")
@click.option("--allow-drift", is_flag=True, help="Run even if the image differs; the drift is recorded.")
@click.option("--quiet", is_flag=True, help="No live progress display.")
@limits_options
def reproduce(run_dir: Path, name: str | None, allow_drift: bool, quiet: bool, loss_tolerance: float,
              threshold: float) -> None:
    """Relaunch RUN with its resolved config and the same image digest, through RUN's own launcher (a Slurm run
    as a Slurm job, followed to its end), then compare the outcomes as `rkit compare RUN NEW` does: exit 0 when
    they agree, 1 when they differ. (`rkit diff` compares the inputs.)"""
    from rkit.contract.rundir import RunDir
    from rkit.readers import compare as outcomes
    from rkit.readers import outcome
    from rkit.readers import status as run_status
    from rkit.readers.display import live_progress
    from rkit.run import runner
    from rkit.run.policy import RunState

    config = RunDir(run_dir).config()
    with live_progress(enabled=not quiet and config.launcher == "local", total=config.trainer.steps) as progress:
        new_dir, state = runner.reproduce(run_dir, name=name, allow_drift=allow_drift, on_progress=progress)
    if state is RunState.PENDING:
        click.echo(f"rkit: submitted {new_dir.path} as Slurm job {runner.slurm_job(new_dir)}; following it")
        state = run_status.follow(new_dir, echo=click.echo)
    click.echo(run_status.render_status(run_status.status(new_dir)))
    if state is not RunState.FINISHED:
        sys.exit(state.exit_code())
    result = outcomes.compare(outcome.load(run_dir), outcome.load(new_dir.path),
                              outcomes.Limits(loss_tolerance, threshold))
    click.echo(outcomes.render(result))
    sys.exit(0 if result["agree"] else 1)


@main.group()
def image() -> None:
    """Build, inspect and verify the Apptainer images (containers/*.def)."""


@image.command("build")
@click.argument("flavor", type=click.Choice(["cpu", "rocm", "cuda", "base"]))
@click.option("--build-arg", "build_args", multiple=True, metavar="NAME=VALUE",
              help="Override a build argument of the definition (e.g. MIRROR=http://deb.debian.org/debian).")
@click.option("--force", is_flag=True, help="Rebuild even if the cache has this key.")
@click.option("--verbose", is_flag=True, help="Echo apptainer's build output.")
@click.option("--refresh-debian-lock", is_flag=True,
              help="Take the Debian packages the mirror gives now as containers/lock/FLAVOR.debian.txt (make lock).")
def image_build(flavor: str, build_args: tuple[str, ...], force: bool, verbose: bool,
                refresh_debian_lock: bool) -> None:
    """Build FLAVOR into the content-addressed image cache (an unchanged key is not rebuilt)."""
    from rkit.images import build as images

    overrides = {}
    for item in build_args:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RkitError(f"--build-arg {item!r}: expected NAME=VALUE.")
        overrides[key] = value
    if refresh_debian_lock:
        click.echo(f"rkit: wrote {images.refresh_debian_lock(flavor, overrides, force=force)}", err=True)
        return
    plan = images.plan_build(flavor, overrides, log=lambda line: click.echo(line, err=True))
    click.echo(f"rkit: image {flavor}, key {plan.key}", err=True)
    record = images.build(plan, force=force, echo=(lambda line: click.echo(line, err=True)) if verbose else
                          (lambda line: None))
    how = "cached" if record["cached"] else f"built in {record['build_seconds']} s"
    click.echo(f"rkit: {how}: {record['sha256']}, {record['size_bytes'] / 1e6:.0f} MB", err=True)
    click.echo(record["path"])


@image.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@json_option
def image_inspect(path: Path, as_json: bool) -> None:
    """SHA256 of the SIF, its rkit labels, flavor and package count."""
    from rkit.images import store as images

    info = images.inspect(path)
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    for key in ("path", "sha256", "size_bytes", "flavor", "python", "package_count", "rkit_version"):
        click.echo(f"{key:14} {info[key]}")
    for key, value in info["labels"].items():
        click.echo(f"label          {key} = {value}")


@image.command("verify")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--expect", required=True, metavar="sha256:HEX", help="The digest the image must have.")
def image_verify(path: Path, expect: str) -> None:
    """Exit 0 when PATH's sha256 is the expected one; exit 2 with both digests when not."""
    from rkit.images import store as images

    click.echo(f"{path}: {images.verify(path, expect)} OK")


@image.command("diff")
@click.argument("a")
@click.argument("b")
@json_option
def image_diff(a: str, b: str, as_json: bool) -> None:
    """What differs between two images: labels, Python and Debian packages, definition. Exit 0 when they hold
    the same environment (the same file, or a rebuild), 1 when not."""
    from rkit.images import diff as imagediff

    result = imagediff.diff_images(a, b)
    click.echo(json.dumps(result, indent=2) if as_json else imagediff.render_diff(result))
    sys.exit(0 if result["same_environment"] else 1)


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@json_option
@click.option("--watch", is_flag=True, help="A live view, redrawn every 2 s until the run ends (Ctrl-C to stop).")
def status(run_dir: Path, as_json: bool, watch: bool) -> None:
    """Where RUN is: state and why, step, checkpoints, attempts and their causes, speed, ETA, goodput."""
    from rkit.contract.rundir import RunDir
    from rkit.readers import status as run_status

    if watch and as_json:
        raise RkitError("--watch and --json do not go together: --watch draws for a person, --json prints once.")
    if watch:
        run_status.watch(RunDir(run_dir).require())
        return
    summary = run_status.status(RunDir(run_dir))
    click.echo(json.dumps(summary, indent=2, sort_keys=True) if as_json else run_status.render_status(summary))


@main.command("ls")
@click.argument("runs_dir", type=click.Path(path_type=Path), default=Path("runs"), required=False)
@json_option
def ls_command(runs_dir: Path, as_json: bool) -> None:
    """One line per run in RUNS_DIR (default: runs): name, state, last step (MaxText's, from 0) and steps done,
    loss, config hash and image digest prefixes, launcher, Slurm job id, time since its last event."""
    from rkit.readers import listing

    rows = [listing.row(run) for run in listing.runs_in(runs_dir)]
    click.echo(json.dumps(rows, indent=2, sort_keys=True) if as_json else listing.render(rows))


@main.command("report")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Directory to write into "
              "(default: RUN/report).")
def report_command(run_dir: Path, out: Path | None) -> None:
    """Plots (loss, tokens/s, step time against the step and against wall-clock time; goodput) and a one-page
    summary.md / summary.html of RUN."""
    from rkit.contract.rundir import RunDir
    from rkit.readers.report import write_report

    for path in write_report(RunDir(run_dir), out):
        click.echo(str(path))


@main.group()
def metrics() -> None:
    """A run's metrics for Prometheus, served from its files."""


@metrics.command("serve")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--interface", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=9400, show_default=True,
              help="Port to listen on (0: any free port).")
@click.option("--tls-cert", type=click.Path(dir_okay=False), help="PEM certificate: serve HTTPS.")
@click.option("--tls-key", type=click.Path(dir_okay=False), help="PEM private key of --tls-cert.")
@click.option("--insecure", is_flag=True, help="Plain HTTP on an interface beyond loopback (warned about).")
def metrics_serve(run_dir: Path, interface: str, port: int, tls_cert: str | None, tls_key: str | None,
                  insecure: bool) -> None:
    """Serve RUN's training, node health and attempt metrics at /metrics until Ctrl-C (live or finished).
    Beyond loopback only over HTTPS (--tls-cert, --tls-key), unless --insecure."""
    from rkit.contract.rundir import RunDir
    from rkit.runtime.telemetry import exporter

    exporter.serve_until_interrupted(RunDir(run_dir).require(), interface=interface, port=port, echo=click.echo,
                                     tls_cert=tls_cert, tls_key=tls_key, insecure=insecure)


@main.command()
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@json_option
def diff(a: Path, b: Path, as_json: bool) -> None:
    """Differences between two runs' inputs (or two manifest files), grouped; exit 1 when they differ.
    `rkit compare` compares what the runs came out as."""
    from rkit.readers.diff import diff_sources, render_diff
    from rkit.readers.display import readable_times

    result = diff_sources(a, b)
    click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else render_diff(readable_times(result)))
    sys.exit(0 if result["identical"] else 1)


@main.command("compare")
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@limits_options
@json_option
def compare_command(runs: tuple[Path, ...], loss_tolerance: float, threshold: float, as_json: bool) -> None:
    """Did the runs come out the same? Each RUN after the first against the first: the loss per step (EXACT /
    WITHIN tolerance / DIFFER, the first divergent step), and step time, tokens/s, host and device memory as
    ratios B/A with a 95 % interval (percentile bootstrap of the ratio of medians over the steady-state per-step
    samples). Exit 0 when all agree, 1 when one differs. `rkit diff` compares the inputs."""
    from rkit.readers import compare as outcomes
    from rkit.readers import outcome

    if len(runs) < 2:
        raise RkitError("rkit compare needs two runs or more: rkit compare RUN_A RUN_B [RUN...]")
    base = outcome.load(runs[0])
    results = [outcomes.with_training_differences(
        outcomes.compare(base, outcome.load(other), outcomes.Limits(loss_tolerance, threshold)), runs[0], other)
        for other in runs[1:]]
    if as_json:
        click.echo(json.dumps(results if len(results) > 1 else results[0], indent=2, sort_keys=True))
    else:
        click.echo("\n\n".join(outcomes.render(r) for r in results))
    sys.exit(0 if all(r["agree"] for r in results) else 1)


@main.group()
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

    points = benches.history_points(benches.storage(storage), metric, globs)
    if not points:
        raise RkitError(f"{storage}: no saved rkit bench results; save one with: rkit bench run RECIPE")
    out = out or Path(f"bench-history-{metric}.png")
    benches.plot_history(points, metric, out)
    click.echo(f"{benches.render_history(points, metric)}\nrkit bench: wrote {out}")


if __name__ == "__main__":
    main()
