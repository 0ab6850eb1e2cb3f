"""A fault campaign (issue 43, `make chaos`): a seeded schedule of many faults fired into one real training run on
the Slurm test bed, at Slurm's default timeouts, on real data, with warm standbys and the node-local tier on; then a
checker of what rkit promises and a report. Real Slurm, real Apptainer, real MaxText, real Grain, real Orbax.

    eval "$(ci/slurm-testbed.sh env)"
    python tests/benchmarks/chaos.py --image SIF [--seed N ...] [--faults 20] [--timeouts 300,10]

The run: recipes/tiny-slurm.yaml (2 nodes x 1 process, one spare node of the test bed's 3) on text records read
through MaxText's Grain pipeline, each process a data-parallel replica holding node-local steps every 2 steps
(checkpoint.local_dir), the run directory's every 10, warm standbys on, the budgets raised to the campaign's faults
(a campaign is many faults by design; the default budgets would rightly give up). One uninterrupted run of the
same recipe is the reference (shared by the seeds).

The schedule (seeded: the same seed gives the same schedule, printed before it starts): faults at steps 10-25 apart,
each drawn from
  kill          SIGKILL a rank (--inject kill)                              expected: task_signal, that rank
  exit          a rank exits with a code (--inject exit)                    expected: task_exit, that rank
  hang          a rank stops (SIGSTOP; --inject hang)                       expected: hang
  preempt       Slurm's USR1 before the time limit (--inject preempt)       expected: preempted (planned), requeued
  lose_local    a node's local checkpoints are lost and its rank killed     expected: task_signal, that rank
  node_crash    the node of rank 1 crashes (ci/slurm-testbed.sh crash)      expected: node_fail, that node
  disk_full     the node-local tier's file system (a tmpfs) is filled but for 64 KiB; once the run has stopped
                on it, the ballast is removed and the run resumed (rkit run --resume), as an operator and a user
                would                                                        expected: disk_full
and, timed to land in a recovery,
  kill_restore  a rank SIGKILLed as it begins the restore after the previous fault     expected: task_signal
  corrupt       once the attempt of the previous fault has ended, the step the next one restores is damaged (bit
                rot: its data files overwritten): rank 1's newest local step, or after a node crash or the loss of
                rank 1's local steps the run directory's newest                       expected: corrupt_checkpoint
  crash_in_recovery  the node of rank 1 of the attempt after the previous fault crashes once that attempt has
                started and before its first step                                 expected: node_fail, that node
Some kills and preemptions fall on a save step (an async save in flight). A crashed node is brought back once the
run has trained past the crash (it returns as a spare).

The checker, on the result:
  finished      the run finished (or stopped with a diagnosis naming a fault that cannot be survived)
  loss          every step's loss and data fingerprint equal the reference run's (rank 0, newest line per step)
  diagnosed     each fault's attempt ended with the cause it is (status --json), naming the right rank or node;
                no crash loop and no budget given up for faults the schedule made
  processes     no process of the run is left (its job left the queue; no process names its directory)
  files         no file of the run directory half-written (every .json parses; no temporary file left)
  goodput       goodput's parts add up to its wall time
The report: faults injected / survived / diagnosed, steps recomputed per fault, detection (fault -> attempt.failed)
and recovery (fault -> the next attempt's first step) per kind (median and range), wall time against the
reference. It exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchruns import REPO, events
from chaos_check import BY_HARNESS, check, final, in_queue, report, status_json

RECIPE = REPO / "recipes" / "tiny-slurm.yaml"
TESTBED = REPO / "ci" / "slurm-testbed.sh"
PERIOD = 10
START = 20  # the first fault's earliest step
# The node-local tier's file system: a tmpfs mounted here before the test bed's cluster starts (a mount made later
# is not seen in its namespaces), which a disk_full fills. Each node's local directory is its own folder on it.
LOCAL_FS = Path("/tmp/rkit-chaos-local")
LOCAL_FS_SIZE = "1g"
REPAIR_SECONDS = 120  # a crashed node is back at the latest this long after its crash
KINDS = {"kill": 4, "exit": 3, "preempt": 3, "lose_local": 2, "node_crash": 3, "hang": 1, "supervisor_kill": 1,
         "disk_full": 1, "kill_restore": 2, "crash_in_recovery": 2, "corrupt": 2}
FOLLOWERS = ("kill_restore", "crash_in_recovery", "corrupt")  # land in the recovery of the fault before them
# What the attempt after each kind restores: the local tier (rank 1, the one replica saving there, keeps its node
# and its steps), else the run directory's newest step (rank 1's local steps lost, or on a crashed node)
RESTORES_LOCAL = ("kill", "exit", "hang", "lose_local")


@dataclass
class Fault:
    index: int
    kind: str
    step: int  # the step it fires at (a follower: the step of the fault whose recovery it lands in)
    rank: int = 1
    code: int | None = None
    on_save: bool = False
    # filled in as it happens
    attempt: int | None = None
    at: float | None = None
    node: str | None = None

    def spec(self) -> str | None:
        if self.kind == "kill":
            return f"kill:rank={self.rank},step={self.step}"
        if self.kind == "exit":
            return f"exit:rank={self.rank},step={self.step},code={self.code}"
        if self.kind == "hang":
            return f"hang:rank={self.rank},step={self.step}"
        if self.kind == "preempt":
            return f"preempt:step={self.step}"
        if self.kind == "lose_local":
            return f"lose_local:rank={self.rank},step={self.step}"
        if self.kind == "kill_restore":  # the restore of any step from the previous fault's on
            return f"kill_restore:rank={self.rank},step={max(0, self.step - PERIOD)}"
        return None

    def describe(self) -> str:
        where = " (a save in flight)" if self.on_save else ""
        if self.kind in FOLLOWERS:
            return f"#{self.index} {self.kind} rank {self.rank}, in the recovery from the fault at step {self.step}"
        extra = f" code {self.code}" if self.code is not None else ""
        rank = "" if self.kind in ("preempt", "supervisor_kill", "disk_full") else f" rank {self.rank}"
        return f"#{self.index} {self.kind}{rank}{extra} at step {self.step}{where}"


def schedule(seed: int, count: int) -> list[Fault]:
    """COUNT faults drawn with SEED: the same seed gives the same schedule."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    step = START - 10
    kinds, weights = list(KINDS), list(KINDS.values())
    while len(faults) < count:
        kind = rng.choices(kinds, weights)[0]
        previous = faults[-1] if faults else None
        if kind in FOLLOWERS:
            # only after a fault that ends an attempt by a failure on the run's nodes, and never two in a row
            if previous is None or previous.kind in (*FOLLOWERS, "preempt", "supervisor_kill", "disk_full"):
                continue  # (after a supervisor kill or a full disk, the recovery is the user's resume)
            rank = 1 if kind in BY_HARNESS else rng.randrange(2)  # rank 1's node: not the batch host
            faults.append(Fault(len(faults), kind, previous.step, rank=rank))
            continue
        at = step + rng.randint(10, 25)
        on_save = kind in ("kill", "preempt") and rng.random() < 0.4
        if on_save:  # a step whose save has just begun, still 10-25 steps after the last fault
            at = -(-at // PERIOD) * PERIOD
            at = at - PERIOD if at - step > 25 else at
        step = at
        rank = 1 if kind in BY_HARNESS else rng.randrange(2)
        code = rng.randint(1, 120) if kind == "exit" else None
        faults.append(Fault(len(faults), kind, step, rank=rank, code=code, on_save=on_save))
    return faults


def recipe_args(work: Path, image: str, steps: int, faults: int) -> list[str]:
    data = work / "data"
    return ["-o", f"runs_dir={work / 'runs'}", "-o", f"image={image}", "-o", f"trainer.steps={steps}",
            "-o", f"checkpoint.period={PERIOD}", "-o", "checkpoint.keep=4",
            "-o", f"checkpoint.local_dir={LOCAL_FS / work.name}/$SLURMD_NODENAME", "-o", "checkpoint.local_period=2",
            "-o", "trainer.overrides.ici_data_parallelism=-1", "-o", "trainer.overrides.ici_fsdp_parallelism=1",
            "-o", "trainer.overrides.dataset_type=grain", "-o", "trainer.overrides.grain_worker_count=0",
            "-o", f"trainer.overrides.grain_train_files={data}/train-*.array_record",
            "-o", "trainer.overrides.tokenizer_path=tokenizer.default", "-o", "trainer.overrides.vocab_size=32768",
            "-o", "resilience.warm_standby=true", "-o", f"resilience.max_restarts={faults + 3}",
            "-o", f"resilience.max_infra_restarts={faults + 3}", "-o", "slurm.time=03:00:00"]


class Campaign:
    """One run under a schedule: submits it (and resumes it after a supervisor kill, with the injections that have
    not fired yet), fires the harness's faults when they are due, brings crashed nodes back."""

    def __init__(self, work: Path, name: str, args: list[str], faults: list[Fault]):
        self.work, self.name, self.args, self.faults = work, name, args, faults
        self.run = work / "runs" / name
        self.jobs: list[str] = []
        self.sessions: list[dict[int, Fault]] = []  # each `rkit run`'s --inject indexes (they restart with each)
        self.crashed: list[tuple[str, int, float]] = []  # (node, the attempt it crashed in, when)
        self.began = 0.0
        self.mount = LOCAL_FS  # the node-local tier's file system, which a disk_full fills

    def submit(self, resume: bool = False) -> None:
        waiting = [f for f in self.faults if f.kind not in BY_HARNESS and f.attempt is None]
        session = {i: f for i, f in enumerate(waiting)}
        specs = [f.spec() for f in waiting]
        self.began = self.began or time.time()
        subprocess.run([sys.executable, "-m", "rkit.cli", "run", str(RECIPE), "-o", f"name={self.name}", *self.args,
                        *[a for spec in specs for a in ("--inject", spec)], *(["--resume"] if resume else [])],
                       check=True, capture_output=True)
        self.sessions.append(session)
        self.jobs.append([e for e in events(self.run) if e["event"] == "job.submitted"][-1]["job_id"])

    def sync(self, evs: list[dict]) -> None:
        """Each injection's attempt and time, from its inject.fired, read in the session of the attempt it fired in
        (the `rkit run` that started that attempt: a killed supervisor's ranks may fire after the resume began)."""
        session, of_attempt = -1, {}
        for e in evs:
            if e["event"] in ("run.submitted", "run.resumed"):
                session += 1
            elif e["event"] == "attempt.started":
                of_attempt[e["attempt"]] = session
            elif e["event"] == "inject.fired" and 0 <= (k := of_attempt.get(e["attempt"], session)) < len(
                    self.sessions):
                fault = self.sessions[k].get(e.get("index"))
                if fault is not None and fault.attempt is None:
                    fault.attempt, fault.at = e["attempt"], e["t"]

    def drive(self, timeout: float) -> float:
        """Until the run's final event and its job left the queue; returns the wall time from the submission."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            evs = events(self.run)
            self.sync(evs)
            job, end = self.jobs[-1], final(evs)
            if end and not in_queue(job) and self.resume_due():
                self.submit(resume=True)  # what a user does after the supervisor was killed or the disk cleared
                print(f"  resumed: job {self.jobs[-1]}", flush=True)
                continue
            if end and not self.crashed and not in_queue(job):
                return end["t"] - self.began
            for node, at, when in list(self.crashed):  # back (a repaired machine) once a later attempt has trained,
                # or after REPAIR_SECONDS: a run that needs it back (no spare left) waits for it meanwhile
                if any(e["event"] == "attempt.first_step" and e["attempt"] > at for e in evs) or final(evs) or \
                        time.time() - when > REPAIR_SECONDS:
                    testbed("restore", node)
                    self.crashed.remove((node, at, when))
            if any(f.kind == "disk_full" and f.at is not None and not any(
                    e["event"] == "attempt.ended" and e["attempt"] == f.attempt for e in evs) for f in self.faults):
                self.fill()
            fault = next((f for f in self.faults if f.kind in BY_HARNESS and f.at is None), None)
            attempt = current_attempt(evs)
            if fault is not None and attempt is not None and self.due(fault, evs, attempt["attempt"]):
                self.fire(fault, attempt["attempt"], evs)
            elif not end and not in_queue(job) and self.resume_due():
                self.submit(resume=True)
                print(f"  resumed: job {self.jobs[-1]}", flush=True)
            time.sleep(0.5)
        raise TimeoutError(f"{self.run}: not done in {timeout:.0f} s")

    def fill(self) -> None:
        """The local tier's file system full but for 64 KiB, topped up each round while the attempt a disk_full
        hit runs (as another job's data would grow): the local tier's retention frees old steps after each save,
        and without it the disk was found full only 13 steps later (seed 1), past the next fault's step."""
        try:  # where the run took the last of it first, the ballast stops at ENOSPC
            with open(self.mount / "ballast", "ab") as ballast:
                ballast.write(b"\0" * max(0, shutil.disk_usage(self.mount).free - 65536))
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise

    def resume_due(self) -> bool:
        """(Its job has left the queue.) A supervisor was killed and the run says it stopped, or the checkpoint
        file system was filled and the run stopped on it (then the ballast is removed first), not yet resumed."""
        stopping = [f for f in self.faults if f.kind in ("supervisor_kill", "disk_full") and f.at is not None]
        if not stopping or len(self.jobs) > len(stopping):
            return False
        time.sleep(1.5)  # status is a command: asked every 2 s, not every round
        status = status_json(self.run)
        if stopping[-1].kind == "supervisor_kill":
            return status.get("state") == "stopped"
        if status.get("state") != "gave up" or not (status.get("reason") or "").startswith("disk full"):
            return False  # stopped for another reason: the checker says so
        (self.mount / "ballast").unlink()
        return True

    def due(self, fault: Fault, evs: list[dict], n: int) -> bool:
        """Once every fault before it has fired: a node crash or a supervisor kill when rank 0 of the current
        attempt is past its step; a crash in a recovery once the attempt after the previous fault has started and
        not yet trained."""
        if any(f.at is None for f in self.faults[: fault.index]):
            return False
        if fault.kind == "corrupt":  # once the previous fault's attempt has ended (no rank writes), before the next
            # attempt restores (it starts at once, its ranks warm: the harness has a second or two)
            previous = self.faults[fault.index - 1]
            return any(e["event"] == "attempt.ended" and e["attempt"] == previous.attempt for e in evs)
        if not (self.run / "attempts" / str(n) / "attempt.json").exists():
            return False
        trained = any(e["event"] == "attempt.first_step" and e["attempt"] == n for e in evs)
        ended = any(e["event"] == "attempt.ended" and e["attempt"] == n for e in evs)
        if fault.kind in ("node_crash", "supervisor_kill", "disk_full"):  # into a live attempt, not one ending,
            # and not one an earlier fault hit (a full disk is found at a later save: the attempt trains on a while)
            hit = max((f.attempt for f in self.faults[: fault.index] if f.attempt is not None), default=0)
            return trained and not ended and n > hit and rank0_step(self.run) >= fault.step
        previous = self.faults[fault.index - 1]
        return n > previous.attempt and not trained

    def fire(self, fault: Fault, n: int, evs: list[dict]) -> None:
        fault.attempt = n
        if fault.kind == "supervisor_kill":
            import psutil

            argv_end = ["supervise", str(self.run.resolve())]
            proc = next((p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[-2:] == argv_end),
                        None)
            if proc is None:
                return  # between jobs: tried again on the next round
            fault.at = time.time()
            proc.kill()
            print(f"  fired {fault.describe()}: supervisor {proc.pid} killed in attempt {n}", flush=True)
            return
        if fault.kind == "corrupt":
            previous = self.faults[fault.index - 1]
            fault.attempt, fault.at = previous.attempt + 1, time.time()
            local = previous.kind in RESTORES_LOCAL and not (previous.kind == "lose_local" and previous.rank == 1)
            ended = json.loads((self.run / "attempts" / str(previous.attempt) / "attempt.json").read_text())
            where = damage_newest(self.run, local, ended["launch"]["nodes"])
            print(f"  fired {fault.describe()}: {where} overwritten after attempt {previous.attempt}", flush=True)
            return
        if fault.kind == "disk_full":
            fault.at = time.time()
            self.fill()
            print(f"  fired {fault.describe()}: {self.mount} filled in attempt {n}", flush=True)
            return
        nodes = json.loads((self.run / "attempts" / str(n) / "attempt.json").read_text())["launch"]["nodes"]
        fault.node, began = nodes[1], time.time()
        testbed("crash", fault.node)
        fault.at = time.time()  # the node is gone once the command returns (it kills the node's every process)
        self.crashed.append((fault.node, n, fault.at))
        print(f"  fired {fault.describe()}: {fault.node} crashed in attempt {n} (the crash took "
              f"{fault.at - began:.1f} s)", flush=True)


def damage_newest(run: Path, local: bool, nodes: list[str]) -> str:
    """Bit rot in the step the next attempt restores, overwritten with random bytes (Orbax's files look whole:
    only the restore finds it): every data file of rank 1's copy of the newest local step (`local`: its node and
    steps are still there; `nodes`: the ended attempt's, whose replicas the next one restores from), unless the run
    directory's newest committed step is newer, else of that step. Returns the step directory."""
    from rkit.contract.rundir import RunDir
    from rkit.runtime.trainers import localtier

    rundir = RunDir(run)
    steps = [p for p in rundir.orbax_dir.iterdir() if p.name.isdigit() and (p / "commit_success.txt").exists()]
    step_dir = max(steps, key=lambda p: int(p.name))
    # Read on disk, in each node's folder as rkit lays it out (one process a node), not from the local tier's
    # records: they can lag the last save (seed 1 at 78573f6 damaged step 134; the restore read 136), and a crashed
    # node's is gone. Orbax keeps local steps on the replicas after the first only (rank 0's folder stays empty).
    local_dir = f"{LOCAL_FS / run.parent.parent.name}/$SLURMD_NODENAME"
    roots = [localtier.run_root(local_dir, rundir, {"SLURMD_NODENAME": n}) / f"{n}-0" for n in nodes[1:]]
    common = set.intersection(*[on_disk(root) for root in roots]) if roots and local else set()
    if common and max(common) >= int(step_dir.name):
        step_dir = roots[0] / str(max(common))
    files = [f for f in step_dir.rglob("*") if f.is_file() and f.parent.name == "d"]
    for f in files:
        f.write_bytes(os.urandom(100))
    return f"{step_dir} ({len(files)} data files)"


def on_disk(root: Path) -> set[int]:  # a replica's steps (Orbax writes a step under a temporary name first)
    return {int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir()} if root.is_dir() else set()


def rank0_step(run: Path) -> int:
    try:
        text = (run / "metrics" / "0.jsonl").read_text()
    except FileNotFoundError:
        return -1
    best = -1
    for line in text.splitlines()[-50:]:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            best = max(best, int(json.loads(line)["step"]))
    return best


def current_attempt(evs: list[dict]) -> dict | None:
    return next((e for e in reversed(evs) if e["event"] == "attempt.started"), None)


def testbed(*args: str) -> None:
    subprocess.run([str(TESTBED), *args], check=True, capture_output=True, timeout=600)


# -- the campaign --------------------------------------------------------------------------------------------------

def steps_for(count: int) -> int:
    """The run's length: room for COUNT faults at their widest spacing, and 30 steps after the last."""
    return START + 25 * count + 30


def campaign(work: Path, image: str, seed: int, count: int, reference: tuple[Path, float] | None,
             timeout: float) -> tuple[bool, tuple[Path, float]]:
    faults = schedule(seed, count)
    steps = steps_for(count)
    print(f"seed {seed}: {len(faults)} faults over {steps} steps", flush=True)
    for f in faults:
        print(f"  {f.describe()}", flush=True)
    args = recipe_args(work, image, steps, len(faults))
    if reference is None:  # one per invocation (or per --keep folder): every seed's run has the same recipe
        ref = Campaign(work, f"reference-{steps}", args, [])
        done = [e for e in events(ref.run) if e["event"] == "run.finished"] if ref.run.is_dir() else []
        if not done:
            ref.submit()
        reference = (ref.run, done[0]["t"] - events(ref.run)[0]["t"] if done else ref.drive(timeout))
        print(f"reference: {steps} steps uninterrupted in {reference[1]:.0f} s", flush=True)
    chaos = Campaign(work, f"chaos-{seed}", args, faults)
    chaos.submit()
    wall = chaos.drive(timeout)
    chaos.sync(events(chaos.run))
    verdict, rows = check(chaos.run, reference[0], faults, chaos.jobs)
    report(seed, faults, rows, verdict, wall, reference[1])
    return verdict.clean, reference


def local_fs() -> None:
    """LOCAL_FS mounted (a tmpfs), and the test bed's cluster showing it: named in RKIT_SLURM_BINDS, so that `up`
    restarts a cluster started without it."""
    LOCAL_FS.mkdir(exist_ok=True)
    if not os.path.ismount(LOCAL_FS):
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={LOCAL_FS_SIZE},mode=0755", "tmpfs", str(LOCAL_FS)],
                       check=True)
    os.environ["RKIT_SLURM_BINDS"] = " ".join({*os.environ.get("RKIT_SLURM_BINDS", "").split(), str(LOCAL_FS)})
    testbed("up")


@contextlib.contextmanager
def slurm_timeouts(slurmd: str, message: str) -> Iterator[None]:
    testbed("timeouts", slurmd, message)
    try:
        yield
    finally:
        testbed("timeouts", "20", "5")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", required=True)
    parser.add_argument("--seed", type=int, action="append", help="a campaign per seed (default 1, 2, 3)")
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--timeouts", default="300,10", help="SLURMD,MESSAGE: the test bed's Slurm timeouts meanwhile")
    parser.add_argument("--timeout", type=float, default=5400, help="seconds a run may take")
    parser.add_argument("--keep", type=Path, help="keep the runs in this folder (under /tmp: the nodes see it)")
    parser.add_argument("--print-schedule", action="store_true", help="print each seed's schedule and stop")
    args = parser.parse_args()
    seeds = args.seed or [1, 2, 3]
    if args.print_schedule:
        for seed in seeds:
            for f in schedule(seed, args.faults):
                print(f"seed {seed}: {f.describe()}")
        return 0
    from rkit.recipe import sampledata

    image = str(Path(args.image).resolve())
    clean = True
    with contextlib.ExitStack() as stack:
        work = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rkit-chaos-", dir="/tmp")))
        work.mkdir(parents=True, exist_ok=True)
        if not (work / "data").exists():  # enough for the run: 2 files of 400 documents last about 380 steps
            sampledata.make(work / "data", documents_per_file=400 * (-(-steps_for(args.faults) // 300)))
        local_fs()
        stack.enter_context(slurm_timeouts(*args.timeouts.split(",")))
        reference = None
        for seed in seeds:
            ok, reference = campaign(work, image, seed, args.faults, reference, args.timeout)
            clean = clean and ok
    return 0 if clean else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
