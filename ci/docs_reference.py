#!/usr/bin/env python3
"""The generated reference pages of docs/reference/, from the code: the recipe keys from the JSON Schema (whose
descriptions `rkit validate` shares), the CLI from click's own --help, the event vocabulary from contract/events.py,
the exit codes and attempt causes from the run states, the error classes and run/policy.py.

    python ci/docs_reference.py          rewrite every page (make docs-reference)
    python ci/docs_reference.py --check  exit 1 naming each stale page (tests/unit/test_docs.py does the same)
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "launch"))
OUT = REPO / "docs" / "reference"
HEADER = ("Generated from the code by `make docs-reference` (`ci/docs_reference.py`); `tests/unit/test_docs.py` fails "
          "while this page is stale.")


def _cell(text: object) -> str:
    """One table cell: on one line, its pipes escaped, and `<` outside code spans written as an entity (Markdown
    would take `<name>` for an HTML tag and show nothing)."""
    parts = str(text).replace("\n", " ").replace("|", "\\|").split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;") for i, part in enumerate(parts))


# ---------------------------------------------------------------------------------------------- recipe keys


def recipe() -> str:
    from rkit.contract.defaults import schema as load_schema

    schema = load_schema()
    defs = schema.get("$defs", {})

    def resolve(node: dict) -> dict:
        return defs[node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node

    def kind(node: dict) -> str:
        if "enum" in node:
            return " or ".join(f"`{json.dumps(v)}`" for v in node["enum"])
        if "const" in node:
            return f"`{json.dumps(node['const'])}`"
        if "type" in node:
            types = node["type"] if isinstance(node["type"], list) else [node["type"]]
            return ", ".join(types)
        for key in ("oneOf", "anyOf"):
            if key in node:
                return " or ".join(kind(resolve(n)) for n in node[key])
        return "any"

    sections: dict[str, tuple[str, list[str]]] = {"": ("", [])}  # a table per object, in the schema's order

    def walk(node: dict, path: str, required: set[str]) -> None:
        for key, child in node.get("properties", {}).items():
            full = f"{path}.{key}" if path else key
            target = resolve(child)
            description = child.get("description") or target.get("description") or ""
            if target.get("properties"):
                sections[full] = (description, [])
                walk(target, full, set(target.get("required", [])))
                continue
            if "default" in child or "default" in target:
                default = f"`{json.dumps(child.get('default', target.get('default')))}`"
            else:
                default = "required" if key in required else "none"
            sections[path][1].append(f"| `{full}` | {_cell(kind(target))} | {default} | {_cell(description)} |")

    walk(schema, "", set(schema.get("required", [])))
    head = ["| key | type | default | meaning |", "|---|---|---|---|"]
    out = ["# Recipe keys", "", HEADER, "",
           "Every key of a recipe, from the JSON Schema (`launch/rkit/contract/schema/recipe.schema.json`): its "
           "descriptions are the texts `rkit validate` prints, and its defaults the values a recipe without the key "
           "gets. An unknown key is an error. How recipes are read and hashed: [Recipes](../recipes.md)."]
    for name, (description, lines) in sections.items():
        out += ["", f"## `{name}`" if name else "## Top level", ""]
        if description:
            out += [_cell(description), ""]
        out += [*head, *lines] if lines else ["Only the keys of the sections below."]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- the CLI


def cli() -> str:
    import click

    from rkit.cli import main

    out = ["# Command line", "", HEADER, "",
           "Each command's own `--help`, as click prints it. What the commands are for: [Commands](../commands.md).",
           ""]

    def visit(command: click.Command, parent: click.Context | None, name: str) -> None:
        ctx = click.Context(command, info_name=name, parent=parent, terminal_width=100, max_content_width=100)
        path = ctx.command_path
        out.extend([f"## `{path}`", "", "```text", command.get_help(ctx).rstrip(), "```", ""])
        if isinstance(command, click.Group):
            for sub in sorted(command.list_commands(ctx)):
                visit(command.get_command(ctx, sub), ctx, sub)

    visit(main, None, "rkit")
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------- events


def _constants_with_comments(path: Path, cls: str) -> list[tuple[str, str, str]]:
    """(NAME, value, the comment on its line or the lines right under it) for each constant of class `cls`."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    tree = ast.parse(source)
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    found = []
    for node in body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and len(node.targets) == 1:
            name = node.targets[0].id  # type: ignore[attr-defined]
            comment = lines[node.lineno - 1].partition("#")[2].strip() if "#" in lines[node.lineno - 1] else ""
            follow = node.lineno
            while follow < len(lines) and lines[follow].strip().startswith("#"):  # a comment continued below
                comment += " " + lines[follow].strip().lstrip("#").strip()
                follow += 1
            found.append((name, str(node.value.value), comment))
    return found


