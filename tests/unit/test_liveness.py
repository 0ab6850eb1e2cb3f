"""rkit's own node liveness (heartbeat.py, liveness.py): the signed heartbeat, the suspicion policy, real UDP
heartbeats from the sender thread, and the attempt loop on a fake backend whose nodes send real heartbeats: a dead
node is confirmed by its failed probe, excluded and replaced; a slow node that answers its probe is left alone.
The probe and the death on the real Slurm test bed are in tests/integration/test_slurm_liveness.py."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time

import pytest

from rkit.backends.base import RankExit
from rkit.contract import heartbeat
from rkit.contract.events import EV, valid_event
from rkit.recipe.load import load_recipe
from rkit.run.ending import Observation, classify
from rkit.run.liveness import STARTUP_SILENCE, HeartbeatListener, NodeLiveness, probe_verdict, suspects
from rkit.run.policy import Budgets, Cause, Outcome, Tally, decide

from ..conftest import TINY, wait_until
from .test_attempt_loop import STEPS, FakeBackend, Script, attempt, events, make


def test_a_heartbeat_verifies_only_under_its_token():
    data = heartbeat.encode("k" * 32, "c2", 3, 17)
    assert heartbeat.decode("k" * 32, data) == heartbeat.Beat("c2", 3, 17)
    assert heartbeat.decode("x" * 32, data) is None  # another job's, or forged
    tampered = data.replace(b" 17 ", b" 18 ")
    assert heartbeat.decode("k" * 32, tampered) is None
    for junk in (b"", b"\xff\xfe", b"rkit-hb1 c2 3", b"rkit-hb1 c2 three 17 00", b"GET / HTTP/1.1"):
        assert heartbeat.decode("k" * 32, junk) is None


def test_no_supervisor_in_the_environment_no_sender():
    assert heartbeat.target({}) is None and not heartbeat.wanted({})
    assert heartbeat.target({heartbeat.ADDRESS_ENV: "127.0.0.1:x", heartbeat.TOKEN_ENV: "t"}) is None
    assert heartbeat.start_sender("n", 1, {}, threading.Event()) is None


def test_suspects_are_silent_nodes_whose_ranks_made_no_progress():
    nodes = {"a": 100.0, "b": 100.0, "c": 109.0}
    ranks = {"a": [0, 1], "b": [2, 3], "c": [4, 5]}
    progress = {0: 100.0, 1: 108.0, 2: 100.0, 3: 101.0, 4: 100.0, 5: 100.0}
    found = suspects(nodes, ranks, progress, now=110.0, silence=3)
    # a: silent 10 s but rank 1 trained 2 s ago (its heartbeat process died, the node lives); c: heard 1 s ago
    assert [(s.node, s.silent, s.stalled) for s in found] == [("b", 10.0, 9.0)]
    assert suspects(nodes, ranks, progress, now=110.0, silence=20) == []


def test_the_sender_thread_reaches_the_listener_over_udp():
    listener = HeartbeatListener("127.0.0.1")
    stop = threading.Event()
    try:
        thread = heartbeat.start_sender("c1", 4, listener.environment(), stop, interval=0.05)
        beats = wait_until(listener.drain, 10, "a heartbeat")
        (beat, arrived), *_ = beats
        assert beat.node == "c1" and beat.attempt == 4 and abs(time.time() - arrived) < 5  # the kernel's stamp
        # A datagram from anyone else is dropped, and reading never waits when nothing came.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            port = int(listener.environment()[heartbeat.ADDRESS_ENV].rpartition(":")[2])
            sock.sendto(heartbeat.encode("not the token", "c9", 4, 0), ("127.0.0.1", port))
        stop.set()
        thread.join(5)
        assert all(b.node == "c1" for b, _ in listener.drain())
        assert listener.drain() == []
    finally:
        stop.set()
        listener.close()


def test_a_backlog_is_read_over_several_drains_each_beat_with_its_arrival_stamp():
    """A late pass does not read the whole backlog at once: a drain stops after its time, the rest waits in the
    socket for the next one, and a beat read later still carries the time it arrived."""
    listener = HeartbeatListener("127.0.0.1")
    listener.size_for(64)
    try:
        address = listener.sock.getsockname()[:2]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for seq in range(500):
                sock.sendto(heartbeat.encode(listener.token, f"n{seq % 64}", 1, seq), address)
        time.sleep(0.2)
        first = listener.drain(seconds=0)  # past its time at once: one batch of 64
        rest: list = []

        def drain_rest() -> bool:
            began = time.time()
            rest.extend((beat, arrived, began) for beat, arrived in listener.drain())
            return len(first) + len(rest) >= 500

        wait_until(drain_rest, 10, "the backlog's rest")
        assert len(first) == 64 and len(first) + len(rest) == 500
        assert sorted(b.seq for b, *_ in first + rest) == list(range(500))
        # Stamped on arrival, not when read: each before the drain that read it began (at least 0.2 s after the
        # last was sent). Not against the send's own time: under load the kernel's loopback delivery, and so its
        # stamp, can lag the send by more than a fixed margin (CI: past 50 ms).
        assert all(arrived < began for _, arrived, began in rest)
    finally:
        listener.close()


def test_liveness_settings_set_jax_heartbeat_past_rkits_detection_with_room_for_a_network_blip():
    r = load_recipe(TINY, ["launcher=slurm"]).config.resilience
    assert (r.node_silence_seconds, r.node_probe_seconds, r.jax_heartbeat_seconds) == (3, 5, 61)
    r = load_recipe(TINY, ["resilience.node_silence_seconds=1", "resilience.node_probe_seconds=1"]).config.resilience
    assert r.jax_heartbeat_seconds == 49


@pytest.mark.parametrize("overrides, seconds", [
    ([], 1200),  # auto: past the start-up allowance (600 s) and the floor doubled around a save (120 s)
    (["resilience.hang_timeout=900"], 1800),
    (["resilience.hang_timeout=5", "resilience.hang_startup_seconds=10", "resilience.hang_floor_seconds=5"], 100),
    (["resilience.hang_timeout=null"], None),  # no hang watch: JAX's own heartbeat is the only one left
])
def test_local_ranks_get_a_jax_heartbeat_above_rkits_hang_detection(tmp_path, overrides, seconds):
    # A stopped rank sends no heartbeat: at JAX's default its coordination service aborted the other rank
    # (SIGABRT, "task_signal") 65 s after the stop, before a 60 s hang_timeout had been read and acted on.
    from rkit.run.plan import plan

    recipe = load_recipe(TINY, [f"runs_dir={tmp_path}", "name=h", *overrides])
    assert recipe.config.resilience.local_jax_heartbeat_seconds == seconds
    for rank in plan(recipe, resume=False, injections=[]).first_request.ranks:
        assert rank.env.get(heartbeat.JAX_HEARTBEAT_ENV) == (None if seconds is None else str(seconds))


# ---------------------------------------------------------------- the attempt loop with real heartbeats


class BeatingBackend(FakeBackend):
    """The fake backend's nodes send real heartbeats (one per poll); a `silence` fault stops node n2's heartbeats
    and every rank's progress for a number of polls, and its probe answers (`alive`) or fails."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.liveness = NodeLiveness(HeartbeatListener("127.0.0.1"), self.start_probe, lambda n: None, silence=3,
                                     probe_timeout=5, jax_heartbeat_seconds=16, clock=lambda: self.sup_ref[0].clock())
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        host, _, port = self.liveness.environment()[heartbeat.ADDRESS_ENV].rpartition(":")
        self.to, self.token = (host, int(port)), self.liveness.listener.token
        self.quiet: dict[str, int] = {}  # node -> polls left without its heartbeat
        self.probed: list[str] = []

    def start_probe(self, node: str) -> subprocess.Popen:
        self.probed.append(node)
        fault = self.script.faults["silence"]
        return _done("true") if fault[3] == "alive" else _said(f"{LAUNCH_FAILED} on node {node}: {NO_CONNECTION}")

    def poll(self, handle):
        fault = self.script.faults.get("silence")  # (attempt, step, polls, alive|dead)
        if fault and handle.attempt == fault[0] and handle.step.get(0) == fault[1] and "n2" not in self.quiet:
            self.quiet["n2"] = fault[2]
            handle.silent.update(handle.step)
            log = self.run.rank_log(handle.attempt, 0)  # what JAX's coordination service says, later on
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text("E1202 coordination_service.cc:1136] The following tasks are unhealthy (stopped "
                           "sending heartbeats):\n/job:jax_worker/replica:0/task:1\n")
        for node in self.nodes(handle):
            if self.quiet.get(node, 0) > 0:
                continue
            self.sock.sendto(heartbeat.encode(self.token, node, handle.attempt, 0), self.to)
        if self.quiet.get("n2", 0) > 0:
            self.quiet["n2"] -= 1
            if self.quiet["n2"] == 0 and fault[3] == "alive":
                handle.silent.clear()  # the slow node catches up
            return handle.exits
        return super().poll(handle)


