"""The node-local checkpoint tier's pure parts (runtime/trainers/localtier.py): the recipes refused before anything
starts (with the key and the fix), the path expanded on the node, MaxText's settings, the ranks' records and
what counts as committed, the integrity check of a local step, its rehearsal injection and `rkit status`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from rkit.contract.errors import RecipeError, RkitError
from rkit.contract.rundir import RunDir, write_json_atomic
from rkit.readers import status as run_status
from rkit.recipe.load import load_recipe
from rkit.runtime.inject import parse_injections
from rkit.runtime.trainers import localtier, maxtext

from ..conftest import TINY, rkit
from .synthetic_run import write_run

GOOD = ("checkpoint.local_dir=$SLURM_TMPDIR", "trainer.overrides.ici_data_parallelism=-1",
        "trainer.overrides.ici_fsdp_parallelism=1")


def config(*overrides: str):
    return load_recipe(TINY, [*GOOD, *overrides]).config


def problems_of(*overrides: str, good: tuple[str, ...] = GOOD) -> dict[str, str]:
    with pytest.raises(RecipeError) as err:
        load_recipe(TINY, [*good, *overrides])
    assert err.value.exit_code == 2
    return {p.path: p.message for p in err.value.problems}


def test_a_recipe_with_a_local_tier_and_data_parallel_replicas_passes():
    c = config("checkpoint.local_period=2")
    assert c.checkpoint.local_dir == "$SLURM_TMPDIR" and c.checkpoint.local_period == 2
    assert localtier.period(c, 10) == 2
    assert localtier.period(config(), 100) == 10 and localtier.period(config(), 5) == 1  # a tenth, at least 1
    # no schema default: a recipe without the keys keeps its config hash
    assert "local_dir" not in load_recipe(TINY).resolved["checkpoint"]


@pytest.mark.parametrize("overrides,good,key,says", [
    (("resources.processes_per_node=1",), GOOD, "checkpoint.local_dir", "2 or more processes"),
    ((), GOOD[:1], "trainer.overrides.ici_data_parallelism", "set ici_data_parallelism to -1"),
    (("trainer.overrides.ici_data_parallelism=-1",), GOOD[:1], "trainer.overrides.ici_fsdp_parallelism",
     "MaxText allows one auto axis"),
    (("checkpoint.local_dir=local/nvme",), GOOD, "checkpoint.local_dir", "not absolute"),
    (("checkpoint.local_dir=/local:nvme",), GOOD, "checkpoint.local_dir", "':'"),
    (("checkpoint.local_period=0",), GOOD, "checkpoint.local_period", ""),
    (("checkpoint.local_period=5",), (), "checkpoint.local_period", "without checkpoint.local_dir"),
])
def test_a_recipe_the_local_tier_cannot_work_with_is_refused_with_the_key_and_the_fix(overrides, good, key, says):
    found = problems_of(*overrides, good=good)
    assert key in found and says in found[key], found


def test_the_path_is_expanded_on_the_node_and_an_unset_variable_is_an_error(tmp_path: Path):
    env = {"SLURM_TMPDIR": "/tmp/slurm-42", "LOCAL": "/nvme"}
    assert localtier.expand("$SLURM_TMPDIR", env) == Path("/tmp/slurm-42")
    assert localtier.expand("${LOCAL}/ckpt", env) == Path("/nvme/ckpt")
    assert localtier.run_root("/nvme", RunDir(tmp_path / "r1"), env) == Path("/nvme/rkit-r1")
    with pytest.raises(RkitError, match=r"\$SLURM_TMPDIR is not set on this node"):
        localtier.expand("$SLURM_TMPDIR", {})
    with pytest.raises(RkitError, match="not an absolute path"):
        localtier.expand("$REL/x", {"REL": "relative"})
    assert localtier.binds(config()) == ()  # expanded only on the node: under /tmp Apptainer mounts it itself
    assert localtier.binds(config("checkpoint.local_dir=/local/nvme")) == ("/local/nvme",)


def test_maxtext_gets_the_emergency_manager_and_each_rank_its_own_directory(tmp_path: Path):
    run = RunDir(tmp_path / "run")
    args = maxtext.maxtext_overrides(config("checkpoint.local_period=3"), run, "/cache", checkpoint_period=10)
    assert "enable_emergency_checkpoint=true" in args and "local_checkpoint_period=3" in args
    assert "checkpoint_period=10" in args and not any(a.startswith("local_checkpoint_directory") for a in args)
    assert maxtext.rank_overrides(run, 1, 0, Path("/nvme/rkit-run"))[-1] == "local_checkpoint_directory=/nvme/rkit-run"
    plain = maxtext.maxtext_overrides(load_recipe(TINY).config, run, "/cache", checkpoint_period=10)
    assert not any("emergency" in a or "local_checkpoint" in a for a in plain)
    assert "local_checkpoint_directory" in maxtext.OWNED_KEYS  # a recipe's overrides cannot set it


def record(run: RunDir, rank: int, replica: int, size: int, steps: list[int]) -> None:
    run.local_tier_dir.mkdir(parents=True, exist_ok=True)
    localtier.record_path(run, f"n{rank}-0").write_text(json.dumps({
        "key": f"n{rank}-0", "rank": rank, "node": f"n{rank}", "replica": replica, "replica_size": size,
        "steps": steps}))


def test_a_local_step_counts_as_committed_when_one_replica_holds_it_whole(tmp_path: Path):
    run = RunDir(tmp_path / "run")
    assert localtier.newest_restorable(run) is None and maxtext.latest_committed_step(run) is None
    # replica 0 (ranks 0, 1) writes persistent; replicas 1 (ranks 2, 3) and 2 (ranks 4, 5) local
    record(run, 2, 1, 2, [12, 14])
    record(run, 3, 1, 2, [12])  # rank 3's step 14 never committed: replica 1 holds 12 whole
    record(run, 4, 2, 2, [16])  # replica 2 lacks rank 5's record: nothing whole
    assert localtier.restorable(localtier.records(run)) == [12]
    (run.local_tier_dir / "rank-9.json").write_text("{not json")  # damaged: skipped
    (run.local_tier_dir / "rank-8.json").write_text(json.dumps({"steps": ["x"]}))
    os.mkfifo(run.local_tier_dir / "rank-7.json")  # planted: must not hang the reader
    assert maxtext.latest_committed_step(run) == 12
    (run.orbax_dir / "20").mkdir(parents=True)
    (run.orbax_dir / "20" / "_CHECKPOINT_METADATA").write_text("{}")
    assert maxtext.latest_committed_step(run) == 20  # the newest of both tiers
    assert localtier.tiers(run)["persistent"] == [20] and localtier.tiers(run)["local"] == [12]


def local_step(path: Path) -> Path:
    """A local step as Orbax's emergency manager writes it (its files, not their contents)."""
    (path / "process_metadata").mkdir(parents=True)
    (path / "state" / "d").mkdir(parents=True)
    (path / "state" / "d" / "abc").write_bytes(b"x")
    (path / "state" / "manifest.ocdbt").write_bytes(b"x")
    (path / "state" / "_METADATA").write_text("{}")
    handlers = {"process_metadata": "ProcessMetadataCheckpointHandler", "state": "PyTreeCheckpointHandler"}
    (path / "_CHECKPOINT_METADATA").write_text(json.dumps({"item_handlers": handlers}))
    return path


