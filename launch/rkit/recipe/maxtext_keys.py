"""MaxText's own keys, checked before anything starts: every `trainer.overrides` key against the config of the
MaxText the run will use (the image's, through apptainer; the host's Python for `image: none`), with the closest
known names, and each value against the type MaxText's config declares where it is a simple one (a number, a
flag, a string, a choice). MaxText itself only says `ValueError: 'learning_rat' not in ...` in a rank log, after
the image, the supervisor and jax.distributed have started (minutes).

The keys come from MaxText's pydantic config (`maxtext.configs.types.MaxTextConfig`, its fields and its nested
models' fields: the same walk as pyconfig's `_check_for_invalid_keys`), or from its `configs/base.yml` where an
older MaxText has no such model. They are read once per image (memoised by digest, beside the image probe) and
once per host MaxText (memoised by its file's size and time)."""

from __future__ import annotations

import difflib
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rkit.contract.errors import Problem, RecipeError, RkitError
from rkit.contract.rundir import write_json_atomic
from rkit.contract.safeio import private_dir
from rkit.images.store import apptainer, cache_dir

if TYPE_CHECKING:
    from rkit.images.identity import ImageIdentity
    from rkit.recipe.load import Recipe

MEMO_VERSION = "v2"

# Run by the Python that will train (argv: none). Prints one JSON line: {"maxtext": version, "source": ...,
# "keys": {name: kinds-or-null}}; kinds is a list of "integer", "number", "boolean", "string", "null", or
# {"enum": [...], "null": bool}; null where the type is not a simple one (then only the key is checked).
EXTRACT = r"""
import json, os, sys
from importlib import metadata, util
def version():
    for name in ("maxtext", "MaxText"):
        try:
            return metadata.version(name)
        except Exception:
            pass
    return None
SIMPLE = {"integer", "number", "boolean", "string", "null"}
def kinds(schema, defs):
    if "$ref" in schema:
        schema = defs.get(schema["$ref"].split("/")[-1], {})
    if "enum" in schema:
        return {"enum": [v for v in schema["enum"] if v is not None], "null": None in schema["enum"]}
    if "anyOf" in schema:
        out, enum, null = [], None, False
        for branch in schema["anyOf"]:
            k = kinds(branch, defs)
            if k is None:
                return None
            if isinstance(k, dict):
                if enum is not None:
                    return None
                enum, null = k["enum"], null or k["null"]
            else:
                out += [x for x in k if x not in out]
        if enum is not None:
            return {"enum": enum, "null": null or "null" in out} if set(out) <= {"null"} else None
        return out
    t = schema.get("type")
    if isinstance(t, str) and t in SIMPLE:
        return [t]
    return None
def from_model():
    from maxtext.configs import types
    from pydantic import TypeAdapter
    out = {}
    def walk(fields):
        for name, field in fields.items():
            annotation = getattr(field, "annotation", None)
            try:
                schema = TypeAdapter(annotation).json_schema()
                out[name] = kinds(schema, schema.get("$defs", {}))
            except Exception:
                out[name] = None
            if hasattr(annotation, "model_fields"):
                walk(annotation.model_fields)
    walk(types.MaxTextConfig.model_fields)
    return out, "maxtext.configs.types.MaxTextConfig"
def from_base_yml():
    import yaml
    for name in ("maxtext", "MaxText"):
        spec = util.find_spec(name)
        if spec and spec.submodule_search_locations:
            path = os.path.join(list(spec.submodule_search_locations)[0], "configs", "base.yml")
            if os.path.isfile(path):
                with open(path) as fh:
                    return {k: None for k in yaml.safe_load(fh)}, path
    raise ImportError("no MaxText config model and no configs/base.yml")
try:
    keys, source = from_model()
except Exception as first:
    try:
        keys, source = from_base_yml()
    except Exception as exc:
        print(json.dumps({"error": f"{type(first).__name__}: {first}; {type(exc).__name__}: {exc}"}))
        sys.exit(0)
def configs():
    for name in ("maxtext", "MaxText"):
        spec = util.find_spec(name)
        if spec and spec.submodule_search_locations:
            root = os.path.join(list(spec.submodule_search_locations)[0], "configs")
            found = []
            for folder, _, files in os.walk(root):
                found += [os.path.relpath(os.path.join(folder, f), root) for f in files
                          if f.endswith((".yml", ".yaml"))]
            return sorted(found)[:5000]
    return []
print(json.dumps({"maxtext": version(), "source": source, "keys": keys, "configs": configs()}))
"""