@pytest.mark.parametrize("fate", ["dead", "alive"])
def test_a_silent_node_is_probed_then_excluded_if_dead_and_left_alone_if_alive(tmp_path, fate):
    sup, backend = make(tmp_path, Script(silence=(1, 6, 12, fate)), "resilience.hang_timeout=600",
                        backend_class=BeatingBackend)
    first = attempt(sup)
    suspected = events(sup.run, EV.NODE_SUSPECTED)
    assert suspected and suspected[0]["node"] == "n2" and suspected[0]["silent_seconds"] > 3
    assert backend.probed[0] == "n2"
    if fate == "alive":  # a slow node: the probe answers, the attempt goes on and finishes
        assert first.cause is Cause.COMPLETED and not events(sup.run, EV.NODE_DEAD)
        assert events(sup.run, EV.NODE_ALIVE)[0]["how"] == "it answered the probe step"
        assert backend.exclude == [] and not events(sup.run, EV.ATTEMPT_FAILED)
        return
    assert first.cause is Cause.NODE_FAIL and first.nodes == ("n2",) and not first.requeue
    assert first.detail.startswith("node failure on n2 (after step 6): n2: no heartbeat for ")
    assert "the probe step failed (exit 1)" in first.detail
    assert [e["node"] for e in events(sup.run, EV.NODE_SUSPECTED)] == ["n2"]  # a dead node is not probed again
    dead = events(sup.run, EV.NODE_DEAD)[0]
    assert dead["node"] == "n2" and dead["detected_by"] == "rkit" and dead["heard_from"]
    failed = events(sup.run, EV.ATTEMPT_FAILED)[0]
    assert failed["cls"] == "node_fail" and failed["detected_by"] == "rkit" and failed["detect_seconds"] > 3
    assert failed["jax_saw_it"].startswith("rank-0.log: E1202 coordination_service.cc:1136] The following tasks")
    assert backend.exclude == ["n2"] and backend.stops == [0]
    second = attempt(sup)  # on the spare
    assert second.cause is Cause.COMPLETED and backend.nodes(None) == ["n1", "n3"]
    assert second.committed_after == STEPS - 1


