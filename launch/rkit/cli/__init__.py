"""rkit's command line: parse, call the library, print. No logic lives here. One module per command group:
runs.py (validate, run, supervise, cancel, logs, reproduce, prune), images.py (rkit image), readers.py (status, ls,
report, metrics, diff, compare), bench.py (rkit bench); options.py holds the options they share."""

from __future__ import annotations

import click

from rkit import __version__
from rkit.contract.errors import RkitError


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


def _register() -> None:
    from rkit.cli import bench, images, readers, runs

    for module in (runs, images, readers, bench):
        for command in module.COMMANDS:
            main.add_command(command)


_register()
