"""The typed view of a resolved recipe: built once after validation (or from a run's resolved.json), read by
attribute everywhere else. The dict stays the stamp (resolved.json, the config hash); this is how code reads it.

Imports nothing of rkit but the schema's defaults and errors: the agent side (inside an image) reads it too.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields
from typing import Any

from rkit.contract.defaults import apply_defaults, schema
from rkit.contract.errors import RkitError


@dataclass(frozen=True)
class Trainer:
    kind: str
    base_config: str
    steps: int
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def final_step(self) -> int:
        """MaxText trains steps 0..steps-1 and saves the last one: the run is done when it is committed."""
        if self.steps is None:  # a damaged or hand-made resolved.json
            raise RkitError("resolved.json: trainer.steps is missing; a run's resolved.json always has it. Restore "
                            "it from a copy of the run directory.")
        return int(self.steps) - 1


@dataclass(frozen=True)
class Resources:
    nodes: int
    processes_per_node: int
    gpus_per_node: int | None = None  # no schema default: a recipe without it keeps its config hash
    min_nodes: int | None = None  # elastic shrink (run/elastic.py); None: nodes, no shrink
    when_short: str | None = None  # "continue" (None) or "wait"

    @property
    def processes(self) -> int:
        return int(self.nodes) * int(self.processes_per_node)

    @property
    def fewest_nodes(self) -> int:
        """The fewest nodes an attempt may train on: min_nodes, or nodes when the recipe does not shrink."""
        return int(self.nodes) if self.min_nodes is None else min(int(self.min_nodes), int(self.nodes))

    @property
    def can_shrink(self) -> bool:
        """min_nodes below nodes: an attempt may train on fewer nodes (now, or after waiting: when_short)."""
        return self.fewest_nodes < int(self.nodes)

    @property
    def elastic(self) -> bool:
        """Shrinks now when nodes are lost: min_nodes below nodes and the policy is to continue."""
        return self.can_shrink and self.when_short != "wait"


@dataclass(frozen=True)
class Checkpoint:
    period: int | str  # steps, "auto", or a time such as "10m" (run/cadence.py)
    keep: int | None
    asynchronous: bool  # the recipe's `async`
    min_period: int | None = None  # the chosen period's bounds (no schema default: older config hashes unchanged)
    max_period: int | None = None
    local_dir: str | None = None  # the node-local tier (runtime/trainers/localtier.py); None: none
    local_period: int | None = None  # its period in steps; None: a tenth of the persistent period

    @property
    def auto(self) -> bool:
        """rkit chooses each attempt's period: `auto` (Young/Daly) or a time (`10m`)."""
        return isinstance(self.period, str)

    @property
    def every_seconds(self) -> float | None:
        """The time form's interval (`90s`, `10m`, `1.5h`) in seconds; None for steps or auto."""
        if not isinstance(self.period, str) or self.period == "auto":
            return None
        return float(self.period[:-1]) * {"s": 1.0, "m": 60.0, "h": 3600.0}[self.period[-1]]

    @property
    def fixed_period(self) -> int | None:
        """The recipe's period in steps; None for auto (each attempt's is in its attempt.started event)."""
        return None if self.auto or self.period is None else int(self.period)


# How long a management-network blip may last without JAX's coordination service aborting the job (Resilience).
JAX_BLIP_MARGIN_SECONDS = 45


@dataclass(frozen=True)
class Resilience:
    max_restarts: int
    max_infra_restarts: int
    crash_loop_limit: int
    signal_grace_seconds: float
    hang_timeout: float | str | None  # seconds, "auto", or None (off)
    hang_floor_seconds: float
    hang_factor: float
    hang_startup_seconds: float
    warm_standby: bool | str = "auto"  # standby ranks for the next attempt (backends/standby.py)
    node_silence_seconds: float = 3.0  # Slurm: heartbeat silence (with no step progress) before a node is probed
    node_probe_seconds: float = 5.0  # Slurm: the probe step's hard timeout (liveness.py)
    budget_window_steps: int | None = None  # committed steps without a failure that refill the budgets

    def window_steps(self, period: int | None) -> int | None:
        """The budgets' refill window (policy.Budgets.window_steps): the recipe's, else ten checkpoint periods
        (the attempt's, for period auto); None (never refilled) when neither is known."""
        if self.budget_window_steps is not None:
            return int(self.budget_window_steps)
        return None if not period else 10 * int(period)

    @property
    def jax_heartbeat_seconds(self) -> int:
        """JAX's coordination-service heartbeat timeout for Slurm attempts: past rkit's own detection (twice a
        node's silence plus its probe) by JAX_BLIP_MARGIN_SECONDS, so that rkit names a dead node first and a
        management-network blip of that length (no heartbeat gets through, every node is alive) does not make
        JAX abort the whole job; JAX still ends the survivors if rkit could not act. 61 s at the defaults (JAX's
        own default is 100 s; before issue 40 rkit set 16 s, which a 15 s blip nearly reached)."""
        return int(2 * (float(self.node_silence_seconds) + float(self.node_probe_seconds))) + JAX_BLIP_MARGIN_SECONDS

    @property
    def local_jax_heartbeat_seconds(self) -> int | None:
        """JAX's heartbeat timeout for local attempts: above rkit's own hang detection, so that a frozen rank (a
        stopped process sends no heartbeat) is caught by the hang watch, which dumps its stacks and names it,
        instead of JAX's coordination service aborting its peers (SIGABRT) about 65 s after it stopped, before
        hang_timeout auto's 60 s floor, doubled around a save, has run out. No node can vanish apart from the
        supervisor on one machine. None (JAX's own default) when hang detection is off."""
        if self.hang_timeout is None:
            return None
        explicit = 0.0 if self.hang_timeout == "auto" else float(self.hang_timeout)
        return max(100, int(2 * max(explicit, 2 * float(self.hang_floor_seconds), float(self.hang_startup_seconds))))

    def standby_on(self, processes_per_node: int, cpus: int | None) -> bool:
        """auto: on when a node (this machine, or the Slurm batch host's allocation) has 4 cores per rank or
        more: a standby imports beside the live attempt, and on fewer cores that slows the attempt more than a
        warm restart saves."""
        if self.warm_standby is False:
            return False
        return self.warm_standby is True or (cpus or 1) >= 4 * processes_per_node