def test_before_its_first_heartbeat_a_node_has_the_start_up_allowance():
    now = [0.0]
    probes: list[str] = []
    live = NodeLiveness(HeartbeatListener("127.0.0.1"), lambda n: probes.append(n) or _said(HELD_DOWN),
                        lambda n: None, silence=3, probe_timeout=5, jax_heartbeat_seconds=16, clock=lambda: now[0])
    try:
        live.watch(1, ["c1", "c2"], 1)
        now[0] = STARTUP_SILENCE - 1
        assert live.check({}) == ([], {}) and probes == []
        now[0] = STARTUP_SILENCE + 1  # never heard from: probed, and dead when the probe fails
        notes, dead = live.check({})
        # every node at once: the supervisor checks its own side first (its own beat comes back: probes go out)
        assert probes == ["c1", "c2"] and [n["event"] for n in notes] == ["liveness.self_check"] + [
            "node.suspected"] * 2
        assert not notes[0]["holding"] and notes[0]["why"].startswith("2 of 2 nodes silent at once; the supervisor's")
        # every note is an event the readers keep (a field of another type than the vocabulary's is skipped)
        assert all(valid_event({**n, "t": 1.0}) for n in notes), notes
        notes, dead = live.check({})
        assert sorted(dead) == ["c1", "c2"] and dead["c1"].startswith("no heartbeat since the attempt started")
    finally:
        live.close()


def watched_pair() -> tuple[list[float], list[str], NodeLiveness]:
    """c1 and c2 watched for attempt 1 (silence 3 s) on a clock set by hand; the probes started, named."""
    now = [0.0]
    probes: list[str] = []
    live = NodeLiveness(HeartbeatListener("127.0.0.1"), lambda n: probes.append(n) or Running(), lambda n: None,
                        silence=3, probe_timeout=5, jax_heartbeat_seconds=16, clock=lambda: now[0])
    live.watch(1, ["c1", "c2"], 1)
    return now, probes, live


def test_a_node_that_died_before_its_first_heartbeat_and_step_is_probed_not_taken_for_a_deaf_one():
    """The campaign (seed 2): a node crashed as the attempt launched; its rank's progress was the attempt's start
    (the hang watch's, before any step), read as "its ranks train", so the node was taken for one whose heartbeats
    cannot arrive and left to Slurm, which saw it 127 s later. The liveness pass is given the hang watch's steps
    only (`HangWatch.stepped`): before any step, none."""
    from rkit.run.watchdog import HangPolicy, HangWatch

    hang = HangWatch(HangPolicy(enabled=True, explicit=None, floor=60.0, factor=5.0, startup=600.0,
                                checkpoint_period=10), ranks=[0, 1], started=0.0)
    assert hang.last_progress == {0: 0.0, 1: 0.0} and hang.stepped == {}  # the start is no step
    now, probes, live = watched_pair()
    try:
        to = live.listener.sock.getsockname()
        notes = []
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _ in range(int(STARTUP_SILENCE) + 2):  # c1 beats; c2 never does; neither rank steps
                sock.sendto(heartbeat.encode(live.listener.token, "c1", 1, 0), to)
                now[0] += 1
                notes += live.check(hang.stepped)[0]
        assert not [n for n in notes if n["event"] == "liveness.channel"], notes
        assert probes == ["c2"]
        hang.progress(1, 0, None, now=5.0)
        assert hang.stepped == {1: 5.0}  # a step is
    finally:
        live.close()


