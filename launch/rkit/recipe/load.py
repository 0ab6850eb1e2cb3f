"""Recipes: load YAML, apply -o overrides and schema defaults, validate, resolve, hash.

This is the one loader for recipes; the CLI and the tests both go through `load_recipe`.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from rkit.backends.slurm.launcher import OWNED_OPTIONS as SLURM_OWNED_OPTIONS
from rkit.backends.slurm.launcher import owned_option as owned_sbatch_option
from rkit.contract.config import Config
from rkit.contract.defaults import apply_defaults, schema  # noqa: F401
from rkit.contract.errors import Problem, RecipeError, RkitError
from rkit.contract.stamp import (  # noqa: F401 - the hash helpers are reached through this module
    IDENTITY_KEYS,
    canonical_json,
    config_hash,
    hashed_config,
    is_secret_name,
    redact_value,
)
from rkit.recipe.yaml_text import (  # noqa: F401 - parse_override_value: tests use it from here
    PATH_CHARS_WHY,
    apply_overrides,
    compose,
    dotted,
    keep_as_written,
    line_index,
    parse_override_value,
    read_text,
    short,
    structural_problems,
    unfit_values,
    unreadable_scalars,
    unsafe_path_chars,
    yaml_problem,
)
from rkit.run import elastic
from rkit.runtime.trainers.maxtext import OWNED_KEYS as OWNED_MAXTEXT_KEYS


@dataclass(frozen=True)
class Recipe:
    """A validated recipe with defaults and overrides applied: `resolved` is the stamp (resolved.json, the config
    hash), `config` the typed view the rest of rkit reads."""

    source: str
    text: str
    resolved: dict
    overrides: tuple[str, ...] = ()  # the -o options, as given

    @cached_property
    def config(self) -> Config:
        return Config.from_resolved(self.resolved)

    @cached_property
    def lines(self) -> dict[tuple, int]:
        """Each key path of the recipe's text and its line (1-based), read once."""
        node = compose(self.source, self.text)
        return line_index(node) if isinstance(node, yaml.MappingNode) else {}

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

    def command(self, *extra: str, drop: tuple[str, ...] = (), absolute: bool = False) -> str:
        """`rkit run` of this recipe with the user's own -o options (less those setting a key in `drop`), then
        `extra`: what a hint tells the user to type (`absolute`: the recipe's absolute path, for any directory)."""
        import shlex

        kept = [o for o in self.overrides if o.partition("=")[0].strip() not in drop]
        source = str(Path(self.source).resolve()) if absolute else self.source
        return shlex.join(["rkit", "run", source, *(a for o in kept for a in ("-o", o)), *extra])


# ---------------------------------------------------------------- defaults and validation


def _schema_at(path: tuple) -> dict:
    node = schema()
    for part in path:
        node = node.get("properties", {}).get(part, {}) if isinstance(part, str) else node.get("items", {})
    return node


# JSON Schema counts 100.0 as an integer; rkit's typed config (and MaxText's) does not: a step count written 1e2
# or 100.0 is refused here, with the file's other problems, rather than after validation passed.
_STRICT = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=jsonschema.Draft202012Validator
                                       .TYPE_CHECKER.redefine("integer", lambda _, value: isinstance(value, int)
                                                              and not isinstance(value, bool)))