@pytest.mark.parametrize("damage,says", [
    (None, None),
    (lambda p: (p / "_CHECKPOINT_METADATA").unlink(), "no commit marker"),
    (lambda p: (p / "state" / "_METADATA").write_text(""), "not readable JSON"),
    (lambda p: (p / "state" / "d" / "abc").unlink(), "state/d holds no data files"),
    (lambda p: __import__("shutil").rmtree(p / "state"), "item 'state' is missing"),
])
def test_a_damaged_local_step_is_named(tmp_path: Path, damage, says):
    step = local_step(tmp_path / "12")
    if damage is not None:
        damage(step)
    problem = maxtext.local_step_problem(step)
    assert problem is None if says is None else says in problem
    if says is None:
        assert maxtext.committed_in(tmp_path) == [12]


def test_losing_a_nodes_local_data_is_rehearsed_only_with_a_local_tier():
    c = config()
    [lose] = parse_injections(["lose_local:rank=1,step=15"], c.processes, 30, c)
    assert lose.kind == "lose_local" and lose.in_trainer and lose.rank == 1
    with pytest.raises(RkitError, match="no local tier"):
        parse_injections(["lose_local:rank=1,step=15"], 2, 30, load_recipe(TINY).config)


def test_status_says_each_tier_and_a_restore_older_than_the_local_tier(tmp_path: Path):
    run = RunDir(write_run(tmp_path / "run"))
    resolved = json.loads(run.resolved.read_text())
    resolved["checkpoint"]["local_dir"] = "/nvme"
    run.resolved.write_text(json.dumps(resolved))
    record(run, 1, 1, 1, [18])
    run.emit("checkpoint.restored", attempt=2, rank=0, step=10, tier="persistent", lost_step=18,
             reason="the local tier's step 18 is gone")
    s = run_status.status(run)
    assert s["checkpoint_tiers"]["local"] == [18]
    text = run_status.render_status(s)
    assert "tiers      persistent (run directory) " in text and "local (node storage) 18; rank 1 on n1: 18" in text
    assert "#2  resumed from step 10 (persistent tier; step 18 was lost)" in text
    from rkit.readers.display import resumed_from  # the report's attempts table says it the same way

    assert resumed_from(s["attempts"][1]) == "step 10 (persistent tier; step 18 was lost)"
    assert resumed_from(s["attempts"][0]) == "from scratch"


