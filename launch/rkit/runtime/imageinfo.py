"""Runs inside an image while it is built: writes /etc/rkit/image.json (the labels, the package list and the
image's environment identity, envscan.py) and appends `org.rkit.environment.sha256 <identity>` to the build's
labels file (Apptainer's $APPTAINER_LABELS), so that the image says what it holds inside and as a label.

    python -m rkit.runtime.imageinfo /etc/rkit/image.json --flavor cpu --definition-sha256 ... [--key value]...

Standard library only: it runs in the image's fresh venv before anything else is trusted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata

from rkit.runtime import envscan

FIELDS = ("flavor", "definition-sha256", "lock-sha256", "base-reference", "base-digest", "rkit-version",
          "build-date", "mirror", "debian-lock-sha256")
ENVIRONMENT_LABEL = "org.rkit.environment.sha256"


def installed_packages() -> dict[str, str]:
    from rkit.runtime.manifest import packages

    return packages()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rkit.runtime.imageinfo")
    parser.add_argument("out")
    parser.add_argument("--labels-file", default=None)
    for field in FIELDS:
        parser.add_argument(f"--{field}", default=None)
    args = parser.parse_args(argv)
    info = {field.replace("-", "_"): getattr(args, field.replace("-", "_")) for field in FIELDS}
    info.update({"python": platform.python_version(), "python_executable": sys.executable,
                 "packages": installed_packages(), "rkit_installed": metadata.version("rkit")})
    env = envscan.environment(sys.version.split()[0], envscan.python_packages(), envscan.debian_packages(),
                              args.definition_sha256, args.lock_sha256, args.debian_lock_sha256)
    info.update({"environment": env, "environment_sha256": envscan.identity(env)})
    if args.labels_file:
        with open(args.labels_file, "a", encoding="utf-8") as fh:
            fh.write(f"{ENVIRONMENT_LABEL} {info['environment_sha256']}\n")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(info, fh, indent=2, sort_keys=True)
        fh.write("\n")


if __name__ == "__main__":
    main()
