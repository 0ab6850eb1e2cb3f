"""The GPU training recipes in recipes/gpu/: each loads and hashes, renders its Slurm request as golden files a
reviewer can read (tests/golden/gpu-<stem>.sbatch / .argv; RKIT_UPDATE_GOLDEN=1 rewrites them, as for
tiny-slurm), asks Slurm for what the recipe says (nodes, exclusive, 8 GPUs a node, a time limit), spreads a
multi-node run over its nodes with MaxText's dcn_* parallelism, and names only MaxText keys and XLA flags that the
installed maxtext and jaxlib know. No GPU, no Slurm: rendering is a pure function."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rkit.backends.slurm.launcher import render_batch
from rkit.contract.rundir import RunDir
from rkit.recipe.load import load_recipe

from ..conftest import REPO

GOLDEN = REPO / "tests" / "golden"
RECIPES = sorted((REPO / "recipes" / "gpu").glob("*.yaml"))
IDS = [p.stem for p in RECIPES]
GPUS_PER_NODE = 8


def render(path: Path):
    recipe = load_recipe(path)
    return recipe, render_batch(RunDir(Path("/runs") / recipe.name), recipe.config, python="/opt/py/bin/python3")


def option(argv: list[str], name: str) -> list[str]:
    """The values of every `--name=value` item of an sbatch argv."""
    return [item.split("=", 1)[1] for item in argv if item.startswith(f"{name}=")]


def test_there_are_gpu_recipes():
    assert {"llama3-8b-mi300x", "llama2-7b-h100", "llama2-70b-h100-8node"} <= set(IDS)


@pytest.mark.parametrize("path", RECIPES, ids=IDS)
def test_loads_and_has_a_sha256_config_hash(path: Path):
    recipe = load_recipe(path)
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", recipe.config_hash)
    assert recipe.name == path.stem
    assert recipe.config.launcher == "slurm" and recipe.config.image in ("rocm", "cuda")


@pytest.mark.parametrize("path", RECIPES, ids=IDS)
def test_golden_batch_script_and_argv(path: Path):
    _, request = render(path)
    golden_script = GOLDEN / f"gpu-{path.stem}.sbatch"
    golden_argv = GOLDEN / f"gpu-{path.stem}.argv"
    if os.environ.get("RKIT_UPDATE_GOLDEN"):
        golden_script.write_text(request.script)
        golden_argv.write_text("\n".join(request.argv) + "\n")
    assert request.script == golden_script.read_text()
    assert request.argv == golden_argv.read_text().splitlines()


@pytest.mark.parametrize("path", RECIPES, ids=IDS)
def test_the_request_asks_for_what_the_recipe_says(path: Path):
    recipe, request = render(path)
    res, slurm = recipe.config.resources, recipe.config.slurm
    argv = request.argv
    assert option(argv, "--nodes") == [str(res.nodes + slurm.spare_nodes)]  # training nodes plus spares
    assert option(argv, "--ntasks-per-node") == [str(res.processes_per_node)]
    assert "--exclusive" in argv
    assert slurm.gpus_per_node == GPUS_PER_NODE and option(argv, "--gpus-per-node") == [str(GPUS_PER_NODE)]
    assert slurm.time and option(argv, "--time") == [slurm.time]
    assert GPUS_PER_NODE % res.processes_per_node == 0
    # The rendered script says the same, for the reviewer who reads only it.
    assert f"#   --nodes={res.nodes + slurm.spare_nodes}" in request.script.splitlines()
    assert "#   --exclusive" in request.script.splitlines()


def _product(values: list[int], total: int) -> bool:
    """MaxText's rule: the axes multiply to `total`, one of them may be -1 (the rest of it)."""
    fill = [v for v in values if v == -1]
    known = math.prod(v for v in values if v != -1)
    if len(fill) > 1 or known <= 0:
        return False
    return known == total if not fill else total % known == 0


@pytest.mark.parametrize("path", RECIPES, ids=IDS)
def test_the_mesh_covers_the_gpus_and_the_nodes(path: Path):
    recipe = load_recipe(path)
    nodes = recipe.config.resources.nodes
    overrides = recipe.config.trainer.overrides
    ici = [v for k, v in overrides.items() if k.startswith("ici_") and k.endswith("_parallelism")]
    dcn = [v for k, v in overrides.items() if k.startswith("dcn_") and k.endswith("_parallelism")]
    assert ici and _product(ici, GPUS_PER_NODE), f"ici_* parallelism {ici} does not cover a node's GPUs"
    assert _product(dcn or [1], nodes), f"dcn_* parallelism {dcn} does not cover {nodes} node(s)"


def test_the_multi_node_recipe_shards_over_its_nodes():
    multi = [p for p in RECIPES if load_recipe(p).config.resources.nodes > 1]
    assert multi, "recipes/gpu/ has no multi-node recipe"
    for path in multi:
        recipe = load_recipe(path)
        nodes, overrides = recipe.config.resources.nodes, recipe.config.trainer.overrides
        across = {k: overrides.get(k) for k in ("dcn_fsdp_parallelism", "dcn_data_parallelism")}
        assert any(v in (nodes, -1) for v in across.values()), f"{path.name}: {across} for {nodes} nodes"


def _maxtext_base_keys() -> set[str]:
    spec = importlib.util.find_spec("maxtext")  # locates the package without importing it (and JAX)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("maxtext is not installed in this Python")
    base = Path(next(iter(spec.submodule_search_locations))) / "configs" / "base.yml"
    return set(yaml.safe_load(base.read_text()))


@pytest.mark.parametrize("path", RECIPES, ids=IDS)
def test_overrides_are_keys_of_the_installed_maxtext(path: Path):
    """MaxText's config refuses unknown keys (pydantic extra='forbid'): a typo would end the first attempt."""
    unknown = set(load_recipe(path).config.trainer.overrides) - _maxtext_base_keys()
    assert not unknown, f"not MaxText keys: {sorted(unknown)}"


def _xla_refusal(flags: str) -> str | None:
    """Start JAX on the CPU with these XLA_FLAGS (XLA parses its GPU flags there too): None when it accepts them,
    else what it said. XLA aborts on a flag it does not know ("Unknown flag in XLA_FLAGS")."""
    if importlib.util.find_spec("jax") is None:
        pytest.skip("JAX is not installed in this Python")
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.ones(2).block_until_ready()"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    return None if done.returncode == 0 and "Unknown flag" not in done.stderr else done.stderr[-2000:]


def test_the_xla_flag_check_catches_an_unknown_flag():
    # As XLA removes flags (jaxlib 0.12 aborts on --xla_gpu_graph_level=0, still in AMD's older MaxText scripts).
    assert "Unknown flag" in (_xla_refusal("--xla_gpu_enable_latency_hiding_scheduler=true --xla_rkit_no_such=1") or "")


# The GPU benchmark recipes too (recipes/bench/*: the ones with XLA flags).
WITH_FLAGS = RECIPES + [p for p in sorted((REPO / "recipes" / "bench").glob("*.yaml")) if "XLA_FLAGS" in p.read_text()]


@pytest.mark.parametrize("path", WITH_FLAGS, ids=[f"{p.parent.name}/{p.stem}" for p in WITH_FLAGS])
def test_xla_flags_are_known_to_the_installed_jaxlib(path: Path):
    flags = str(load_recipe(path).config.env.get("XLA_FLAGS", ""))
    assert flags.startswith("--"), "a GPU recipe sets XLA_FLAGS"
    refusal = _xla_refusal(flags)
    assert refusal is None, refusal
