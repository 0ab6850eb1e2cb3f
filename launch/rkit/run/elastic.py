"""Elastic shrink (`resources.min_nodes`): which node counts an attempt may train on when nodes are lost and no
spare is left, and what each count changes in MaxText's settings so that the global batch stays the same.

MaxText's global batch is devices x per_device_batch_size x gradient_accumulation_steps (its config's
calculate_global_batch_sizes), and every node has the same devices. On n of N nodes an attempt keeps
per_device_batch_size and trains with gradient_accumulation_steps x N / n: the same tokens per step, the same
synthetic batch (MaxText draws it once, from PRNGKey(0), in the global batch's shape). Only node counts where
that is a whole number are used. Orbax restores the last committed checkpoint into the smaller mesh's shardings
(the arrays' global shapes do not depend on the data-parallel degree); only an auto (-1) data-parallel mesh axis
may absorb the change, so a recipe whose mesh cannot shrink is refused before anything starts (`problems`).

Pure: reads the recipe's values (and its base config file where it is one on this host), never the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rkit.contract.config import Config
from rkit.contract.errors import Problem

# MaxText's configs/base.yml values of the keys elastic shrink reads, where neither the recipe's overrides nor a
# base config file on this host sets them.
MAXTEXT_DEFAULTS: dict[str, Any] = {"per_device_batch_size": 12.0, "gradient_accumulation_steps": 1,
                                    "dataset_type": "synthetic", "ici_fsdp_parallelism": -1,
                                    "dcn_data_parallelism": -1, "grain_use_elastic_iterator": False,
                                    "packing": True, "grain_file_type": "arrayrecord", "grain_train_files": "",
                                    "grain_train_mixture_config_path": ""}
DATA_AXES = ("data", "fsdp", "fsdp_transpose")  # the mesh axes whose size is the data-parallel degree
# Data pipelines whose position carries over to fewer processes. Synthetic data has none; Grain's carries over
# through its elastic iterator only (grain_order_problems); tfds and hf start their iterators over.
CARRIED_DATA = ("synthetic",)


@dataclass(frozen=True)
class Shape:
    """One attempt's size: its nodes and processes, and the accumulation that keeps the global batch."""

    nodes: int
    full_nodes: int
    processes: int
    gradient_accumulation_steps: int
    per_device_batch_size: float

    @property
    def shrunk(self) -> bool:
        return self.nodes < self.full_nodes

    def as_record(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "full_nodes": self.full_nodes, "processes": self.processes,
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "per_device_batch_size": self.per_device_batch_size}


def setting(config: Config, key: str) -> Any:
    """MaxText's value of `key` for this recipe: its override, its base config file's, or base.yml's."""
    overrides = config.trainer.overrides or {}
    if key in overrides:
        return overrides[key]
    return (_base_file_values(config.trainer.base_config) or {}).get(key, MAXTEXT_DEFAULTS.get(key, 1))


def _base_file(base_config: str) -> Path | None:
    """The recipe's base config on this host: its file, else the config of that name in this host's MaxText
    (its shipped configs); None where neither is here (base.yml needs none: MAXTEXT_DEFAULTS are its values)."""
    path = Path(base_config)
    if path.is_file():
        return path
    if path.is_absolute():
        return None
    import importlib.util

    try:
        spec = importlib.util.find_spec("maxtext")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(location) / "configs" / path).is_file():
            return Path(location) / "configs" / path
    return None


def _base_file_values(base_config: str) -> dict[str, Any] | None:
    """A recipe's base config's values, where rkit can read it on this host ({} for base.yml: MAXTEXT_DEFAULTS);
    None where it cannot."""
    if Path(base_config).name == "base.yml":
        return {}
    path = _base_file(base_config)
    if path is None:
        return None
    try:
        import yaml

        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f.read(1 << 20))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def mesh_settings(config: Config, prefixes: tuple[str, ...] = ("ici", "dcn")) -> dict[str, Any]:
    """MaxText's value of each <prefix>_<axis>_parallelism key the recipe or base.yml's defaults name."""
    return {key: setting(config, key) for key in {*MAXTEXT_DEFAULTS, *(config.trainer.overrides or {})}
            if key.split("_", 1)[0] in prefixes and key.endswith("_parallelism")}


