"""The Slurm launcher on a real 3-node Slurm 24.11 cluster (ci/slurm-testbed.sh), real Apptainer
(srun --container=<cpu SIF>), real MaxText: finish, survive a node crash, a USR1 preemption, and stop a
deterministic failure at its budget."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from rkit.contract.rundir import RunDir
from rkit.runtime.telemetry.metrics import lines, merged
from rkit.runtime.trainers import localtier

from ..conftest import REPO, rkit, wait_until
from .slurm_helpers import (
    TESTBED,
    crash_and_wait_finished,
    crash_when_at_step,
    final_loss,
    job_of,
    squeue,
    status,
    submit,
    wait_finished,
)

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def test_two_nodes_in_containers_finish(cluster, clean_run: RunDir):
    """Budget: the first test of the Slurm group; its set-up waits for the cpu image (the image group builds it)
    and makes the shared clean run."""
    s = status(cluster, clean_run)
    assert s["state"] == "finished" and [a["cause"] for a in s["attempts"]] == ["completed"]
    assert s["slurm"]["job_id"] == job_of(clean_run)
    node_ids = set()
    for rank in (0, 1):
        env = json.loads((clean_run.attempt_dir(1) / "env" / f"rank-{rank}.json").read_text())
        assert env["python"]["executable"] == "/opt/venv/bin/python"
        assert env["environment"]["SLURM_PROCID"] == str(rank) and env["jax"]["process_count"] == 2
        node_ids.add(env["environment"]["SLURM_NODEID"])
    assert node_ids == {"0", "1"}  # one task on each of two nodes
    launch = json.loads((clean_run.attempt_dir(1) / "attempt.json").read_text())["launch"]
    assert any(a.startswith("--container=") for a in launch["argv"]) and "--kill-on-bad-exit=1" in launch["argv"]
    assert (clean_run.path / "job.sbatch").is_file()


def test_reproduce_of_a_slurm_run_is_a_slurm_job_and_ends_with_the_verdict(cluster, slurm_workspace,
                                                                          clean_run: RunDir):
    # The verdict on the loss only (--threshold 10): the test bed's load is not what this test is about.
    done = rkit("reproduce", str(clean_run.path), "--name", "clean-again", "--threshold", "10", "--quiet",
                cwd=slurm_workspace, env=cluster, timeout=900, check=0)
    again = RunDir(slurm_workspace / "clean-again")
    assert "as Slurm job" in done.stdout and job_of(again) != job_of(clean_run)
    assert again.load_manifest()["reproduced_from"]["config_hash"] == clean_run.load_manifest()["config_hash"]
    assert "steps 0-39: EXACT" in done.stdout and "verdict: the same outcome" in done.stdout
    assert again.load_outcome()["loss"]["sha256"] == clean_run.load_outcome()["loss"]["sha256"]


def test_an_image_without_rkit_runs_on_slurm_with_the_agent_rkit_brings(cluster, slurm_workspace,
                                                                        image_without_rkit: Path, clean_run: RunDir):
    run = submit(cluster, slurm_workspace, "without-rkit", image_without_rkit)
    s = wait_finished(cluster, run)
    assert s["state"] == "finished" and [a["cause"] for a in s["attempts"]] == ["completed"]
    assert run.load_manifest()["image"]["agent"] == "bound"
    for rank in (0, 1):
        env = json.loads((run.attempt_dir(1) / "env" / f"rank-{rank}.json").read_text())
        assert env["rkit_path"] == str((run.path / "agent" / "rkit").resolve())
        assert env["python"]["executable"] == "/opt/venv/bin/python" and env["jax"]["process_count"] == 2
        assert "rkit" not in env["packages"]
    assert final_loss(run) == final_loss(clean_run)


def test_the_shared_path_check_names_each_node_that_cannot_see_a_path(cluster, monkeypatch):
    # The check step the supervisor runs before a job's first attempt, on the real cluster: this checkout is bound
    # into the test bed's nodes, a folder under this machine's /var/tmp is not. (The supervisor's side of it, the
    # run stopped with run.gave_up before any attempt, is tested on the attempt loop's fake backend.)
    from rkit.backends import shared_paths

    monkeypatch.setenv("PATH", cluster["PATH"])
    nodes = sorted(set(subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True,
                                      check=True).stdout.split()))
    hidden = Path(tempfile.mkdtemp(prefix="rkit-not-shared-", dir="/var/tmp"))
    try:
        found, why = shared_paths.check(nodes, [str(REPO), str(hidden)])
    finally:
        shutil.rmtree(hidden, ignore_errors=True)
    assert why is None and len(nodes) == 3
    assert found == {node: [str(hidden)] for node in nodes}


def test_the_gpu_health_check_step_names_the_node_with_uncorrectable_ecc_errors(cluster, tmp_path):
    # The check's job step on the real cluster: one task per node, each node's answer told apart by srun's labels.
    # The test bed has no GPUs, so nvidia-smi here is a stand-in printing what the real one prints for those
    # queries (the csv of --query-gpu / --query-compute-apps): node 2 has a GPU with 4 uncorrectable errors.
    from rkit.backends import gpu_health

    env = dict(os.environ, PATH=cluster["PATH"])
    nodes = sorted(set(subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True,
                                      check=True, env=env).stdout.split()))
    tools = Path(tempfile.mkdtemp(prefix="rkit-fake-smi-", dir="/tmp"))
    try:
        smi = tools / "nvidia-smi"
        smi.write_text("#!/bin/sh\n"
                       'case "$1" in\n'
                       f'  --query-gpu=*) echo "0, 0"; [ "$SLURMD_NODENAME" = "{nodes[1]}" ] && echo "1, 4" || '
                       'echo "1, [N/A]" ;;\n'
                       f'  --query-compute-apps=*) [ "$SLURMD_NODENAME" = "{nodes[2]}" ] && '
                       'echo "77, python3, 00000000:07:00.0" ;;\n'
                       "esac\nexit 0\n")
        smi.chmod(0o755)
        # (The test bed's srun resets PATH inside the cluster: the tool is named by its path, as a site whose
        # nvidia-smi is off the default PATH would.)
        found, why = gpu_health.check(nodes, "nvidia", env=dict(env, RKIT_NVIDIA_SMI=str(smi)))
    finally:
        shutil.rmtree(tools, ignore_errors=True)
    assert why is None and len(nodes) == 3
    assert found == {nodes[1]: "uncorrectable ECC errors on GPU 1 (4)",
                     nodes[2]: "1 process(es) still holding GPUs: pid 77 python3 on 00000000:07:00.0"}


def test_node_crash_resumes_on_a_healthy_node(cluster, slurm_workspace, cpu_image, clean_run: RunDir):
    run = submit(cluster, slurm_workspace, "crash", cpu_image)
    wait_until(lambda: (run.attempt_dir(1) / "attempt.json").exists() and len(merged(run, 0)) >= 25, 600,
               "step 25")
    nodes = json.loads((run.attempt_dir(1) / "attempt.json").read_text())["launch"]["nodes"]
    victim = nodes[1]  # runs rank 1; the batch script (and the supervisor) run on the first node
    crashed_at = time.time()
    subprocess.run([str(TESTBED), "crash", victim], check=True, capture_output=True)
    try:
        wait_finished(cluster, run)
    finally:
        subprocess.run([str(TESTBED), "restore", victim], check=False, capture_output=True)
    events = run.events()
    failed = [e for e in events if e["event"] == "attempt.failed"]
    assert failed and failed[0]["cls"] == "node_fail" and victim in failed[0]["lost_nodes"]
    assert any(e["event"] == "nodes.excluded" and victim in e["excluded"] for e in events)
    second = json.loads((run.attempt_dir(2) / "attempt.json").read_text())
    assert victim not in second["launch"]["nodes"] and second["resume_from_step"] >= 10
    first_step = next(e for e in events if e["event"] == "attempt.first_step" and e["attempt"] == 2)
    print(f"node crash -> first resumed step: {first_step['t'] - crashed_at:.1f} s")
    assert final_loss(run) == final_loss(clean_run)


def test_usr1_saves_requeues_and_resumes_with_the_clean_runs_loss(cluster, slurm_workspace, cpu_image,
                                                                   clean_run_200: RunDir):
    """Budget: a 200-step job (its set-up makes the shared clean 200-step run), Slurm's USR1, the requeue's eligible
    delay (cred_expire 30 s) and the second job's cold start."""
    # Enough steps left after the signal for JAX's preemption sync point to come before the last step
    # (with few steps left MaxText trains on to the end inside the grace period, and the run just finishes).
    # No infrastructure budget at all: a requeue answered by its save is a planned end and spends none (issue 39).
    run = submit(cluster, slurm_workspace, "usr1", cpu_image, "-o", "trainer.steps=200",
                 "-o", "resilience.max_infra_restarts=0")
    job = job_of(run)
    wait_until(lambda: len(merged(run, 0)) >= 15, 600, "step 15")
    signalled = time.time()
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=dict(os.environ, **cluster), check=True)
    s = wait_finished(cluster, run)
    events = run.events()
    requested = [e for e in events if e["event"] == "preempt.requested"]
    assert requested and requested[0]["received"] == "SIGUSR1"
    requeued = [e for e in events if e["event"] == "job.requeued"]
    assert requeued and requeued[0]["t"] - signalled < 120
    restarts = [e for e in events if e["event"] == "job.started"]
    assert [e["restart_count"] for e in restarts][:2] == [0, 1]
    ended = next(e for e in events if e["event"] == "attempt.ended")
    started = [e for e in events if e["event"] == "attempt.started"]
    assert ended["cause"] == "preempted" and ended["decision"] == "requeue"
    assert started[1]["resume_from_step"] == ended["committed_step"]
    assert s["slurm"]["requeues"] >= 1 and s["state"] == "finished"
    assert ended["committed_step"] >= requested[0]["step"]  # saved at or after the signal: nothing recomputed
    assert ended["planned"] and ended["tally"]["infra_failures"] == 0 and ended["tally"]["planned_ends"] == 1
    text = rkit("status", str(run.path), env=cluster, check=0).stdout
    assert "preempted, a planned end: saved, no budget spent" in text
    assert "infrastructure 0 of 0" in text and "planned ends 1" in text, text
    # checkpoint.keep's default: 21 saves, the newest 3 on disk (Orbax's own retention), the run resumable from them
    from rkit.runtime.trainers.maxtext import committed_steps

    assert committed_steps(run) == [180, 190, 199] and run.config().checkpoint.keep == 3
    # Every step's loss, bit for bit, the uninterrupted run's: the requeue lost and changed nothing.
    assert run.load_outcome()["loss"]["count"] == 200
    assert run.load_outcome()["loss"]["sha256"] == clean_run_200.load_outcome()["loss"]["sha256"]


