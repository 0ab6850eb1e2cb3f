"""`rkit validate`, `run`, `supervise` (inside a Slurm job), `cancel`, `logs`, `reproduce`, `prune`: the commands
that make, drive or clear up runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from rkit.cli.options import json_option, limits_options, overrides_option
from rkit.contract.errors import RecipeError, RkitError


def load_readers() -> None:
    """Import what the supervisor's chronicle and the final status need (Supervisor.on_launched)."""
    import rkit.readers.outcome
    import rkit.readers.status  # noqa: F401


def chronicle(run, config, final: bool) -> None:
    """readers/outcome.chronicle, imported when first called (load_readers has imported it by then)."""
    from rkit.readers.outcome import chronicle as readers_chronicle

    readers_chronicle(run, config, final)


@click.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@overrides_option
@json_option
def validate(recipe: Path, overrides: tuple[str, ...], as_json: bool) -> None:
    """Check RECIPE against the schema and its data settings against this host's files; report every problem
    with its key and line."""
    from rkit.run.plan import load_checked

    try:
        loaded, note = load_checked(recipe, overrides, whole=True)
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


@click.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@overrides_option
@click.option("--resume", is_flag=True, help="Continue an existing run of the same name and config.")
@click.option("--inject", "injects", multiple=True, metavar="SPEC",
              help="Inject a fault: kill:rank=R,step=S | exit:rank=R,step=S[,code=C] | hang:rank=R,step=S "
                   "| sigterm:step=S | preempt:step=S (Slurm) | lose_node:rank=R,step=S (local, with "
                   "resources.min_nodes) | lose_local:rank=R,step=S | kill_restore:rank=R[,step=S] "
                   "(with checkpoint.local_dir) (add ,repeat=true to fire every attempt).")
@click.option("--quiet", is_flag=True, help="No live progress display.")
@click.option("--wait", is_flag=True, help="launcher: slurm: follow the job until the run ends.")
@click.option("--dry-run", is_flag=True, help="Print the plan `rkit run` executes: the sbatch script and the first "
              "attempt's srun line (Slurm), or its command lines (local), with the variables rkit sets; write "
              "nothing, start nothing.")
def run(recipe: Path, overrides: tuple[str, ...], resume: bool, injects: tuple[str, ...], quiet: bool,
        wait: bool, dry_run: bool) -> None:
    """Validate RECIPE, stamp a run directory and train under the supervisor (here, or as a Slurm job)."""
    from rkit.readers.display import live_progress
    from rkit.run import runner
    from rkit.run.plan import load_checked
    from rkit.run.policy import RunState
    from rkit.runtime.inject import parse_injections

    loaded, _ = load_checked(recipe, overrides)
    injections = parse_injections(injects, loaded.processes, loaded.total_steps, loaded.config)
    if dry_run:
        click.echo(runner.dry_run(loaded, injections, resume=resume))
        return
    # The readers (numpy with the digest) are imported once the ranks have started, while they import their
    # trainer: not before the first rank starts (issue 45: rkit's fixed cost per run).
    with live_progress(enabled=not quiet and loaded.config.launcher == "local",
                       total=loaded.total_steps) as on_progress:
        run_dir, state = runner.run_recipe(loaded, resume=resume, injections=injections, on_progress=on_progress,
                                           chronicle=chronicle, on_launched=load_readers)
    from rkit.readers import status as run_status

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


@click.command(hidden=True)
@click.argument("run_dir", type=click.Path(path_type=Path))
def supervise(run_dir: Path) -> None:
    """(Inside a Slurm batch job) run RUN's attempts as job steps."""
    from rkit.run import runner
    from rkit.run.policy import RunState

    state = runner.supervise(run_dir, chronicle)
    sys.exit(0 if state is RunState.REQUEUED else state.exit_code())  # requeued: the batch job ends cleanly


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
def cancel(run_dir: Path) -> None:
    """Cancel RUN's Slurm job (scancel); the run stays resumable with `rkit run RECIPE --resume`."""
    from rkit.backends.slurm import launcher as slurm
    from rkit.contract.events import EV
    from rkit.contract.rundir import RunDir
    from rkit.run import runner

    run = RunDir(run_dir).require()
    job = runner.slurm_job(run)
    if not job:
        raise RkitError(f"{run_dir}: this run was never submitted to Slurm; stop a local run with Ctrl-C.")
    run.emit(EV.JOB_CANCEL_REQUESTED, job_id=job)
    ok = slurm.cancel(job)
    click.echo(f"rkit: {'cancelled' if ok else 'could not cancel'} Slurm job {job}")
    sys.exit(0 if ok else 1)


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--rank", type=int, default=0, show_default=True, help="Whose log: the process's rank (from 0).")
@click.option("--attempt", type=int, default=None, help="Default: the newest.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing as the log grows (Ctrl-C to stop).")
def logs(run_dir: Path, rank: int, attempt: int | None, follow: bool) -> None:
    """Print one process's log of one attempt."""
    from rkit.contract.rundir import RunDir
    from rkit.readers import logs as run_logs

    run_logs.print_log(RunDir(run_dir).require(), rank=rank, attempt=attempt, follow=follow, echo=click.echo)


@click.command()
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
        new_dir, state = runner.reproduce(run_dir, name=name, allow_drift=allow_drift, on_progress=progress,
                                           chronicle=outcome.chronicle)
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


@click.command()
@click.argument("runs_dir", type=click.Path(path_type=Path), default=Path("runs"), required=False)
@click.option("--dry-run", is_flag=True, help="List what would go and how many bytes; remove nothing.")
@click.option("--images", is_flag=True, help="Also cached images no run in RUNS_DIR was made with (each flavor's "
                                             "newest stays).")
@click.option("--caches", is_flag=True, help="Also JAX compilation cache entries and rkit status digests unused for "
                                             "--older-than days.")
@click.option("--older-than", "older_than", type=click.FloatRange(0, 36500), default=30.0, show_default=True,
              metavar="DAYS", help="With --caches: how long unused.")
@json_option
def prune(runs_dir: Path, dry_run: bool, images: bool, caches: bool, older_than: float, as_json: bool) -> None:
    """Free the disk weeks of runs fill: ended runs' checkpoints beyond their final step (finished) or their
    newest 3 (resumable), unfinished saves, quarantined steps; with --images and --caches, those too. Runs a
    supervisor or a Slurm job may still work on are left whole."""
    from rkit.readers import prune as pruning

    found = pruning.plan(runs_dir, images=images, caches=caches, older_than_days=older_than)
    problems = [] if dry_run else pruning.remove(found)
    click.echo(json.dumps(dict(found.as_dict(), dry_run=dry_run, problems=problems), indent=2) if as_json
               else pruning.render(found, dry_run))
    for line in problems if not as_json else ():
        click.echo(f"rkit: {line}", err=True)
    sys.exit(1 if problems else 0)


COMMANDS = (validate, run, supervise, cancel, logs, reproduce, prune)