def _run(argv: list[str]) -> dict[str, Any]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": str(exc)}
    lines = done.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if lines else None
    except ValueError:
        found = None
    if not isinstance(found, dict) or ("keys" not in found and "error" not in found):
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}
    return found


def _memoised(memo: Path, argv: list[str]) -> dict[str, Any]:
    try:
        found = json.loads(memo.read_text(encoding="utf-8"))
        if isinstance(found, dict) and isinstance(found.get("keys"), dict):
            return found
    except (OSError, ValueError):
        pass
    found = _run(argv)
    if isinstance(found.get("keys"), dict):
        try:
            private_dir(memo.parent)
            write_json_atomic(memo, found)
        except OSError:
            pass  # a read-only cache: read them again next time
    return found


def image_keys(image: ImageIdentity) -> dict[str, Any]:
    memo = cache_dir() / "probes" / f"{image.sha256.split(':')[-1]}.maxtext-keys.{MEMO_VERSION}.json"
    return _memoised(memo, [apptainer(), "exec", "--cleanenv", "--no-home", image.path, image.python, "-c",
                            EXTRACT])


def host_keys(python: str = sys.executable) -> dict[str, Any]:
    """The keys of the MaxText this Python imports (found without importing it: 3 s of imports, once)."""
    from importlib import util

    try:
        spec = util.find_spec("maxtext") if python == sys.executable else None
    except (ImportError, ValueError):  # a finder that refuses it: ask the Python itself
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return _run([python, "-c", EXTRACT])
    root = Path(list(spec.submodule_search_locations)[0])
    stamp = []
    for name in ("configs/types.py", "configs/base.yml"):
        try:
            st = (root / name).stat()
            stamp.append(f"{st.st_size}-{st.st_mtime_ns}")
        except OSError:
            stamp.append("-")
    import hashlib

    key = hashlib.sha256(f"{python}\0{root}\0{'/'.join(stamp)}".encode()).hexdigest()[:16]
    return _memoised(cache_dir() / "probes" / f"host-{key}.maxtext-keys.{MEMO_VERSION}.json", [python, "-c", EXTRACT])


# ---------------------------------------------------------------- the check (pure)

TRUE_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0", "t", "f", "y", "n"}


def _fits(kind: str, value: Any) -> bool:
    """As MaxText takes a value (a string from the command line, parsed, then pydantic's lax coercion)."""
    if kind == "null":
        return value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", ""))
    if kind == "boolean":
        return isinstance(value, bool) or value in (0, 1) or (isinstance(value, str)
                                                                and value.strip().lower() in TRUE_WORDS)
    if kind in ("integer", "number"):
        if isinstance(value, bool):  # pydantic's lax mode takes a flag for a number
            return True
        if isinstance(value, (int, float)):
            return kind == "number" or (math.isfinite(value) and float(value).is_integer())
        if isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                return False
            return kind == "number" or (math.isfinite(number) and number.is_integer())
        return False
    if kind == "string":
        return not isinstance(value, (dict, list))
    return True


def _describe(kinds: Any) -> str:
    if isinstance(kinds, dict):
        choices = ", ".join(repr(v) for v in kinds["enum"])
        return f"one of {choices}" + (" or none" if kinds.get("null") else "")
    words = {"integer": "an integer", "number": "a number", "boolean": "true or false", "string": "a string",
             "null": "none"}
    return " or ".join(words[k] for k in kinds)