def test_a_node_heard_from_then_silent_early_in_an_attempt_is_suspected_after_the_silence_not_the_start_up():
    """The campaign (seed 2): the spare, heard from as the attempt began, crashed 18 s in; the start-up allowance
    (30 s) still held its silence, no probe went out, and the survivor's broken collective was blamed instead."""
    now, probes, live = watched_pair()
    try:
        to = live.listener.sock.getsockname()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            now[0] = 2.0
            for node in ("c1", "c2"):
                sock.sendto(heartbeat.encode(live.listener.token, node, 1, 0), to)
            wait_until(lambda: live.check({0: 2.0, 1: 2.0}) and live.heard == {"c1", "c2"}, 10, "both beats")
            for t in (4.0, 6.0):  # c1 beats on and steps; c2 (rank 1) is silent from t=2
                now[0] = t
                sock.sendto(heartbeat.encode(live.listener.token, "c1", 1, 1), to)
                wait_until(lambda: live.check({0: now[0], 1: 2.0}) is not None and live.since["c1"] >= now[0] - 0.5,
                           10, "c1's beat")
        assert probes == ["c2"] and now[0] < STARTUP_SILENCE
    finally:
        live.close()


@pytest.mark.parametrize("slurmd", ["refuses", "answers"])
def test_a_probe_that_does_not_answer_in_time_is_a_death_only_when_the_nodes_slurmd_is_silent_too(slurmd):
    now = [0.0]
    why = "its slurmd (10.0.0.3:6818) took no connection: Connection refused" if slurmd == "refuses" else None
    live = NodeLiveness(HeartbeatListener("127.0.0.1"), lambda n: subprocess.Popen(["sleep", "60"]), lambda n: why,
                        silence=3, probe_timeout=5, jax_heartbeat_seconds=16, clock=lambda: now[0])
    try:
        live.watch(1, ["c1"], 1)
        now[0] = STARTUP_SILENCE + 1
        live.check({})
        assert ticks(live, now, 4) == ([], {})  # still within the probe's time
        notes, dead = ticks(live, now, 2)
        if slurmd == "refuses":
            assert dead["c1"].endswith("did not answer within 5 s and " + why) and notes[0]["event"] == "node.dead"
            return
        # a controller slow to create the step (the node's slurmd is up): no verdict, probed again later
        assert dead == {} and notes[0]["event"] == "node.unconfirmed" and notes[0]["next_probe_seconds"] == 6
        assert notes[0]["probe"].endswith("but its slurmd takes connections")
        assert ticks(live, now, 2) == ([], {})  # within its backoff
        assert [n["event"] for n in ticks(live, now, 5)[0]] == ["node.suspected"]
    finally:
        live.close()


def _done(program: str) -> subprocess.Popen:
    proc = subprocess.Popen([program], stdout=subprocess.PIPE, text=True)
    proc.wait()
    return proc


def ticks(live: NodeLiveness, now: list[float], seconds: int) -> tuple[list[dict], dict[str, str]]:
    """The supervisor's loop passing every second for `seconds` (a longer gap is the supervisor's own lateness):
    the notes and deaths of those passes."""
    notes, dead = [], {}
    for _ in range(seconds):
        now[0] += 1
        more, died = live.check({})
        notes += more
        dead.update(died)
    return notes, dead


def _said(line: str, code: int = 1) -> subprocess.Popen:
    """A finished probe whose srun printed `line` and exited `code`."""
    proc = subprocess.Popen(["sh", "-c", 'echo "$1"; exit "$2"', "probe", line, str(code)], stdout=subprocess.PIPE,
                            text=True)
    proc.wait()
    return proc


# Slurm 24.11's own words (src/common/slurm_errno.c; srun's launch and step-creation errors)
LAUNCH_FAILED = "srun: error: Task launch for StepId=4242.7 failed"
NO_CONNECTION = "Communication connection failure"
HELD_DOWN = ("srun: error: Unable to create step for job 4242: Required node not available (down, drained or "
             "reserved)")
PROBE_WORDS = {
    "launch failed on the node": (f"{LAUNCH_FAILED} on node c2: {NO_CONNECTION}", "dead"),
    "connect timed out": (f"{LAUNCH_FAILED} on node c2: Connection timed out establishing", "dead"),
    "held down by the controller": (HELD_DOWN, "dead"),
    "launch failed on another node": (f"{LAUNCH_FAILED} on node c20: {NO_CONNECTION}", "unconfirmed"),
    "controller busy": ("srun: error: Unable to create step for job 4242: Socket timed out on send/recv operation",
                        "unconfirmed"),
    "controller down": ("srun: error: Unable to confirm allocation for job 4242: Unable to contact slurm controller "
                        "(connect failure)", "unconfirmed"),
    "step limit": ("srun: error: Unable to create step for job 4242: Step limit reached for this job",
                   "unconfirmed"),
    "nodes busy": ("srun: Job 4242 step creation temporarily disabled, retrying (Requested nodes are busy)",
                   "unconfirmed"),
    "rate limited": ("srun: error: Unable to create step for job 4242: Rate limit exceeded, please retry "
                     "momentarily", "unconfirmed"),
    "no words": ("", "unconfirmed"),
}


