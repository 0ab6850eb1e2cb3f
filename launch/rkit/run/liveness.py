"""Node liveness on Slurm: rkit sees a dead node in seconds, without waiting for Slurm.

Slurm's controller marks a node DOWN only after SlurmdTimeout (300 s by default) without an answer, and srun learns
of it only from the controller; JAX's coordination service waits heartbeat_timeout_seconds (100 s by default); a
collective with a dead peer hangs. So every node of an attempt sends the supervisor a heartbeat every second
(heartbeat.py, from its telemetry process), and a node is

  suspected  when its heartbeat has been silent for `silence` seconds while its ranks made no step progress for as
             long (before its first heartbeat: STARTUP_SILENCE, the container's and the agent's start);
  probed     by a second, bounded channel: a one-task step on that node (the backend's `start_probe`, `srun
             --overlap --nodelist=NODE true`) that must succeed within `probe_timeout` seconds;
  alive      when the probe succeeds or its heartbeat comes back (a slow node, a long save or compilation: the
             attempt goes on; a node that stays silent is probed again after twice as long each time, 2 x silence
             first, at most MAX_BACKOFF);
  dead       only on evidence about the node itself (`probe_verdict`): Slurm's own words that srun could not reach
             the node's slurmd or that the controller holds the node down, or a probe that did not answer in time
             while the node's slurmd does not accept a connection either (the backend's `slurmd_silent`). The
             supervisor ends the attempt as a node failure, cancels the step and excludes the node, so the next
             attempt runs on the healthy nodes and the spares;
  unconfirmed  any other failed probe (a busy or failing-over controller, a step limit, srun's own error, a slurmd
             that answers but a step that does not start): no verdict on the node, which is probed again after the
             same backoff as a live one (`node.unconfirmed`): a wrong death costs a healthy node, a late one seconds.

`suspects` is the pure policy (tested without sleeping); `HeartbeatListener` the socket; `NodeLiveness` one
attempt's watch, driven by the supervisor's loop and its clock.
"""

from __future__ import annotations

import re
import secrets
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rkit.contract import heartbeat

# Slurm's own words (src/common/slurm_errno.c) when srun could not reach a node's slurmd: on srun's "Task launch for
# StepId=S failed on node N: ..." line, which names the node, they are evidence against that node.
UNREACHABLE = ("Communication connection failure", "Connection refused", "Connection timed out establishing",
               "No route to host", "Network is unreachable")
# The controller's own verdict on the one node a probe asks for: it holds the node down or drained.
HELD_DOWN = ("Required node not available (down, drained or reserved)",)
LAUNCH_ON_NODE = re.compile(r"failed on node (\S+?):? ")
STARTUP_SILENCE = 30.0  # before a node's first heartbeat: its container, Python and the agent start
MAX_BACKOFF = 60.0  # a node found alive while still silent is probed again after 2x, 4x ... the silence, at most this
MAX_DATAGRAMS = 4096  # read per pass at most (16 per node above 256 nodes): a flood cannot hold the loop
# And for this long at most: the backlog of a late pass (the supervisor's own stall) is read over the next passes,
# each beat still stamped by its arrival, instead of in one pass of 100 ms and more at 4,096 nodes. At ~25 us a
# datagram that is some 800 a pass, 8,000 a second: twice the beats of 4,096 nodes (and the receive buffer holds
# BUFFERED_SECONDS of them meanwhile).
DRAIN_SECONDS = 0.02
# The receive buffer: room for BUFFERED_SECONDS of every node's beats (the kernel counts some 2 KiB a datagram), so a
# pass that comes late drops none; within the kernel's limits (net.core.rmem_max, or more with CAP_NET_ADMIN).
BUFFERED_SECONDS = 16
BUFFER_BYTES_PER_BEAT = 2048
MOST_BUFFER_BYTES = 64 << 20
# Probes are bounded: a burst of suspicion starts at most this many a pass and a minute (a sixteenth of the nodes,
# if more; the rest wait their turn).
PROBES_PER_PASS = 16
PROBES_PER_MINUTE = 128
# The supervisor suspects itself first: when at least this share of an attempt's nodes (and at least two) would be
# suspected in one pass, its own side is checked before any node is probed (`liveness.self_check`).
SELF_SUSPECT_SHARE = 0.5
SO_TIMESTAMP = getattr(socket, "SO_TIMESTAMP", 29 if sys.platform == "linux" else None)  # Linux's SO_TIMESTAMP_OLD


