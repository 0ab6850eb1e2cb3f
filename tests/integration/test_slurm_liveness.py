"""rkit's own node liveness on the real Slurm test bed at Slurm's default timeouts (SlurmdTimeout=300,
MessageTimeout=10), where Slurm itself would see a crashed node only after five minutes: the crash is found by
rkit (heartbeats, then the probe step), the run resumes on the spare and ends with the clean run's loss; a node
that is slow but alive (its rank and its heartbeat stopped for longer than the silence allowed) is probed, answers,
and the attempt goes on, also when the controller stops answering while the node is suspected; a live node whose
slurmd stops for 20 s while it is silent is excluded on that evidence, and rejoins as a spare when asked again."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time

import psutil
import pytest

from rkit.contract.rundir import RunDir
from rkit.runtime.telemetry import metrics
from rkit.runtime.telemetry.metrics import merged

from ..conftest import wait_until
from .slurm_helpers import (
    FAST_TIMEOUTS,
    SLURM_TIMEOUTS,
    TESTBED,
    crash_and_wait_finished,
    final_event,
    final_loss,
    job_of,
    status,
    submit,
    wait_finished,
)

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


@pytest.fixture(scope="module")
def real_timeouts(cluster):
    from .slurm_helpers import set_timeouts

    set_timeouts(*SLURM_TIMEOUTS)
    yield SLURM_TIMEOUTS
    set_timeouts(*FAST_TIMEOUTS)


def events_named(run: RunDir, name: str) -> list[dict]:
    return [e for e in run.events() if e["event"] == name] if run.events_file.exists() else []


def crash_and_finish(cluster, run: RunDir) -> tuple[str, float]:
    """Crash rank 1's node (the batch host lives) once rank 0 is past step 25; the run must finish."""
    victim, crashed_at = crash_and_wait_finished(cluster, run, 25, which=1)
    end = final_event(run)
    assert end["event"] == "run.finished", end
    return victim, crashed_at


def test_a_node_crash_at_slurms_timeouts_is_found_by_rkit_and_the_run_resumes_on_the_spare(
        cluster, real_timeouts, slurm_workspace, cpu_image, clean_run: RunDir):
    """Budget: a cold resume on the spare, then the crashed node's return at Slurm's real SlurmdTimeout=300 before the
    job leaves the queue."""
    run = submit(cluster, slurm_workspace, "crash-300", cpu_image)
    victim, crashed_at = crash_and_finish(cluster, run)
    dead = events_named(run, "node.dead")
    assert [d["node"] for d in dead] == [victim] and dead[0]["detected_by"] == "rkit" and dead[0]["heard_from"]
    failed = events_named(run, "attempt.failed")[0]
    assert failed["cls"] == "node_fail" and failed["lost_nodes"] == [victim] and failed["detected_by"] == "rkit"
    assert failed["t"] - crashed_at < real_timeouts[0]  # found by rkit, long before Slurm's SlurmdTimeout
    second = json.loads((run.attempt_dir(2) / "attempt.json").read_text())
    assert victim not in second["launch"]["nodes"] and second["resume_from_step"] >= 10
    s = status(cluster, run)
    assert [a["cause"] for a in s["attempts"]] == ["node_fail", "completed"]
    first_step = next(e for e in run.events() if e["event"] == "attempt.first_step" and e["attempt"] == 2)
    print(f"SlurmdTimeout={real_timeouts[0]}: node crash -> rkit's detection {failed['t'] - crashed_at:.1f} s, "
          f"-> first resumed step {first_step['t'] - crashed_at:.1f} s")
    assert final_loss(run) == final_loss(clean_run)