@pytest.mark.parametrize("case", sorted(PROBE_WORDS))
def test_a_probe_says_dead_only_in_slurms_words_about_that_node(case):
    line, verdict = PROBE_WORDS[case]
    got, why = probe_verdict("c2", 1, f"srun: warning: can't run 1 processes on 2 nodes\n{line}\n")
    assert got == verdict and (not line or line in why) and why.startswith("the probe step failed (exit 1)")
    assert probe_verdict("c2", 0, line) == ("alive", "")


def test_the_backend_asks_the_nodes_slurmd_itself(tmp_path):
    from rkit.backends.slurm.launcher import SlurmStepBackend

    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: a connection is refused
    try:
        backend = SlurmStepBackend(nodes_per_step=2, tasks_per_node=1)
        backend._slurmd = {"up": listening.getsockname(), "gone": closed.getsockname()}
        assert backend.slurmd_silent("up") is None
        assert "took no connection: Connection refused" in backend.slurmd_silent("gone")
        assert backend.slurmd_silent("unknown-node") is None  # no address from the controller: no evidence
    finally:
        listening.close()
        closed.close()


SHOW_NODE = """NodeName=c1 Arch=x86_64 CoresPerSocket=1
   NodeAddr=10.0.0.1 NodeHostName=c1 Port=18002 Version=24.11.5
   State=IDLE ThreadsPerCore=1
NodeName=c2 Arch=x86_64 CoresPerSocket=1
   NodeAddr=10.0.0.2 NodeHostName=c2 Version=24.11.5
   State=ALLOCATED ThreadsPerCore=1
"""


def test_the_slurmds_addresses_come_from_one_scontrol_call_with_the_clusters_port_where_a_node_has_none(
        monkeypatch):
    from rkit.backends.slurm import queries

    asked = []

    def slurm_output(argv, timeout=30):
        asked.append(argv)
        return SHOW_NODE if argv[:3] == ["scontrol", "show", "node"] else "SlurmdPort              = 7818\n"

    monkeypatch.setattr(queries, "slurm_output", slurm_output)
    assert queries.slurmd_addresses(["c1", "c2", "c3"]) == {"c1": ("10.0.0.1", 18002), "c2": ("10.0.0.2", 7818)}
    assert asked == [["scontrol", "show", "node", "c1,c2,c3"], ["scontrol", "show", "config"]]
    asked.clear()
    assert queries.slurmd_addresses([]) == {} and asked == []  # nothing asked about no nodes


def test_a_step_the_launcher_could_not_start_is_infrastructure_and_never_a_crash_loop():
    obs = Observation(processes=2, exits=(RankExit(0, 1, "c2"), RankExit(1, -9)), failed_nodes=("c2",),
                      launch_failed="Unable to create step for job 7: Requested node configuration is not available")
    ending = classify(obs)
    assert ending.cause is Cause.STEP_FAILED and ending.exclude == ("c2",)
    assert ending.detail.startswith("the job step could not start its ranks on c2: Unable to create step")
    budgets, tally = Budgets(3, 10, 2), Tally()
    for _ in range(5):  # the same words five times: still restarts, on the infrastructure budget
        decision, tally = decide(tally, Outcome(ending.cause, 10, 10, ending.detail, nodes=ending.nodes), budgets,
                                 False)
        assert decision.action.value == "restart"
    assert tally.infra_failures == 5 and tally.repeats == 0


SRUN_LOGS = {
    "refused": ("srun: error: Unable to create step for job 41: Requested node configuration is not available\n",
                "Unable to create step for job 41: Requested node configuration is not available", []),
    "launch": ("srun: error: Task launch for StepId=41.3 failed on node c2: Communication connection failure\n"
               "srun: error: Application launch failed: Communication connection failure\n",
               "Task launch for StepId=41.3 failed on node c2: Communication connection failure", ["c2"]),
    "before agents": ("srun: error: c3: task 1: Exited with exit code 255\n", "no rank started (srun: error: c3: "
                      "task 1: Exited with exit code 255)", ["c3"]),
    # an unreadable SIF: every node's task fails the same way; no node is to blame (issue 40)
    "every node": ("srun: error: c1: task 0: Exited with exit code 255\nsrun: error: c3: task 1: Exited with exit "
                   "code 255\n", "no rank started (srun: error: c3: task 1: Exited with exit code 255); on every node "
                   "of the step: the image or the launcher, not the nodes", []),
}