def test_deterministic_failure_stops_at_its_budget(cluster, slurm_workspace, cpu_image):
    run = submit(cluster, slurm_workspace, "crashloop", cpu_image, "--inject",
                 "exit:rank=0,step=15,code=3,repeat=true", "-o", "resilience.crash_loop_limit=2")
    s = wait_finished(cluster, run)
    assert s["state"] == "gave up" and "crash loop" in s["reason"] and "rank 0 " in s["reason"]
    assert "injected fault 'exit:rank=0,step=15,code=3,repeat=true'" in s["reason"]
    # Twice the same failure (rank 0, its own words, step 15) whenever the async save of step 10 committed, and
    # whichever exit srun heard first: rank 0's own (code 3), or rank 1's abort when its Gloo pair broke, after
    # which srun ends rank 0 itself and its code is lost (CI, stop 35, under load).
    assert "2 consecutive attempts failed the same way" in s["reason"]
    failed = [e for e in run.events() if e["event"] == "attempt.failed"]
    assert [(e["cls"], e["rank"]) for e in failed] == [("task_exit", 0), ("task_exit", 0)]
    assert [a["cause"] for a in s["attempts"]] == ["task_exit", "task_exit"]
    assert squeue(cluster, job_of(run)) == ""  # the job does not linger in the queue
    text = rkit("status", str(run.path), env=cluster, check=0).stdout
    assert "gave up: crash loop" in text and f"job {job_of(run)}" in text