def test_a_node_crash_with_warm_standbys_resumes_warm_on_the_spare(cluster, real_timeouts, slurm_workspace,
                                                                   cpu_image):
    """Budget: the standby step starts beside the job, the crash waits for step 25, and the node must come back at
    Slurm's real SlurmdTimeout=300 before the job leaves the queue."""
    # Long enough for the three standby steps (started after the first step, importing beside the training on these
    # 2 cores) to be ready before the crash. (A rank stopped to wait for them would be declared dead by JAX's own
    # heartbeat after 16 s.)
    run = submit(cluster, slurm_workspace, "warm-300", cpu_image, "-o", "resilience.warm_standby=true",
                 "-o", "trainer.steps=600")

    def ready() -> list[dict]:
        return [e for e in events_named(run, "standby") if e["what"] == "ready"]

    wait_until(lambda: len(ready()) >= 3, 600, "a standby step on each node, the spare's too")
    assert sorted(n["nodes"][0] for n in ready()) == ["c1", "c2", "c3"]
    assert not final_event(run), "the run ended before its standby steps were ready"
    victim, crashed_at = crash_and_finish(cluster, run)
    assert [d["node"] for d in events_named(run, "node.dead")] == [victim]
    second = json.loads((run.attempt_dir(2) / "attempt.json").read_text())
    assert victim not in second["launch"]["nodes"] and "c3" in second["launch"]["nodes"]
    taken = [e for e in events_named(run, "standby") if e["what"] == "taken"]
    assert [t["nodes"][0] for t in taken] == second["launch"]["nodes"]  # the spare's standby step too
    agents = [e for e in events_named(run, "agent.started") if e["attempt"] == 2]
    assert len(agents) == 2 and all(e["warm"] for e in agents)
    assert all(e["import_seconds"] < 1 for e in events_named(run, "agent.ready") if e["attempt"] == 2)
    first_step = next(e for e in events_named(run, "attempt.first_step") if e["attempt"] == 2)
    print(f"SlurmdTimeout={real_timeouts[0]}, warm standbys: node crash -> first resumed step on the spare "
          f"{first_step['t'] - crashed_at:.1f} s")
    # The steps trained again after the resume have attempt 1's losses, bit for bit, and the run trained to the end.
    by_attempt: dict[int, dict[int, float]] = {1: {}, 2: {}}
    for line in metrics.lines(run, 0):
        by_attempt[line["attempt"]][line["step"]] = line["loss"]
    again = sorted(set(by_attempt[1]) & set(by_attempt[2]))
    assert again and again[0] == second["resume_from_step"] + 1 and max(by_attempt[2]) == 599
    assert [by_attempt[2][step] for step in again] == [by_attempt[1][step] for step in again]


def node_processes(run: RunDir, node: str) -> list[psutil.Process]:
    """The telemetry process of `node` (it sends the node's heartbeats) and its parent, the rank's agent."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if "rkit.runtime.telemetry.node" in argv and str(run.path.resolve()) in argv and node in argv:
            found = [proc, proc.parent()]
    return found


def controller() -> psutil.Process:
    """The test bed's slurmctld (Debian names its binary slurmctld-wlm)."""
    found = [p for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("slurmctld")]
    assert len(found) == 1, f"one slurmctld expected, found {[p.info['name'] for p in found]}"
    return found[0]


