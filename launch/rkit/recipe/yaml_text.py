"""A recipe's text, read defensively: only a regular file, at most 1 MiB, UTF-8, YAML without aliases, duplicate
keys or deep nesting; values JSON can hold (finite, in range, one line of text); `-o key=value` overrides.
Every problem is a `Problem` naming the key and line; nothing here raises anything but RkitError."""

from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from rkit.contract.errors import Problem, RecipeError, RkitError

MAX_RECIPE_BYTES = 1 << 20
MAX_DEPTH = 32  # sections nest 3 deep; a trainer override may hold a small structure


def read_text(path: Path) -> str:
    """At most MAX_RECIPE_BYTES + 1 bytes, and only from a regular file: a FIFO, a device or /dev/zero would
    block or never end (opened non-blocking, so a FIFO without a writer does not hang the open either)."""
    source = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RkitError(f"{source}: no such recipe file. Give the path of a YAML recipe (see recipes/).") from None
    except OSError as exc:
        raise RkitError(f"{source}: cannot read the recipe: {exc.strerror}.") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise RkitError(f"{source}: is a directory, not a recipe file. Give the path of a YAML recipe.")
        raise RkitError(f"{source}: is not a regular file (a FIFO, device or socket); give the path of a "
                        "YAML recipe file.")
    with os.fdopen(fd, "rb") as fh:
        try:
            data = fh.read(MAX_RECIPE_BYTES + 1)
        except OSError as exc:
            raise RkitError(f"{source}: cannot read the recipe: {exc.strerror}.") from None
    if len(data) > MAX_RECIPE_BYTES:
        size = max(len(data), os.stat(path).st_size)
        raise RecipeError(source, [Problem("", f"the file is {size / 1e6:.1f} MB; a recipe is at most "
                                                f"{MAX_RECIPE_BYTES >> 20} MiB of YAML. Is this the right file?")])
    return decode_recipe_bytes(source, data)


def decode_recipe_bytes(source: str, data: bytes) -> str:
    if b"\x00" in data:
        raise RecipeError(source, [Problem("", "this is a binary file, not a YAML recipe.")])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(source, [Problem("", f"not UTF-8 text (bad byte at offset {exc.start}); "
                                               "save the recipe as UTF-8 YAML.")]) from None


def yaml_problem(exc: yaml.YAMLError) -> Problem:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    line = mark.line + 1 if mark is not None else None
    problem = getattr(exc, "problem", None) or str(exc)
    return Problem("", f"malformed YAML: {problem}; fix the syntax on this line.", line)


def compose(source: str, text: str) -> yaml.Node | None:
    """Parse to a node tree (with line numbers), refusing aliases and duplicate keys."""
    try:
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                raise RecipeError(source, [Problem("", "YAML aliases (*name) are not supported in recipes; "
                                                       "write the value out.", event.start_mark.line + 1)])
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise RecipeError(source, [Problem("", f"the YAML nests more than {MAX_DEPTH} levels deep; a "
                                                           "recipe is a few sections of plain values.",
                                                       event.start_mark.line + 1)])
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise RecipeError(source, [yaml_problem(exc)]) from None
    except RecursionError:
        raise RecipeError(source, [Problem("", "the YAML is nested too deeply to be a recipe.")]) from None
    return node


def line_index(node: yaml.Node, path: tuple = (), index: dict | None = None) -> dict[tuple, int]:
    """Map each key path to the line (1-based) where it is written."""
    index = {} if index is None else index
    index.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.start_mark)
            index[path + (key,)] = key_node.start_mark.line + 1
            line_index(value_node, path + (key,), index)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            line_index(item, path + (i,), index)
    return index


def structural_problems(node: yaml.Node, path: tuple = ()) -> list[Problem]:
    problems: list[Problem] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode):
                problems.append(Problem(dotted(path), "keys must be plain names, not lists or mappings.", line))
                continue
            key = key_node.value
            if key in seen:
                problems.append(Problem(dotted(path + (key,)),
                                        f"duplicate key (first written on line {seen[key]}); keep one.", line))
            seen.setdefault(key, line)
            problems.extend(structural_problems(value_node, path + (key,)))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            problems.extend(structural_problems(item, path + (i,)))
    return problems


def dotted(path: tuple | list) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


PATH_SEPARATORS = ",:%"  # --bind src:dst:opts,src2...; %j %u ... in sbatch --output


PATH_CHARS_WHY = "which Apptainer's --bind and Slurm's --output would read as separators or patterns"


def unsafe_path_chars(path: str) -> str:
    """The characters of `path` that Apptainer's --bind or Slurm's --output would interpret, quoted, or ''."""
    return " ".join(repr(c) for c in PATH_SEPARATORS if c in path)


INT_RANGE = 2**63 - 1
_UNSAFE_CHARS = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")


def _unsafe_text(text: str) -> str | None:
    """Control characters (a newline ends an sbatch directive early) and lone surrogates (bytes that were not
    UTF-8, from `-o`) have no place in a recipe's names or values."""
    found = _UNSAFE_CHARS.search(text)
    if found is None:
        return None
    char = found.group()
    if "\ud800" <= char <= "\udfff":
        return "holds bytes that are not UTF-8 text; write it in UTF-8."
    return f"holds the control character {char!r}; recipe values are one line of printable text."


