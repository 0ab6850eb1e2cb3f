"""Runs inside the training environment, one per process: the trainer's side of the run directory.

    python -m rkit.agent KEY=VALUE ...   (MaxText overrides; the rest comes from RKIT_* variables)

It sets up jax.distributed (coordinator, process count, process id from the backend), writes this
process's environment manifest into attempts/<n>/env/, arms fault injections, then runs MaxText's
trainer in this very process, so signals reach it directly (SIGTERM -> Orbax's preemption save).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .inject import FIRED_EVENT, Injection
from .rundir import RunDir, write_json_atomic
from .telemetry.metrics import MetricsTail


@dataclass(frozen=True)
class AgentContext:
    run: RunDir
    attempt: int
    rank: int
    processes: int
    coordinator: str
    base_config: str
    injections: tuple[Injection, ...]

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> AgentContext:
        env = os.environ if environ is None else environ
        # Slurm (or another launcher) may give the rank; the local backend sets RKIT_RANK.
        rank = env.get("RKIT_RANK") or env.get("SLURM_PROCID") or "0"
        injections = tuple(Injection.from_dict(d) for d in json.loads(env.get("RKIT_INJECT", "[]")))
        return cls(run=RunDir(env["RKIT_RUN_DIR"]), attempt=int(env["RKIT_ATTEMPT"]), rank=int(rank),
                   processes=int(env.get("RKIT_NPROCS", "1")), coordinator=env.get("RKIT_COORDINATOR", ""),
                   base_config=env.get("RKIT_BASE_CONFIG", "base.yml"),
                   injections=tuple(i for i in injections if i.rank in (None, int(rank)) and i.in_trainer))


def init_distributed(ctx: AgentContext) -> None:
    if ctx.processes <= 1:
        return
    import jax

    jax.distributed.initialize(coordinator_address=ctx.coordinator, num_processes=ctx.processes,
                               process_id=ctx.rank)


def write_env_manifest(ctx: AgentContext) -> Path:
    from . import manifest

    env_dir = ctx.run.attempt_dir(ctx.attempt) / "env"
    env_dir.mkdir(parents=True, exist_ok=True)
    captured = manifest.capture(with_jax=True)
    captured.update({"rank": ctx.rank, "attempt": ctx.attempt, "pid": os.getpid()})
    path = env_dir / f"rank-{ctx.rank}.json"
    write_json_atomic(path, captured)
    return path


def fire(ctx: AgentContext, inj: Injection, step: int) -> None:
    try:
        ctx.run.emit(FIRED_EVENT, index=inj.index, kind=inj.kind, rank=ctx.rank, step=step,
                     attempt=ctx.attempt, spec=inj.spec)
    finally:
        _act(inj, step)


def _act(inj: Injection, step: int) -> None:
    sys.stderr.write(f"rkit: injected fault {inj.spec!r} fires at step {step}\n")
    sys.stderr.flush()
    if inj.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(inj.code)


def arm_injections(ctx: AgentContext, poll_seconds: float = 0.01) -> threading.Thread | None:
    """Watch this rank's own metrics file; when a step at or past the target is written, fire."""
    if not ctx.injections:
        return None
    tail = MetricsTail(ctx.run.metrics_file(ctx.rank))
    tail.skip_existing()
    targets = sorted(ctx.injections, key=lambda i: i.step)

    def watch() -> None:
        while True:
            for m in tail.poll():
                for inj in targets:
                    if m.step >= inj.step:
                        fire(ctx, inj, m.step)
            time.sleep(poll_seconds)

    thread = threading.Thread(target=watch, name="rkit-inject", daemon=True)
    thread.start()
    return thread


PREEMPT_FILE = "preempt"


def preempt_request_path(run: RunDir, attempt: int) -> Path:
    """The supervisor creates this file to ask every rank to save and stop (the preemption path)."""
    return run.attempt_dir(attempt) / PREEMPT_FILE


def watch_preempt_request(ctx: AgentContext, poll_seconds: float = 0.25) -> threading.Thread:
    """SIGTERM this very process when the supervisor asks: JAX/Orbax then save at the preemption sync point.
    A file, not a signal through the launcher: a container runtime between srun and the trainer may not pass
    a signal on (or may die of it and leave the trainer running)."""
    path = preempt_request_path(ctx.run, ctx.attempt)

    def watch() -> None:
        while not path.exists():
            time.sleep(poll_seconds)
        sys.stderr.write("rkit: preemption requested by the supervisor: SIGTERM to self (save and stop)\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="rkit-preempt", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> None:
    overrides = list(sys.argv[1:] if argv is None else argv)
    ctx = AgentContext.from_env()
    # When this process started (after any container runtime): splits restart latency into its parts.
    ctx.run.emit("agent.started", attempt=ctx.attempt, rank=ctx.rank, pid=os.getpid())
    init_distributed(ctx)
    write_env_manifest(ctx)
    arm_injections(ctx)
    watch_preempt_request(ctx)

    from absl import app
    from maxtext.trainers.pre_train import train

    from .trainers.maxtext import rank_overrides, resolve_base_config

    argv = ["maxtext", resolve_base_config(ctx.base_config), *overrides, *rank_overrides(ctx.run, ctx.rank)]
    app.run(train.main, argv=argv)


if __name__ == "__main__":
    main()