def test_a_slow_node_is_probed_and_not_declared_dead_even_while_the_controller_does_not_answer(
        cluster, real_timeouts, slurm_workspace, cpu_image, clean_run: RunDir):
    """The node's rank and heartbeat stop; once it is suspected, slurmctld stops too for 15 s (a busy or
    failing-over controller): the probe steps time out, the node's slurmd still takes connections, so the node is
    unconfirmed, never dead; when the controller is back the next probe answers."""
    run = submit(cluster, slurm_workspace, "slow-300", cpu_image)
    wait_until(lambda: (run.attempt_dir(1) / "attempt.json").exists() and len(merged(run, 0)) >= 15, 600, "step 15")
    node = json.loads((run.attempt_dir(1) / "attempt.json").read_text())["launch"]["nodes"][1]
    frozen = wait_until(lambda: node_processes(run, node), 60, f"the telemetry process on {node}")
    env = frozen[1].environ()  # the rank's: where its node's heartbeats go, their token, JAX's heartbeat timeout
    token = env["RKIT_LIVENESS_TOKEN"]
    assert len(token) == 32 and env["RKIT_JAX_HEARTBEAT_SECONDS"] == "61"
    slurmctld = controller()
    for proc in frozen:  # the node's rank and its heartbeat stop: a node that does not answer for a while
        proc.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: events_named(run, "node.suspected"), 60, "the node's suspicion")
        slurmctld.send_signal(signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            unconfirmed = wait_until(lambda: events_named(run, "node.unconfirmed"), 60, "a probe that timed out")
            time.sleep(max(0.0, 15 - (time.monotonic() - stopped)))  # the controller away 15 s in all
        finally:
            slurmctld.send_signal(signal.SIGCONT)
        alive = wait_until(lambda: events_named(run, "node.alive"), 120, "the probe's answer")
    finally:
        for proc in frozen:
            proc.send_signal(signal.SIGCONT)
    s = wait_finished(cluster, run)
    suspected = events_named(run, "node.suspected")
    assert suspected[0]["node"] == node and suspected[0]["silent_seconds"] >= 3
    assert unconfirmed[0]["node"] == node and unconfirmed[0]["probe"].endswith("but its slurmd takes connections")
    assert alive[0]["node"] == node and alive[0]["how"] == "it answered the probe step"
    assert not events_named(run, "node.dead") and not events_named(run, "attempt.failed")
    assert not events_named(run, "nodes.excluded")
    assert s["state"] == "finished" and [a["cause"] for a in s["attempts"]] == ["completed"]
    assert final_loss(run) == final_loss(clean_run)
    leaks = [p for p in run.path.rglob("*") if p.is_file() and not p.is_symlink()
             and token.encode() in p.read_bytes()]
    assert leaks == []  # the heartbeats' token is in no manifest, log or event


def test_a_live_node_whose_slurmd_stops_while_its_heartbeats_are_blocked_comes_back_as_a_spare(
        cluster, real_timeouts, slurm_workspace, cpu_image, clean_run_200: RunDir):
    """Budget: three jobs' worth of start-up (the first attempt, its resume on the spare, the requeued job after
    Slurm's eligible delay) on a 200-step run, the shared clean 200-step run's set-up.

    A node's rank and heartbeat stop and its slurmd is stopped for 20 s (the node lives on: `slurmd stop`, as
    `systemctl stop slurmd`): silent, and its slurmd refuses connections, so rkit confirms it dead and the run resumes
    on the spare. The exclusion is not for good: slurmd is back, and before the requeue that a USR1 asks for rkit asks
    the node again (Slurm's state, a probe step); it answers and rejoins as a spare, so the requeued job's
    ExcNodeList is empty, and the run finishes with the clean run's loss."""
    run = submit(cluster, slurm_workspace, "slurmd-300", cpu_image, "-o", "trainer.steps=200")
    wait_until(lambda: (run.attempt_dir(1) / "attempt.json").exists() and len(merged(run, 0)) >= 15, 600, "step 15")
    node = json.loads((run.attempt_dir(1) / "attempt.json").read_text())["launch"]["nodes"][1]
    frozen = wait_until(lambda: node_processes(run, node), 60, f"the telemetry process on {node}")
    for proc in frozen:  # the node's heartbeats and its rank stop
        proc.send_signal(signal.SIGSTOP)
    subprocess.run([str(TESTBED), "slurmd", "stop", node], check=True, capture_output=True, timeout=60)
    stopped = time.monotonic()
    try:
        dead = wait_until(lambda: events_named(run, "node.dead"), 120, f"rkit's verdict on {node}")
        time.sleep(max(0.0, 20 - (time.monotonic() - stopped)))  # the node's slurmd away 20 s in all
    finally:
        subprocess.run([str(TESTBED), "slurmd", "start", node], check=False, capture_output=True, timeout=60)
        for proc in frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGCONT)
    # The cancelled step's processes on the node end once its slurmd is back (Slurm delivers the cancel then).
    wait_until(lambda: not [p for p in frozen if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 180,
               f"attempt 1's processes on {node} to end")
    # The resumed attempt trains on the other node and the spare; a few steps in, Slurm's USR1 asks for a requeue.
    wait_until(lambda: len([m for m in metrics.lines(run, 0) if m["attempt"] == 2]) >= 5, 600, "attempt 2's steps")
    assert not final_event(run), "the run ended before the requeue was asked for"
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_of(run)], env=dict(os.environ, **cluster), check=True)
    s = wait_finished(cluster, run)
    assert [d["node"] for d in dead] == [node] and "Connection refused" in dead[0]["probe"], dead
    assert events_named(run, "nodes.excluded")[0]["excluded"] == [node]
    second = json.loads((run.attempt_dir(2) / "attempt.json").read_text())
    assert node not in second["launch"]["nodes"] and "c3" in second["launch"]["nodes"]
    rejoined = events_named(run, "nodes.rejoined")
    assert rejoined and rejoined[0]["nodes"] == [node] and rejoined[0]["excluded"] == [], rejoined
    assert events_named(run, "job.requeue_requested")[0]["excluded"] == []
    # The requeued job (the same job id) may first lose its rank on the node to Slurm's late kill of the job's
    # earlier instance there (seen once in CI, under load: "rank 1 killed by SIGKILL before its first step"); the
    # next attempt then trains on the same nodes.
    causes = [a["cause"] for a in s["attempts"]]
    assert s["state"] == "finished" and causes[:2] == ["node_fail", "preempted"] and causes[-1] == "completed"
    assert causes[2:-1] in ([], ["task_signal"]), causes
    assert s["slurm"]["excluded_nodes"] == [] and s["slurm"]["requeues"] == 1
    third = json.loads((run.attempt_dir(3) / "attempt.json").read_text())
    assert node in third["launch"]["nodes"]  # the requeued job had it back, and the attempt took it
    assert run.load_outcome()["loss"]["sha256"] == clean_run_200.load_outcome()["loss"]["sha256"]


