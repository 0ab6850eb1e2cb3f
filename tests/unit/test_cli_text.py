"""What the text views and help print for a person: no Python `None`, no raw Unix times, every option explained."""

from __future__ import annotations

import json
from pathlib import Path

from rkit.readers import compare
from rkit.runtime.inject import KINDS

from .synthetic_run import write_run
from .test_compare import LOSSES, noisy, record


def test_run_help_names_every_inject_kind_and_logs_rank_is_explained(cli):
    text = " ".join(cli("run", "--help", check=0).stdout.split())  # click wraps the help
    for kind, fields in KINDS.items():
        assert f"{kind}:" in text and all(f"{field}=" in text for field in fields), kind
    logs = " ".join(cli("logs", "--help", check=0).stdout.split())
    assert "--rank INTEGER Whose log: the process's rank (from 0)." in logs


def test_compare_text_has_no_python_none():
    a = {**record(LOSSES, noisy(0.1, seed=1)), "state": None}
    b = {**record(LOSSES, noisy(0.1, seed=2)), "image_sha256": "sha256:" + "ef" * 32}
    text = compare.render(compare.compare(a, b))
    assert "None" not in text
    assert "A r (state not recorded)  vs  B r (finished)" in text
    assert "images differ: no image (the host's Python) vs sha256:efefefefefef" in text
    assert "device_memory_peak         n/a (not recorded for both runs)" in text


def test_diff_prints_times_in_iso_8601_utc(tmp_path: Path, cli):
    runs = []
    for name, created in (("a", 1_700_000_000.25), ("b", 1_700_003_661.0)):
        path = write_run(tmp_path / name)
        stamp = json.loads((path / "manifest.json").read_text())
        stamp["run"] = {"name": name, "created": created}
        (path / "manifest.json").write_text(json.dumps(stamp))
        runs.append(str(path))
    text = cli("diff", *runs, check=0).stdout
    assert "  created: 2023-11-14T22:13:20Z -> 2023-11-14T23:14:21Z" in text and "1700000000" not in text
    raw = json.loads(cli("diff", *runs, "--json", check=0).stdout)
    assert {"key": "created", "a": 1_700_000_000.25, "b": 1_700_003_661.0} in raw["groups"]["run"]