def test_supervisor_sigkill_ends_the_job_and_its_steps_and_resume_finishes(cluster, slurm_workspace, cpu_image,
                                                                          clean_run: RunDir):
    """Budget: two Slurm jobs (the killed one and the resume), each a cold start in containers."""
    # The supervisor is the batch script's process (exec): its death ends the job, and Slurm ends the job's
    # steps with it. No rank trains on unsupervised; `--resume` submits a new job that records the attempt lost.
    import psutil

    # Rank 1 stops itself at step 15 (hang detection off; JAX's heartbeat timeout above the wait), so the kill
    # lands mid-run: the 40-step run takes about a second once it trains, faster than the test can look.
    run = submit(cluster, slurm_workspace, "supkill", cpu_image, "--inject", "hang:rank=1,step=15",
                 "-o", "resilience.hang_timeout=null", "-o", "resilience.node_silence_seconds=60")
    job = job_of(run)
    argv_end = ["supervise", str(run.path.resolve())]
    supervisor = wait_until(lambda: next((p for p in psutil.process_iter(["cmdline"])
                                          if (p.info["cmdline"] or [])[-2:] == argv_end), None),
                            600, "the supervisor process")

    def ranks(state: str | None = None) -> list[int]:
        mark = f"base_output_directory={run.path.resolve()}"
        return [p.pid for p in psutil.process_iter(["cmdline", "status"])
                if p.info["status"] != psutil.STATUS_ZOMBIE and mark in (p.info["cmdline"] or [])
                and state in (None, p.info["status"])]

    wait_until(lambda: ranks(psutil.STATUS_STOPPED), 600, "rank 1 stopped at step 15")
    assert not [e for e in run.events() if e["event"] in ("attempt.ended", "run.finished")]
    killed = time.time()
    supervisor.kill()

    wait_until(lambda: squeue(cluster, job) == "" and not ranks(), 120, "the job and its ranks to end")
    print(f"supervisor SIGKILL -> job and ranks gone: {time.time() - killed:.1f} s")
    s = status(cluster, run)
    assert s["state"] == "stopped" and [a["cause"] for a in s["attempts"]] == ["lost"]
    resumed = submit(cluster, slurm_workspace, "supkill", cpu_image, "--resume")
    assert job_of(resumed) != job
    s = wait_finished(cluster, run)
    assert s["state"] == "finished" and [a["cause"] for a in s["attempts"]] == ["lost", "completed"]
    assert "supervisor was killed" in s["attempts"][0]["detail"]
    assert final_loss(run) == final_loss(clean_run)


