"""`rkit status`, `ls`, `report`, `metrics serve`, `diff`, `compare`: the commands that read run directories."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from rkit.cli.options import json_option, limits_options
from rkit.contract.errors import RkitError


@click.command()
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
        from rkit.readers.watch import watch as live_view

        live_view(RunDir(run_dir).require())
        return
    summary = run_status.status(RunDir(run_dir))
    click.echo(json.dumps(summary, indent=2, sort_keys=True) if as_json else run_status.render_status(summary))


@click.command("ls")
@click.argument("runs_dir", type=click.Path(path_type=Path), default=Path("runs"), required=False)
@json_option
def ls_command(runs_dir: Path, as_json: bool) -> None:
    """One line per run in RUNS_DIR (default: runs): name, state, last step (MaxText's, from 0) and steps done,
    loss, config hash and image digest prefixes, launcher, Slurm job id, time since its last event."""
    from rkit.readers import listing

    rows = [listing.row(run) for run in listing.runs_in(runs_dir)]
    click.echo(json.dumps(rows, indent=2, sort_keys=True) if as_json else listing.render(rows))


@click.command("report")
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


@click.group()
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


@click.command()
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


@click.command("compare")
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


COMMANDS = (status, ls_command, report_command, metrics, diff, compare_command)