def _schema_problems(data: dict) -> list[Problem]:
    validator = _STRICT(schema())
    problems = []
    for err in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path))):
        path = tuple(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            allowed = sorted(_schema_at(path).get("properties", {}))
            for extra in sorted(set(err.instance) - set(allowed), key=str):  # a YAML key may be null or a number
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
        elif err.validator in ("type", "pattern") and tuple(path) == ("checkpoint", "period"):
            problems.append(Problem("checkpoint.period", f"{short(err.instance)} is not a period; expected an integer "
                                                         "(steps), auto (chosen from the measured save cost and "
                                                         "failure rate) or a time such as 90s, 10m or 1.5h."))
        elif err.validator == "type":
            want = err.validator_value if isinstance(err.validator_value, str) else " or ".join(err.validator_value)
            problems.append(Problem(dotted(path), f"{short(err.instance)} is a {_json_type(err.instance)}; "
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


# MaxText keys that hold credentials end like these (hf_access_token); the environment-variable rule of
# `is_secret_name` is too broad here (tokenizer_path, key_proj, reasoning_start_token are model settings).
SECRET_OVERRIDE_ENDINGS = ("access_token", "auth_token", "api_token", "api_key", "access_key", "secret_key",
                           "private_key", "secret", "password", "passwd", "credentials", "jwt", "cookie")


def is_secret_override(key: str) -> bool:
    return key.lower().endswith(SECRET_OVERRIDE_ENDINGS)


def _semantic_problems(data: dict) -> list[Problem]:
    problems = []
    trainer = data.get("trainer")
    overrides = trainer.get("overrides") if isinstance(trainer, dict) else None
    if isinstance(overrides, dict):
        for key in sorted(set(overrides) & set(OWNED_MAXTEXT_KEYS)):
            problems.append(Problem(f"trainer.overrides.{key}",
                                    f"rkit sets MaxText's '{key}' itself; use {OWNED_MAXTEXT_KEYS[key]}."))
        for key, value in sorted(overrides.items(), key=lambda kv: str(kv[0])):
            strings = [text for _, text in _paths_of_strings(value)]
            if isinstance(key, str) and is_secret_override(key):
                problems.append(Problem(f"trainer.overrides.{key}", "looks like a secret; MaxText prints its "
                                        "config into the rank logs and rkit records overrides in the run "
                                        "directory. Give it to MaxText through its environment instead."))
            elif any(redact_value(text, "") != text for text in strings):
                problems.append(Problem(f"trainer.overrides.{key}", "holds a credential (a password in a URL, a "
                                        "token, a private key); MaxText prints its config into the rank logs and rkit "
                                        "records overrides in the run directory. Use a URL without it and give "
                                        "the credential through the environment (e.g. the storage client's own "
                                        "credentials file or variables)."))
            elif any("${" in text for text in strings):
                problems.append(Problem(f"trainer.overrides.{key}", "an interpolation (${...}) is resolved by "
                                        "MaxText outside the config hash and printed into the rank logs; write "
                                        "the value itself."))
    problems.extend(_elastic_problems(data))
    problems.extend(_local_tier_problems(data))
    ckpt = data.get("checkpoint")
    period = ckpt.get("period") if isinstance(ckpt, dict) else None
    if isinstance(period, str) and re.fullmatch(r"0+(\.0+)?[smh]", period):
        problems.append(Problem("checkpoint.period", f"{period!r} is no time; give more than 0 (e.g. 10m)."))
    if isinstance(ckpt, dict) and isinstance(ckpt.get("min_period"), int) and isinstance(ckpt.get("max_period"), int) \
            and ckpt["min_period"] > ckpt["max_period"]:
        problems.append(Problem("checkpoint.min_period", f"{ckpt['min_period']} is more than checkpoint.max_period "
                                                         f"({ckpt['max_period']}); give min_period <= max_period."))
    if data.get("launcher") == "local" and isinstance(data.get("resources"), dict) \
            and data["resources"].get("nodes", 1) != 1 and not _shrinks(data["resources"]):
        problems.append(Problem("resources.nodes", "the local launcher runs on one node; set 1, or use "
                                                   "launcher: slurm for several (or set resources.min_nodes "
                                                   "below it to rehearse elastic shrink: every node's processes "
                                                   "then run on this machine)."))
    res, slurm = data.get("resources"), data.get("slurm")
    if isinstance(res, dict) and isinstance(res.get("processes_per_node"), int) and res["processes_per_node"] > 1:
        gpus = res.get("gpus_per_node")
        if gpus is None and data.get("launcher") == "slurm" and isinstance(slurm, dict):
            gpus = slurm.get("gpus_per_node")
        if isinstance(gpus, int) and gpus and gpus % res["processes_per_node"]:
            problems.append(Problem("resources.gpus_per_node", f"{gpus} GPUs do not split evenly over "
                                    f"{res['processes_per_node']} processes per node; give a multiple of "
                                    "processes_per_node."))
    if isinstance(slurm, dict):
        extra = slurm.get("extra_sbatch")
        for i, option in enumerate(extra if isinstance(extra, list) else []):  # another type: the schema says so
            name = str(option).split("=", 1)[0]
            if (owned := owned_sbatch_option(name)) is not None:
                means = "" if owned == name else f" ({name} is sbatch's abbreviation of {owned})"
                problems.append(Problem(f"slurm.extra_sbatch[{i}]", f"rkit sets {owned} itself{means}: "
                                                                    f"{SLURM_OWNED_OPTIONS[owned]}."))
    prom = (data.get("observability") or {}).get("prometheus") if isinstance(data.get("observability"), dict) \
        else None
    if isinstance(prom, dict) and prom.get("enabled") and isinstance(prom.get("interface"), str):
        from rkit.runtime.telemetry.exposure import exposure

        why = exposure(prom["interface"], prom.get("tls_cert"), prom.get("tls_key"), bool(prom.get("insecure")),
                       tls_hint="set tls_cert and tls_key", insecure_hint="set insecure: true")
        if why is not None:
            problems.append(Problem("observability.prometheus.interface", why))
    runs_dir = data.get("runs_dir")
    if isinstance(runs_dir, str) and (bad := unsafe_path_chars(runs_dir)):
        problems.append(Problem("runs_dir", f"{runs_dir!r} holds {bad}, {PATH_CHARS_WHY}; pick a directory "
                                            "without them."))
    env = data.get("env")
    if isinstance(env, dict):
        for key, value in sorted(env.items(), key=lambda kv: str(kv[0])):
            secret = (isinstance(key, str) and is_secret_name(key)) or (isinstance(value, str)
                                                                         and redact_value(value, "") != value)
            if secret:
                problems.append(Problem(f"env.{key}", "looks like a secret; recipes are copied into the run "
                                                      "directory, so set it in the environment of `rkit run` "
                                                      "instead (training processes inherit it and it is never "
                                                      "recorded)."))
    for where, text in _paths_of_strings(data):
        if where.split(".")[0] != "env" and not where.startswith("trainer.overrides") \
                and redact_value(text, "") != text:
            problems.append(Problem(where, "holds a credential (a password in a URL, a token, a private key); "
                                           "recipes are copied into the run directory and its records. Give it "
                                           "through the environment of `rkit run` instead."))
    return problems


def _shrinks(res: dict) -> bool:
    return isinstance(res.get("min_nodes"), int) and isinstance(res.get("nodes"), int) \
        and res["min_nodes"] < res["nodes"]


def _elastic_problems(data: dict) -> list[Problem]:
    """resources.min_nodes: at most nodes, and a recipe that can shrink (run/elastic.py)."""
    res = data.get("resources")
    if not isinstance(res, dict) or not isinstance(res.get("min_nodes"), int) or not isinstance(res.get("nodes"), int):
        return []
    if res["min_nodes"] > res["nodes"]:
        return [Problem("resources.min_nodes", f"{res['min_nodes']} is more than resources.nodes ({res['nodes']}); "
                                               "give at most nodes (fewer lets an attempt shrink).")]
    config = _typed(data)
    return [] if config is None else elastic.problems(config)


def _typed(data: dict) -> Config | None:
    """The recipe's typed view for the checks that need one; None when the schema's problems say why not."""
    try:
        return Config.from_resolved(data)
    except RkitError:
        return None


def _local_tier_problems(data: dict) -> list[Problem]:
    """checkpoint.local_dir: a path and a mesh the node-local tier works with (runtime/trainers/localtier.py)."""
    ckpt = data.get("checkpoint")
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("local_dir"), str):
        if isinstance(ckpt, dict) and ckpt.get("local_period") is not None and ckpt.get("local_dir") is None:
            return [Problem("checkpoint.local_period", "is set without checkpoint.local_dir; add local_dir (each "
                                                       "node's own storage) or remove local_period.")]
        return []
    if bad := unsafe_path_chars(ckpt["local_dir"]):
        return [Problem("checkpoint.local_dir", f"{ckpt['local_dir']!r} holds {bad}, {PATH_CHARS_WHY}; pick a "
                                                "directory without them.")]
    config = _typed(data)
    return [] if config is None else _local_tier_config_problems(config)


def _local_tier_config_problems(config: Config) -> list[Problem]:
    """Why this recipe cannot have a node-local tier (runtime/trainers/localtier.py), before anything starts."""
    ckpt = config.checkpoint
    found = []
    where = "trainer.overrides."
    text = str(ckpt.local_dir)
    if not (text.startswith("/") or text.startswith("$")):
        found.append(Problem("checkpoint.local_dir", f"{text!r} is not absolute; give a path on each node's own "
                                                     "storage, e.g. /local/nvme or $SLURM_TMPDIR."))
    if config.processes < 2:
        found.append(Problem("checkpoint.local_dir", "a local tier needs 2 or more processes: Orbax's emergency "
                                                     "manager keeps local checkpoints on the data-parallel "
                                                     "replicas after the first; raise resources.processes_per_node "
                                                     "or nodes, or remove checkpoint.local_dir."))
    data = elastic.setting(config, "ici_data_parallelism")
    if data != -1 and not (isinstance(data, int) and not isinstance(data, bool) and data >= 2):
        found.append(Problem(f"{where}ici_data_parallelism", f"{data!r}: a local tier needs data-parallel replicas "
                                                             "that each hold the whole state (MaxText's data axis); "
                                                             "set ici_data_parallelism to -1 and "
                                                             "ici_fsdp_parallelism to 1 (or a size that divides "
                                                             "each process's devices)."))
    elif data == -1:
        for key, value in sorted(elastic.mesh_settings(config, ("ici",)).items()):
            if key != "ici_data_parallelism" and value == -1:
                found.append(Problem(f"{where}{key}", "-1 (auto) beside ici_data_parallelism -1: MaxText allows "
                                                      "one auto axis; give it a fixed size (1 for fsdp keeps each "
                                                      "replica's state whole on its process)."))
    return found


def _paths_of_strings(value: Any, where: str = "", depth: int = 0) -> Iterator[tuple[str, str]]:
    """(dotted key path, string) for every string inside the recipe, keys included."""
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, dict) and depth < 64:
        for k, v in value.items():
            inner = f"{where}.{k}" if where else str(k)
            yield from _paths_of_strings(k, inner, depth + 1)
            yield from _paths_of_strings(v, inner, depth + 1)
    elif isinstance(value, list) and depth < 64:
        for i, v in enumerate(value):
            yield from _paths_of_strings(v, f"{where}[{i}]", depth + 1)


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    path = Path(path)
    return parse_recipe(str(path), read_text(path), overrides)


def parse_recipe(source: str, text: str, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Validate recipe text; raise RecipeError with every problem found, each with key path and line."""
    node = compose(source, text)
    if node is None:
        raise RecipeError(source, [Problem("", "the recipe is empty; start from recipes/tiny-cpu.yaml.")])
    if not isinstance(node, yaml.MappingNode):
        raise RecipeError(source, [Problem("", "a recipe is a mapping of sections (name:, trainer:, ...), "
                                               f"not a {'list' if isinstance(node, yaml.SequenceNode) else 'scalar'}.",
                                           node.start_mark.line + 1)])
    lines = line_index(node)
    problems = structural_problems(node) or unreadable_scalars(node)
    if not problems:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:  # constructor errors not caught above
            raise RecipeError(source, [yaml_problem(exc)]) from None
        keep_as_written(node, data)
        problems = apply_overrides(source, data, list(overrides))
    if not problems:
        unfit = unfit_values(data)
        apply_defaults(data, schema())
        named = {p.path for p in unfit}
        problems = unfit + [p for p in _schema_problems(data) + _semantic_problems(data) if p.path not in named]
        if problems:
            raise RecipeError(source, placed(problems, lines, overrides),
                              partial=_partial(source, text, data, problems, overrides))
    if problems:
        raise RecipeError(source, placed(problems, lines, overrides))
    return Recipe(source=source, text=text, resolved=data, overrides=tuple(overrides))


def _partial(source: str, text: str, data: dict, problems: list[Problem],
             overrides: list[str] | tuple[str, ...]) -> Recipe | None:
    """The recipe as far as it can be read, for the checks of its data settings and MaxText keys: each value the
    schema refused dropped (its default stands in); None when even that has no typed view."""
    kept = copy.deepcopy(data)
    for problem in problems:
        keys = [k for k in problem.path.split("[", 1)[0].split(".") if k]
        parent = kept
        for key in keys[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if keys and isinstance(parent, dict):
            parent.pop(keys[-1], None)
    apply_defaults(kept, schema())
    if _typed(kept) is None:
        return None
    return Recipe(source=source, text=text, resolved=kept, overrides=tuple(overrides))


def placed(problems: list[Problem], lines: dict[tuple, int], overrides: list[str] | tuple[str, ...]) -> list[Problem]:
    """Each problem with where its value came from: the -o option that set it, else the recipe's line."""
    for p in problems:
        origin = override_origin(overrides, p.path) if p.path else None
        if origin is not None and "(from -o" not in p.message:
            p.message += f" (from -o {redact_value(origin, '<redacted>')})"
        elif p.line is None and p.path and origin is None:
            p.line = _nearest_line(lines, p.path)
    return problems


def override_origin(overrides: list[str] | tuple[str, ...], path: str) -> str | None:
    """The last -o option that set `path` or a key above it (the value the recipe ended up with), as given."""
    parts = tuple(p for p in re.split(r"\.|\[|\]", path) if p)
    for item in reversed(list(overrides)):
        key = tuple(item.partition("=")[0].strip().split("."))
        if key and parts[:len(key)] == key:
            return item
    return None


def recipe_lines(recipe: Recipe) -> dict[tuple, int]:
    """Each key path of the recipe's text and its line (1-based)."""
    return recipe.lines


def _nearest_line(lines: dict[tuple, int], path: str) -> int | None:
    parts = tuple(int(p) if re.fullmatch(r"[0-9]+", p) else p for p in re.split(r"\.|\[|\]", path) if p)
    while parts:
        if parts in lines:
            return lines[parts]
        parts = parts[:-1]
    return None