def test_a_task_failure_on_the_same_nodes_restarts_warm_in_the_standby_step(cluster, slurm_workspace, cpu_image,
                                                                             clean_run: RunDir):
    # Rank 1 stops itself at step 15 (hang detection off); once the standby steps beside the attempt (one per node,
    # the spare's too) say they are ready, the test kills that rank: a task failure, the same nodes, and the next
    # attempt is made of the standby steps of its two nodes.
    import psutil

    # node_silence_seconds=60: JAX's heartbeat timeout (2 x (silence + probe)) above the time rank 1 stays stopped
    # while the standbys get ready; at the default 16 s JAX would end rank 0 first.
    run = submit(cluster, slurm_workspace, "warm", cpu_image, "-o", "resilience.warm_standby=true",
                 "-o", "resilience.hang_timeout=null", "-o", "resilience.node_silence_seconds=60",
                 "--inject", "hang:rank=1,step=15")

    def notes(what: str) -> list[dict]:
        return [e for e in run.events() if e["event"] == "standby" and e["what"] == what] \
            if run.events_file.exists() else []

    ready = wait_until(lambda: len(notes("ready")) >= 3 and notes("ready"), 600, "a standby step on each node")
    assert sorted(n["nodes"][0] for n in ready) == ["c1", "c2", "c3"]
    mark = f"base_output_directory={run.path.resolve()}"

    def hung_rank() -> psutil.Process | None:
        return next((p for p in psutil.process_iter(["cmdline", "status"]) if p.info["status"] ==
                     psutil.STATUS_STOPPED and mark in (p.info["cmdline"] or [])), None)

    wait_until(hung_rank, 600, "rank 1 stopped at step 15").kill()
    s = wait_finished(cluster, run)
    assert s["state"] == "finished" and [a["cause"] for a in s["attempts"]][-1] == "completed"
    assert len(s["attempts"]) == 2, s["attempts"]
    taken = notes("taken")  # attempt 2's node 0, then node 1
    first, second = (json.loads((run.attempt_dir(a) / "attempt.json").read_text()) for a in (1, 2))
    assert [t["nodes"][0] for t in taken] == second["nodes"] == first["nodes"]
    by_step = {n["step"]: n for n in ready}
    assert all(t["pids"] == by_step[t["step"]]["pids"] for t in taken)
    events = run.events()
    started = {e["rank"]: e for e in events if e["event"] == "agent.started" and e["attempt"] == 2}
    # the resumed ranks are the standby tasks: rank i is task 0 of node i's step
    assert {r: e["pid"] for r, e in started.items()} == {i: t["pids"]["0"] for i, t in enumerate(taken)}
    assert all(e["warm"] for e in started.values())
    assert all(e["warm"] and e["import_seconds"] < 1 for e in events
               if e["event"] == "agent.ready" and e["attempt"] == 2)
    assert (run.attempt_dir(2) / "srun.log").is_file() and (run.attempt_dir(2) / "rank-1.log").is_file()
    ended = [e for e in events if e["event"] == "attempt.ended"]
    assert ended[0]["decision"] == "restart" and ended[0]["tally"]["infra_failures"] == 0
    assert final_loss(run) == final_loss(clean_run)


