"""A GPU set per process (devices.py): each local rank's share through the vendor's visibility variable, in its
environment manifest and an event; a GPU count that does not split evenly is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.parametrize("vendor,names", [("nvidia", ["CUDA_VISIBLE_DEVICES"]), ("amd", ["HIP_VISIBLE_DEVICES"]),
                                          ("", ["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"])])
def test_each_local_rank_gets_its_share_of_the_node_gpus(vendor: str, names: list[str]):
    from rkit.runtime import devices

    env = {devices.GPUS_ENV: "8", devices.PER_NODE_ENV: "4", devices.VENDOR_ENV: vendor}
    shares = [devices.binding(env, r) for r in range(4)]
    assert [s[names[0]] for s in shares] == ["0,1", "2,3", "4,5", "6,7"]
    assert all(sorted(s) == sorted(names) for s in shares)
    # The step's own GPUs (Slurm narrowed them): the share is taken from that list.
    narrowed = {**env, "ROCR_VISIBLE_DEVICES": "4,5,6,7", devices.PER_NODE_ENV: "2"}
    assert devices.binding(narrowed, 1)[names[0]] == "6,7"
    assert devices.binding({**env, devices.PER_NODE_ENV: "1"}, 0) == {}  # one process per node: all of them
    assert devices.binding({devices.PER_NODE_ENV: "4"}, 0) == {}  # no GPU count: nothing bound
    assert devices.local_rank({"SLURM_LOCALID": "3"}, 9) == 3 and devices.local_rank(env, 6) == 2
    assert devices.vendor_of(["--rocm"]) == "amd" and devices.vendor_of(["--nv"]) == "nvidia"


def test_the_binding_reaches_the_rank_env_manifest_and_an_event(tmp_path: Path, monkeypatch):
    from rkit.contract.rundir import RunDir
    from rkit.runtime import agent, devices

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    ctx = agent.AgentContext(run=run, attempt=1, rank=3, processes=4, coordinator="", base_config="base.yml",
                             injections=())
    env = {devices.GPUS_ENV: "8", devices.PER_NODE_ENV: "4", devices.VENDOR_ENV: "amd", "SLURM_LOCALID": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("ROCR_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    import os

    assert agent.bind_devices(ctx, os.environ) == {"HIP_VISIBLE_DEVICES": "2,3"}
    (event,) = [e for e in run.events() if e["event"] == "agent.devices"]
    assert event["local_rank"] == 1 and event["variables"] == {"HIP_VISIBLE_DEVICES": "2,3"}
    captured = json.loads(agent.write_env_manifest(ctx).read_text())
    assert captured["environment"]["HIP_VISIBLE_DEVICES"] == "2,3"


def test_gpus_that_do_not_split_evenly_are_refused(cli):
    from ..conftest import TINY

    done = cli("validate", str(TINY), "-o", "resources.gpus_per_node=3", check=2)
    assert "resources.gpus_per_node" in done.stderr and "multiple of processes_per_node" in done.stderr
    cli("validate", str(TINY), "-o", "resources.gpus_per_node=4", check=0)