def test_an_unset_variable_in_the_local_dir_is_refused_before_a_local_run_writes_anything(tmp_path: Path):
    # the local launcher's machine is the node: the variable is looked up when the run is planned
    env = {k: v for k, v in os.environ.items() if k != "SLURM_TMPDIR"}
    env["SLURM_TMPDIR"] = ""
    done = rkit("run", str(TINY), "--dry-run", "-o", "name=unset", *(f"-o{o}" for o in GOOD), cwd=tmp_path,
                env=env, check=2)
    assert "$SLURM_TMPDIR is not set on this node" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()
    done = rkit("run", str(TINY), "--dry-run", "-o", "name=set", *(f"-o{o}" for o in GOOD), cwd=tmp_path,
                env={"SLURM_TMPDIR": str(tmp_path / "node")}, check=0)
    assert "enable_emergency_checkpoint=true" in done.stdout


def test_the_records_are_read_again_only_when_a_rank_rewrote_one(tmp_path: Path):
    # the supervisor asks every poll: an unchanged directory (its mtime older than a few seconds) is not read again
    run = RunDir(tmp_path / "run")
    run.local_tier_dir.mkdir(parents=True)
    write_json_atomic(localtier.record_path(run, "n1-0"), {"rank": 1, "replica": 1, "replica_size": 1, "steps": [12]})
    old = time.time() - 60
    os.utime(run.local_tier_dir, (old, old))
    assert localtier.newest_restorable(run) == 12
    # edited in place (rkit never does): the directory is unchanged, so the read is not repeated
    localtier.record_path(run, "n1-0").write_text(json.dumps({"rank": 1, "replica": 1, "replica_size": 1,
                                                         "steps": [99]}))
    os.utime(run.local_tier_dir, (old, old))
    assert localtier.newest_restorable(run) == 12
    # a rank's rewrite (a rename into the directory) is read
    write_json_atomic(localtier.record_path(run, "n1-0"), {"rank": 1, "replica": 1, "replica_size": 1, "steps": [14]})
    assert localtier.newest_restorable(run) == 14


def test_a_local_tier_may_shrink_with_its_nodes():
    c = config("resources.nodes=4", "resources.processes_per_node=1", "resources.min_nodes=2",
               "trainer.overrides.gradient_accumulation_steps=2")  # 4 nodes x 2 = 2 nodes x 4
    assert c.checkpoint.local_dir and c.resources.can_shrink


