"""Fault injection for rehearsals and tests: `--inject kind:key=value,...`.

kill:rank=R,step=S          SIGKILL rank R at step S (kill, exit and hang fire in the rank's training loop,
                            once step S is dispatched: it never trains step S+1)
exit:rank=R,step=S,code=C   rank R exits with code C (default 1) at step S
hang:rank=R,step=S          rank R stops (SIGSTOP of its process) at step S: it keeps existing but never
                            advances, so the supervisor's hang detection has to notice, dump and replace it
sigterm:step=S              the preemption path: the supervisor asks every rank to save (SIGTERM),
                            waits the grace period, SIGKILLs what is left, and starts a new attempt
preempt:step=S              Slurm's time-limit/preemption signal (USR1) at step S: the same save and stop,
                            then the job is requeued (launcher: slurm)
lose_node:rank=R,step=S     rank R's node is lost for good at step S (its ranks SIGKILLed, the node reported
                            dead): the local launcher's rehearsal of a node crash with no spare, for a recipe
                            with resources.min_nodes below nodes
lose_local:rank=R,step=S    rank R's node-local checkpoints are lost at step S (its pending local saves finished,
                            then its local directory deleted and the rank SIGKILLed): the rehearsal of a node
                            replaced with empty local storage, for a recipe with checkpoint.local_dir
kill_restore:rank=R[,step=S] SIGKILL rank R as it begins to restore a checkpoint of step S or later (default any),
                            for a recipe with checkpoint.local_dir: a peer lost during the others' restore
Add `repeat=true` to fire in every attempt (a deterministic failure); by default an injection fires once.
"""

from __future__ import annotations

import signal
from dataclasses import asdict, dataclass

from rkit.contract.config import Config
from rkit.contract.errors import RkitError
from rkit.contract.events import EV

KINDS = {"kill": {"rank", "step"}, "exit": {"rank", "step", "code"}, "hang": {"rank", "step"}, "sigterm": {"step"},
         "preempt": {"step"}, "lose_node": {"rank", "step"}, "lose_local": {"rank", "step"},
         "kill_restore": {"rank", "step"}}
REQUIRED = {"kill": {"rank", "step"}, "exit": {"rank", "step"}, "hang": {"rank", "step"}, "sigterm": {"step"},
            "preempt": {"step"}, "lose_node": {"rank", "step"}, "lose_local": {"rank", "step"},
            "kill_restore": {"rank"}}
FIRED_EVENT = EV.INJECT_FIRED
KILLS_ITS_RANK = ("kill", "lose_local", "kill_restore")  # the rank SIGKILLs itself (runtime.agent's _act)


@dataclass(frozen=True)
class Injection:
    index: int
    kind: str
    step: int
    rank: int | None = None
    code: int = 1
    repeat: bool = False
    spec: str = ""

    @property
    def in_trainer(self) -> bool:
        """kill, exit, hang, lose_local and kill_restore act inside the rank's own process; sigterm, preempt and
        lose_node are the supervisor's."""
        return self.kind in ("kill", "exit", "hang", "lose_local", "kill_restore")

    @property
    def own_exit(self) -> int | None:
        """The exit the rank gives itself when this fires in its process (subprocess convention: -9 its SIGKILL);
        None for a hang (it lives on, stopped) and the supervisor's kinds."""
        if self.kind in KILLS_ITS_RANK:
            return -signal.SIGKILL
        return self.code if self.kind == "exit" else None

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: dict) -> Injection:
        return cls(**value)