@pytest.mark.parametrize("case", sorted(SRUN_LOGS))
def test_srun_failing_to_start_the_step_names_what_slurm_said_and_the_nodes(tmp_path, case):
    from rkit.backends.slurm.launcher import SlurmStepBackend, StepHandle, StepRequest
    from rkit.contract.rundir import RunDir

    text, said, nodes = SRUN_LOGS[case]
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    log = tmp_path / "srun.log"
    log.write_text(text)
    request = StepRequest(attempt=1, argv=["srun"], env={"RKIT_RUN_DIR": str(run.path), "RKIT_NPROCS": "2"},
                          nodes=["c1", "c3"], log=log, cwd=tmp_path, processes=2)
    backend = SlurmStepBackend(nodes_per_step=2, tasks_per_node=1)
    handle = StepHandle.cold(request, _done("false"))
    backend.poll(handle)
    assert handle.launch_failed == said and handle.failed_nodes == nodes
    # Once a rank's agent started, a task failure is the rank's own (its exit code), not the launcher's.
    run.emit(EV.AGENT_STARTED, attempt=1, rank=0, pid=1, warm=False)
    again = StepHandle.cold(request, _done("false"))
    backend.poll(again)
    assert (again.launch_failed is None) == (case in ("before agents", "every node"))


def test_status_and_goodput_show_the_detection_and_each_part_of_the_recovery():
    from rkit.readers import goodput
    from rkit.readers.status import StatusFold

    t0 = 1000.0
    events = [
        {"event": "run.submitted", "t": t0},
        {"event": "attempt.started", "attempt": 1, "t": t0 + 1, "resume_from_step": None},
        {"event": "attempt.first_step", "attempt": 1, "t": t0 + 11, "step": 0},
        {"event": "attempt.failed", "attempt": 1, "t": t0 + 50, "cls": "node_fail", "detected_by": "rkit",
         "detect_seconds": 4.5},
        {"event": "attempt.ended", "attempt": 1, "t": t0 + 51, "cause": "node_fail", "detail": "node failure on c2"},
        {"event": "attempt.started", "attempt": 2, "t": t0 + 52, "resume_from_step": 20},
        {"event": "agent.started", "attempt": 2, "rank": 0, "t": t0 + 54},
        {"event": "agent.ready", "attempt": 2, "rank": 0, "t": t0 + 60, "import_seconds": 5.5,
         "distributed_seconds": 0.5},
        {"event": "attempt.first_step", "attempt": 2, "t": t0 + 66, "step": 21, "restore_started": t0 + 61,
         "restore_seconds": 1.0},
        {"event": "attempt.ended", "attempt": 2, "t": t0 + 80, "cause": "completed"},
        {"event": "run.finished", "t": t0 + 81},
    ]
    rows = StatusFold.of(events).attempts()
    assert "recovery" not in rows[0] and rows[0]["detected_by"] == "rkit"
    assert rows[1]["recovery"] == {"detect": 4.5, "stop": 1.0, "launch": 3.0, "imports": 5.5, "distributed": 0.5,
                                   "restore": 1.0, "compile": 5.0, "total": 20.5}
    lost = goodput.compute(events)
    assert lost.seconds["detect"] == pytest.approx(4.5)
    assert sum(lost.seconds.values()) == pytest.approx(lost.wall_seconds)


def test_a_node_that_answers_its_probe_while_still_silent_is_probed_again_less_and_less_often():
    now = [0.0]
    probes: list[float] = []
    live = NodeLiveness(HeartbeatListener("127.0.0.1"), lambda n: probes.append(now[0]) or _done("true"),
                        lambda n: None, silence=3, probe_timeout=5, jax_heartbeat_seconds=16, clock=lambda: now[0])
    try:
        live.watch(1, ["c1"], 1)
        now[0] = STARTUP_SILENCE + 1  # a node whose container takes long to start: alive, never heard from
        for _ in range(400):
            live.check({})
            now[0] += 0.5
        gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
        # 2x, 4x, 8x, 16x the silence, then at most 60 s after each answer (which comes one 0.5 s pass after its
        # probe, and the next probe one pass after the wait)
        assert [g - 1 for g in gaps[:5]] == [6, 12, 24, 48, 60] and max(gaps) == 61
    finally:
        live.close()