def test_a_processs_folder_is_named_by_its_node_and_local_rank_not_its_index():
    # the local launcher's virtual nodes: node 0 lost, node 2's process is now rank 1 and keeps its folder
    env = {localtier.NODE_ENV: "h-node2", localtier.NODES_ENV: "h-node1,h-node2", "RKIT_PROCS_PER_NODE": "1"}
    assert localtier.node_key(env, 1) == "h-node2-0"
    assert localtier.live_keys(env, 1) == {"h-node1-0", "h-node2-0"}
    # Slurm: the node's name and the task's local id, whatever its global rank
    slurm = {"SLURMD_NODENAME": "gpu07", "SLURM_LOCALID": "1", "RKIT_PROCS_PER_NODE": "2"}
    assert localtier.node_key(slurm, 5) == "gpu07-1"
    assert localtier.live_keys(slurm, 5) == {"gpu07-0", "gpu07-1"}


def tier(tmp_path: Path, run: RunDir, key: str = "h-node1-0", nodes: str = "h-node1,h-node2",
         final_step: int = 29) -> localtier.LocalTier:
    env = {localtier.NODE_ENV: key.rpartition("-")[0], localtier.NODES_ENV: nodes, "RKIT_PROCS_PER_NODE": "1"}
    said: list[dict] = []
    t = localtier.LocalTier(run, 2, 0, final_step, tmp_path / "node" / "rkit-run",
                            lambda event, **f: said.append({"event": event, **f}), environ=env)
    t.process_dir = t.root / t.key
    t.process_dir.mkdir(parents=True, exist_ok=True)
    t.said = said  # type: ignore[attr-defined]
    return t


def persistent(run: RunDir, step: int) -> None:
    (run.orbax_dir / str(step)).mkdir(parents=True)
    (run.orbax_dir / str(step) / "_CHECKPOINT_METADATA").write_text("{}")


def test_a_restore_failure_is_a_corrupt_step_only_on_evidence(tmp_path: Path):
    run = RunDir(tmp_path / "run")
    t = tier(tmp_path, run)
    t.restored_tier = "local"
    step = local_step(t.process_dir / "14")
    # a peer lost in the restore's collectives, memory, a passing I/O error: the step stays
    for exc in (RuntimeError("Gloo: Connection reset by peer"), MemoryError(), ConnectionResetError(104, "reset"),
                OSError(5, "Input/output error", str(step / "state" / "d" / "abc"))):
        assert not t.restore_failed(14, exc) and step.is_dir(), exc
    # an error on the step's own files (Orbax/TensorStore naming them): moved aside, said with the error
    assert localtier.names_files_of(ValueError(f"DATA_LOSS: Error reading {step}/state/d/abc"), step)
    assert t.restore_failed(14, ValueError(f"DATA_LOSS: Error reading {step}/state/d/abc"))
    assert not step.exists()
    [event] = t.said
    assert (event["event"], event["step"], event["tier"]) == ("checkpoint.quarantined", 14, "local")
    assert "the restore failed: ValueError" in event["reason"] and "h-node1-0-14" in event["moved_to"]
    # files the check finds damaged are evidence whatever the error says
    step = local_step(t.process_dir / "12")
    (step / "state" / "_METADATA").write_text("")
    assert t.restore_failed(12, RuntimeError("Gloo: Connection reset by peer")) and not step.exists()
    # a restore from the run directory is never the local step's fault
    step = local_step(t.process_dir / "10")
    t.restored_tier = "persistent"
    assert not t.restore_failed(10, ValueError(f"DATA_LOSS: {step}")) and step.is_dir()  # not its files


def test_a_final_step_only_the_local_tier_holds_is_moved_aside_and_trained_again(tmp_path: Path):
    run = RunDir(tmp_path / "run")
    t = tier(tmp_path, run)
    local_step(t.process_dir / "28")
    local_step(t.process_dir / "29")
    persistent(run, 20)
    assert not maxtext.final_committed(run, 29)  # the run is not finished on node-local bytes
    t.check()
    assert sorted(localtier.step_dirs_in(t.process_dir)) == [28]
    [event] = t.said
    assert event["step"] == 29 and "held only by the local tier" in event["reason"]
    # once the run directory has it, the local copy is an ordinary step
    persistent(run, 29)
    local_step(t.process_dir / "29")
    t.check()
    assert sorted(localtier.step_dirs_in(t.process_dir)) == [28, 29] and len(t.said) == 1
    assert maxtext.final_committed(run, 29)


