#!/usr/bin/env python3
"""docs/modules.md, generated from the package's tree: each folder's room (its __init__.py docstring) and each
module's first docstring sentence. `python3 ci/module_table.py > docs/modules.md` (make module-table) rewrites it;
tests/unit/test_module_table.py fails while the page is stale."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "launch" / "rkit"
IMAGE_SIDE = ("contract", "runtime")


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def first_sentence(text: str) -> str:
    flat = " ".join(text.split())
    ends = [flat.index(end) for end in (". ", "? ") if end in flat]  # the first sentence, else all of it
    return flat[: min(ends) + 1] if ends else flat


def render() -> str:
    out = ["# Modules", "",
           "Generated from the package's tree by `python3 ci/module_table.py > docs/modules.md`",
           "(`make module-table`); `tests/unit/test_module_table.py` fails while this page is stale. The image side",
           "is `launch/rkit/__init__.py` with `contract/` and `runtime/`: the image cache key and the agent rkit",
           "binds into images that lack it.", ""]
    folders = sorted({p.parent for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts},
                     key=lambda p: p.relative_to(PACKAGE).parts)
    for folder in folders:
        rel = folder.relative_to(PACKAGE).as_posix()
        name = "launch/rkit/" if rel == "." else f"launch/rkit/{rel}/"
        side = "image side" if rel.split("/")[0] in IMAGE_SIDE else "host side" if rel != "." else "the package"
        out += [f"## `{name}` ({side})", ""]
        room = docstring(folder / "__init__.py")
        out += [line for paragraph in room.split("\n\n") if room for line in (" ".join(paragraph.split()), "")]
        out += ["| module | what it holds |", "|---|---|"]
        for path in sorted(folder.glob("*.py")):
            if path.name == "__init__.py":
                continue
            out.append(f"| `{path.name}` | {first_sentence(docstring(path)).replace('|', '/')} |")
        out.append("")
    out += ["## `RKIT_*` environment variables", "",
            "From `launch/rkit/contract/envvars.py` (tests/unit/test_envvars.py: every name the package uses is",
            "there).",
            "", "| variable | set by | read by | holds |", "|---|---|---|---|"]
    spec = importlib.util.spec_from_file_location("rkit_envvars_table", PACKAGE / "contract" / "envvars.py")
    envvars = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = envvars  # dataclasses look their module up
    spec.loader.exec_module(envvars)
    out += [f"| `{v.name}` | {v.set_by} | {v.read_by} | {v.holds} |" for v in envvars.VARIABLES]
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