def test_a_task_srun_ended_after_another_failed_is_marked_so(tmp_path):
    """The srun log of the CI run (stop 35) where rank 1's abort was heard before rank 0's own exit: srun ended
    rank 0 (its exit code lost); a third task srun did not name was killed with the step."""
    from rkit.backends.slurm.launcher import SlurmStepBackend, StepHandle, StepRequest
    from rkit.contract.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.emit(EV.AGENT_STARTED, attempt=1, rank=0, pid=1, warm=False)
    log = tmp_path / "srun.log"
    log.write_text("srun: error: c2: task 1: Exited with exit code 134\nsrun: Terminating StepId=240.1\n"
                   "slurmstepd: error: *** STEP 240.1 ON c1 CANCELLED AT 2026-12-03T09:08:55 ***\n"
                   "srun: error: c1: task 0: Terminated\nsrun: Force Terminated StepId=240.1\n")
    request = StepRequest(attempt=1, argv=["srun"], env={"RKIT_RUN_DIR": str(run.path), "RKIT_NPROCS": "3"},
                          nodes=["c1", "c2", "c3"], log=log, cwd=tmp_path, processes=3)
    handle = StepHandle.cold(request, _done("false"))
    exits = SlurmStepBackend(nodes_per_step=3, tasks_per_node=1).poll(handle)
    assert list(exits) == [1, 0, 2]
    assert (exits[1].returncode, exits[1].ended_by_launcher) == (134, False)
    assert (exits[0].returncode, exits[0].node, exits[0].ended_by_launcher) == (-signal.SIGTERM, "c1", True)
    assert exits[2].ended_by_launcher and exits[0].describe().startswith("was ended by the launcher (SIGTERM)")
    assert handle.launch_failed is None


def test_a_task_killed_inside_its_container_is_a_signal_not_an_exit_code(tmp_path):
    """srun --container (and apptainer exec) report a task SIGKILLed inside the container as "Exited with exit code
    137": rkit called it task_exit. 128+N is signal N, as the shell and every OCI runtime have it (found by the fault
    campaign on the test bed); a plain exit code stays one, and a step without a container keeps 137 as given."""
    from rkit.backends.local.launcher import Container, LocalBackend
    from rkit.backends.slurm.launcher import SlurmStepBackend, StepHandle, StepRequest
    from rkit.contract.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    log = tmp_path / "srun.log"
    log.write_text("srun: error: c2: task 1: Exited with exit code 137\nsrun: error: c1: task 0: Exited with exit "
                   "code 3\n")
    outcomes = {}
    for argv in (["srun", "--container=/x/cpu.sif", "python"], ["srun", "apptainer", "exec", "/x/cpu.sif", "python"],
                 ["srun", "python"]):
        request = StepRequest(attempt=1, argv=argv, env={"RKIT_RUN_DIR": str(run.path), "RKIT_NPROCS": "2"},
                              nodes=["c1", "c2"], log=log, cwd=tmp_path, processes=2)
        exits = SlurmStepBackend(nodes_per_step=2, tasks_per_node=1).poll(StepHandle.cold(request, _done("false")))
        outcomes[argv[1]] = (exits[1].returncode, exits[1].describe(), exits[0].returncode)
    assert outcomes["--container=/x/cpu.sif"] == outcomes["apptainer"] == (
        -signal.SIGKILL, "killed by SIGKILL (exit code 137 from its container)", 3)
    assert outcomes["python"] == (137, "exited with code 137", 3)
    killed = RankExit.in_container(1, 137, "c2")
    assert killed.as_record() == {"exit_code": None, "signal": "SIGKILL", "node": "c2", "container_exit_code": 137}
    local = LocalBackend(container=Container("apptainer", "/x/cpu.sif"))
    assert (local._exit(1, 134).signal_name, local._exit(1, 3).returncode) == ("SIGABRT", 3)
    assert LocalBackend()._exit(1, 137).returncode == 137


def test_slurms_oom_kill_report_makes_the_task_out_of_memory(tmp_path):
    from rkit.backends.slurm.launcher import SlurmStepBackend, StepHandle, StepRequest
    from rkit.contract.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.emit(EV.AGENT_STARTED, attempt=1, rank=1, pid=1, warm=False)
    log = tmp_path / "srun.log"
    log.write_text("slurmstepd: error: Detected 1 oom_kill event in StepId=41.0. Some of the step tasks have been "
                   "OOM Killed.\nsrun: error: c2: task 1: Out Of Memory\n")
    request = StepRequest(attempt=1, argv=["srun"], env={"RKIT_RUN_DIR": str(run.path), "RKIT_NPROCS": "2"},
                          nodes=["c1", "c2"], log=log, cwd=tmp_path, processes=2)
    handle = StepHandle.cold(request, _done("false"))
    exits = SlurmStepBackend(nodes_per_step=2, tasks_per_node=1).poll(handle)
    assert exits[1].returncode == -signal.SIGKILL and exits[1].node == "c2"
    assert handle.out_of_memory == ("Slurm said: slurmstepd: error: Detected 1 oom_kill event in StepId=41.0. Some "
                                    "of the step tasks have been OOM Killed.")
    assert handle.launch_failed is None


class Running:
    """A probe that has not answered yet (a Popen's poll/kill/wait)."""

    stdout = None

    def poll(self):
        return None

    def kill(self):
        pass

    def wait(self):
        return -9