def test_node_crash_without_a_spare_requeues_the_job_without_that_node(cluster, slurm_workspace, cpu_image,
                                                                       clean_run: RunDir):
    """Budget: the crash, Slurm's requeue without the node, its eligible delay, the new job's cold start and the node's
    return."""
    run = submit(cluster, slurm_workspace, "nospare", cpu_image, "-o", "slurm.spare_nodes=0")
    victim, _ = crash_and_wait_finished(cluster, run, 25, which=1)
    events = run.events()
    failed = next(e for e in events if e["event"] == "attempt.failed")
    assert failed["cls"] == "node_fail" and victim in failed["lost_nodes"]
    requeue = next(e for e in events if e["event"] == "job.requeue_requested")
    assert victim in requeue["excluded"]
    restarted = [e for e in events if e["event"] == "job.started"]
    assert [e["restart_count"] for e in restarted][:2] == [0, 1] and victim in restarted[1]["excluded"]
    assert victim not in restarted[1]["allocation"]  # Slurm kept the dead node out of the new allocation
    second = json.loads((run.attempt_dir(2) / "attempt.json").read_text())
    assert victim not in second["launch"]["nodes"] and second["resume_from_step"] >= 10
    assert final_loss(run) == final_loss(clean_run)


# Long enough that the preemption injected at step 20 saves before the last step (a tiny step takes about 10 ms on
# one node: the save request reaches the trainer a few hundred ms later).
LONG = ["-o", "trainer.steps=200"]