@dataclass(frozen=True)
class Prometheus:
    enabled: bool
    interface: str
    port: int
    tls_cert: str | None = None  # PEM: HTTPS (no default in the schema, so older config hashes are unchanged)
    tls_key: str | None = None
    insecure: bool | None = None  # plain HTTP beyond loopback, warned about on every start


@dataclass(frozen=True)
class Observability:
    telemetry_interval_seconds: float
    disk_low_fraction: float
    prometheus: Prometheus
    straggler_factor: float


@dataclass(frozen=True)
class Slurm:
    partition: str | None
    account: str | None
    qos: str | None
    time: str | None
    gpus_per_node: int
    spare_nodes: int
    exclusive: bool
    extra_sbatch: tuple[str, ...]
    signal_lead_seconds: int
    container_launch: str
    python: str | None


@dataclass(frozen=True)
class Reproducibility:
    deterministic: bool = False  # no schema default: a recipe without the section keeps its config hash


@dataclass(frozen=True)
class Config:
    name: str
    runs_dir: str
    access: str
    image: str
    launcher: str
    trainer: Trainer
    resources: Resources
    checkpoint: Checkpoint
    resilience: Resilience
    observability: Observability
    slurm: Slurm
    env: dict[str, Any]
    reproducibility: Reproducibility = Reproducibility()

    @property
    def processes(self) -> int:
        return self.resources.processes

    @property
    def gpus_per_node(self) -> int:
        """The GPUs a node's processes share (devices.py): resources.gpus_per_node, else slurm.gpus_per_node."""
        given = self.resources.gpus_per_node
        return int(given if given is not None else self.slurm.gpus_per_node if self.launcher == "slurm" else 0)

    @classmethod
    def from_resolved(cls, resolved: dict) -> Config:
        """From a validated recipe's resolved dict; a run stamped before a section existed gets its defaults (a key
        without a default, absent from a hand-made file, reads None)."""
        data = copy.deepcopy(resolved)
        for key in ("trainer", "resources", "checkpoint", "resilience", "observability", "slurm", "env"):
            data[key] = data.get(key) if isinstance(data.get(key), dict) else {}
        apply_defaults(data, schema())
        data["checkpoint"]["asynchronous"] = data["checkpoint"].pop("async", None)
        data["slurm"]["extra_sbatch"] = tuple(data["slurm"].get("extra_sbatch") or ())
        prometheus = data["observability"].get("prometheus")
        data["observability"]["prometheus"] = _build(Prometheus, prometheus if isinstance(prometheus, dict) else {},
                                                     "observability.prometheus.")
        sections = {"trainer": Trainer, "resources": Resources, "checkpoint": Checkpoint, "resilience": Resilience,
                    "observability": Observability, "slurm": Slurm}
        for key, section in sections.items():
            data[key] = _build(section, data[key], f"{key}.")
        data["reproducibility"] = Reproducibility(
            deterministic=bool((data.get("reproducibility") or {}).get("deterministic")))
        return _build(cls, data)


class ConfigTypeError(RkitError):
    """A resolved config (a run's resolved.json) whose value has another type than the typed view declares."""


# The annotations of the typed view, as written (from __future__ annotations), and the values each part admits.
_ADMITS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1 << 62,
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) < 1e15,
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "None": lambda v: v is None,
    "dict[str, Any]": lambda v: isinstance(v, dict),
    "tuple[str, ...]": lambda v: isinstance(v, tuple) and all(isinstance(x, str) for x in v),
}


def _check(cls: type, path: str, name: str, annotation: Any, value: Any) -> None:
    parts = [p.strip() for p in str(annotation).split("|")]
    if value is None:  # absent (a hand-made or older file): read as None, as before
        return
    if all(p in _ADMITS for p in parts) and not any(_ADMITS[p](value) for p in parts):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ConfigTypeError(f"{path}{name} is {shown}, expected {' or '.join(parts)}")


def _build(cls: type, data: dict, path: str = "") -> Any:
    values = {f.name: data.get(f.name) for f in fields(cls)}
    for f in fields(cls):
        if not isinstance(values[f.name], (Trainer, Resources, Checkpoint, Resilience, Prometheus, Observability,
                                           Slurm, Reproducibility)):
            _check(cls, path, f.name, f.type, values[f.name])
    return cls(**values)
