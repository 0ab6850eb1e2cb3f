"""The package's layers, read from its imports (every `import` and `from ... import` in every module, those inside
functions too): no circle between modules; `contract/` imports nothing of rkit but itself (and the package's
version); `runtime/` imports only `contract/` and itself. Those two folders are the image side (the image cache key
and the agent rkit binds into images: images/store.image_side_files), so this is what keeps a host-side change out
of the images and the bound agent self-contained."""

from __future__ import annotations

import ast
from pathlib import Path

from rkit.images.store import PACKAGE, image_side_files

IMAGE_SIDE = ("rkit.contract", "rkit.runtime")


def module_name(path: Path) -> str:
    parts = ["rkit", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in path.parts}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The rkit modules `name` imports (a name imported from a package counts as its submodule when it is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "rkit")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "rkit":
                continue
            subs = {f"{source}.{a.name}" for a in node.names} & known
            found.update(subs or {source})
    return {module for module in found if module != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports_of(name, path, known) & known for name, path in found.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def inside(module: str, folder: str) -> bool:
    return module == folder or module.startswith(folder + ".")


def test_no_module_imports_itself_back_through_others():
    assert circles(graph()) == []


def test_the_checker_sees_a_circle_and_a_submodule_imported_from_its_package():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    edges = graph()
    assert "rkit.contract.rundir" in edges["rkit.runtime.agent"]
    assert "rkit.runtime.telemetry.metrics" in edges["rkit.readers.status"]  # imported from its package


def test_contract_imports_nothing_of_rkit_but_itself():
    wrong = {name: sorted(m for m in deps if not inside(m, "rkit.contract") and m != "rkit")
             for name, deps in graph().items() if inside(name, "rkit.contract")}
    assert {name: deps for name, deps in wrong.items() if deps} == {}


def test_runtime_imports_only_the_contract_and_itself():
    wrong = {name: sorted(m for m in deps if not inside(m, "rkit.runtime") and not inside(m, "rkit.contract")
                          and m != "rkit")
             for name, deps in graph().items() if inside(name, "rkit.runtime")}
    assert {name: deps for name, deps in wrong.items() if deps} == {}


def test_the_image_side_is_the_contract_and_runtime_folders_whole():
    files = image_side_files()
    on_disk = {path.relative_to(PACKAGE).as_posix() for folder in ("contract", "runtime")
               for path in (PACKAGE / folder).rglob("*") if path.is_file() and "__pycache__" not in path.parts}
    assert set(files) == on_disk | {"__init__.py"}
    assert "contract/schema/recipe.schema.json" in files and "runtime/agent.py" in files
    assert not [f for f in files if f.startswith(("run/", "readers/", "images/", "backends/", "recipe/", "cli"))]
    # Every image-side module is in the list, and nothing it imports is outside it.
    side = {name for name in modules() if name.startswith(IMAGE_SIDE)}
    listed = {module_name(PACKAGE / f) for f in files if f.endswith(".py")}
    assert side <= listed
    for name in side:
        assert graph()[name] <= listed | {"rkit"}, name