def events() -> str:
    from rkit.contract import events as ev

    path = Path(ev.__file__)
    out = ["# Events", "", HEADER, "",
           "Every event name of a run's `events.jsonl`, from `launch/rkit/contract/events.py` (`EV`). Each line is "
           "one JSON object with `t` (seconds since 1970) and `event`; what the run directory holds: "
           "[The run directory](../run-directory.md).", "", "| event | what it records |", "|---|---|"]
    for _name, value, comment in _constants_with_comments(path, "EV"):
        out.append(f"| `{value}` | {_cell(comment) or ''} |")
    out += ["", "## Field types", "",
            "An event whose `t` is not a time, whose `event` is not a string, or whose field below has another type "
            "is damaged: readers skip it (`valid_event`).", "", "| field | type |", "|---|---|"]
    for key, want in sorted(ev.EVENT_FIELD_TYPES.items()):
        types = want if isinstance(want, tuple) else (want,)
        out.append(f"| `{key}` | {' or '.join(t.__name__ for t in types)} |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- exit codes, causes


def exit_codes() -> str:
    import importlib
    import pkgutil

    import rkit
    from rkit.contract import errors
    from rkit.run import policy

    # Every module first: the error classes are found as subclasses, and which are defined depends on what is
    # imported (a test session imports more than this script would).
    for module in sorted(m.name for m in pkgutil.walk_packages(rkit.__path__, "rkit.")):
        if not module.endswith("__main__"):
            importlib.import_module(module)

    out = ["# Exit codes and causes", "", HEADER, "",
           "## How `rkit run` (and `rkit reproduce`, `rkit supervise`) ends", "",
           "From the state the run is left in (`RunState.exit_code`; `rkit supervise`, the batch job's own, exits 0 "
           "when it requeued the job):", "", "| state | exit code | meaning |", "|---|---|---|"]
    notes = {value: comment for _n, value, comment in _constants_with_comments(Path(policy.__file__), "RunState")}
    for state in policy.RunState:
        if state.is_final():
            out.append(f"| `{state.value}` | {state.exit_code()} | {_cell(notes.get(state.value, ''))} |")
    out += ["", "## Errors", "", "Any command, on these errors (`launch/rkit/contract/errors.py`): one line "
            "`rkit: error: ...` naming the file, the key and the fix, no traceback, nothing written.", "",
            "| error | exit code | when |", "|---|---|---|"]
    seen: list[type] = []
    stack = [errors.RkitError]
    while stack:
        cls = stack.pop(0)
        seen.append(cls)
        stack.extend(sorted(cls.__subclasses__(), key=lambda c: c.__name__))
    for cls in seen:
        doc = " ".join((cls.__doc__ or "").split())
        out.append(f"| `{cls.__name__}` | {cls.exit_code} | {_cell(doc)} |")
    out += ["", "The comparing commands (`rkit diff`, `compare`, `reproduce`, `bench compare`, `bench gate`, "
            "`image diff`) exit 0 for the same, 1 for different and 2 for bad input; each command's line in "
            "[Commands](../commands.md) says which.", "",
            "## Attempt causes", "",
            "How an attempt ended (`cause` in `attempt.ended`, `rkit status` and its `--json`), from "
            "`launch/rkit/run/policy.py`. Infrastructure causes spend `resilience.max_infra_restarts`, the others "
            "`max_restarts`; what to do about each: [Troubleshooting](../troubleshooting.md).", "",
            "| cause | budget | meaning |", "|---|---|---|"]
    for _name, value, comment in _constants_with_comments(Path(policy.__file__), "Cause"):
        cause = policy.Cause(value)
        budget = "none" if cause in (policy.Cause.COMPLETED, policy.Cause.INTERRUPTED) else (
            "infrastructure" if cause.infrastructure else "training")
        out.append(f"| `{value}` | {budget} | {_cell(comment)} |")
    return "\n".join(out) + "\n"


PAGES: dict[str, Callable[[], str]] = {"recipe.md": recipe, "cli.md": cli, "events.md": events,
                                       "exit-codes.md": exit_codes}


def main(argv: list[str]) -> int:
    stale = []
    for name, render in PAGES.items():
        path, text = OUT / name, render()
        if "--check" in argv:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path.relative_to(REPO)))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    for name in stale:
        print(f"{name} is stale: run `make docs-reference`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
