"""Runs inside the training environment, one per process: the trainer's side of the run directory.

    python -m rkit.runtime.agent KEY=VALUE ...   (MaxText overrides; the rest comes from RKIT_* variables)

It sets up jax.distributed (coordinator, process count, process id from the backend), writes this
process's environment manifest into attempts/<n>/env/, arms fault injections, then runs MaxText's
trainer in this very process, so signals reach it directly (SIGTERM -> Orbax's preemption save).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rkit.contract.events import EV
from rkit.contract.heartbeat import JAX_HEARTBEAT_ENV
from rkit.contract.rundir import UMASK_ENV, RunDir, open_for_writing, write_json_atomic
from rkit.runtime import determinism, devices
from rkit.runtime.compilecache import cache_every_compilation, cache_every_process
from rkit.runtime.inject import FIRED_EVENT, KILLS_ITS_RANK, Injection
from rkit.runtime.rankexit import exit_without_teardown
from rkit.runtime.telemetry import metrics
from rkit.runtime.telemetry.metrics import MetricsTail
from rkit.runtime.telemetry.node import node_name, start_node_services
from rkit.runtime.trainers.maxtext import set_assets_root

if TYPE_CHECKING:
    from rkit.runtime.trainers.localtier import LocalTier


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
    """jax.distributed for every attempt, one process too: its preemption service is what turns a SIGTERM into
    a save at the sync point (without it a one-process run dies on SIGTERM and recomputes from the last period).
    Process 0's coordination service listens on the coordinator's own address (127.0.0.1 for the local
    launcher, the first node's address on Slurm), not on every interface as JAX does by default."""
    if not ctx.coordinator:
        return
    import jax

    # Seconds without a heartbeat before JAX's coordination service declares a process dead (JAX's default: 100).
    # The Slurm launcher sets it just above its own node detection (liveness.py), so the survivors of a dead node
    # end within seconds even if rkit's supervisor could not act, instead of waiting in a collective.
    extra = {}
    if (heartbeat := os.environ.get(JAX_HEARTBEAT_ENV, "")).isdigit():
        extra["heartbeat_timeout_seconds"] = int(heartbeat)
    jax.distributed.initialize(coordinator_address=ctx.coordinator, num_processes=ctx.processes,
                               process_id=ctx.rank, coordinator_bind_address=ctx.coordinator, **extra)


MAXTEXT_ENV_PREFIX = "M_"  # MaxText's pyconfig reads M_<KEY> as the setting <key>


def drop_maxtext_settings_from_env(environ: dict[str, str] | os._Environ) -> list[str]:
    """MaxText takes M_<KEY> variables as settings, outside the recipe and its config hash (and an M_ variable
    for a key rkit owns would undo it). The recipe's trainer.overrides is the one way in: drop them all."""
    names = sorted(k for k in environ if k.startswith(MAXTEXT_ENV_PREFIX))
    for name in names:
        del environ[name]
    return names


def bind_devices(ctx: AgentContext, environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """This process's share of its node's GPUs (devices.py), set before JAX starts; an `agent.devices` event."""
    local = devices.local_rank(dict(environ), ctx.rank)
    bound = devices.binding(dict(environ), local)
    if bound:
        environ.update(bound)
        ctx.run.emit(EV.AGENT_DEVICES, attempt=ctx.attempt, rank=ctx.rank, local_rank=local, variables=bound)
    return bound


def write_env_manifest(ctx: AgentContext) -> Path:
    from rkit.runtime import manifest

    path = ctx.run.env_capture(ctx.attempt, ctx.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    captured = manifest.capture(with_jax=True)
    captured.update({"rank": ctx.rank, "attempt": ctx.attempt, "pid": os.getpid()})
    write_json_atomic(path, captured)
    return path


def fire(ctx: AgentContext, inj: Injection, step: int, tier: LocalTier | None = None) -> None:
    try:
        ctx.run.emit(FIRED_EVENT, index=inj.index, kind=inj.kind, rank=ctx.rank, step=step,
                     attempt=ctx.attempt, spec=inj.spec)
        if inj.kind == "lose_local" and tier is not None:  # a replaced node: its local checkpoints are gone
            tier.lose()
    finally:
        _act(inj, step)


def _act(inj: Injection, step: int) -> None:
    sys.stderr.write(f"rkit: injected fault {inj.spec!r} fires at step {step}\n")
    sys.stderr.flush()
    if inj.kind in KILLS_ITS_RANK:
        os.kill(os.getpid(), signal.SIGKILL)
    if inj.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops; the process lives on, silent
        return
    os._exit(inj.code)


class Injector:
    """This rank's injections, fired from the training loop's own thread at exactly their step (see
    `trainers.maxtext.hook_the_train_loop`), once per attempt; the metrics lines before it are drained first."""

    def __init__(self, ctx: AgentContext, pump: MetricsPump | None = None, tier: LocalTier | None = None):
        self.ctx = ctx
        self.pump = pump
        self.tier = tier
        self.targets = sorted(ctx.injections, key=lambda i: i.step)
        if tier is not None:
            tier.on_restore.append(self.at_restore)

    def at_restore(self, step: int) -> None:
        """kill_restore: as this rank begins to restore step `step` (the node-local tier's hook calls it)."""
        for inj in [i for i in self.targets if i.kind == "kill_restore" and step >= i.step]:
            self.targets.remove(inj)
            fire(self.ctx, inj, step, self.tier)

    def at_step(self, step: int) -> None:
        if self.tier is not None:
            self.tier.observe(step)  # this rank's committed local checkpoints, into its record
        due = [i for i in self.targets if step >= i.step and i.kind != "kill_restore"]
        if not due:
            return
        if self.pump is not None:
            self.pump.drain()
        for inj in due:
            self.targets.remove(inj)  # once per attempt (a hung rank that is continued must not re-fire)
            fire(self.ctx, inj, step, self.tier)


def arm_stack_dumps(ctx: AgentContext) -> Path:
    """SIGQUIT -> every thread's Python stack into attempts/<n>/stacks/rank-<r>.txt (the hang path asks for it).
    faulthandler writes from the signal handler itself, so it works while the main thread is stuck in C."""
    path = ctx.run.stacks_file(ctx.attempt, ctx.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    global _STACKS_FILE  # faulthandler keeps only the descriptor: the file object must stay alive
    _STACKS_FILE = os.fdopen(open_for_writing(path), "a")  # noqa: SIM115
    faulthandler.register(signal.SIGQUIT, file=_STACKS_FILE, all_threads=True)
    return path


_STACKS_FILE = None


class StepSampler:
    """What MaxText's metrics line lacks: the device's peak (for MFU), device memory, host RSS."""

    def __init__(self) -> None:
        self._device = None
        self.peak: float | None = None
        self._statm = "/proc/self/statm"
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def _first_device(self):
        if self._device is None:
            import jax  # already imported and initialised by MaxText when its first metrics line exists

            self._device = jax.local_devices()[0]
            self.peak = metrics.peak_tflops(getattr(self._device, "device_kind", None))
        return self._device

    def device_memory(self) -> tuple[int | None, int | None]:
        try:
            stats = self._first_device().memory_stats() or {}
        except Exception:  # noqa: BLE001 - backends without memory stats (CPU) or a failing plugin: absent
            return None, None
        return stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")

    def host_rss(self) -> int | None:
        try:
            with open(self._statm) as fh:
                return int(fh.read().split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            return None


class MetricsPump:
    """Follows MaxText's metrics file for this rank and attempt; appends one rkit line per step to
    metrics/<rank>.jsonl (one write each). A background thread polls; `drain()` reads what is left (MaxText
    writes a step's line when the next step is buffered, and its last step's line at the very end)."""

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self.tail = MetricsTail(ctx.run.maxtext_metrics_file(ctx.attempt, ctx.rank))
        ctx.run.metrics_dir.mkdir(parents=True, exist_ok=True)
        ctx.run.maxtext_metrics_file(ctx.attempt, ctx.rank).parent.mkdir(parents=True, exist_ok=True)
        self.sampler = StepSampler()
        self.node = node_name()
        self.fd = open_for_writing(ctx.run.metrics_file(ctx.rank))
        self._lock = threading.Lock()
        self.batches: dict[int, tuple[str, int]] = {}  # step -> its batch's fingerprint (the loop's thread adds)

    def batch(self, step: int, fingerprint: tuple[str, int] | None) -> None:
        """The training loop's hook (trainers.maxtext.hook_the_train_loop): before MaxText writes the step's line."""
        if fingerprint is not None:
            self.batches[step] = fingerprint

    def drain(self) -> None:
        with self._lock:
            for raw in self.tail.poll_raw():
                step = raw.get("step")  # MaxText writes it as a float
                step = int(step) if isinstance(step, (int, float)) and float(step).is_integer() else None
                line = metrics.enrich(raw, t=time.time(), attempt=self.ctx.attempt, rank=self.ctx.rank,
                                      node=self.node, peak=self.sampler.peak,
                                      device_memory=self.sampler.device_memory(), host_rss=self.sampler.host_rss(),
                                      data=self.batches.pop(step, None) if step is not None else None)
                if line is not None:
                    os.write(self.fd, (json.dumps(line, sort_keys=True) + "\n").encode())

    def start(self, poll_seconds: float = 0.05) -> MetricsPump:
        def loop() -> None:
            while True:
                self.drain()
                time.sleep(poll_seconds)

        threading.Thread(target=loop, name="rkit-metrics", daemon=True).start()
        return self


def watch_preempt_request(ctx: AgentContext, poll_seconds: float = 0.25) -> threading.Thread:
    """SIGTERM this very process when the supervisor asks: JAX/Orbax then save at the preemption sync point.
    A file, not a signal through the launcher: a container runtime between srun and the trainer may not pass
    a signal on (or may die of it and leave the trainer running)."""
    path = ctx.run.preempt_request(ctx.attempt)

    def watch() -> None:
        while not path.exists():
            time.sleep(poll_seconds)
        sys.stderr.write("rkit: preemption requested by the supervisor: SIGTERM to self (save and stop)\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="rkit-preempt", daemon=True)
    thread.start()
    return thread


SUPERVISOR_FD = "RKIT_SUPERVISOR_FD"
SUPERVISOR_TOKEN = "RKIT_SUPERVISOR_TOKEN"


def watch_supervisor(environ: dict[str, str] | None = None,
                     on_gone: Callable[[], None] | None = None, lifeline: int | None = None) -> threading.Thread | None:
    """The local backend hands each rank the read end of a pipe whose write end only the supervisor holds,
    with a token written into it. EOF on it means the supervisor is gone (even by SIGKILL): this rank and
    everything in its process group stop, so no trainer outlives its supervisor. No pipe (Slurm: the batch job
    ends its steps with it), a closed descriptor or a wrong token: nothing is watched."""
    env = os.environ if environ is None else environ
    if lifeline is not None:  # a standby (standby.py) read and checked the token already
        fd = lifeline
    else:
        try:
            fd, token = int(env[SUPERVISOR_FD]), env[SUPERVISOR_TOKEN].encode()
            if not stat.S_ISFIFO(os.fstat(fd).st_mode) or os.read(fd, len(token)) != token:
                return None
        except (KeyError, ValueError, OSError):
            return None

    def gone() -> None:
        sys.stderr.write("rkit: the supervisor is gone: stopping this rank\n")
        sys.stderr.flush()
        os.killpg(os.getpgrp(), signal.SIGKILL)

    def watch() -> None:
        try:
            while os.read(fd, 64):
                pass
        except OSError:
            pass
        (on_gone or gone)()

    thread = threading.Thread(target=watch, name="rkit-supervisor", daemon=True)
    thread.start()
    return thread


def check_determinism(ctx: AgentContext, environ: dict[str, str] | os._Environ) -> list[dict]:
    """Deterministic mode (determinism.py), after MaxText's set-up: JAX's PRNG back to threefry (MaxText sets
    unsafe_rbg), then every switch checked; a warning line and an event for each one that did not survive."""
    import jax

    jax.config.update("jax_default_prng_impl", determinism.PRNG_IMPL)
    lost = determinism.clobbered(dict(environ), str(jax.config.jax_default_prng_impl))
    for item in lost:
        sys.stderr.write(f"rkit: [deterministic] WARNING: {item['switch']} is {item['found']!r}, expected "
                         f"{item['expected']!r}: reruns may not be bit-exact\n")
        ctx.run.emit(EV.DETERMINISM_CLOBBERED, attempt=ctx.attempt, rank=ctx.rank, **item)
    ctx.run.emit(EV.DETERMINISM_CHECKED, attempt=ctx.attempt, rank=ctx.rank, clobbered=len(lost),
                 prng=str(jax.config.jax_default_prng_impl))
    return lost


def main(argv: list[str] | None = None, lifeline: int | None = None) -> None:
    overrides = list(sys.argv[1:] if argv is None else argv)
    os.umask(int(os.environ.get(UMASK_ENV, "077"), 8))  # the run's access, whatever reached this process
    watch_supervisor(lifeline=lifeline)  # first: jax.distributed's set-up below may block for minutes
    ctx = AgentContext.from_env()
    # When this process started (after any container runtime), or a standby took the rank: splits restart
    # latency into its parts. A warm rank imported MaxText before the attempt (import_seconds: how long).
    warm = os.environ.get("RKIT_WARM") == "1"
    ctx.run.emit(EV.AGENT_STARTED, attempt=ctx.attempt, rank=ctx.rank, pid=os.getpid(), warm=warm,
                 **({"standby_import_seconds": float(os.environ["RKIT_STANDBY_IMPORT_SECONDS"])} if warm else {}))
    if dropped := drop_maxtext_settings_from_env(os.environ):
        sys.stderr.write(f"rkit: ignored {', '.join(dropped)}: MaxText would read them as settings outside the "
                         "recipe; put them in trainer.overrides\n")
        ctx.run.emit(EV.AGENT_ENV_DROPPED, attempt=ctx.attempt, rank=ctx.rank, names=dropped)
    set_assets_root(os.environ)  # before MaxText is imported: its bare tokenizer names resolve there
    bind_devices(ctx, os.environ)  # before JAX starts a backend: it reads the visibility variables once
    # Health sampler, exporter and heartbeat (local rank 0 of a node only); before jax.distributed's set-up, so
    # that a node lost while its peers wait there is seen too.
    start_node_services(ctx.run, ctx.attempt)
    began = time.monotonic()
    init_distributed(ctx)
    distributed = time.monotonic() - began
    write_env_manifest(ctx)
    arm_stack_dumps(ctx)
    pump = MetricsPump(ctx).start()
    watch_preempt_request(ctx)

    began = time.monotonic()
    from absl import app
    from maxtext.trainers.pre_train import train

    from rkit.runtime.trainers.maxtext import (
        after_initialize,
        credentials_given,
        guard_the_preemption_sync_point,
        hook_the_train_loop,
        mesh_record,
        rank_overrides,
        resolve_base_config,
        restore_elastic_positions_at_any_count,
        route_tensorboard,
    )

    # Start-up's parts before MaxText's own (restore and compile, up to the first step): the imports (a warm
    # rank's were done in its standby) and jax.distributed's set-up.
    ctx.run.emit(EV.AGENT_READY, attempt=ctx.attempt, rank=ctx.rank, warm=warm,
                 import_seconds=round(time.monotonic() - began, 3), distributed_seconds=round(distributed, 3))

    tier = local_tier(ctx)
    hook_the_train_loop(Injector(ctx, pump, tier).at_step, pump.batch)
    guard_the_preemption_sync_point()
    route_tensorboard(ctx.run)
    restore_elastic_positions_at_any_count()
    def after_set_up(config: object) -> None:
        if ctx.rank == 0 and config is not None:  # the attempt's mesh and batch, once per attempt
            import jax

            ctx.run.emit(EV.AGENT_MESH, attempt=ctx.attempt, rank=ctx.rank, credentials=credentials_given(config),
                         **mesh_record(config, jax.device_count()))
        if os.environ.get(determinism.EXPECTED_ENV):
            check_determinism(ctx, os.environ)

    after_initialize(after_set_up)
    cache_every_compilation(os.environ)
    cache_every_process()

    argv = ["maxtext", resolve_base_config(ctx.base_config), *overrides,
            *rank_overrides(ctx.run, ctx.attempt, ctx.rank, None if tier is None else tier.root)]
    try:
        app.run(train.main, argv=argv)
    except SystemExit as end:  # app.run ends with sys.exit
        if tier is not None and end.code in (0, None):
            tier.finish()
        pump.drain()
        exit_without_teardown(end.code)  # the interpreter's teardown skipped: 1 s per rank (rankexit.py)
    except Exception:
        # An error out of MaxText (a save the file system refused): said, then out at once. Left to the
        # interpreter's exit, the process waits forever for Orbax's signalling threads, and its peers in
        # jax.distributed's shutdown barrier for it: a failure the supervisor could only call a hang.
        import traceback

        traceback.print_exc()
        pump.drain()
        sys.stderr.flush()
        os._exit(1)
    finally:  # the last steps' lines are read before the process goes
        pump.drain()


def local_tier(ctx: AgentContext) -> LocalTier | None:
    """checkpoint.local_dir: this rank's side of the node-local tier, hooked into MaxText (localtier.py)."""
    config = ctx.run.config()
    if not config.checkpoint.local_dir:
        return None
    from rkit.runtime.trainers import localtier

    tier = localtier.LocalTier(ctx.run, ctx.attempt, ctx.rank, config.trainer.final_step,
                               localtier.run_root(config.checkpoint.local_dir, ctx.run), ctx.run.emit)
    tier.keep = config.checkpoint.keep
    from rkit.runtime.trainers import emergency

    emergency.hook(tier)
    return tier


if __name__ == "__main__":
    main()