def test_a_node_crash_with_no_spare_shrinks_to_one_node_and_a_requeue_grows_back(cluster, slurm_workspace,
                                                                                    cpu_image, clean_run_200: RunDir):
    """Budget: three cold starts of MaxText in containers (full, shrunk onto one node, grown back after a requeue and
    its eligible delay)."""
    # resources.min_nodes=1, no spare: sbatch --nodes=1-2 --no-kill. Rank 1 stops at step 12 (so that attempt 1
    # cannot train past it, whatever the machine's speed), then its node crashes: the run goes on at once on the
    # batch host alone, with twice the accumulation. The preemption injected at step 15 (in that attempt) requeues
    # the job, saved or not: rank 0 stops at step 20, so that one fast node cannot train to step 200 before the
    # preemption lands (beside a CPU hog it did, and the run finished). The stop comes after the step at which
    # the preemption fires: the supervisor reads a step from the metrics, written a step late. The requeued job
    # gets two nodes again and the last attempt trains at full size.
    clean_run = clean_run_200
    run = submit(cluster, slurm_workspace, "elastic", cpu_image, *LONG, "-o", "slurm.spare_nodes=0",
                 "-o", "resources.min_nodes=1", "--inject", "hang:rank=1,step=12",
                 "--inject", "hang:rank=0,step=20", "--inject", "preempt:step=15",
                 "-o", "resilience.signal_grace_seconds=5")
    script = run.batch_script.read_text()
    assert "--nodes=1-2" in script and "--no-kill" in script
    victim, crashed_at = crash_and_wait_finished(cluster, run, 12, which=1)
    events = run.events()

    def named(kind: str) -> list[dict]:
        return [e for e in events if e["event"] == kind]

    failed = named("attempt.failed")[0]
    assert failed["cls"] == "node_fail" and failed["lost_nodes"] == [victim]
    ended = named("attempt.ended")
    assert [(e["cause"], e["decision"]) for e in ended] == [("node_fail", "restart"), ("preempted", "requeue"),
                                                            ("completed", "finish")]
    resized = named("run.resized")
    assert [(e["attempt"], e["node_count"], e["gradient_accumulation_steps"]) for e in resized] == [(2, 1, 2),
                                                                                                    (3, 2, 1)]
    started = {e["attempt"]: e for e in named("attempt.started")}
    assert len(started[1]["nodes"]) == 2 and started[2]["nodes"] == [started[1]["nodes"][0]]
    assert len(started[3]["nodes"]) == 2 and victim not in started[3]["nodes"]  # grown back on another node
    mesh = {e["attempt"]: e for e in named("agent.mesh")}
    assert [(mesh[a]["devices"], mesh[a]["global_batch"]) for a in (1, 2, 3)] == [(2, 2), (1, 2), (2, 2)]
    jobs = named("job.started")
    assert [e["restart_count"] for e in jobs] == [0, 1] and len(jobs[1]["allocation"]) == 2
    # The loss per step within the tolerance measured for a shrink (the local test's), bit for bit up to the
    # restored step's successor.
    from .test_tiny_maxtext import SHRINK_TOLERANCE

    done = rkit("compare", "--json", "--threshold", "10", "--loss-tolerance", str(SHRINK_TOLERANCE),
                str(clean_run.path), str(run.path), env=cluster, check=0)
    loss = json.loads(done.stdout)["loss"]
    assert loss["counts"]["DIFFER"] == 0 and loss["counts"]["EXACT"] >= started[2]["resume_from_step"] + 2
    a, b = merged(clean_run, rank=0), merged(run, rank=0)
    worst = max(abs(a[s]["loss"] - b[s]["loss"]) for s in a)
    first_small = next(e for e in named("attempt.first_step") if e["attempt"] == 2)
    text = rkit("status", str(run.path), env=cluster, check=0).stdout
    assert "on 1 of 2 nodes, devices 1, gradient accumulation 2, global batch 2" in text

    def median_step(attempt: int) -> float:
        times = [m["step_time"] for m in lines(run, 0) if m["attempt"] == attempt][1:]  # less the compiling one
        return statistics.median(times) if times else float("nan")

    print(f"elastic on Slurm: node crash -> first step on 1 node {first_small['t'] - crashed_at:.1f} s (failure "
          f"found {failed['t'] - crashed_at:.1f} s after the crash); max |loss - clean| {worst:.6f}; median step "
          f"time 2 nodes {median_step(1):.4f} s, 1 node {median_step(2):.4f} s, grown back {median_step(3):.4f} s")


