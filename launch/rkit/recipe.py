"""Recipes: load YAML, apply -o overrides and schema defaults, validate, resolve, hash.

This is the one loader for recipes; the CLI and the tests both go through `load_recipe`.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from .backends.slurm import OWNED_OPTIONS as SLURM_OWNED_OPTIONS
from .config import Config
from .defaults import apply_defaults, schema  # noqa: F401
from .errors import Problem, RecipeError, RkitError
from .stamp import IDENTITY_KEYS, canonical_json, config_hash, hashed_config, is_secret_name  # noqa: F401
from .trainers.maxtext import OWNED_KEYS as OWNED_MAXTEXT_KEYS

MAX_RECIPE_BYTES = 1 << 20

@dataclass(frozen=True)
class Recipe:
    """A validated recipe with defaults and overrides applied: `resolved` is the stamp (resolved.json, the config
    hash), `config` the typed view the rest of rkit reads."""

    source: str
    text: str
    resolved: dict

    @cached_property
    def config(self) -> Config:
        return Config.from_resolved(self.resolved)

    @property
    def name(self) -> str:
        return self.resolved["name"]

    @property
    def config_hash(self) -> str:
        return config_hash(self.resolved)

    @property
    def total_steps(self) -> int:
        return int(self.config.trainer.steps)

    @property
    def processes(self) -> int:
        return self.config.processes


# ---------------------------------------------------------------- reading YAML


def _read_text(path: Path) -> str:
    source = str(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise RkitError(f"{source}: no such recipe file. Give the path of a YAML recipe (see recipes/).") from None
    except OSError as exc:
        raise RkitError(f"{source}: cannot read the recipe: {exc.strerror}.") from None
    if path.is_dir():
        raise RkitError(f"{source}: is a directory, not a recipe file. Give the path of a YAML recipe.")
    if size > MAX_RECIPE_BYTES:
        raise RecipeError(source, [Problem("", f"the file is {size / 1e6:.1f} MB; a recipe is at most "
                                                f"{MAX_RECIPE_BYTES >> 20} MiB of YAML. Is this the right file?")])
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RkitError(f"{source}: cannot read the recipe: {exc.strerror}.") from None
    return decode_recipe_bytes(source, data)


def decode_recipe_bytes(source: str, data: bytes) -> str:
    if b"\x00" in data:
        raise RecipeError(source, [Problem("", "this is a binary file, not a YAML recipe.")])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(source, [Problem("", f"not UTF-8 text (bad byte at offset {exc.start}); "
                                               "save the recipe as UTF-8 YAML.")]) from None


def _yaml_problem(exc: yaml.YAMLError) -> Problem:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    line = mark.line + 1 if mark is not None else None
    problem = getattr(exc, "problem", None) or str(exc)
    return Problem("", f"malformed YAML: {problem}; fix the syntax on this line.", line)


def _compose(source: str, text: str) -> yaml.Node | None:
    """Parse to a node tree (with line numbers), refusing aliases and duplicate keys."""
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                raise RecipeError(source, [Problem("", "YAML aliases (*name) are not supported in recipes; "
                                                       "write the value out.", event.start_mark.line + 1)])
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise RecipeError(source, [_yaml_problem(exc)]) from None
    except RecursionError:
        raise RecipeError(source, [Problem("", "the YAML is nested too deeply to be a recipe.")]) from None
    return node


def _line_index(node: yaml.Node, path: tuple = (), index: dict | None = None) -> dict[tuple, int]:
    """Map each key path to the line (1-based) where it is written."""
    index = {} if index is None else index
    index.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.start_mark)
            index[path + (key,)] = key_node.start_mark.line + 1
            _line_index(value_node, path + (key,), index)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _line_index(item, path + (i,), index)
    return index


def _structural_problems(node: yaml.Node, path: tuple = ()) -> list[Problem]:
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
            problems.extend(_structural_problems(value_node, path + (key,)))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            problems.extend(_structural_problems(item, path + (i,)))
    return problems


def dotted(path: tuple | list) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _non_json_values(value: Any, path: tuple = ()) -> list[Problem]:
    """YAML can express things JSON cannot (dates, NaN, non-string keys); a recipe may not."""
    problems: list[Problem] = []
    if isinstance(value, dict):
        for key, sub in value.items():
            if not isinstance(key, str):
                problems.append(Problem(dotted(path), f"key {key!r} must be a string name; quote it."))
                continue
            problems.extend(_non_json_values(sub, path + (key,)))
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            problems.extend(_non_json_values(sub, path + (i,)))
    elif isinstance(value, float) and not math.isfinite(value):
        problems.append(Problem(dotted(path), f"{value} is not a finite number."))
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        problems.append(Problem(dotted(path), f"{type(value).__name__} values are not allowed; quote it "
                                              "to make it a string."))
    return problems


# ---------------------------------------------------------------- overrides


_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def parse_override_value(raw: str) -> Any:
    """`-o key=value`: the value is read as a YAML scalar, so 20 is an int and true a bool."""
    if _FLOAT_RE.match(raw.strip()) and not re.match(r"^[+-]?\d+$", raw.strip()):
        return float(raw)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, (dict, list)) or value is None and raw.strip() not in ("null", "~"):
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
            target[parts[-1]] = parse_override_value(raw)
    return problems


# ---------------------------------------------------------------- defaults and validation


def _schema_at(path: tuple) -> dict:
    node = schema()
    for part in path:
        node = node.get("properties", {}).get(part, {}) if isinstance(part, str) else node.get("items", {})
    return node


def _schema_problems(data: dict) -> list[Problem]:
    validator = jsonschema.Draft202012Validator(schema())
    problems = []
    for err in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path))):
        path = tuple(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            allowed = sorted(_schema_at(path).get("properties", {}))
            for extra in sorted(set(err.instance) - set(allowed)):
                near = difflib.get_close_matches(str(extra), allowed, n=1)
                hint = f" Did you mean '{near[0]}'?" if near else ""
                problems.append(Problem(dotted(path + (extra,)),
                                        f"unknown key.{hint} Valid keys here: {', '.join(allowed)}."))
        elif err.validator == "required":
            missing = err.message.split("'")[1] if "'" in err.message else err.message
            problems.append(Problem(dotted(path + (missing,)), f"missing required key '{missing}'; add it."))
        elif err.validator == "enum":
            valid = ", ".join(repr(v) for v in err.validator_value)
            problems.append(Problem(dotted(path), f"{err.instance!r} is not one of {valid}."))
        elif err.validator == "type":
            want = err.validator_value if isinstance(err.validator_value, str) else " or ".join(err.validator_value)
            problems.append(Problem(dotted(path), f"{_short(err.instance)} is a {_json_type(err.instance)}; "
                                                  f"expected {want}."))
        elif err.validator == "pattern" and path and path[0] == "name":
            problems.append(Problem("name", f"{err.instance!r} is not a valid run name: use letters, digits, "
                                            "'.', '_' and '-' (at most 128, starting with a letter or digit)."))
        else:
            problems.append(Problem(dotted(path), err.message))
    return problems


def _json_type(value: Any) -> str:
    return {dict: "mapping", list: "list", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _semantic_problems(data: dict) -> list[Problem]:
    problems = []
    trainer = data.get("trainer")
    overrides = trainer.get("overrides") if isinstance(trainer, dict) else None
    if isinstance(overrides, dict):
        for key in sorted(set(overrides) & set(OWNED_MAXTEXT_KEYS)):
            problems.append(Problem(f"trainer.overrides.{key}",
                                    f"rkit sets MaxText's '{key}' itself; use {OWNED_MAXTEXT_KEYS[key]}."))
    if data.get("launcher") == "local" and isinstance(data.get("resources"), dict) \
            and data["resources"].get("nodes", 1) != 1:
        problems.append(Problem("resources.nodes", "the local launcher runs on one node; set 1, or use "
                                                   "launcher: slurm for several."))
    slurm = data.get("slurm")
    if isinstance(slurm, dict):
        for i, option in enumerate(slurm.get("extra_sbatch") or []):
            name = str(option).split("=", 1)[0]
            if name in SLURM_OWNED_OPTIONS:
                problems.append(Problem(f"slurm.extra_sbatch[{i}]", f"rkit sets {name} itself "
                                                                    f"({SLURM_OWNED_OPTIONS[name]})."))
    env = data.get("env")
    if isinstance(env, dict):
        for key in sorted(k for k in env if isinstance(k, str) and is_secret_name(k)):
            problems.append(Problem(f"env.{key}", "looks like a secret; recipes are copied into the run "
                                                  "directory, so set it in the environment of `rkit run` instead "
                                                  "(training processes inherit it and it is never recorded)."))
    return problems


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    path = Path(path)
    return parse_recipe(str(path), _read_text(path), overrides)


def parse_recipe(source: str, text: str, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Validate recipe text; raise RecipeError with every problem found, each with key path and line."""
    node = _compose(source, text)
    if node is None:
        raise RecipeError(source, [Problem("", "the recipe is empty; start from recipes/tiny-cpu.yaml.")])
    if not isinstance(node, yaml.MappingNode):
        raise RecipeError(source, [Problem("", "a recipe is a mapping of sections (name:, trainer:, ...), "
                                               f"not a {'list' if isinstance(node, yaml.SequenceNode) else 'scalar'}.",
                                           node.start_mark.line + 1)])
    lines = _line_index(node)
    problems = _structural_problems(node)
    if not problems:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:  # constructor errors, e.g. an invalid timestamp
            raise RecipeError(source, [_yaml_problem(exc)]) from None
        except RecursionError:
            raise RecipeError(source, [Problem("", "the YAML is nested too deeply to be a recipe.")]) from None
        problems = _non_json_values(data)
    if not problems:
        override_problems = apply_overrides(source, data, list(overrides))
        for p in override_problems:
            p.message += " (from -o)"
        problems = override_problems
    if not problems:
        apply_defaults(data, schema())
        problems = _schema_problems(data) + _semantic_problems(data)
    if problems:
        for p in problems:
            if p.line is None and p.path:
                p.line = _nearest_line(lines, p.path)
        raise RecipeError(source, problems)
    return Recipe(source=source, text=text, resolved=data)


def _nearest_line(lines: dict[tuple, int], path: str) -> int | None:
    parts = tuple(int(p) if re.fullmatch(r"[0-9]+", p) else p for p in re.split(r"\.|\[|\]", path) if p)
    while parts:
        if parts in lines:
            return lines[parts]
        parts = parts[:-1]
    return None