@dataclass(frozen=True)
class Suspect:
    node: str
    silent: float  # seconds since its last heartbeat (or since the attempt started)
    stalled: float  # seconds since any of its ranks made step progress


def suspects(nodes: Mapping[str, float], ranks_of: Mapping[str, list[int]], progress: Mapping[int, float],
             now: float, silence: float) -> list[Suspect]:
    """Nodes silent for more than `silence` seconds since `nodes[node]` (their last heartbeat, or when watching
    began) whose ranks all made no step progress for as long: the nodes to probe."""
    out = []
    for node, since in nodes.items():
        silent = now - since
        last = max((progress[r] for r in ranks_of.get(node, []) if r in progress), default=since)
        if silent > silence and now - last > silence:
            out.append(Suspect(node, round(silent, 3), round(now - last, 3)))
    return out


SELF_NODE = "rkit-supervisor"  # the name on the beat a listener sends itself (self_beat)


def _arrival(ancillary: list[tuple[int, int, bytes]]) -> float:
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMP and len(payload) >= 16:
            seconds, micros = struct.unpack("qq", payload[:16])
            return seconds + micros / 1e6
    return time.time()


class HeartbeatListener:
    """The supervisor's heartbeat socket (UDP on the address the nodes reach this host at), for the whole job:
    non-blocking, so that reading it never waits on a peer."""

    def __init__(self, address: str, token: str | None = None):
        self.token = token or secrets.token_hex(16)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self.sock.bind((address, 0))
        except OSError:  # a NodeAddr that is a name this host does not resolve to itself: every interface
            self.sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        self.sock.setblocking(False)
        self.address = address
        self.stamped = False  # the kernel stamps each datagram's arrival (SO_TIMESTAMP)
        if SO_TIMESTAMP is not None:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMP, 1)
                self.stamped = True
            except OSError:
                pass
        self.most = MAX_DATAGRAMS
        self.pending: list[tuple[heartbeat.Beat, float]] = []  # beats read by self_beat

    def environment(self) -> dict[str, str]:
        return {heartbeat.ADDRESS_ENV: f"{self.address}:{self.sock.getsockname()[1]}",
                heartbeat.TOKEN_ENV: self.token}

    def size_for(self, nodes: int) -> int:
        """Room for BUFFERED_SECONDS of `nodes` nodes' beats (as much as the kernel allows); the bytes it got."""
        want = min(MOST_BUFFER_BYTES, max(256 << 10, nodes * BUFFERED_SECONDS * BUFFER_BYTES_PER_BEAT))
        self.most = max(MAX_DATAGRAMS, 16 * nodes)
        for option in (getattr(socket, "SO_RCVBUFFORCE", None), socket.SO_RCVBUF):
            if option is None:
                continue
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, option, want)
                break
            except OSError:  # SO_RCVBUFFORCE needs CAP_NET_ADMIN: then SO_RCVBUF, capped at net.core.rmem_max
                continue
        return self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)

    def drain(self, seconds: float = DRAIN_SECONDS) -> list[tuple[heartbeat.Beat, float]]:
        """The beats that arrived since the last drain, each with its arrival time (time.time(): the kernel's
        stamp, else now); after `seconds` of reading, the rest waits in the socket for the next drain."""
        beats, self.pending = self.pending, []
        space = socket.CMSG_SPACE(16)
        deadline = time.perf_counter() + seconds
        for count in range(self.most):
            if count and count % 64 == 0 and time.perf_counter() > deadline:
                break
            try:
                data, ancillary, _, _ = self.sock.recvmsg(heartbeat.MAX_DATAGRAM, space)
            except OSError:  # BlockingIOError: nothing more has arrived
                break
            beat = heartbeat.decode(self.token, data)
            if beat is not None:
                beats.append((beat, _arrival(ancillary)))
        return beats

    def self_beat(self) -> bool:
        """Whether a beat this listener sends itself arrives (its socket and this host's network stack work)."""
        probe = heartbeat.Beat(SELF_NODE, 0, secrets.randbelow(1 << 30))
        try:
            self.sock.sendto(heartbeat.encode(self.token, probe.node, probe.attempt, probe.seq),
                             self.sock.getsockname()[:2])
        except OSError:
            return False
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(heartbeat.MAX_DATAGRAM, socket.CMSG_SPACE(16))
            except BlockingIOError:
                time.sleep(0.005)
                continue
            except OSError:
                return False
            beat = heartbeat.decode(self.token, data)
            if beat == probe:
                return True
            if beat is not None:  # a node's: the next drain gets it
                self.pending.append((beat, _arrival(ancillary)))
        return False

    def close(self) -> None:
        self.sock.close()


