"""A warm standby's imports (runtime/standby.py warm_up) leave MaxText as a cold rank's would find it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ..conftest import require_maxtext

WARM_THEN_READ = """
from rkit.runtime import standby
standby.warm_up()
from maxtext.utils import globals
print(globals.MAXTEXT_ASSETS_ROOT)
"""


def test_a_standby_imports_maxtext_with_the_assets_root_a_bare_tokenizer_name_resolves_in():
    """MaxText reads MAXTEXT_ASSETS_ROOT once, when it is imported. The agent sets it first (set_assets_root); a
    standby imported MaxText without it, and a warm rank of a run with `tokenizer_path: tokenizer.default` (real
    data, recipes/tiny-grain.yaml) failed at once: "Failed to load sentencepiece tokenizer from tokenizer.default"
    (found by the fault campaign, tests/benchmarks/chaos.py, on the Slurm test bed)."""
    require_maxtext()
    env = {k: v for k, v in os.environ.items() if k != "MAXTEXT_ASSETS_ROOT"}
    done = subprocess.run([sys.executable, "-c", WARM_THEN_READ], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    root = Path(done.stdout.strip().splitlines()[-1])
    assert (root / "tokenizers" / "tokenizer.default").is_file(), root
