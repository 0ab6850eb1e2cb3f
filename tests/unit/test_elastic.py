"""Elastic shrink's pure parts (run/elastic.py and what it changes): the node counts an attempt may train on and
the accumulation that keeps the global batch, the recipes refused before anything starts (with the key and the
fix), sbatch's node range, the injections that rehearse it, and the local launcher's virtual nodes."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rkit.backends.local.launcher import LocalBackend
from rkit.backends.slurm.launcher import sbatch_options
from rkit.contract.errors import RecipeError, RkitError
from rkit.recipe.load import load_recipe
from rkit.run import elastic
from rkit.runtime.inject import parse_injections
from rkit.runtime.trainers.maxtext import maxtext_overrides, mesh_record

from ..conftest import REPO, TINY

SLURM = REPO / "recipes" / "tiny-slurm.yaml"


def config(*overrides: str, recipe: Path = SLURM):
    return load_recipe(recipe, list(overrides)).config


def problems_of(*overrides: str, recipe: Path = SLURM) -> dict[str, str]:
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe, list(overrides))
    return {p.path: p.message for p in err.value.problems}


@pytest.mark.parametrize("nodes,minimum,accumulation,expect", [
    (2, 1, 1, [2, 1]),
    (4, 1, 1, [4, 2, 1]),  # 3 nodes would need 4/3 accumulation steps
    (4, 1, 3, [4, 2, 1]),  # 3 nodes would take 4 steps' worth each, but 12 devices' shards of what 4 divide
    (8, 1, 3, [8, 4, 2, 1]),  # not 6 (48 devices: a 4096-wide embedding does not divide) nor 3
    (8, 6, 1, [8]),  # none from 6 to 7: refused below
    (3, 3, 1, [3]),
    (6, 2, 1, [6, 3, 2]),
    ("data", 1, 3, [4, 3, 2, 1]),  # 4 nodes, the data axis auto, fsdp 1: only the batch is sharded, per device
])
def test_the_sizes_keep_the_global_batch_and_every_sharded_dimension(nodes, minimum, accumulation, expect):
    mesh = ["trainer.overrides.ici_data_parallelism=-1", "trainer.overrides.ici_fsdp_parallelism=1"] \
        if nodes == "data" else []
    nodes = 4 if nodes == "data" else nodes
    c = config(f"resources.nodes={nodes}", f"resources.min_nodes={min(minimum, nodes)}",
               f"trainer.overrides.gradient_accumulation_steps={accumulation}", *mesh) if expect != [8] else None
    if c is None:
        assert "resources.min_nodes" in problems_of(f"resources.nodes={nodes}", f"resources.min_nodes={minimum}")
        return
    assert elastic.sizes(c) == expect
    for n in expect:
        shape = elastic.shape(c, n)
        # devices x per_device_batch_size x accumulation: the same global batch at every size
        assert shape.nodes * shape.gradient_accumulation_steps == nodes * accumulation
        assert shape.processes == n * c.resources.processes_per_node and shape.shrunk == (n < nodes)


def test_the_size_for_the_healthy_nodes():
    c = config("resources.nodes=4", "resources.min_nodes=2")
    assert [elastic.size_for(c, h) for h in (5, 4, 3, 2, 1, 0)] == [4, 4, 2, 2, None, None]
    wait = config("resources.nodes=4", "resources.min_nodes=2", "resources.when_short=wait")
    assert [elastic.size_for(wait, h) for h in (4, 3, 2)] == [4, None, None]
    fixed = config("resources.nodes=2")  # no min_nodes: today's behaviour
    assert not fixed.resources.elastic and elastic.size_for(fixed, 1) is None and elastic.problems(fixed) == []


def test_a_shrunk_attempt_gets_its_accumulation_and_a_full_one_none(tmp_path):
    from rkit.contract.rundir import RunDir

    c = config("resources.min_nodes=1", "trainer.overrides.gradient_accumulation_steps=3")
    full = maxtext_overrides(c, RunDir(tmp_path / "r"), "/cache")
    shrunk = maxtext_overrides(c, RunDir(tmp_path / "r"), "/cache", elastic.shape(c, 1).gradient_accumulation_steps)
    assert "gradient_accumulation_steps=3" in full and "gradient_accumulation_steps=6" in shrunk
    assert len([a for a in shrunk if a.startswith("gradient_accumulation_steps=")]) == 1


@pytest.mark.parametrize("overrides,key,says", [
    (["trainer.overrides.dataset_type=grain"], "trainer.overrides.grain_use_elastic_iterator",
     "needs Grain's elastic"),
    (["trainer.overrides.dataset_type=hf"], "trainer.overrides.dataset_type", "remove resources.min_nodes"),
    (["trainer.overrides.per_device_batch_size=0.5"], "trainer.overrides.per_device_batch_size", "whole"),
    (["trainer.overrides.ici_fsdp_parallelism=2"], "trainer.overrides.ici_fsdp_parallelism",
     "no data-parallel ici mesh axis is auto"),
    (["trainer.overrides.ici_fsdp_parallelism=1", "trainer.overrides.ici_tensor_parallelism=-1"],
     "trainer.overrides.ici_tensor_parallelism", "not data-parallel"),
    (["resources.min_nodes=3"], "resources.min_nodes", "more than resources.nodes"),
])
def test_a_recipe_that_cannot_shrink_is_refused_with_the_key_and_the_fix(overrides, key, says):
    found = problems_of("resources.min_nodes=1", *overrides)
    assert key in found and says in found[key], found


def test_a_recipe_that_can_shrink_passes():
    c = config("resources.min_nodes=1", "trainer.overrides.ici_fsdp_parallelism=1",
               "trainer.overrides.ici_data_parallelism=-1")  # another data-parallel axis takes the change
    assert c.resources.elastic and elastic.problems(c) == []
    # the same recipe without min_nodes is not checked at all
    assert elastic.problems(config("trainer.overrides.dataset_type=grain")) == []


def test_the_local_launcher_takes_several_nodes_only_to_rehearse_a_shrink():
    assert "resources.nodes" in problems_of("resources.nodes=2", "resources.processes_per_node=1", recipe=TINY)
    c = config("resources.nodes=2", "resources.processes_per_node=1", "resources.min_nodes=1", recipe=TINY)
    backend = LocalBackend(nodes=2, processes_per_node=1)
    host = socket.gethostname()
    assert backend.healthy_nodes() == [f"{host}-node0", f"{host}-node1"]
    request = backend.prepare(attempt=1, processes=c.processes, trainer_args=[], base_env={},
                              attempt_dir=Path("/nonexistent"), cwd=Path("/"), port=1)
    assert request.nodes == (f"{host}-node0", f"{host}-node1")
    backend.exclude.append(f"{host}-node0")
    shrunk = backend.prepare(attempt=2, processes=1, trainer_args=[], base_env={}, attempt_dir=Path("/nonexistent"),
                             cwd=Path("/"), port=1)
    assert shrunk.nodes == (f"{host}-node1",) and [r.env["RKIT_NPROCS"] for r in shrunk.ranks] == ["1"]
    assert LocalBackend().healthy_nodes() == [host]  # one node: the machine, as before


def test_sbatch_asks_for_a_node_range_and_survives_a_lost_node():
    opts = sbatch_options(config("resources.min_nodes=1", "slurm.spare_nodes=0"))
    assert "--nodes=1-2" in opts and "--no-kill" in opts
    wait = sbatch_options(config("resources.min_nodes=1", "resources.when_short=wait", "slurm.spare_nodes=0"))
    assert "--nodes=2" in wait  # the full size only: the job waits for it
    plain = sbatch_options(config("slurm.spare_nodes=0"))
    assert "--nodes=2" in plain and "--no-kill" not in plain
    assert "--nodes=1-3" in sbatch_options(config("resources.min_nodes=1", "slurm.spare_nodes=1"))


def test_the_rehearsal_injections_are_checked_against_the_launcher():
    local = config("resources.nodes=2", "resources.processes_per_node=1", "resources.min_nodes=1", recipe=TINY)
    [lose] = parse_injections(["lose_node:rank=1,step=5"], local.processes, 30, local)
    assert lose.kind == "lose_node" and not lose.in_trainer and lose.rank == 1
    with pytest.raises(RkitError, match="crash a node for real"):
        parse_injections(["lose_node:rank=1,step=5"], 2, 30, config("resources.min_nodes=1"))
    with pytest.raises(RkitError, match="min_nodes below"):
        parse_injections(["lose_node:rank=1,step=5"], 2, 30, config(recipe=TINY))
    with pytest.raises(RkitError, match="launcher: slurm"):
        parse_injections(["preempt:step=5"], 2, 30, local)
    [preempt] = parse_injections(["preempt:step=5"], 2, 30, config())
    assert preempt.kind == "preempt" and not preempt.in_trainer


class MaxTextConfig:
    mesh_axes = ["data", "stage", "fsdp", "tensor"]
    num_slices = 1
    ici_data_parallelism, ici_fsdp_parallelism, ici_tensor_parallelism = 1, -1, 2
    dcn_data_parallelism, dcn_fsdp_parallelism, dcn_tensor_parallelism = -1, 1, 1
    per_device_batch_size, gradient_accumulation_steps, global_batch_size_to_train_on = 2.0, 3, 48


def test_the_mesh_record_resolves_the_auto_axes():
    assert mesh_record(MaxTextConfig(), 8) == {"devices": 8, "mesh": {"ici_fsdp": 4, "ici_tensor": 2},
                                               "per_device_batch_size": 2.0, "gradient_accumulation_steps": 3,
                                               "global_batch": 48}


def test_a_shrunk_attempts_hang_timeout_scales_with_its_accumulation():
    from rkit.run.watchdog import HangPolicy, HangWatch

    c = config("resources.nodes=8", "resources.min_nodes=1", "resilience.hang_factor=3")
    learned = [30.0] * 50  # 8 nodes: 30 s a step; on 2 nodes each step does 4 accumulation steps' work
    shrunk = elastic.rescaled(learned, c, 8, 2)
    assert shrunk == [120.0] * 50 and elastic.rescaled(shrunk, c, 2, 8) == learned

    def timeout(times: list[float]) -> float:
        watch = HangWatch(HangPolicy.from_config(c, 1000), [0], 0.0, step_times=list(times))
        watch.progress(0, 5, None, 1.0)  # past the first step: the learned median counts
        return watch.timeout_for(0)

    # 3 x 30 s would call every 120 s step of the shrunk attempt a hang; 3 x 120 s does not
    assert timeout(learned) == 90.0 and timeout(shrunk) == 360.0


def test_shrink_refuses_a_base_config_it_cannot_read_rather_than_assume_its_values(tmp_path):
    base = tmp_path / "model.yml"
    base.write_text("gradient_accumulation_steps: 2\nper_device_batch_size: 4\ndataset_type: synthetic\n")
    c = config("resources.nodes=4", "resources.min_nodes=2", f"trainer.base_config={base}")
    assert elastic.accumulation(c) == 2 and elastic.problems(c) == []  # read here: its values count
    base.unlink()  # the file is only on the cluster's file system, not where rkit runs
    (found,) = elastic.problems(c)
    assert found.path == "trainer.base_config" and "will not assume them" in found.message