def slurmctld_port(cluster) -> int:
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=True,
                         env=dict(os.environ, **cluster)).stdout
    return int(re.search(r"SlurmctldPort\s*=\s*(\d+)", out).group(1))


def test_a_blip_of_the_batch_hosts_network_while_every_rank_stalls_condemns_no_node(
        cluster, real_timeouts, slurm_workspace, cpu_image, clean_run: RunDir):
    """For 15 s the heartbeats' datagrams and the batch host's traffic to slurmctld are dropped (iptables), while
    every rank is stopped: every node looks silent and stalled at once, but the supervisor's own beat does not come
    back either, so it holds (liveness.self_check), probes none and condemns none; the run goes on."""
    if shutil.which("iptables") is None:
        pytest.fail("no iptables on this host: ci/slurm-testbed.sh up installs it (make test does)")
    run = submit(cluster, slurm_workspace, "blip-300", cpu_image)
    wait_until(lambda: (run.attempt_dir(1) / "attempt.json").exists() and len(merged(run, 0)) >= 15, 600, "step 15")
    nodes = json.loads((run.attempt_dir(1) / "attempt.json").read_text())["launch"]["nodes"]
    found = {n: wait_until(lambda n=n: node_processes(run, n), 60, f"the telemetry process on {n}") for n in nodes}
    ranks = [found[n][1] for n in nodes]  # each node's rank; its heartbeat process goes on sending
    port = int(ranks[0].environ()["RKIT_LIVENESS_ADDRESS"].rpartition(":")[2])
    rules = [["INPUT", "-p", "udp", "--dport", str(port), "-j", "DROP"],
             ["OUTPUT", "-p", "tcp", "--dport", str(slurmctld_port(cluster)), "-j", "DROP"]]
    for proc in ranks:
        proc.send_signal(signal.SIGSTOP)
    try:
        for rule in rules:
            subprocess.run(["iptables", "-I", *rule], check=True)
        try:
            wait_until(lambda: [e for e in events_named(run, "liveness.self_check") if e["holding"]], 60,
                       "the supervisor suspecting its own side")
            time.sleep(15)
        finally:
            for rule in rules:
                subprocess.run(["iptables", "-D", *rule], check=False)
    finally:
        for proc in ranks:
            proc.send_signal(signal.SIGCONT)
    s = wait_finished(cluster, run)
    held = [e for e in events_named(run, "liveness.self_check") if e["holding"]]
    assert any(e["suspected"] == 2 and "own beat did not come back" in e["why"] for e in held), held
    assert not events_named(run, "node.dead") and not events_named(run, "nodes.excluded")
    assert not events_named(run, "attempt.failed")
    assert s["state"] == "finished" and [a["cause"] for a in s["attempts"]] == ["completed"]
    assert final_loss(run) == final_loss(clean_run)