def test_batch_host_crash_slurm_requeues_and_the_run_continues(cluster, slurm_workspace, cpu_image,
                                                               clean_run: RunDir):
    """Budget: Slurm must find the batch host's node down (SlurmdTimeout 20 s here) before it requeues; then the
    eligible delay and a new job's cold start."""
    # Rank 1 stops at step 25, so the run cannot finish before the crash lands (beside a CPU hog it once committed
    # its last step first, and the requeued job found nothing to do).
    run = submit(cluster, slurm_workspace, "batchhost", cpu_image, "-o", "slurm.spare_nodes=0",
                 "--inject", "hang:rank=1,step=25")
    victim, crashed_at = crash_when_at_step(cluster, run, 25, which=0)  # the batch script and the supervisor
    try:
        s = wait_finished(cluster, run)
    finally:
        subprocess.run([str(TESTBED), "restore", victim], check=False, capture_output=True)
    events = run.events()
    restarted = [e for e in events if e["event"] == "job.started"]
    assert restarted[0]["batch_host"] != restarted[1]["batch_host"] or victim not in restarted[1]["allocation"]
    assert [e["restart_count"] for e in restarted][:2] == [0, 1]  # Slurm's own requeue (NODE_FAIL)
    started = [e for e in events if e["event"] == "attempt.started"]
    assert [e["attempt"] for e in started][:2] == [1, 2] and started[1]["resume_from_step"] >= 10
    first = next(e for e in events if e["event"] == "attempt.first_step" and e["attempt"] == 2)
    print(f"batch host crash -> first resumed step: {first['t'] - crashed_at:.1f} s")
    assert s["state"] == "finished" and final_loss(run) == final_loss(clean_run)