def unfit_values(value: Any, path: tuple = ()) -> list[Problem]:
    """YAML can express things JSON cannot (dates, NaN, non-string keys), and `-o` can pass anything; a recipe
    may hold neither. Checked after the overrides are applied, so `-o` gets the same checks as the file."""
    problems: list[Problem] = []
    if isinstance(value, dict):
        for key, sub in value.items():
            if not isinstance(key, str):
                problems.append(Problem(dotted(path), f"key {key!r} must be a string name; quote it."))
                continue
            if (why := _unsafe_text(key)) is not None:
                problems.append(Problem(dotted(path), f"the key {short(key)} {why}"))
                continue
            problems.extend(unfit_values(sub, path + (key,)))
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            problems.extend(unfit_values(sub, path + (i,)))
    elif isinstance(value, str):
        if (why := _unsafe_text(value)) is not None:
            problems.append(Problem(dotted(path), f"{short(value)} {why}"))
    elif isinstance(value, bool) or value is None:
        pass
    elif isinstance(value, int) and abs(value) > INT_RANGE:
        problems.append(Problem(dotted(path), f"a number of {len(str(abs(value)))} digits is out of range "
                                              f"(at most {INT_RANGE})."))
    elif isinstance(value, float) and not math.isfinite(value):
        problems.append(Problem(dotted(path), f"{value} is not a finite number."))
    elif not isinstance(value, (int, float)):
        problems.append(Problem(dotted(path), f"{type(value).__name__} values are not allowed; quote it "
                                              "to make it a string."))
    return problems


def unreadable_scalars(node: yaml.Node, path: tuple = ()) -> list[Problem]:
    """A scalar YAML resolves to a type it then cannot build (2024-13-45, a 5000-digit integer): which key."""
    if isinstance(node, yaml.MappingNode):
        return [p for k, v in node.value for p in unreadable_scalars(v, path + (getattr(k, "value", "?"),))]
    if isinstance(node, yaml.SequenceNode):
        return [p for i, v in enumerate(node.value) for p in unreadable_scalars(v, path + (i,))]
    try:
        yaml.constructor.SafeConstructor().construct_object(node)
    except (ValueError, yaml.YAMLError) as exc:
        kind = node.tag.rsplit(":", 1)[-1]
        why = (f"a number of {len(node.value.strip('+-'))} digits is out of range (at most {INT_RANGE})"
               if kind == "int" else f"it reads as a {kind} but is not a valid one ({exc})")
        return [Problem(dotted(path), f"{short(node.value)}: {why}; quote it if it is text.",
                        node.start_mark.line + 1)]
    return []


# ---------------------------------------------------------------- overrides


_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


# Values that are text whatever YAML makes of them: an unquoted 1:30:00 is YAML 1.1's base-60 integer 5400.
TEXT_KEYS = {("slurm", "time")}


def keep_as_written(node: yaml.MappingNode, data: dict) -> None:
    for path in TEXT_KEYS:
        written, target = node, data
        for part in path:
            if not isinstance(written, yaml.MappingNode) or not isinstance(target, dict):
                break
            written = next((v for k, v in written.value if getattr(k, "value", None) == part), None)
            value = target.get(part)
            if part == path[-1] and isinstance(written, yaml.ScalarNode) and isinstance(value, int) \
                    and not isinstance(value, bool):
                target[part] = written.value
            target = value


def parse_override_value(raw: str) -> Any:
    """`-o key=value`: the value is a YAML value, as in the file: 20 is an int, true a bool, [1, 2] a list and
    {a: 1} a mapping (flow style), with the file's limits (no aliases, nesting, duplicate keys, scalars YAML cannot
    build). Text that is not valid YAML is taken as the string it is. ValueError names what is wrong."""
    if _FLOAT_RE.match(raw.strip()) and not re.match(r"^[+-]?\d+$", raw.strip()):
        return float(raw)
    try:
        node = compose("-o", raw)
    except RecipeError as exc:
        if exc.problems and not exc.problems[0].message.startswith("malformed YAML"):
            raise ValueError(exc.problems[0].message) from None
        return raw
    if node is None:
        return raw
    if bad := [*structural_problems(node), *unreadable_scalars(node)]:
        where = f" (at {bad[0].path})" if bad[0].path else ""
        raise ValueError(f"{bad[0].message}{where}")
    try:
        value = yaml.safe_load(raw)
    except (yaml.YAMLError, RecursionError):
        return raw
    if value is None and raw.strip() not in ("null", "~"):
        return raw
    return value


def apply_overrides(source: str, data: dict, overrides: list[str]) -> list[Problem]:
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            problems.append(Problem(key, f"override {item!r} is not key.path=value "
                                         "(for example -o trainer.steps=20)."))
            continue
        if len(parts) > MAX_DEPTH:
            problems.append(Problem(".".join(parts[:3]) + "...", f"override key path of {len(parts)} levels; a "
                                    f"recipe nests at most {MAX_DEPTH}: name a key of the recipe "
                                    "(for example -o trainer.steps=20)."))
            continue
        target = data
        for i, part in enumerate(parts[:-1]):
            nxt = target.get(part)
            if nxt is None:
                nxt = target[part] = {}
            if not isinstance(nxt, dict):
                problems.append(Problem(".".join(parts[: i + 1]),
                                        f"override {item!r} goes inside a value that is not a mapping."))
                break
            target = nxt
        else:
            try:
                value = parse_override_value(raw)
                text = tuple(parts) in TEXT_KEYS and isinstance(value, int) and not isinstance(value, bool)
                target[parts[-1]] = raw.strip() if text else value
            except ValueError as exc:
                problems.append(Problem(key.strip(), str(exc)))
    return problems


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
