"""What the benchmark scripts share: running the tiny recipe with the real CLI and reading a run's events.
(The scripts run as `python tests/benchmarks/X.py`, so this directory is on sys.path.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny-cpu.yaml"


def run_tiny(workdir: Path, name: str, *extra: str) -> Path:
    """`rkit run recipes/tiny-cpu.yaml --quiet -o name=NAME EXTRA...` in WORKDIR, to the end; the run directory."""
    subprocess.run([sys.executable, "-m", "rkit.cli", "run", str(TINY), "--quiet", "-o", f"name={name}", *extra],
                   cwd=workdir, check=True, capture_output=True)
    return workdir / "runs" / name


def events(run: Path) -> list[dict]:
    """A run's events so far ([] before the first; a line being written is skipped)."""
    try:
        text = (run / "events.jsonl").read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def first(evs: list[dict], kind: str, **match) -> dict:
    """The first event of KIND whose fields equal MATCH (StopIteration when there is none)."""
    return next(e for e in evs if e["event"] == kind and all(e.get(k) == v for k, v in match.items()))
