"""The host-side CLI imports and works without JAX or MaxText (they live in the training environment)."""

from __future__ import annotations

import subprocess
import sys

from ..conftest import TINY

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('jax', 'jaxlib', 'maxtext', 'orbax', 'flax'):
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, Block())
import rkit.cli, rkit.run.runner, rkit.readers.status, rkit.readers.report, rkit.runtime.manifest
import rkit.run.supervisor, rkit.readers.display
from rkit.cli import main
sys.argv = ['rkit', 'validate', sys.argv[1]]
main()
"""


def test_cli_imports_and_validates_without_jax_or_maxtext():
    done = subprocess.run([sys.executable, "-c", BLOCKER, str(TINY)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "valid; config hash sha256:" in done.stdout
