"""docs/modules.md is generated from the package's tree (ci/module_table.py): this fails while it is stale, as the
golden files do, and names the command that rewrites it."""

from __future__ import annotations

import importlib.util

from ..conftest import REPO


def generator():
    spec = importlib.util.spec_from_file_location("module_table", REPO / "ci" / "module_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_module_table_is_the_one_the_tree_gives():
    written = (REPO / "docs" / "modules.md").read_text(encoding="utf-8")
    assert written == generator().render(), "docs/modules.md is stale: run `make module-table` and commit it"


def test_every_folder_says_what_it_is_for_and_every_module_has_a_first_sentence():
    table = generator()
    folders = {p.parent for p in table.PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert {f.relative_to(table.PACKAGE).as_posix() for f in folders if not table.docstring(f / "__init__.py")} == set()
    modules = [p for p in table.PACKAGE.rglob("*.py") if "__pycache__" not in p.parts and p.name != "__init__.py"]
    assert [p.name for p in modules if not table.first_sentence(table.docstring(p))] == []
    assert table.first_sentence("Is it fit? Two causes. More.") == "Is it fit?"