def accumulation(config: Config) -> int:
    value = setting(config, "gradient_accumulation_steps")
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 1


def sizes(config: Config) -> list[int]:
    """The node counts an attempt may train on, largest first: nodes, then each count down to min_nodes whose
    accumulation (gradient_accumulation_steps x nodes / count) is a whole number, and, where the axis that
    absorbs the change shards the weights (fsdp: MaxText's default), that divides nodes: its devices then divide
    the full count, so every dimension the full mesh shards (an embedding, the heads) still divides. (6 of 8 nodes
    with accumulation 3 makes the accumulation whole but shards over 48 devices, which typical dimensions do not
    divide: every shrunk attempt would fail the same way.) A data axis shards only the batch, which is per device."""
    full, grad = int(config.resources.nodes), accumulation(config)
    whole = full if shards_weights(config) else grad * full
    return [n for n in range(full, config.resources.fewest_nodes - 1, -1) if whole % n == 0]


def shards_weights(config: Config) -> bool:
    """Whether an auto (-1) mesh axis that absorbs lost nodes is an fsdp one (it shards the weights)."""
    return any(value == -1 and key.split("_", 1)[1].startswith("fsdp")
               for key, value in mesh_settings(config).items())


def rescaled(step_times: list[float], config: Config, before: int, after: int) -> list[float]:
    """Step times measured on `before` nodes, as they would be on `after` (the work per device scales with the
    accumulation, which keeps the global batch)."""
    ratio = shape(config, after).gradient_accumulation_steps / max(1, shape(config, before).gradient_accumulation_steps)
    return [t * ratio for t in step_times]


def shape(config: Config, nodes: int | None = None) -> Shape:
    res = config.resources
    full = int(res.nodes)
    nodes = full if nodes is None else nodes
    pdb = setting(config, "per_device_batch_size")
    return Shape(nodes=nodes, full_nodes=full, processes=nodes * int(res.processes_per_node),
                 gradient_accumulation_steps=accumulation(config) * full // nodes,
                 per_device_batch_size=float(pdb) if isinstance(pdb, (int, float)) else 0.0)


def size_for(config: Config, healthy: int) -> int | None:
    """How many of `healthy` nodes the next attempt trains on; None when it cannot go on here (requeue)."""
    if healthy >= int(config.resources.nodes):
        return int(config.resources.nodes)
    if not config.resources.elastic:
        return None
    return next((n for n in sizes(config) if n <= healthy), None)


def grain_order_problems(config: Config) -> list[Problem]:
    """Why a shrunk attempt could not consume the same tokens at the same global step with this Grain pipeline.
    Grain's per-process iterators belong to their process count; its ElasticIterator (MaxText's
    grain_use_elastic_iterator) keeps one global position, the next global batch, that restores on any count, and
    each step's global batch is the same sequences however they are split (ArrayRecord, random access; no
    packing, which would make a sequence out of several records per process; one pattern, not a mixture)."""
    where = "trainer.overrides."
    wants = "set grain_use_elastic_iterator: true and packing: false (ArrayRecord, one file pattern), or remove " \
            "resources.min_nodes"
    found = []
    if setting(config, "grain_use_elastic_iterator") is not True:
        found.append(Problem(f"{where}grain_use_elastic_iterator", "elastic shrink (resources.min_nodes) with grain "
                                                                   "data needs Grain's elastic iterator: the "
                                                                   "per-process iterators cannot be restored on "
                                                                   f"fewer processes; {wants}."))
    if setting(config, "packing") is not False:
        found.append(Problem(f"{where}packing", "packing joins records into sequences per process, so a shrunk "
                                                "attempt would consume other sequences (and MaxText's elastic "
                                                f"iterator refuses it); {wants}."))
    if setting(config, "grain_file_type") != "arrayrecord":
        found.append(Problem(f"{where}grain_file_type", f"{setting(config, 'grain_file_type')!r}: only ArrayRecord "
                                                        "(random access) has Grain's elastic iterator; convert the "
                                                        "data, or remove resources.min_nodes."))
    if ";" in str(setting(config, "grain_train_files")) or setting(config, "grain_train_mixture_config_path"):
        found.append(Problem(f"{where}grain_train_files", "a mixture of data sets mixes per process: a shrunk "
                                                          "attempt would draw other sequences; give one pattern, or "
                                                          "remove resources.min_nodes."))
    return found


