"""The Slurm tests' shared fixtures: the test bed (at its fast timeouts; a module that needs Slurm's own sets them
and sets them back), a folder the cluster's nodes see, and one clean run per length that every test comparing a loss
reuses (40 steps; 200 for the tests whose fault needs steps left after it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rkit.contract.rundir import RunDir

from ..conftest import missing_test_bed, require_maxtext
from .slurm_helpers import FAST_TIMEOUTS, TESTBED, set_timeouts, submit, wait_finished


@pytest.fixture(scope="session")
def cluster() -> dict[str, str]:
    require_maxtext()
    done = subprocess.run([str(TESTBED), "status"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        missing_test_bed("the Slurm test bed is not up; start it with `ci/slurm-testbed.sh up` (make test does)"
                         f"\n{done.stdout}{done.stderr}")
    seen = subprocess.run([str(TESTBED), "exec", "test", "-x", sys.executable], capture_output=True, check=False)
    if seen.returncode != 0:  # the batch script would fail at once, and each test wait out its timeout
        missing_test_bed(f"the test bed's nodes cannot see {sys.executable} (they see /tmp and /root): run the "
                         "Slurm tests from a checkout under /tmp, as CI does")
    set_timeouts(*FAST_TIMEOUTS)  # whatever an earlier session left
    base = os.environ.get("RKIT_SLURM_BASE", "/opt/rkit-ci/slurm")
    return {"PATH": f"{base}/bin:{os.environ['PATH']}"}


@pytest.fixture(scope="session")
def slurm_workspace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("slurm") / "slurm runs"  # under /tmp: visible inside the cluster
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def clean_run(cluster, slurm_workspace, cpu_image) -> RunDir:
    run = submit(cluster, slurm_workspace, "clean", cpu_image)
    wait_finished(cluster, run)
    return run


@pytest.fixture(scope="session")
def clean_run_200(cluster, slurm_workspace, cpu_image) -> RunDir:
    run = submit(cluster, slurm_workspace, "clean-200", cpu_image, "-o", "trainer.steps=200")
    wait_finished(cluster, run)
    return run
