"""The documentation: each generated reference page (ci/docs_reference.py) fails here while it is stale, as the
golden files do, and names the command that rewrites it; the pages cover what the code has (every cause on the
troubleshooting page, every command in the command table); the README stays short and its links resolve. The strict
site build (warnings, broken links and anchors are errors) runs here, so `make test` builds the site once."""

from __future__ import annotations

import importlib.util
import re

import pytest

from ..conftest import REPO


def generator():
    spec = importlib.util.spec_from_file_location("docs_reference", REPO / "ci" / "docs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", ["recipe.md", "cli.md", "events.md", "exit-codes.md"])
def test_each_generated_page_is_the_one_the_code_gives(page):
    written = (REPO / "docs" / "reference" / page).read_text(encoding="utf-8")
    assert written == generator().PAGES[page](), f"docs/reference/{page} is stale: run `make docs-reference`"


def test_the_recipe_reference_has_every_schema_key_with_its_description():
    from rkit.contract.defaults import schema

    page = (REPO / "docs" / "reference" / "recipe.md").read_text(encoding="utf-8")
    leaves = []

    def walk(node, path):
        node = schema()["$defs"][node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node
        for key, child in node.get("properties", {}).items():
            target = schema()["$defs"][child["$ref"].rsplit("/", 1)[-1]] if "$ref" in child else child
            if target.get("properties"):
                walk(target, f"{path}{key}.")
            else:
                leaves.append(f"{path}{key}")

    walk(schema(), "")
    assert len(leaves) > 40 and [k for k in leaves if f"| `{k}` |" not in page] == []
    assert "&lt;runs_dir>/&lt;name>" in page  # Markdown would take <name> for a tag and show nothing


def test_every_cause_and_every_way_a_run_stops_is_on_the_troubleshooting_page():
    from rkit.run.policy import Cause

    page = (REPO / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    assert [c.value for c in Cause if f"`{c.value}`" not in page] == []
    for diagnosis in ("crash loop", "restart budget exhausted", "changed since planned", "stopped"):
        assert diagnosis in page


def test_every_command_is_in_the_command_table():
    import click

    from rkit.cli import main

    table = (REPO / "docs" / "commands.md").read_text(encoding="utf-8")
    ctx = click.Context(main, info_name="rkit")
    names = []
    for name in main.list_commands(ctx):
        command = main.get_command(ctx, name)
        if command.hidden:
            continue
        subs = command.list_commands(click.Context(command, parent=ctx)) if isinstance(command, click.Group) else []
        names += [f"rkit {name} {sub}" for sub in subs] or [f"rkit {name}"]
    assert len(names) > 15 and [n for n in names if f"`{n}" not in table] == []


def test_the_readme_is_short_and_its_links_resolve():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) <= 11_000
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links and [link for link in links if "://" not in link and not (REPO / link).exists()] == []


def test_the_site_builds_strictly_and_a_broken_anchor_fails_it(tmp_path):
    # mkdocs' --quiet silences the warnings that --strict turns into errors: never pass it.
    import shutil
    import subprocess
    import sys

    def build(config):
        return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d",
                               str(tmp_path / "site")], capture_output=True, text=True, check=False)

    done = build(REPO / "mkdocs.yml")
    assert done.returncode == 0 and "WARNING" not in done.stderr, done.stderr
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "docs", copy / "docs")
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    with (copy / "docs" / "index.md").open("a") as page:
        page.write("\n[a broken anchor](commands.md#no-such-section)\n")
    done = build(copy / "mkdocs.yml")
    assert done.returncode == 1 and "no-such-section" in done.stderr
