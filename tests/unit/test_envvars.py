"""contract/envvars.py is every RKIT_* variable the package names: none missing, none stale."""

from __future__ import annotations

import re

from rkit.contract.envvars import BY_NAME, VARIABLES
from rkit.images.store import PACKAGE

NAME = re.compile(r"\bRKIT_[A-Z][A-Z_]*[A-Z]\b")


def named_in_the_package() -> set[str]:
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name != "envvars.py" and "__pycache__" not in path.parts:
            found |= set(NAME.findall(path.read_text(encoding="utf-8")))
    for path in (PACKAGE.parents[1] / "containers").glob("*.def"):  # the build arguments
        found |= set(NAME.findall(path.read_text(encoding="utf-8")))
    return found


def test_every_rkit_variable_the_package_names_is_in_the_table_and_every_entry_is_used():
    used = named_in_the_package()
    assert sorted(used - set(BY_NAME)) == []
    assert sorted(set(BY_NAME) - used) == []
    assert {"RKIT_RANK", "RKIT_IMAGE_CACHE", "RKIT_VERSION"} <= used  # code, the host side and the definitions
    assert len(BY_NAME) == len(VARIABLES) and all(v.set_by and v.read_by and v.holds for v in VARIABLES)