@dataclass
class Probe:
    node: str
    proc: subprocess.Popen
    started: float
    deadline: float

    def result(self, now: float) -> tuple[str, str] | None:
        """(verdict, what it said) once it ended or timed out: probe_verdict's, or "timeout"; None while it
        runs."""
        code = self.proc.poll()
        if code is None and now < self.deadline:
            return None
        if code is None:
            _discard(self)
            return "timeout", f"the probe step did not answer within {self.deadline - self.started:.0f} s"
        said = self.proc.stdout.read() if self.proc.stdout else ""
        _discard(self)
        return probe_verdict(self.node, code, said)


def settled(node: str, verdict: str, said: str, slurmd_silent: Callable[[str], str | None]) -> tuple[str, str]:
    """A probe's result with a timeout settled: the step did not start in time (the controller's delay, or a dead
    node): dead when the node's slurmd takes no connection either, else unconfirmed."""
    if verdict != "timeout":
        return verdict, said
    refused = slurmd_silent(node)
    if refused:
        return "dead", f"{said} and {refused}"
    return "unconfirmed", f"{said}, but its slurmd takes connections"


def probe_verdict(node: str, code: int, output: str) -> tuple[str, str]:
    """A probe step's verdict on `node` from its exit and srun's words: "alive", "dead" (Slurm said it cannot
    reach the node, or holds it down) or "unconfirmed" (anything else: no word on the node), and what decided."""
    if code == 0:
        return "alive", ""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        on = LAUNCH_ON_NODE.search(line)
        if (on and on.group(1) == node and any(w in line for w in UNREACHABLE)) or any(w in line for w in HELD_DOWN):
            return "dead", f"the probe step failed (exit {code}): {line[:300]}"
    return "unconfirmed", f"the probe step failed (exit {code}){': ' + lines[-1][:300] if lines else ''}"