def test_the_supervisor_suspects_itself_first_and_bounds_its_probes(monkeypatch):
    """issue 40: a late pass of the supervisor's own loop suspects nobody; many nodes silent at once are probed
    only once its own beat came back, and then at most PROBES_PER_PASS a pass and PROBES_PER_MINUTE a minute."""
    from rkit.run import liveness

    now = [0.0]
    probes: list[str] = []
    nodes = [f"c{i}" for i in range(200)]
    live = NodeLiveness(HeartbeatListener("127.0.0.1"), lambda n: probes.append(n) or Running(), lambda n: None,
                        silence=3, probe_timeout=600, jax_heartbeat_seconds=61, clock=lambda: now[0])
    try:
        live.watch(1, nodes, 1)
        assert live.receive_buffer >= 256 << 10  # sized for 200 nodes' beats, not the kernel's default
        now[0] = STARTUP_SILENCE - 1
        live.check({})
        now[0] = STARTUP_SILENCE + 5  # the loop was away 6 s: its own lateness, nobody is suspected
        notes, _ = live.check({})
        assert probes == [] and [n["event"] for n in notes] == ["liveness.self_check"] and notes[0]["holding"]
        assert "own loop was away 6.0 s" in notes[0]["why"]
        monkeypatch.setattr(live.listener, "self_beat", lambda: False)  # its own socket hears nothing
        notes, _ = ticks(live, now, 4)
        assert probes == [] and notes[-1]["holding"] and "own beat did not come back" in notes[-1]["why"]
        assert all(valid_event({**n, "t": 1.0}) for n in notes), notes
        monkeypatch.setattr(live.listener, "self_beat", lambda: True)
        # its side is fine again: once checked again (every `silence` seconds), the nodes are probed, a bounded
        # number a pass
        notes, _ = ticks(live, now, 2 + 3)
        assert len(probes) == 3 * liveness.PROBES_PER_PASS and not any(n.get("holding") for n in notes)
        ticks(live, now, 20)
        assert len(probes) == liveness.PROBES_PER_MINUTE  # the minute's budget
        ticks(live, now, 60)
        assert len(probes) == len(nodes)  # and the next minute's
    finally:
        live.close()


def test_a_node_that_trains_but_whose_heartbeats_never_arrive_is_named_once_and_never_probed():
    now = [0.0]
    probes: list[str] = []
    live = NodeLiveness(HeartbeatListener("127.0.0.1"), lambda n: probes.append(n) or Running(), lambda n: None,
                        silence=3, probe_timeout=5, jax_heartbeat_seconds=61, clock=lambda: now[0])
    try:
        live.watch(1, ["c1", "c2", "c3"], 1)
        beat = heartbeat.encode(live.listener.token, "c1", 1, 0)
        to = live.listener.sock.getsockname()
        notes = []
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _ in range(int(STARTUP_SILENCE) + 20):  # c1 beats; c2 steps, never heard (a firewall); c3 neither
                sock.sendto(beat, to)
                now[0] += 1
                notes += live.check({0: now[0], 1: now[0]})[0]
        channel = [n for n in notes if n["event"] == "liveness.channel"]
        assert [n["node"] for n in channel] == ["c2"] and "UDP to that port may be blocked" in channel[0]["why"]
        assert set(probes) == {"c3"}  # neither stepping nor heard: suspected as before; c2 is left to Slurm
    finally:
        live.close()


def test_srun_losing_a_node_of_its_step_names_that_node(tmp_path):
    """The fault campaign: c2 crashed while an attempt started; srun said only "io error and missing step on node 1"
    and killed rank 0, and the attempt went to rank 0 (task_signal) instead of the node, which the next attempt then
    used again (step_failed). Node 1 of the step [c1, c2] is c2: a node failure."""
    from rkit.backends.slurm.launcher import SlurmStepBackend, StepHandle, StepRequest
    from rkit.contract.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.emit(EV.AGENT_STARTED, attempt=12, rank=0, pid=1, warm=False)  # rank 0 had started (its JAX service)
    log = tmp_path / "srun.log"
    log.write_text("srun: error: _server_write write failed: Bad file descriptor\n"
                   "srun: error: Aborting, io error and missing step on node 1\n"
                   "srun: Job step aborted: Waiting up to 7 seconds for job step to finish.\n"
                   "srun: error: c1: task 0: Killed\nsrun: Terminating StepId=31.28\n"
                   "srun: error: Aborting, step missing and io error on node 1\n")
    request = StepRequest(attempt=12, argv=["srun", "--container=/x.sif"], env={"RKIT_RUN_DIR": str(run.path)},
                          nodes=["c2", "c1"], log=log, cwd=tmp_path, processes=2)
    handle = StepHandle.cold(request, _done("false"))
    SlurmStepBackend(nodes_per_step=2, tasks_per_node=1).poll(handle)
    assert handle.failed_nodes == ["c2"]