def value_problem(kinds: Any, value: Any) -> str | None:
    """Why MaxText would refuse `value` for a key of these kinds; None when it fits or the type is not simple."""
    if kinds is None:
        return None
    if isinstance(kinds, dict):
        if kinds.get("null") and _fits("null", value):
            return None
        if value in kinds["enum"] or (isinstance(value, str) and value.strip() in map(str, kinds["enum"])):
            return None
    elif any(_fits(k, value) for k in kinds):
        return None
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return f"{shown} is not {_describe(kinds)}, which MaxText's config declares for it"


def problems(overrides: dict, keys: dict[str, Any], where: str) -> list[Problem]:
    """Every override MaxText would refuse: an unknown key (with the closest known names), a value of the wrong
    simple type. `where` names the MaxText that was asked."""
    found = []
    known = sorted(keys)
    for key, value in sorted(overrides.items(), key=lambda kv: str(kv[0])):
        path = f"trainer.overrides.{key}"
        if key not in keys:
            # the nearest names of the first unknown keys only: a file of 40,000 of them answers in seconds
            near = difflib.get_close_matches(str(key), known, n=3, cutoff=0.75) if len(found) < 100 else []
            hint = f" Did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
            found.append(Problem(path, f"MaxText has no key {str(key)!r} ({where}).{hint} Fix the name, or drop "
                                       "it; MaxText would refuse the run at start-up."))
        elif value is not None and (why := value_problem(keys[key], value)) is not None:
            found.append(Problem(path, f"{why} ({where})."))
    return found


def check(recipe: Recipe, image: ImageIdentity | None, locked: str | None = None) -> str | None:
    """Raise RecipeError naming each override MaxText would refuse. Returns a note when the keys could not be
    read (no MaxText on this host for `image: none`, a MaxText whose config cannot be listed): the run goes on,
    MaxText checks them itself at start-up. `locked`: the image is not at hand (not built yet, no apptainer
    here) and its lock pins this MaxText version: the host's MaxText answers for it when it is that version."""
    overrides = recipe.config.trainer.overrides or {}
    slurm_python = recipe.config.launcher == "slurm" and image is None and recipe.config.slurm.python
    if image is not None:
        found, where = image_keys(image), f"MaxText in image {Path(image.path).name}"
    elif locked is not None:
        found = host_keys()
        if found.get("maxtext") != locked:
            return (f"note: trainer.overrides not checked against MaxText: the image is not at hand and this host's "
                    f"MaxText is {found.get('maxtext') or 'not installed'}, not the {locked} the image locks; "
                    "MaxText checks them at start-up")
        where = f"MaxText {locked} of {sys.executable}, the version the image locks"
    elif slurm_python:
        return (f"note: trainer.overrides not checked against MaxText: slurm.python ({slurm_python}) runs on the "
                "cluster's nodes; MaxText checks them at start-up")
    else:
        found, where = host_keys(), f"MaxText of {sys.executable}"
    if not isinstance(found.get("keys"), dict):
        return (f"note: trainer.overrides not checked against MaxText ({where}: {found.get('error', '?')}); "
                "MaxText checks them at start-up")
    where += f" {found['maxtext']}" if found.get("maxtext") and locked is None else ""
    bad = problems(overrides, found["keys"], where)
    if (why := base_config_problem(str(recipe.config.trainer.base_config), found.get("configs"), where)):
        bad.append(Problem("trainer.base_config", why))
    if bad:
        raise RecipeError(recipe.source, locate(recipe, bad))
    return None if locked is None else f"note: trainer.overrides checked against {where}, as the image is not at hand"


MAX_CONFIG_BYTES = 1 << 20


