"""Whether rkit's own costs stay flat as a run ages (issue 39, part 4): two generated run directories of a 512-rank
run (64 nodes x 8, launcher slurm, checkpoint.period auto, checkpoint.keep 500), "day 1" (1 attempt, ~10
checkpoints, a day of steps) and "day 30" (1,000 attempts, 500 committed checkpoints, 30 days of steps), each in a
runs directory of its own (cadence.py reads the runs beside a run: side by side in one folder, day 1 would pay for
day 30). For each, medians with min-max over --repeats of:

  pass     the supervisor's loop while an attempt trains (Supervisor._watch: AttemptWatch.read, the backend's poll,
           the heartbeat listener's check, _observe/classify), the real loop at its real poll (0.1 s) over
           --watch-seconds, with supervisor_scale.py's generator writing one step a second to all 512 metrics files:
           CPU time of the supervisor's thread per pass (every 8th pass scans the 512 files);
  start-up what the supervisor does before it launches an attempt: Supervisor._run_to_end from its start up to
           backend.submit (tally_from_events, lost_attempt, the planted-link check, the period choice
           (cadence.period_for), preflight.checkpoints, latest_committed_step, MetricsTail.at_end of the
           512 metrics files, resume_data_position, the launch request); submit raises, nothing is launched;
  status   `rkit status --json RUN` in a child process, cold (an empty $RKIT_STATUS_CACHE: status_scale.measure):
           it starts from <run>/digest/ as the supervisor kept it after the next-to-last attempt's end, and reads
           the current attempt's lines (day 1 has no earlier attempt: it reads everything).

The issue's target: day 30 / day 1 <= 1.5 for each. Scalings (all knobs below), stated so the figures can be read:
- events: each attempt has attempt.started, checkpoint.period, agent.started and agent.ready of --agent-ranks
  ranks (default 64; a real 512-rank attempt writes them for all 512: 8x these events), agent.mesh,
  attempt.first_step, preempt.requested/preempt.saved or attempt.failed (+ nodes.excluded), attempt.ended with a
  policy.Tally dict; no job.* events (`rkit status` would ask squeue);
- metrics: rank 0's file has every step (10 s steps: 8,640 a day, recomputed steps included); the other 511 ranks
  have every --thin'th step (default 100) and each attempt's last (only their ends and sizes are read);
- rank logs: ranks 0..--log-ranks-1 (default 8) of every attempt (startup noise, a line per step, Orbax's save and
  restore lines); no env/ or maxtext/ folders in attempts/<n>/; attempt.json without per-rank exits;
- checkpoints: items/ as OCDBT with --ocdbt-processes (default 16, a real one has 512) process folders of a tiny
  manifest and one tiny data file, synthetic data (no Grain iter/ item); every step is checked whole (check_step)
  and triaged clean before anything is measured.

    python tests/benchmarks/long_run.py --repeats 3 [--profile 25]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from status_scale import measure as status_measure
from supervisor_scale import PER_NODE, REPO, GeneratedRequest, GeneratorBackend

from rkit.contract.events import EV
from rkit.contract.rundir import RunDir
from rkit.readers.outcome import chronicle
from rkit.recipe.load import load_recipe
from rkit.run import elastic
from rkit.run.attemptwatch import AttemptWatch
from rkit.run.liveness import HeartbeatListener, NodeLiveness
from rkit.run.policy import Progress, Tally
from rkit.run.supervisor import Supervisor
from rkit.runtime.telemetry.metrics import MetricsTail
from rkit.runtime.trainers import localtier, orbaxdirs
from rkit.runtime.trainers.orbaxdirs import check_step, committed_in, step_dirs_in, triage

NODES = 64
RANKS = NODES * PER_NODE
T0 = 1_750_000_000.0
STARTUP = 180.0  # seconds from attempt.started to the first step
PYTREE = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
ENDINGS = ("task_exit", "preempted", "node_fail", "preempted")  # attempt a ends ENDINGS[a % 4]
LINE = ('{{"attempt": {a}, "host_rss_bytes": 1073741824, "loss": {loss:.5f}, "node": "n{node}", "rank": {r}, '
        '"step": {s}, "step_time": {st}, "t": {t:.3f}, "tokens_per_sec_per_device": 640.0}}\n')
SAVED = ("I0101 00:00:00.000000 1 checkpoint_manager.py:1990] [async] Finished blocking save in 2.1 seconds\n"
         "I0101 00:00:00.000000 1 async_checkpointer.py:250] [async] Finished save (blocking + background) in 9.8 "
         "seconds\n")
NOISE = "".join(f"I0101 00:00:{i % 60:02d}.000000 1 xla_bridge.py:{900 + i}] start-up line {i} of the rank's "
                f"imports, jax.distributed, the mesh and compilation\n" for i in range(60))


@dataclass
class Attempt:
    n: int
    t: float  # attempt.started
    first: int  # first step trained
    last: int
    saves: list[int]
    ending: str
    before: int | None  # committed step resumed from
    after: int | None


def timeline(days: float, attempts: int, checkpoints: int, step_seconds: float) -> tuple[list[Attempt], int]:
    """Each attempt trains from the last committed step to the end of its share of the days; saves every `period`
    steps (MaxText's step % period == 0) and at a saved preemption. The period gives ~`checkpoints` saves on one
    attempt, two saves an attempt otherwise (checkpoint.keep then keeps the newest)."""
    span = days * 86400 / attempts
    n = max(2, int((span - STARTUP) / step_seconds))
    period = max(1, n // checkpoints if attempts == 1 else n // 2)
    out, committed = [], None
    for a in range(1, attempts + 1):
        first = 0 if committed is None else committed + 1
        last = first + n - 1
        ending = "preempted" if attempts == 1 else ENDINGS[a % len(ENDINGS)]
        saves = [s for s in range(first, last + 1) if s and s % period == 0]
        if ending == "preempted" and (not saves or saves[-1] != last):
            saves.append(last)
        after = saves[-1] if saves else committed
        out.append(Attempt(a, T0 + (a - 1) * span, first, last, saves, ending, committed, after))
        committed = after
    return out, period


def step_dir(path: Path, processes: int) -> None:
    """A committed MaxText step as check_step reads it: _CHECKPOINT_METADATA naming items/, an OCDBT PyTree."""
    items = path / "items"
    for p in range(processes):
        (items / f"ocdbt.process_{p}" / "d").mkdir(parents=True)
        (items / f"ocdbt.process_{p}" / "d" / "0a1b2c").write_bytes(b"x")
        (items / f"ocdbt.process_{p}" / "manifest.ocdbt").write_bytes(b"m")
    (items / "manifest.ocdbt").write_bytes(b"m")
    (items / "_METADATA").write_text('{"tree_metadata": {}}')
    (path / "_CHECKPOINT_METADATA").write_text(json.dumps({"item_handlers": {"items": PYTREE}}))
    (path / "commit_success.txt").write_text("Checkpoint commit was successful")


def write_events(run: RunDir, plan: list[Attempt], period: int, agents: int) -> None:
    nodes = [f"n{i}" for i in range(NODES)]
    tally, rows = Tally(), []

    def ev(t: float, name: str, **fields) -> None:
        rows.append(json.dumps({"t": round(t, 3), **fields, "event": name}, sort_keys=True))

    ev(T0 - 60, EV.RUN_SUBMITTED, total_steps=10_000_000, config_hash="sha256:" + "ab" * 32)
    for at in plan:
        a, t, end = at.n, at.t, at.t + STARTUP + (at.last - at.first + 1) * 10.0
        ev(t - 1, EV.CHECKPOINT_PERIOD, attempt=a, period=period, interval_seconds=period * 10.0,
           mtbf_seconds=2600.0, save_seconds=2.1, saves=max(1, a - 1), step_seconds=10.0, failures=a // 2,
           hours=round(a * 0.7, 3), reason="Young/Daly: generated")
        ev(t, EV.ATTEMPT_STARTED, attempt=a, resume_from_step=at.before, nodes=nodes, processes=RANKS,
           injections=[], gradient_accumulation_steps=1, checkpoint_period=period, data_position=None)
        for r in range(agents):
            ev(t + 20 + r * 0.01, EV.AGENT_STARTED, attempt=a, rank=r, pid=10_000 + r, warm=False)
        for r in range(agents):
            ev(t + 80 + r * 0.01, EV.AGENT_READY, attempt=a, rank=r, warm=False, import_seconds=41.5,
               distributed_seconds=12.25)
        ev(t + 90, EV.AGENT_MESH, attempt=a, rank=0, devices=RANKS, mesh={"dcn_data": NODES, "ici_fsdp": 8},
           per_device_batch_size=2.0, gradient_accumulation_steps=1, global_batch=2 * RANKS)
        ev(t + STARTUP, EV.ATTEMPT_FIRST_STEP, attempt=a, step=at.first, rank=0, seconds_since_start=STARTUP,
           **({"restore_started": t + 95, "restore_seconds": 30.0} if at.before is not None else {}))
        node = f"n{a % NODES}"
        if at.ending == "preempted":
            ev(end, EV.PREEMPT_REQUESTED, attempt=a, step=at.last, signal="SIGTERM", grace_seconds=120.0,
               reason="signal from Slurm", received="SIGUSR1")
            ev(end + 20, EV.PREEMPT_SAVED, attempt=a, committed_step=at.after, requested_at_step=at.last,
               step=at.last)
            tally = replace(tally, planned_ends=tally.planned_ends + 1, stalled=0)
            detail = f"SIGUSR1 after step {at.last} (time limit or preemption)"
            decision = "requeue"
        else:
            cls = at.ending
            ev(end, EV.ATTEMPT_FAILED, attempt=a, cls=cls, rank=8 * (a % NODES), last_step=at.last, node=node,
               exit_code=1 if cls == "task_exit" else None, signal=None if cls == "task_exit" else "SIGKILL",
               lost_nodes=[node] if cls == "node_fail" else [],
               **({"error": "jax.errors.JaxRuntimeError: INTERNAL: an XLA error"} if cls == "task_exit" else {}))
            if cls == "node_fail":
                ev(end + 1, EV.NODES_EXCLUDED, nodes=[node], excluded=[node], healthy=nodes[:-1],
                   reason="implicated in a node failure")
            failures = tally.training_failures + tally.infra_failures
            tally = Tally(training_failures=int(cls == "task_exit"), infra_failures=int(cls == "node_fail"),
                          planned_ends=tally.planned_ends, last_failure_at=at.after or -1,
                          refills=tally.refills + int(failures > 0), signature=f"{cls} rank={8 * (a % NODES)}",
                          repeats=1)
            detail = f"rank {8 * (a % NODES)} exited with 1 after step {at.last}"
            decision = "restart"
        ev(end + 25, EV.ATTEMPT_ENDED, attempt=a, cause=at.ending, detail=detail, committed_step=at.after,
           decision=decision, reason=f"{detail}; generated", tally=tally.as_dict(),
           **({"planned": True} if at.ending == "preempted" else {}))
        if decision == "requeue":
            ev(end + 26, EV.JOB_REQUEUE_REQUESTED, reason=detail, committed_step=at.after, excluded=[])
    run.events_file.write_text("\n".join(rows) + "\n")


def write_metrics(run: RunDir, plan: list[Attempt], thin: int) -> None:
    run.metrics_dir.mkdir()
    for r in range(RANKS):
        with open(run.metrics_file(r), "w") as fh:
            for at in plan:
                every = range(at.first, at.last + 1) if r == 0 else \
                    [*range(-(-at.first // thin) * thin, at.last, thin), at.last]
                fh.writelines(LINE.format(a=at.n, loss=2.0 + 8.0 / (1 + s / 5e4), node=r // PER_NODE, r=r, s=s,
                                          st=10.0, t=at.t + STARTUP + (s - at.first) * 10.0) for s in every)


def write_attempts(run: RunDir, plan: list[Attempt], log_ranks: int) -> None:
    for at in plan:
        run.attempt_dir(at.n).mkdir(parents=True)
        record = {"attempt": at.n, "started": at.t, "backend": "slurm", "excluded_nodes": [], "slurm_job_id": "4242",
                  "image": None, "resume_from_step": at.before, "injections": [], "launch": {"srun": "generated"},
                  "nodes": [f"n{i}" for i in range(NODES)], "pids": {"srun": 4242}, "host": "batch-host",
                  "pid_started": {"srun": 1.0}, "ended": at.t + 3000, "cause": at.ending, "detail": "generated",
                  "error": None, "committed_step": at.after, "exits": {}}
        run.attempt_record(at.n).write_text(json.dumps(record, indent=2, sort_keys=True))
        steps = "".join(f"I0101 00:00:00.000000 1 metric_logger.py:185] completed step: {s}, seconds: 10.000, "
                        f"TFLOP/s/device: 410.123, Tokens/s/device: 640.000, loss: 2.500\n"
                        + (SAVED if s in at.saves else "")
                        for s in range(at.first, at.last + 1))
        restored = ("" if at.before is None else
                    f"I0101 00:01:35.0 1 logging.py:90] {{'step': {at.before}, 'event_type': 'restore', "
                    f"'checkpoint_manager_start_time': {at.t + 95}, 'checkpoint_manager_duration_secs': 30.0}}\n")
        for r in range(log_ranks):
            run.rank_log(at.n, r).write_text(NOISE + restored + steps)


def cut_at(path: Path, starts: Callable[[dict], bool]) -> int:
    """The byte offset of the first line of `path` that `starts(parsed line)`, else its size."""
    offset = 0
    with open(path, "rb") as fh:
        for line in fh:
            if starts(json.loads(line)):
                return offset
            offset += len(line)
    return offset


def keep_digest(run: RunDir, plan: list[Attempt]) -> None:
    """<run>/digest/ as the supervisor left it at the end of the next-to-last attempt (outcome.chronicle after its
    attempt.ended): events.jsonl and rank 0's metrics cut there, digested, made whole again (same inodes)."""
    if len(plan) < 2:
        return
    last = plan[-1].n
    cuts = {run.events_file: cut_at(run.events_file, lambda e: e.get("event") == EV.CHECKPOINT_PERIOD
                                    and e.get("attempt") == last),
            run.metrics_file(0): cut_at(run.metrics_file(0), lambda m: m.get("attempt") == last)}
    rest = {}
    for path, cut in cuts.items():
        with open(path, "rb") as fh:
            fh.seek(cut)
            rest[path] = fh.read()
        os.truncate(path, cut)
    chronicle(run, run.config(), False)
    for path, data in rest.items():
        with open(path, "ab") as fh:
            fh.write(data)


def generate(path: Path, args: argparse.Namespace, days: float, attempts: int, checkpoints: int) -> tuple:
    recipe = load_recipe(REPO / "recipes" / "tiny-slurm.yaml", overrides=[
        f"name={path.name}", f"resources.nodes={NODES}", f"resources.processes_per_node={PER_NODE}",
        "trainer.steps=10000000", "checkpoint.period=auto", f"checkpoint.keep={args.checkpoints}",
        "resilience.hang_timeout=600"])
    run = RunDir(path)
    path.mkdir(parents=True)
    run.resolved.write_text(json.dumps(recipe.resolved))
    run.manifest.write_text(json.dumps({"config_hash": "sha256:" + "ab" * 32, "launcher": "slurm"}))
    plan, period = timeline(days, attempts, checkpoints, 10.0)
    kept = sorted({s for at in plan for s in at.saves})[-checkpoints:]
    for s in kept:
        step_dir(run.orbax_dir / str(s), args.ocdbt_processes)
    write_events(run, plan, period, args.agent_ranks)
    write_metrics(run, plan, args.thin)
    write_attempts(run, plan, args.log_ranks)
    keep_digest(run, plan)
    dirs = step_dirs_in(run.orbax_dir)
    bad = {s: c.problem for s, c in ((s, check_step(p)) for s, p in dirs.items()) if c.problem}
    found = triage(dirs)
    assert not bad and not found.quarantine and found.suspect is None and committed_in(run.orbax_dir) == kept, \
        (bad, found)
    return run, recipe.config, period, plan


# ------------------------------------------------------------------ the figures


class Launched(Exception):  # backend.submit was reached: the start-up is over
    pass


@dataclass
class Backend(GeneratorBackend):
    """supervisor_scale's generator backend with the job's 64 nodes (+1 spare) healthy, a CPU mark at each poll,
    and a submit that stops the start-up (`launch` False)."""

    launch: bool = True
    marks: list[float] = field(default_factory=list)

    def healthy_nodes(self) -> list[str]:
        return [f"n{i}" for i in range(NODES + 1)]

    def submit(self, request: GeneratedRequest):
        if not self.launch:
            raise Launched()
        return super().submit(request)

    def poll(self, handle):
        self.marks.append(time.thread_time())
        return super().poll(handle)


def supervisor(run: RunDir, config, backend: Backend) -> Supervisor:
    return Supervisor(run, config, [], backend, base_env={}, jax_cache_dir=str(run.path.parent / "jax"),
                      chronicle=chronicle)


@contextlib.contextmanager
def restored(run: RunDir):
    """Whatever a measurement adds to the run (events, metrics lines, an attempt's folder) is undone after it."""
    sizes = {p: p.stat().st_size for p in [run.events_file, *run.metrics_dir.iterdir()]}
    attempts = set(run.attempt_numbers())
    try:
        yield
    finally:
        for p, size in sizes.items():
            os.truncate(p, size)
        for n in set(run.attempt_numbers()) - attempts:
            shutil.rmtree(run.attempt_dir(n))


def true_probe(node: str) -> subprocess.Popen:  # no heartbeats are sent: past 30 s a node is probed, and answers
    return subprocess.Popen(["true"], stdout=subprocess.PIPE, text=True)


def pass_cost(run: RunDir, config, period: int, seconds: float) -> tuple[float, int]:
    """CPU milliseconds of the supervisor's thread per pass of its loop, and the passes, over `seconds`."""
    listener = HeartbeatListener("127.0.0.1")
    liveness = NodeLiveness(listener, start_probe=true_probe, slurmd_silent=lambda n: None, silence=10.0,
                            probe_timeout=10.0, jax_heartbeat_seconds=100, clock=time.monotonic)
    backend = Backend(run, seconds, liveness=liveness)
    sup = supervisor(run, config, backend)
    sup.shape, sup.period = elastic.shape(config), period
    with restored(run):
        attempt = sup.next_attempt_number()
        run.attempt_dir(attempt).mkdir()
        tails = {r: MetricsTail(run.metrics_file(r)) for r in range(RANKS)}
        for tail in tails.values():
            tail.skip_existing()
        handle = backend.submit(GeneratedRequest(attempt, RANKS))
        try:
            nodes = backend.nodes(handle)
            watch = AttemptWatch(sup, attempt, time.time(), tails, Progress(total_steps=10_000_000),
                                 resumed_from=None)
            liveness.watch(attempt, nodes, PER_NODE)
            sup._watch(handle, attempt, watch, nodes, None)
        finally:
            backend.stop(handle, grace=0)
            liveness.close()
    marks = backend.marks
    return 1000 * (marks[-1] - marks[0]) / max(1, len(marks) - 1), len(marks) - 1


def startup_cost(run: RunDir, config) -> tuple[float, float]:
    """Wall and CPU seconds of the supervisor's start until it would submit the next attempt."""
    sup = supervisor(run, config, Backend(run, 0.0, launch=False))
    for cache in (getattr(orbaxdirs, "_SEEN", {}), getattr(localtier, "_READ", {})):
        cache.clear()  # a requeued job's supervisor is a new process: nothing read yet
    with restored(run):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            sup._run_to_end()
        except Launched:
            pass
        else:
            raise RuntimeError(f"{run.path}: the supervisor ended without launching an attempt")
        return time.perf_counter() - wall, time.thread_time() - cpu


def status_in_process(run: RunDir, cache: Path) -> None:
    from rkit.cli import main

    os.environ["RKIT_STATUS_CACHE"] = str(cache)
    with contextlib.redirect_stdout(io.StringIO()):
        main(["status", "--json", str(run.path)], standalone_mode=False)


def profile(title: str, call, top: int) -> None:
    prof = cProfile.Profile()
    prof.runcall(call)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top + 16)
    lines = [line.replace(f"{REPO}/", "").replace(f"{Path(os.__file__).parent}/", "")
             for line in out.getvalue().splitlines()[6:] if line.strip() and "click/" not in line
             and "long_run.py" not in line and "__init__.py:16(invoke)" not in line]
    print(f"\n--- cProfile, day 30, {title}: top {top} by cumulative time ---")
    print("\n".join(lines[:top + 1]))


