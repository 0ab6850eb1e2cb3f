"""The node-local checkpoint tier (`checkpoint.local_dir`): rkit's records of what each tier holds, and each
rank's side of it (LocalTier); the hook into MaxText's emergency checkpointing, built so that it works, is
emergency.py.

MaxText 0.2.5's `enable_emergency_checkpoint` builds Orbax's emergency.CheckpointManager: the first data-parallel
replica saves every `checkpoint_period` steps to the shared run directory (the persistent tier), every other
replica every `local_checkpoint_period` steps to its own node's storage (the local tier); a restore takes the
newest step that one replica holds whole, from local storage, else the newest persistent step.

rkit's own: a process's local folder is named by what stays the same when other nodes leave, its node and local rank
(`<node>-<local rank>`), so that after a node is lost each survivor, at whatever process index it now has, finds its
own steps (a replica holds the whole state and a node's processes keep their order, so the restoring replica reads
them in the current mesh: emergency.py, fix 5); after a restore of step S every process deletes its local steps
newer than S (a replica left holding a newer step skips saving it while the others save it: a deadlock in the next
save's collective); each process records its committed local steps in <run>/checkpoints/local-tier/<node>-<local
rank>.json, so that the supervisor (which cannot read another node's disk) counts them as committed, `rkit status`
says which tier each step is in, and a restore from an older step than the local tier had is said
(`checkpoint.restored`), not silent. A restore that fails is a corrupt step only on evidence (the step's files fail
the check again, or the error names them); the final step counts only in the run directory (a local copy of it is
moved aside at the next start, and the step trained again so that its save reaches the run directory); folders no
current process maps to, and old quarantined steps, are removed once the run directory holds a newer step.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rkit.contract.errors import RkitError
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir, write_json_atomic
from rkit.contract.safeio import load_json
from rkit.runtime.trainers.orbaxdirs import committed_in, local_step_problem, step_dirs_in, step_problem

if TYPE_CHECKING:
    from collections.abc import Callable

    from rkit.contract.config import Config

NODE_ENV = "RKIT_NODE"  # the local launcher's virtual node of a rank (on Slurm: SLURMD_NODENAME)
NODES_ENV = "RKIT_NODES"  # the local launcher's virtual nodes of the attempt, comma-separated
QUARANTINE = "quarantine"
KEEP_QUARANTINED = 4  # local steps kept aside for a post-mortem, per node's run directory
FINAL_WAIT_SECONDS = 600.0  # at its end, how long a process waits for the first replica's final save to commit
DATA_AXIS = "data"  # MaxText's data-parallel axis whose every index holds the whole state (fsdp shards it)
KEEP = 2  # local steps each process keeps: a damaged newest still leaves one


def period(config: Config, persistent_period: int) -> int:
    """The local tier's period: checkpoint.local_period, else a tenth of the persistent period (at least 1)."""
    given = config.checkpoint.local_period
    return int(given) if given else max(1, int(persistent_period) // 10)


def expand(local_dir: str, environ: dict[str, str] | os._Environ | None = None) -> Path:
    """checkpoint.local_dir on this node: its $VAR / ${VAR} expanded from this process's environment (Slurm's
    $SLURM_TMPDIR, $TMPDIR); an unset variable is an error, never a directory named after it."""
    env = os.environ if environ is None else environ

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if not env.get(name):
            raise RkitError(f"checkpoint.local_dir: {local_dir!r}: ${name} is not set on this node; set it in the "
                            "job's environment or give a path.")
        return env[name]

    path = Path(re.sub(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))", value, local_dir))
    if not path.is_absolute():
        raise RkitError(f"checkpoint.local_dir: {local_dir!r} is {str(path)!r} here, not an absolute path.")
    return path


def node_key(environ: dict[str, str] | os._Environ, rank: int) -> str:
    """The local folder (and record) of a process: its node and local rank, which stay the same when other
    nodes leave and the process indexes move."""
    from rkit.runtime.devices import local_rank
    from rkit.runtime.telemetry.node import node_name

    node = environ.get(NODE_ENV) or node_name(environ)
    return f"{node}-{local_rank(dict(environ), rank)}"


def live_keys(environ: dict[str, str] | os._Environ, rank: int) -> set[str]:
    """The folders the attempt's processes on the nodes this process can see map to: the attempt's virtual
    nodes' (local launcher), else this node's, each local rank."""
    from rkit.runtime.devices import PER_NODE_ENV
    from rkit.runtime.telemetry.node import node_name

    nodes = [n for n in environ.get(NODES_ENV, "").split(",") if n] or \
        [environ.get(NODE_ENV) or node_name(environ)]
    per_node = max(1, int(environ.get(PER_NODE_ENV) or 1))
    return {f"{node}-{lr}" for node in nodes for lr in range(per_node)} | {node_key(environ, rank)}


def run_root(local_dir: str, run: RunDir, environ: dict[str, str] | os._Environ | None = None) -> Path:
    """This run's directory in the node's local storage; Orbax keeps one directory per process under it."""
    return expand(local_dir, environ) / f"rkit-{run.name}"


def binds(config: Config) -> tuple[str, ...]:
    """What an image needs bound for the local tier: a plain checkpoint.local_dir (it must exist on every node).
    One with a variable is expanded only on the node, where srun starts Apptainer without a shell: it must lie
    where Apptainer mounts by itself (/tmp, /var/tmp: $SLURM_TMPDIR and $TMPDIR usually do)."""
    local = config.checkpoint.local_dir
    return (str(local),) if local and "$" not in local else ()


# ------------------------------------------------------------------ records (host side: the shared run directory)

def record_path(run: RunDir, key: str) -> Path:
    return run.local_tier_dir / f"{key}.json"


def forget(run: RunDir, nodes: list[str] | tuple[str, ...]) -> list[str]:
    """The records of nodes the run left out (excluded, lost): their steps are on disks no attempt reads."""
    gone = []
    for rec in records(run):
        key = rec.get("key")
        if rec.get("node") in nodes and isinstance(key, str) and Path(key).name == key and key not in (".", ".."):
            record_path(run, key).unlink(missing_ok=True)  # a key is a file name here, never a path elsewhere
            gone.append(rec["key"])
    return gone


# records() per directory: its mtime when read, and what was read. The supervisor asks every poll (0.1 s) and a
# run has a record per rank on a shared file system: read again only when a rank rewrote one (a rename changes the
# directory's mtime), or while the last change is under RECENT_SECONDS old (two renames within the file system's
# mtime granularity would leave it unchanged).
_READ: dict[str, tuple[int, list[dict]]] = {}
RECENT_SECONDS = 2.0


def records(run: RunDir) -> list[dict]:
    """Each process's last record of its local tier: key, node, local_rank, rank, process, replica,
    replica_size, steps, path."""
    try:
        seen = os.stat(run.local_tier_dir)
    except OSError:
        return []
    key = str(run.local_tier_dir)
    cached = _READ.get(key)
    if cached is not None and cached[0] == seen.st_mtime_ns and time.time() - seen.st_mtime > RECENT_SECONDS:
        return cached[1]
    found = []
    try:
        paths = sorted(run.local_tier_dir.glob("*.json"))
    except OSError:
        return []
    for path in paths:
        try:  # a regular file only (a FIFO or device planted there must not hang a reader)
            value = load_json(path, "local-tier record", limit=1 << 20)
        except (RkitError, OSError):
            continue
        if isinstance(value, dict) and isinstance(value.get("steps"), list) \
                and all(isinstance(s, int) and not isinstance(s, bool) for s in value["steps"]):
            found.append(value)
    _READ[key] = (seen.st_mtime_ns, found)
    return found


def restorable(found: list[dict]) -> list[int]:
    """Steps one replica holds whole, as recorded: every process of the replica lists the step."""
    by_replica: dict[Any, list[dict]] = {}
    for rec in found:
        by_replica.setdefault(rec.get("replica"), []).append(rec)
    steps: set[int] = set()
    for replica, members in by_replica.items():
        size = members[0].get("replica_size")
        if replica is None or not isinstance(size, int) or len(members) < size:
            continue
        steps |= set.intersection(*(set(m["steps"]) for m in members))
    return sorted(steps)


def newest_restorable(run: RunDir) -> int | None:
    steps = restorable(records(run))
    return steps[-1] if steps else None


def tiers(run: RunDir) -> dict[str, Any]:
    """`rkit status`: the committed steps of each tier (the newest few) and each rank's local steps."""
    found = records(run)
    return {"persistent": committed_in(run.orbax_dir)[-3:], "local": restorable(found)[-3:],
            "ranks": [{k: r.get(k) for k in ("rank", "node", "replica", "steps")} for r in found if r.get("steps")]}


# ------------------------------------------------------------------ in the training environment

class LocalTier:
    """One rank's side of the local tier: the hooks into MaxText and Orbax, and its record."""

    def __init__(self, run: RunDir, attempt: int, rank: int, final_step: int, root: Path,
                 emit: Callable[..., Any], environ: dict[str, str] | os._Environ | None = None):
        self.run, self.attempt, self.rank, self.root, self.emit = run, attempt, rank, root, emit
        env = os.environ if environ is None else environ
        self.key, self.live = node_key(env, rank), live_keys(env, rank)
        self.sees_all = bool(env.get(NODES_ENV))  # the local launcher's virtual nodes: every live folder is known
        self.node = self.key.rpartition("-")[0]
        self.on_restore: list[Callable[[int], Any]] = []  # called as this process begins a restore (injections)
        self.final_step = final_step
        self.last_step: int | None = None  # the newest step this process trained
        self.process_dir: Path | None = None
        self.replica: int | None = None
        self.replica_size: int | None = None
        self.manager: Any = None
        self.restored_tier: str | None = None
        self.keep: int | None = None  # checkpoint.keep: the persistent tier's retention (emergency.py)
        self._seen: list[int] | None = None

    # -- the record

    def local_steps(self) -> list[int]:
        return committed_in(self.process_dir) if self.process_dir is not None else []

    def observe(self, step: int | None = None) -> None:
        """Rewrite this rank's record when its committed local steps changed (the loop calls it every step)."""
        if step is not None:
            self.last_step = step
        if self.process_dir is None:
            return
        steps = self.local_steps()
        if steps == self._seen:
            return
        self._seen = steps
        self.run.local_tier_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(record_path(self.run, self.key), {
            "key": self.key, "node": self.node, "local_rank": int(self.key.rpartition("-")[2]), "rank": self.rank,
            "process": self.process, "replica": self.replica, "replica_size": self.replica_size, "steps": steps,
            "path": str(self.process_dir), "attempt": self.attempt, "t": time.time()})
        self.tidy()

    def tidy(self) -> list[str]:
        """Folders under this node's run directory that no process of the attempt maps to (a lost virtual
        node's, under the local launcher; a layout's before a change) and quarantined steps beyond the newest
        KEEP_QUARANTINED, removed once the run directory holds a step newer than all they hold: no restore can
        pick them then. On Slurm only this node's own folders: another node's may be live on a disk they share."""
        persistent = committed_in(self.run.orbax_dir)
        if not persistent:
            return []
        gone = []
        try:
            children = [c for c in self.root.iterdir() if c.is_dir() and not c.is_symlink()]
        except OSError:
            return []
        for child in children:
            if child.name in self.live or child.name == QUARANTINE or not (
                    self.sees_all or child.name.startswith(f"{self.node}-") or child.name.isdigit()):
                continue
            if all(step < persistent[-1] for step in step_dirs_in(child)):
                shutil.rmtree(child, ignore_errors=True)
                gone.append(child.name)
        aside = self.root / QUARANTINE
        try:
            kept = sorted((c for c in aside.iterdir() if c.is_dir()), key=lambda c: c.stat().st_mtime, reverse=True)
        except OSError:
            kept = []
        for old in kept[KEEP_QUARANTINED:]:
            shutil.rmtree(old, ignore_errors=True)
            gone.append(f"{QUARANTINE}/{old.name}")
        return gone

    def wait_and_observe(self) -> None:
        """Pending local saves finished, then recorded (an injection that loses the local data waits for it)."""
        if self.manager is not None:
            self.manager.wait_until_finished()
        self.observe()

    def lose(self) -> None:
        """The rehearsal of a replaced node: this process's local data is gone."""
        self.wait_and_observe()
        if self.process_dir is not None:
            shutil.rmtree(self.process_dir, ignore_errors=True)

    def finish(self, wait_seconds: float = FINAL_WAIT_SECONDS) -> None:
        """This process ends normally having trained the run's final step: once the run directory holds that
        step (the first replica's save, which may still be committing), its local checkpoints have served and are
        removed (its record then lists none). Until then they are kept: when the run directory refused the final
        save they are the newest copy (the next attempt trains the final step again from them). A preempted
        process (stopped before the final step) keeps them."""
        if self.process_dir is None or self.last_step is None or self.last_step < self.final_step:
            return
        deadline = time.monotonic() + wait_seconds
        while self.final_step not in committed_in(self.run.orbax_dir):
            if time.monotonic() > deadline:
                sys.stderr.write(f"rkit: the run directory has no committed step {self.final_step} after "
                                 f"{wait_seconds:.0f} s: this process keeps its local checkpoints "
                                 f"({self.process_dir})\n")
                sys.stderr.flush()
                return
            time.sleep(0.5)
        shutil.rmtree(self.process_dir, ignore_errors=True)
        self.observe()
        try:
            self.root.rmdir()  # the last process of this node to finish removes the run's directory
        except OSError:
            pass

    @property
    def process(self) -> int:
        import jax

        return int(jax.process_index())

    # -- integrity, before Orbax sees the directory

    def check(self) -> None:
        """Each local step Orbax would see but could not restore is moved to <local>/quarantine/ (a
        `checkpoint.quarantined` event with tier local); so is a local copy of the final step while the run
        directory lacks it: a run is finished only when its final step is there ($SLURM_TMPDIR goes with the
        job), so the step is trained again from the previous one and saved there."""
        assert self.process_dir is not None
        final_kept = self.final_step in committed_in(self.run.orbax_dir)
        for step, path in sorted(step_dirs_in(self.process_dir).items(), reverse=True):
            problem = local_step_problem(path)
            if problem is None and step >= self.final_step and not final_kept:
                problem = (f"the final step {step} is held only by the local tier (the run directory lacks it): it "
                           "is trained again from the previous step, so that its save reaches the run directory")
            if problem is not None:
                self.quarantine(step, path, problem)

    def quarantine(self, step: int, path: Path, problem: str) -> None:
        target = self.root / QUARANTINE / f"{self.key}-{step}"
        n = 2
        while target.exists():
            target = self.root / QUARANTINE / f"{self.key}-{step}-{n}"
            n += 1
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        self.emit(EV.CHECKPOINT_QUARANTINED, step=step, tier="local", reason=problem, rank=self.rank,
                  attempt=self.attempt, moved_to=str(target))
        self.observe()

    def restore_failed(self, step: int, exc: BaseException) -> bool:
        """Whether a failed restore is this step's damage, on evidence: the step's files fail the check again,
        or the error (not one of memory, a connection or a peer) names them. Then a local step is moved aside,
        so that the next attempt restores from another replica or the run directory (a run directory's step, the
        supervisor moves aside on the attempt's cause). Anything else (a
        peer lost in the restore's collectives, memory, a passing I/O error) leaves the step alone: the attempt
        fails as that, and the rank that failed first is named."""
        if self.restored_tier == "persistent":  # the run directory's step: the supervisor moves it aside
            path = step_dirs_in(self.run.orbax_dir).get(step)
            return path is not None and (step_problem(path) is not None or names_files_of(exc, path))
        path = step_dirs_in(self.process_dir).get(step) if self.process_dir is not None else None
        if self.restored_tier != "local" or path is None:
            return False
        problem = local_step_problem(path)
        if problem is None and names_files_of(exc, path):
            problem = f"the restore failed: {type(exc).__name__}: {str(exc)[:300]}"
        if problem is None:
            return False
        self.quarantine(step, path, problem)
        return True

    # -- after a restore

    def purge_newer(self, step: int) -> list[int]:
        gone = []
        for s, path in step_dirs_in(self.process_dir).items() if self.process_dir is not None else ():
            if s > step:
                shutil.rmtree(path, ignore_errors=True)
                gone.append(s)
        return sorted(gone)

    def restored(self, step: int, seconds: float, data: str = "none") -> None:
        """Rank 0's `checkpoint.restored` event (`data`: its data position restored, missing or none). A restore
        older than the newest step the supervisor counted as
        committed when it started this attempt (attempt.started's resume_from_step: either tier's, the local one
        from the ranks' records) says which step was lost."""
        if self.rank != 0:
            return
        started = [e for e in self.run.events() if e.get("event") == EV.ATTEMPT_STARTED
                   and e.get("attempt") == self.attempt]
        recorded = started[-1].get("resume_from_step") if started else None
        recorded = recorded if isinstance(recorded, int) and not isinstance(recorded, bool) else None
        tier = self.restored_tier or "persistent"
        fields: dict[str, Any] = {"attempt": self.attempt, "rank": self.rank, "step": step, "tier": tier,
                                  "seconds": round(seconds, 3), "data_position": data}
        if recorded is not None and recorded > step:
            fields["lost_step"] = recorded
            fields["reason"] = (f"step {recorded} is gone (a node's local checkpoints were lost or damaged): "
                                f"restored step {step} from the {tier} tier, {recorded - step} steps older")
            sys.stderr.write(f"rkit: WARNING: {fields['reason']}\n")
            sys.stderr.flush()
        self.emit(EV.CHECKPOINT_RESTORED, **fields)


NOT_THE_STEP = (MemoryError, ConnectionError, TimeoutError)
PASSING_ERRNOS = (5, 11, 12, 110)  # EIO, EAGAIN, ENOMEM, ETIMEDOUT: the device or the moment, not the bytes


def names_files_of(exc: BaseException, path: Path) -> bool:
    """Whether an exception (or one it came from) is a read error on the step's own files: it names them, and
    is not memory, a connection or a passing I/O error."""
    seen: set[int] = set()
    link: BaseException | None = exc
    named = False
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, NOT_THE_STEP) or (isinstance(link, OSError) and link.errno in PASSING_ERRNOS):
            return False
        named = named or str(path) in str(link)
        link = link.__cause__ or link.__context__
    return named