def problems(config: Config) -> list[Problem]:
    """Why this recipe cannot shrink, before anything starts (only asked when min_nodes is below nodes)."""
    res = config.resources
    if not res.can_shrink:
        return []
    found = []
    where = "trainer.overrides."
    if _base_file_values(config.trainer.base_config) is None:
        found.append(Problem("trainer.base_config", f"{config.trainer.base_config!r} cannot be read on this host "
                                                    "(not a file here, nor a config of this host's MaxText): elastic "
                                                    "shrink keeps the global batch from its per_device_batch_size, "
                                                    "gradient_accumulation_steps, dataset_type and mesh axes, and "
                                                    "will not assume them. Put the file where rkit runs, set those "
                                                    "keys in trainer.overrides and use base.yml, or remove "
                                                    "resources.min_nodes."))
        return found
    data = setting(config, "dataset_type")
    if data == "grain":
        found.extend(grain_order_problems(config))
    elif data not in CARRIED_DATA:
        found.append(Problem(f"{where}dataset_type", f"{data!r}: resources.min_nodes (elastic shrink) supports "
                                                     f"dataset_type {', '.join(CARRIED_DATA)} only; grain saves "
                                                     "one data iterator per process, which a smaller attempt cannot "
                                                     "restore, and tfds and hf start their iterators over. Use "
                                                     "synthetic data, or remove resources.min_nodes."))
    pdb = setting(config, "per_device_batch_size")
    if not isinstance(pdb, (int, float)) or isinstance(pdb, bool) or pdb < 1 or float(pdb) != int(pdb):
        found.append(Problem(f"{where}per_device_batch_size", f"{pdb!r}: elastic shrink keeps the global batch "
                                                              "by raising gradient_accumulation_steps, which needs "
                                                              "a whole per_device_batch_size of 1 or more; set "
                                                              "one, or remove resources.min_nodes."))
    axes = mesh_settings(config)
    auto = sorted(key for key, value in axes.items() if value == -1)
    data_axis = [key for key in auto if key.split("_", 1)[1].removesuffix("_parallelism") in DATA_AXES]
    for key in sorted(set(auto) - set(data_axis)):
        found.append(Problem(f"{where}{key}", "-1 (auto) on an axis that is not data-parallel: with "
                                              "resources.min_nodes only a data-parallel axis (data, fsdp, "
                                              "fsdp_transpose) may absorb lost nodes; give it a fixed size and "
                                              "set ici_fsdp_parallelism to -1."))
    # On GPUs and CPUs MaxText has one slice (num_slices 1): every device is on the ici axes, and a dcn auto
    # axis is 1, so the ici axes are the ones that must absorb the change.
    if not [key for key in data_axis if key.startswith("ici_")]:
        found.append(Problem(f"{where}ici_fsdp_parallelism", "no data-parallel ici mesh axis is auto (-1), so "
                                                             "the mesh cannot shrink with resources.min_nodes "
                                                             "(on GPUs every device is on the ici axes); set "
                                                             "ici_fsdp_parallelism (or ici_data_parallelism) to "
                                                             "-1."))
    if sizes(config) == [int(res.nodes)]:
        found.append(Problem("resources.min_nodes", f"no node count from {res.fewest_nodes} to {res.nodes - 1} "
                                                    + (f"divides nodes ({res.nodes}): with an auto fsdp axis a "
                                                       "shrunk attempt's devices must divide the full count, so "
                                                       "that the weights it shards still divide; lower min_nodes to "
                                                       "a divisor of nodes." if shards_weights(config) else
                                                       "keeps the global batch: gradient_accumulation_steps "
                                                       f"({accumulation(config)}) x nodes ({res.nodes}) is "
                                                       "divisible by none of them; raise min_nodes or "
                                                       "gradient_accumulation_steps.")))
    return found