def base_config_problem(name: str, shipped: list[str] | None, where: str) -> str | None:
    """Why MaxText could not start from this base config: a path that is not a regular YAML mapping file of at
    most 1 MiB, or a name that is not one of the configs shipped with MaxText (`shipped`, relative to its
    configs/; None when unknown). None when it can."""
    import os
    import stat

    import yaml

    path = Path(name).expanduser()
    if path.is_absolute() or os.path.lexists(path) or (shipped is not None and name not in shipped and
                                                        name.startswith((".", "~"))):
        try:
            info = os.stat(path)
        except OSError as exc:
            return f"{name!r}: {exc.strerror}; give a MaxText config file or a name from MaxText's configs/"
        if not stat.S_ISREG(info.st_mode):
            return f"{name!r} is not a regular file; give a MaxText config file (YAML)"
        if info.st_size > MAX_CONFIG_BYTES:
            return f"{name!r} is {info.st_size / 1e6:.1f} MB, not a MaxText config (YAML, at most 1 MiB)"
        try:
            with open(path, "rb") as fh:
                value = yaml.safe_load(fh.read(MAX_CONFIG_BYTES + 1))
        except (OSError, yaml.YAMLError, ValueError, RecursionError) as exc:
            return f"{name!r} cannot be read as YAML ({type(exc).__name__}); give a MaxText config file"
        if not isinstance(value, dict):
            return f"{name!r} is not a MaxText config (a YAML mapping of keys, like MaxText's configs/base.yml)"
        return None
    if shipped is None or name in shipped:
        return None
    near = difflib.get_close_matches(name, shipped, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
    return (f"{name!r} is neither a file nor a config shipped with {where} (its configs/).{hint} Give a name "
            "such as base.yml, or a path to your own config")


def locate(recipe: Recipe, found: list[Problem]) -> list[Problem]:
    """Each problem at its recipe line, or at the `-o` option that set it."""
    from rkit.contract.stamp import REDACTED, redact_value
    from rkit.recipe.load import override_origin, recipe_lines

    lines = recipe_lines(recipe)
    for p in found:
        origin = override_origin(recipe.overrides, p.path)
        if origin is not None:
            p.message += f" (from -o {redact_value(origin, REDACTED)})"
        else:
            path = tuple(p.path.split(".", 2))
            p.line = lines.get(path) or lines.get(path[:2])
    return found


def safe_check(recipe: Recipe, image: ImageIdentity | None, locked: str | None = None) -> str | None:
    """`check`, where reading the keys themselves failed for a reason of this machine: a note, never a stop."""
    try:
        return check(recipe, image, locked)
    except RecipeError:
        raise
    except (RkitError, OSError) as exc:
        return f"note: trainer.overrides not checked against MaxText: {exc}"


# ---------------------------------------------------------------- what MaxText derives from trainer.steps


def schedule_steps(resolved: dict) -> int | None:
    """The length of MaxText's learning-rate schedule for a resolved recipe: learning_rate_schedule_steps where
    set (and not -1), else trainer.steps, which MaxText's schedule then follows (warm-up and decay stretch
    with it)."""
    trainer = resolved.get("trainer") if isinstance(resolved, dict) else None
    if not isinstance(trainer, dict):
        return None
    overrides = trainer.get("overrides") if isinstance(trainer.get("overrides"), dict) else {}
    fixed = overrides.get("learning_rate_schedule_steps")
    try:
        if fixed is not None and int(fixed) != -1:
            return int(fixed)
        return int(trainer["steps"])
    except (KeyError, TypeError, ValueError):
        return None


def schedule_change(before: dict, after: dict) -> str | None:
    """Why two resolved recipes train differently although they may look alike: MaxText's learning-rate schedule
    follows trainer.steps unless learning_rate_schedule_steps fixes it. None when the schedules are the same."""
    old, new = schedule_steps(before), schedule_steps(after)
    if old is None or new is None or old == new:
        return None
    return (f"learning-rate schedule differs: {old} vs {new} steps (MaxText's schedule follows trainer.steps "
            "unless trainer.overrides.learning_rate_schedule_steps sets it), so the learning rate differs from "
            "the first steps on")