@dataclass
class NodeLiveness:
    """One job's liveness: the listener lives as long as the supervisor; `watch` starts each attempt's."""

    listener: HeartbeatListener
    start_probe: Callable[[str], subprocess.Popen]  # the backend's probe step on one node
    # the backend's: why the node's slurmd takes no connection (None when it does, or nobody knows)
    slurmd_silent: Callable[[str], str | None]
    silence: float
    probe_timeout: float
    jax_heartbeat_seconds: int
    clock: Callable[[], float]
    attempt: int = 0
    since: dict[str, float] = field(default_factory=dict)  # node -> last heartbeat (or when watching began)
    heard: set[str] = field(default_factory=set)  # nodes heard from in this attempt
    ranks_of: dict[str, list[int]] = field(default_factory=dict)
    probes: dict[str, Probe] = field(default_factory=dict)
    cleared: dict[str, float] = field(default_factory=dict)  # node -> when it was last found alive (+ its backoff)
    backoff: dict[str, float] = field(default_factory=dict)  # node -> the wait before its next probe while silent
    dead: set[str] = field(default_factory=set)  # confirmed in this attempt: never probed again
    started: deque = field(default_factory=deque)  # when the probes of the last minute started
    last_pass: float | None = None  # when `check` last ran (the supervisor's own lateness)
    self_checked: float = float("-inf")  # when the supervisor last checked its own side
    own_side_ok: bool = True  # what that check found
    watched_at: float = 0.0  # when this attempt's watch began
    deaf: set[str] = field(default_factory=set)  # nodes that step but were never heard: left to Slurm's view
    receive_buffer: int = 0  # the listener's receive buffer for this attempt (bytes the kernel gave)

    def environment(self) -> dict[str, str]:
        """What the ranks need: where to send heartbeats, and JAX's own heartbeat timeout."""
        return {**self.listener.environment(), heartbeat.JAX_HEARTBEAT_ENV: str(self.jax_heartbeat_seconds)}

    def watch(self, attempt: int, nodes: list[str], tasks_per_node: int) -> None:
        """A new attempt on `nodes` (srun's block distribution: node i runs ranks i*T .. i*T+T-1)."""
        self.end()
        now = self.clock()
        self.listener.drain()  # the previous attempt's last beats
        self.receive_buffer = self.listener.size_for(len(nodes))
        self.attempt, self.heard, self.cleared, self.dead, self.backoff = attempt, set(), {}, set(), {}
        self.last_pass, self.watched_at, self.deaf = None, now, set()
        # Before a node's first heartbeat its start-up is allowed STARTUP_SILENCE (less `silence`, which the
        # policy adds).
        self.since = {n: now + max(0.0, STARTUP_SILENCE - self.silence) for n in nodes}
        self.ranks_of = {n: list(range(i * tasks_per_node, (i + 1) * tasks_per_node)) for i, n in enumerate(nodes)}

    def check(self, progress: Mapping[int, float]) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """One pass: read heartbeats, settle probes, start new ones. `progress`: when each rank made its latest
        step, for the ranks that made one (a rank not yet stepping is absent: the hang watch's start-of-attempt
        time read as a step took a node that died at launch for one whose heartbeats cannot arrive). Returns the
        notes to record as events ({"event": name, ...}) and the nodes confirmed dead with why."""
        now = self.clock()
        away, self.last_pass = (0.0 if self.last_pass is None else now - self.last_pass), now
        notes: list[dict[str, Any]] = []
        dead: dict[str, str] = {}
        for beat, arrived in self.listener.drain():
            if beat.attempt == self.attempt and beat.node in self.since:
                self.deaf.discard(beat.node)
                # stamped by its arrival (a pass that comes late does not make the beat newer than it is); the first
                # beat ends the start-up allowance (a node that dies 10 s into an attempt is silent from then on)
                stamp = now - max(0.0, time.time() - arrived)
                self.since[beat.node] = max(self.since[beat.node], stamp) if beat.node in self.heard else stamp
                self.heard.add(beat.node)
                self.backoff.pop(beat.node, None)
                if (probe := self.probes.pop(beat.node, None)) is not None:
                    _discard(probe)
                    self.cleared[beat.node] = now
                    notes.append({"event": "node.alive", "node": beat.node, "how": "its heartbeat came back",
                                  "after_seconds": round(now - probe.started, 3)})
        for node, probe in list(self.probes.items()):
            result = probe.result(now)
            if result is None:
                continue
            del self.probes[node]
            verdict, said = settled(node, *result, self.slurmd_silent)
            if verdict != "dead":
                wait = self.backoff[node] = min(MAX_BACKOFF, 2 * self.backoff.get(node, self.silence))
                self.cleared[node] = now + max(0.0, wait - self.silence)
                notes.append({"event": "node.alive", "node": node, "how": "it answered the probe step",
                              "after_seconds": round(now - probe.started, 3)} if verdict == "alive" else
                             {"event": "node.unconfirmed", "node": node, "probe": said,
                              "probe_seconds": round(now - probe.started, 3), "next_probe_seconds": wait})
            else:
                self.dead.add(node)
                silent = round(now - self.since[node], 3)
                dead[node] = (f"no heartbeat for {silent:.1f} s and {said}" if node in self.heard else
                              f"no heartbeat since the attempt started and {said}")
                notes.append({"event": "node.dead", "node": node, "silent_seconds": silent, "probe": said,
                              "probe_seconds": round(now - probe.started, 3), "detected_by": "rkit",
                              "heard_from": node in self.heard})
        notes += self._deaf_nodes(progress, now)
        watched = {n: max(t, self.cleared.get(n, t)) for n, t in self.since.items()
                   if n not in self.probes and n not in self.dead and n not in self.deaf}
        found = suspects(watched, self.ranks_of, progress, now, self.silence)
        # Silent "at once" means within a probe's time, not in one pass: nodes whose beats stopped together cross
        # the silence a pass or two apart (their phases differ), and the first of them is already being probed.
        holding, said = self._own_side(away, len(found) + len(self.probes), now) if found else (False, None)
        notes += [said] if said else []
        if holding:
            return notes, dead
        while self.started and now - self.started[0] > 60:
            self.started.popleft()
        per_minute = max(PROBES_PER_MINUTE, len(self.since) // 16)
        for suspect in found[:max(0, min(PROBES_PER_PASS, per_minute - len(self.started)))]:
            self.started.append(now)
            try:
                proc = self.start_probe(suspect.node)
            except OSError as exc:
                notes.append({"event": "node.suspected", "node": suspect.node, "silent_seconds": suspect.silent,
                              "stalled_seconds": suspect.stalled, "probe": f"could not start: {exc}"})
                self.cleared[suspect.node] = now  # not probed again before another silence
                continue
            self.probes[suspect.node] = Probe(suspect.node, proc, now, now + self.probe_timeout)
            notes.append({"event": "node.suspected", "node": suspect.node, "silent_seconds": suspect.silent,
                          "stalled_seconds": suspect.stalled, "heard_from": suspect.node in self.heard})
        return notes, dead

    def _deaf_nodes(self, progress: Mapping[int, float], now: float) -> list[dict[str, Any]]:
        """Nodes whose ranks step but whose heartbeats never arrived by the end of the start-up allowance: the
        channel does not work for them (a firewalled port, a name that is not the NodeName). Said once; rkit's
        heartbeat no longer watches them (no probe storm whenever a step is slow): Slurm's view does."""
        notes = []
        for node, ranks in self.ranks_of.items():
            if node in self.heard or node in self.deaf or now < self.watched_at + STARTUP_SILENCE or \
                    not any(r in progress for r in ranks):
                continue
            self.deaf.add(node)
            where = self.listener.environment()[heartbeat.ADDRESS_ENV]
            notes.append({"event": "liveness.channel", "node": node, "address": where,
                          "why": f"node {node}'s ranks train but none of its heartbeats reached {where} in "
                                 f"{STARTUP_SILENCE:g} s: UDP to that port may be blocked (a firewall), the address "
                                 "may not be this host's for that node, or the node's name may differ from its "
                                 "Slurm NodeName; rkit's own liveness leaves it to Slurm's view (srun, sinfo)"})
        return notes

    def _own_side(self, away: float, suspected: int, now: float) -> tuple[bool, dict[str, Any] | None]:
        """The supervisor suspects itself first: when its own loop was away longer than the silence (what looks
        silent is its own lateness), or when many nodes look silent at once and its own beat does not come back
        (its socket, its host's network; checked again every `silence` seconds), no node is probed this pass.
        Returns whether to hold, and the `liveness.self_check` note when there is news."""
        if away > self.silence:
            for node in self.since:  # a fresh look from now: nobody read their beats, the buffer may have overflowed
                self.since[node] = max(self.since[node], now)
            return True, {"event": "liveness.self_check", "holding": True, "suspected": suspected,
                          "node_count": len(self.since),
                          "why": f"the supervisor's own loop was away {away:.1f} s (more than the {self.silence:g} "
                                 "s silence): no node is suspected on this pass"}
        if suspected < 2 or suspected / max(1, len(self.since)) < SELF_SUSPECT_SHARE:
            return False, None
        if now - self.self_checked < self.silence:
            return not self.own_side_ok, None
        self.self_checked = now
        ok = self.own_side_ok = self.listener.self_beat()
        return not ok, {"event": "liveness.self_check", "holding": not ok, "suspected": suspected,
                        "node_count": len(self.since),
                "why": (f"{suspected} of {len(self.since)} nodes silent at once; the supervisor's own beat came "
                        "back, so its socket and host are not the cause: probing, at most "
                        f"{PROBES_PER_PASS} a pass") if ok else
                       (f"{suspected} of {len(self.since)} nodes silent at once and the supervisor's own beat did not "
                        "come back: its socket or its host's network is at fault, not the nodes; no node is probed")}

    def last_heard(self, node: str) -> float | None:
        return self.since.get(node) if node in self.heard else None

    def end(self) -> None:
        for probe in self.probes.values():
            _discard(probe)
        self.probes.clear()

    def close(self) -> None:
        self.end()
        self.listener.close()


def detection(liveness: NodeLiveness | None, nodes: tuple[str, ...], now: float, *, by_rkit: bool, launcher: str,
              jax: str | None) -> dict[str, object]:
    """A node failure's attempt.failed fields: who saw it first (rkit's heartbeats and probe, or the launcher:
    Slurm through srun), how long after the node's last heartbeat, and JAX's word where a rank's log had it."""
    heard = [t for n in nodes if liveness is not None and (t := liveness.last_heard(n)) is not None]
    after = {"detect_seconds": round(now - min(heard), 3)} if heard else {}
    return {"detected_by": "rkit" if by_rkit else launcher, **after, **({"jax_saw_it": jax} if jax else {})}


def _discard(probe: Probe) -> None:
    if probe.proc.poll() is None:
        probe.proc.kill()
    probe.proc.wait()
    if probe.proc.stdout is not None:
        probe.proc.stdout.close()