def test_folders_no_process_maps_to_and_old_quarantine_are_removed_once_the_run_directory_is_newer(
        tmp_path: Path):
    run = RunDir(tmp_path / "run")
    t = tier(tmp_path, run)
    lost = local_step(t.root / "h-node0-0" / "14").parent  # the lost node's (one disk for the virtual nodes)
    peer = local_step(t.root / "h-node2-0" / "14").parent  # a live process's: never touched
    legacy = local_step(t.root / "1" / "12").parent  # the folder of a process index (rkit before node keys)
    for i in range(6):
        aside = t.root / "quarantine" / f"h-node1-0-{i}"
        aside.mkdir(parents=True)
        os.utime(aside, (1000 + i, 1000 + i))
    assert t.tidy() == []  # nothing in the run directory yet: any of them may still be restored
    persistent(run, 10)
    assert t.tidy() == ["quarantine/h-node1-0-1", "quarantine/h-node1-0-0"]
    assert lost.is_dir() and legacy.is_dir()  # they hold steps newer than the run directory's
    persistent(run, 20)
    assert sorted(t.tidy()) == ["1", "h-node0-0"]
    assert not lost.exists() and not legacy.exists() and peer.is_dir() and t.process_dir.is_dir()
    assert len(list((t.root / "quarantine").iterdir())) == localtier.KEEP_QUARANTINED


def test_on_slurm_a_node_removes_only_its_own_stale_folders(tmp_path: Path):
    # local_dir on a disk the nodes share: another node's folder may belong to a live process (an empty one just
    # made, one with only a save in progress); this node knows only its own local ranks.
    run = RunDir(tmp_path / "run")
    env = {"SLURMD_NODENAME": "gpu07", "SLURM_LOCALID": "0", "RKIT_PROCS_PER_NODE": "1"}
    t = localtier.LocalTier(run, 2, 0, 29, tmp_path / "node" / "rkit-run", lambda event, **f: None, environ=env)
    t.process_dir = t.root / t.key
    t.process_dir.mkdir(parents=True)
    other = t.root / "gpu08-0"
    other.mkdir()
    own = local_step(t.root / "gpu07-1" / "4").parent  # this node's, from a layout of 2 processes per node
    persistent(run, 10)
    assert t.tidy() == ["gpu07-1"] and not own.exists() and other.is_dir() and t.process_dir.is_dir()


def test_records_of_a_left_out_node_are_forgotten(tmp_path: Path):
    run = RunDir(tmp_path / "run")
    record(run, 1, 1, 1, [14])
    record(run, 2, 2, 1, [16])
    assert localtier.newest_restorable(run) == 16
    assert localtier.forget(run, ["n2"]) == ["n2-0"]
    assert localtier.newest_restorable(run) == 14


def test_a_peer_killed_in_the_restore_is_rehearsed_with_a_local_tier():
    c = config()
    [kill] = parse_injections(["kill_restore:rank=0"], c.processes, 30, c)
    assert (kill.kind, kill.rank, kill.step, kill.in_trainer) == ("kill_restore", 0, 0, True)
    with pytest.raises(RkitError, match="no local tier|fault of the node-local tier"):
        parse_injections(["kill_restore:rank=1"], 2, 30, load_recipe(TINY).config)


def test_a_failed_restore_of_the_run_directorys_step_is_its_damage_only_on_evidence(tmp_path: Path):
    run = RunDir(tmp_path / "run")
    t = tier(tmp_path, run)
    t.restored_tier = "persistent"
    persistent(run, 20)
    step = run.orbax_dir / "20"
    assert not t.restore_failed(20, RuntimeError("Gloo AllGather failed: Connection closed by peer"))
    assert t.restore_failed(20, ValueError(f"DATA_LOSS: Error reading {step}/state/d/abc"))
    assert step.is_dir()  # the supervisor moves it aside, on the attempt's cause
    t.restored_tier = None  # broken off before a tier was chosen (listing the replicas' steps)
    assert not t.restore_failed(20, ValueError(f"DATA_LOSS: {step}"))
