"""The recipe schema, the one home of every default, and filling them in. Imports nothing of rkit: the agent
side (telemetry settings inside an image) reads defaults without the recipe loader and jsonschema."""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from importlib import resources
from typing import Any


@lru_cache(maxsize=1)
def schema() -> dict:
    text = resources.files("rkit.contract").joinpath("schema/recipe.schema.json").read_text(encoding="utf-8")
    return json.loads(text)


def apply_defaults(data: Any, node_schema: dict) -> None:
    """Fill in the schema's defaults for absent keys, recursively (defaults live only in the schema)."""
    if not isinstance(data, dict) or node_schema.get("type") != "object":
        return
    for key, sub_schema in node_schema.get("properties", {}).items():
        if key not in data and "default" in sub_schema:
            data[key] = copy.deepcopy(sub_schema["default"])
        if key in data:
            apply_defaults(data[key], sub_schema)
