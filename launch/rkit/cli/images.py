"""`rkit image build|inspect|verify|diff`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from rkit.cli.options import json_option
from rkit.contract.errors import RkitError


@click.group()
def image() -> None:
    """Build, inspect and verify the Apptainer images (containers/*.def)."""


@image.command("build")
@click.argument("flavor", type=click.Choice(["cpu", "rocm", "cuda", "base"]))
@click.option("--build-arg", "build_args", multiple=True, metavar="NAME=VALUE",
              help="Override a build argument of the definition (e.g. MIRROR=http://deb.debian.org/debian).")
@click.option("--force", is_flag=True, help="Rebuild even if the cache has this key.")
@click.option("--verbose", is_flag=True, help="Echo apptainer's build output.")
@click.option("--refresh-debian-lock", is_flag=True,
              help="Take the Debian packages the mirror gives now as the flavor's Debian lock "
                   "(containers/bases.json's debian_lock, in containers/lock/; make lock).")
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


COMMANDS = (image,)