def parse_injection(spec: str, index: int = 0) -> Injection:
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise RkitError(f"--inject {spec!r}: unknown kind {kind!r}; use one of {', '.join(sorted(KINDS))} "
                        "(e.g. kill:rank=1,step=60).")
    fields: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise RkitError(f"--inject {spec!r}: {item!r} is not key=value.")
        fields[key.strip()] = value.strip()
    allowed = KINDS[kind] | {"repeat"}
    unknown = set(fields) - allowed
    if unknown:
        raise RkitError(f"--inject {spec!r}: unknown field(s) {', '.join(sorted(unknown))}; "
                        f"{kind} takes {', '.join(sorted(allowed))}.")
    missing = REQUIRED[kind] - set(fields)
    if missing:
        raise RkitError(f"--inject {spec!r}: missing {', '.join(sorted(missing))} (e.g. kill:rank=1,step=60).")
    try:
        numbers = {k: int(v) for k, v in fields.items() if k in ("rank", "step", "code")}
    except ValueError:
        raise RkitError(f"--inject {spec!r}: rank, step and code must be whole numbers.") from None
    if any(v < 0 for v in numbers.values()):
        raise RkitError(f"--inject {spec!r}: rank, step and code must not be negative.")
    if "code" in numbers and not 1 <= numbers["code"] <= 255:
        raise RkitError(f"--inject {spec!r}: code {numbers['code']} is not an exit code of a failure; give 1..255.")
    repeat = fields.get("repeat", "false").lower()
    if repeat not in ("true", "false", "1", "0", "yes", "no"):
        raise RkitError(f"--inject {spec!r}: repeat must be true or false.")
    return Injection(index=index, kind=kind, step=numbers.get("step", 0), rank=numbers.get("rank"),
                     code=numbers.get("code", 1), repeat=repeat in ("true", "1", "yes"), spec=spec)


def parse_injections(specs: list[str] | tuple[str, ...], processes: int,
                     steps: int | None = None, config: Config | None = None) -> list[Injection]:
    """The --inject specs, checked against the run: its ranks, its steps (0..steps-1, MaxText's numbers) and, for
    preempt and lose_node, its launcher."""
    injections = [parse_injection(spec, i) for i, spec in enumerate(specs)]
    for inj in injections:
        if config is not None and inj.kind == "preempt" and config.launcher != "slurm":
            raise RkitError(f"--inject {inj.spec!r}: preempt is Slurm's signal and requeue (launcher: slurm); "
                            "locally, sigterm:step=S takes the same save and stop.")
        if config is not None and inj.kind == "lose_node" and (config.launcher != "local"
                                                               or not config.resources.elastic):
            raise RkitError(f"--inject {inj.spec!r}: lose_node rehearses a node crash on the local launcher with "
                            "resources.min_nodes below resources.nodes (e.g. -o resources.nodes=2 -o "
                            "resources.processes_per_node=1 -o resources.min_nodes=1); on Slurm, crash a node "
                            "for real.")
        if config is not None and inj.kind in ("lose_local", "kill_restore") and not config.checkpoint.local_dir:
            raise RkitError(f"--inject {inj.spec!r}: {inj.kind} rehearses a fault of the node-local tier; this "
                            "recipe has no local tier (set checkpoint.local_dir).")
        if inj.rank is not None and inj.rank >= processes:
            raise RkitError(f"--inject {inj.spec!r}: rank {inj.rank} does not exist; "
                            f"this run has ranks 0..{processes - 1}.")
        if steps is not None and inj.step >= steps:
            raise RkitError(f"--inject {inj.spec!r}: step {inj.step} is never reached; this run trains steps "
                            f"0..{steps - 1} (trainer.steps={steps}).")
    return injections


def pending(injections: list[Injection], events: list[dict]) -> list[Injection]:
    """Injections still to fire: one-shot ones fire once per run, repeat ones every attempt."""
    starts = [i for i, e in enumerate(events) if e.get("event") in (EV.RUN_SUBMITTED, EV.RUN_RESUMED)]
    since = events[starts[-1]:] if starts else events  # indexes restart with each `rkit run`
    fired = {e.get("index") for e in since if e.get("event") == FIRED_EVENT}
    return [inj for inj in injections if inj.repeat or inj.index not in fired]