def test_the_first_node_lost_leaves_the_next_nodes_processes_their_own_local_steps(cluster, slurm_workspace,
                                                                                   cpu_image):
    """Budget: the crash waits for step 25, Slurm requeues the job off the batch host's node (its eligible delay), and
    the new job's ranks start cold and restore from their node-local tier."""
    # The node-local tier on Slurm, in the image, 2 nodes x 2 processes: four data-parallel replicas, rank 0 writes
    # the run directory (steps 0 and the last only: a period past the end), ranks 1-3 their node's storage every 2
    # steps. The test bed's nodes share /tmp, so each node's "own storage" is a directory named after it
    # ($SLURMD_NODENAME, expanded on the node). The first node (ranks 0 and 1, and the batch script) crashes at
    # step 25 (rank 1 stops there, so the run cannot finish first): Slurm requeues the job onto the second node and
    # the third, and the second node's processes, ranks 2 and 3 before, are ranks 0 and 1 now. Each finds the
    # steps its node saved, and the restore is the local tier's newest step, not the run directory's step 0.
    local = slurm_workspace / "node-local"
    local.mkdir(exist_ok=True)
    run = submit(cluster, slurm_workspace, "local-tier", cpu_image, "-o", "checkpoint.period=1000",
                 "-o", "slurm.spare_nodes=0", "-o", "resources.processes_per_node=2",
                 "-o", f"checkpoint.local_dir={local}/$SLURMD_NODENAME", "-o", "checkpoint.local_period=2",
                 "-o", "trainer.overrides.ici_data_parallelism=-1", "-o", "trainer.overrides.ici_fsdp_parallelism=1",
                 "--inject", "hang:rank=1,step=25")
    victim, crashed_at = crash_and_wait_finished(cluster, run, 25, 0)
    events = run.events()
    assert any(e["event"] == "run.finished" for e in events)
    first = json.loads((run.attempt_dir(1) / "attempt.json").read_text())["launch"]["nodes"]
    started = [e for e in events if e["event"] == "attempt.started"]
    [restored] = [e for e in events if e["event"] == "checkpoint.restored"]
    assert restored["tier"] == "local" and 20 <= restored["step"] <= 26 and "lost_step" not in restored, restored
    second = json.loads((run.attempt_dir(restored["attempt"]) / "attempt.json").read_text())["launch"]["nodes"]
    assert victim == first[0] and victim not in second and second[0] == first[1]  # the second node moved up
    # its processes' folders are named by node and local rank, whatever their rank now
    survivor = {r["key"]: r for r in localtier.records(run) if r["node"] == first[1]}
    assert sorted(survivor) == [f"{first[1]}-0", f"{first[1]}-1"]
    assert sorted(r["rank"] for r in survivor.values()) == [0, 1]
    trained = {line["step"] for line in lines(run, 0) if line["attempt"] == restored["attempt"]}
    assert min(trained) == restored["step"] + 1 and max(trained) == 39
    first_step = next(e for e in events if e["event"] == "attempt.first_step"
                      and e["attempt"] == started[-1]["attempt"])
    print(f"local tier on Slurm, 2 processes per node: {victim} (first node) crashed at step 25; restored step "
          f"{restored['step']} from the local tier (today's code: step 0 from the run directory, {restored['step']} "
          f"steps more recomputed); crash -> first step {first_step['t'] - crashed_at:.1f} s")


def test_real_data_in_the_image_resumes_with_its_data_position(cluster, slurm_workspace, cpu_image):
    """Budget: real Grain data in containers on two nodes, a fault and a resume: two cold starts."""
    # Text records read through MaxText's Grain pipeline inside the cpu image on two nodes (the data on the file
    # system the nodes share); rank 1 killed at step 25: attempt 2 restores step 20 with each process's Grain
    # position, and the steps it trains again (21-24) consume the batches attempt 1 consumed, to the same loss.
    from rkit.recipe import sampledata

    data = slurm_workspace / "text data"
    sampledata.make(data)
    grain = ["-o", "trainer.overrides.dataset_type=grain", "-o", "trainer.overrides.grain_worker_count=0",
             "-o", f"trainer.overrides.grain_train_files={data}/train-*.array_record",
             "-o", "trainer.overrides.tokenizer_path=tokenizer.default", "-o", "trainer.overrides.vocab_size=32768"]
    run = submit(cluster, slurm_workspace, "grain", cpu_image, *grain, "--inject", "kill:rank=1,step=25")
    assert wait_finished(cluster, run)["state"] == "finished"
    started = [e for e in run.events() if e["event"] == "attempt.started"]
    assert [e["resume_from_step"] for e in started] == [None, 20]
    assert sorted(started[1]["data_position"]) == ["0", "1"]
    assert [p["counter"] for p in started[1]["data_position"].values()] == [21, 21]
    assert not [e for e in run.events() if e["event"] == "checkpoint.quarantined"]
    for rank in (0, 1):
        by_attempt = {a: {line["step"]: line for line in lines(run, rank) if line["attempt"] == a} for a in (1, 2)}
        again = sorted(set(by_attempt[1]) & set(by_attempt[2]))
        assert again[:4] == [21, 22, 23, 24], again
        for step in again:
            first, second = by_attempt[1][step], by_attempt[2][step]
            assert first["data_fingerprint"] and (first["data_fingerprint"], first["loss"]) == (
                second["data_fingerprint"], second["loss"]), step