def spread(values: list[float], unit: str, digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} {unit} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attempts", type=int, default=1000, help="day 30's attempts")
    parser.add_argument("--checkpoints", type=int, default=500, help="day 30's committed steps (checkpoint.keep)")
    parser.add_argument("--day1-checkpoints", type=int, default=10)
    parser.add_argument("--agent-ranks", type=int, default=64, help="ranks with agent.* events in each attempt")
    parser.add_argument("--thin", type=int, default=100, help="ranks 1..511 keep every THIN'th step's line")
    parser.add_argument("--log-ranks", type=int, default=8, help="ranks with a log in each attempt's folder")
    parser.add_argument("--ocdbt-processes", type=int, default=16, help="process folders in each step's items/")
    parser.add_argument("--watch-seconds", type=float, default=8.0, help="the loop's watch per repeat")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile day 30: top N entries")
    parser.add_argument("--keep", type=Path, help="generate the runs here and keep them (else a temp folder)")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="rkit-long-run-"))
    try:
        days, made = {}, time.perf_counter()
        for label, n_days, attempts, ckpts in (("day 1", 1, 1, args.day1_checkpoints),
                                               ("day 30", 30, args.attempts, args.checkpoints)):
            run, config, period, plan = generate(root / label.replace(" ", "") / "runs" / "long", args, n_days,
                                                 attempts, ckpts)
            days[label] = (run, config, period)
            size = sum(p.stat().st_size for p in run.path.rglob("*") if p.is_file())
            events = sum(1 for _ in open(run.events_file))
            print(f"{label}: {attempts} attempt(s), {len(committed_in(run.orbax_dir))} committed steps "
                  f"(period {period}), {plan[-1].last + 1} steps, {events} events, {size / 2**20:.0f} MiB "
                  f"in {run.path}", flush=True)
        print(f"generated in {time.perf_counter() - made:.0f} s")
        figures: dict[str, dict[str, list[float]]] = {f: {d: [] for d in days} for f in (
            "pass", "start", "start cpu", "status", "status cpu")}
        for i in range(args.repeats):
            for label, (run, config, period) in days.items():
                ms, passes = pass_cost(run, config, period, args.watch_seconds)
                wall, cpu = startup_cost(run, config)
                # status_measure's peak RSS is left out: a child keeps its parent's peak across the exec (this one's)
                s_wall, s_cpu, _ = status_measure(run.path, Path(tempfile.mkdtemp(dir=root, prefix="cache")))
                for name, value in (("pass", ms), ("start", wall), ("start cpu", cpu), ("status", s_wall),
                                    ("status cpu", s_cpu)):
                    figures[name][label].append(value)
                print(f"  repeat {i + 1} {label}: pass {ms:.2f} ms CPU ({passes} passes); start-up {wall:.2f} s "
                      f"(CPU {cpu:.2f} s); status cold {s_wall:.2f} s (CPU {s_cpu:.2f} s)", flush=True)
        print(f"\n{'figure':<34}{'day 1 median (min-max)':<28}{'day 30 median (min-max)':<28}day30/day1")
        # CPU time is what rkit costs; wall time on a shared machine is mostly its neighbours' (both shown)
        for name, title, unit, digits in (("pass", "supervisor pass (CPU per pass)", "ms", 2),
                                          ("start cpu", "attempt start-up (CPU)", "s", 3),
                                          ("start", "attempt start-up (wall)", "s", 3),
                                          ("status cpu", "rkit status --json, cold (CPU)", "s", 2),
                                          ("status", "rkit status --json, cold (wall)", "s", 2)):
            one, thirty = figures[name]["day 1"], figures[name]["day 30"]
            ratio = statistics.median(thirty) / statistics.median(one)
            print(f"{title:<34}{spread(one, unit, digits):<28}{spread(thirty, unit, digits):<28}{ratio:.2f} "
                  f"{'ok' if ratio <= 1.5 else 'ABOVE the 1.5 target'}")
        if args.profile:
            run, config, period = days["day 30"]
            profile("supervisor pass", lambda: pass_cost(run, config, period, args.watch_seconds), args.profile)
            profile("attempt start-up", lambda: startup_cost(run, config), args.profile)
            profile("rkit status --json (cold)",
                    lambda: status_in_process(run, Path(tempfile.mkdtemp(dir=root, prefix="cache"))), args.profile)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
