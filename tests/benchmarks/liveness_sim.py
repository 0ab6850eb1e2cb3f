"""rkit's node liveness at a large cluster's size, simulated (issue 40, part 6): the real HeartbeatListener and
NodeLiveness (run/liveness.py) of the supervisor, against --nodes simulated nodes of --ranks-per-node ranks.

- the nodes: a separate process sends each node's signed heartbeat over UDP to the real listener once a second
  (each node with its own phase and +-20 % jitter), dropping --loss of them; one node crashes at --crash-at s
  (its beats stop, its ranks stop stepping);
- the ranks: every live rank steps every --step-seconds (10 s: longer than the 3 s silence, so the no-progress guard
  does not hide a silent node);
- the probes: a probe step (the backend's start_probe) answers after 3 to 10 s (uniform): a live node's exits 0, the
  crashed node's never answers; the probe's timeout is the default 5 s, so the slow ones time out and the node's
  slurmd is asked: a live node's answers, the crashed node's refuses;
- the supervisor: its loop passes every 0.1 s (the real poll), and stalls once for --stall-seconds at --stall-at s
  (a slow file system, a swap storm).

It prints the false deaths (nodes found dead other than the crashed one: the target is 0), the crashed node's
detection time after its last heartbeat (target <= 10 s), the pass time (median, 99th percentile, max, and when the
three slowest came; target: the 99th percentile under 50 ms), the probes started, and the self-checks. Exit 1 when a
target is missed.

    python tests/benchmarks/liveness_sim.py [--nodes 4096] [--ranks-per-node 8] [--seconds 70] [--seed 1]
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import socket
import statistics
import sys
import time
from dataclasses import dataclass

from rkit.contract import heartbeat
from rkit.run.liveness import HeartbeatListener, NodeLiveness


def send_beats(address: tuple[str, int], token: str, nodes: int, seconds: float, loss: float, crashed: int,
               crash_at: float, t0: float, seed: int) -> None:
    """The nodes' heartbeats: node i beats at t0 + phase_i + k +- jitter; the crashed node stops at crash_at."""
    rng = random.Random(seed)
    phase = [rng.random() for _ in range(nodes)]
    seq = [0] * nodes
    due = sorted((t0 + phase[i], i) for i in range(nodes))
    names = [f"n{i:05d}" for i in range(nodes)]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        import heapq

        heapq.heapify(due)
        while due:
            at, i = heapq.heappop(due)
            if at - t0 > seconds:
                continue
            wait = at - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if not (i == crashed and at - t0 >= crash_at):
                if rng.random() >= loss:
                    try:
                        sock.sendto(heartbeat.encode(token, names[i], 1, seq[i]), address)
                    except OSError:
                        pass
                seq[i] += 1
                heapq.heappush(due, (at + 1.0 + rng.uniform(-0.2, 0.2), i))


@dataclass
class FakeProbe:
    """A probe step that answers `answers_at` (monotonic) with `code`, or never (None)."""

    answers_at: float | None
    code: int = 0
    stdout = None

    def poll(self) -> int | None:
        return self.code if self.answers_at is not None and time.monotonic() >= self.answers_at else None

    def kill(self) -> None:
        self.answers_at = None

    def wait(self) -> int:
        return -9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4096)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=70.0)
    parser.add_argument("--loss", type=float, default=0.01)
    parser.add_argument("--step-seconds", type=float, default=10.0)
    parser.add_argument("--crash-at", type=float, default=50.0)
    parser.add_argument("--stall-at", type=float, default=38.0)
    parser.add_argument("--stall-seconds", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    names = [f"n{i:05d}" for i in range(args.nodes)]
    crashed = rng.randrange(args.nodes)
    probes_started: list[str] = []

    def start_probe(node: str) -> FakeProbe:
        probes_started.append(node)
        return FakeProbe(None if node == names[crashed] else time.monotonic() + rng.uniform(3.0, 10.0))

    def slurmd_silent(node: str) -> str | None:
        return "its slurmd (10.0.0.1:6818) took no connection: Connection refused" if node == names[crashed] else None

    live = NodeLiveness(HeartbeatListener("127.0.0.1"), start_probe, slurmd_silent, silence=3.0, probe_timeout=5.0,
                        jax_heartbeat_seconds=61, clock=time.monotonic)
    live.watch(1, names, args.ranks_per_node)
    address = live.listener.sock.getsockname()[:2]
    t0 = time.monotonic() + 1.0
    sender = multiprocessing.get_context("spawn").Process(target=send_beats, args=(
        address, live.listener.token, args.nodes, args.seconds, args.loss, crashed, args.crash_at, t0, args.seed),
        daemon=True)
    sender.start()
    ranks = args.nodes * args.ranks_per_node
    progress: dict[int, float] = {}
    passes: list[float] = []
    when: list[float] = []  # each pass's time in the run
    deaths: dict[str, tuple[float, str]] = {}
    events: dict[str, int] = {}
    last_beat = None  # the crashed node's last heartbeat as the supervisor saw it, when it was found dead
    stalled = False
    try:
        while (now := time.monotonic()) < t0 + args.seconds:
            elapsed = now - t0
            if not stalled and elapsed >= args.stall_at:
                time.sleep(args.stall_seconds)  # the supervisor's own stall
                stalled = True
                continue
            stepping = int(max(0.0, elapsed) // args.step_seconds)
            stamp = t0 + stepping * args.step_seconds
            if progress.get(0) != stamp:  # a step: every live rank's progress moves
                lost = range(crashed * args.ranks_per_node, (crashed + 1) * args.ranks_per_node)
                for r in range(ranks):
                    if not (elapsed >= args.crash_at and r in lost):
                        progress[r] = stamp
            began = time.perf_counter()
            notes, dead = live.check(progress)
            passes.append(time.perf_counter() - began)
            when.append(elapsed)
            for note in notes:
                events[note["event"]] = events.get(note["event"], 0) + 1
            for node, why in dead.items():
                deaths[node] = (now, why)
                if node == names[crashed]:
                    last_beat = live.last_heard(node)
            time.sleep(max(0.0, 0.1 - (time.perf_counter() - began)))
    finally:
        sender.terminate()
        live.close()
    false = sorted(n for n in deaths if n != names[crashed])
    found = deaths.get(names[crashed])
    detect = None if found is None or last_beat is None else found[0] - last_beat
    ms = sorted(1000 * p for p in passes)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    print(f"{args.nodes} nodes x {args.ranks_per_node} ranks, {args.seconds:.0f} s, beats lost {args.loss:.0%}, "
          f"steps every {args.step_seconds:g} s, a {args.stall_seconds:g} s stall of the supervisor at "
          f"{args.stall_at:g} s, node {names[crashed]} crashed at {args.crash_at:g} s (seed {args.seed})")
    print(f"  receive buffer {live.receive_buffer / 2**20:.1f} MiB, arrival stamps {live.listener.stamped}")
    print(f"  false deaths: {len(false)}{' ' + ', '.join(false[:10]) if false else ''}")
    print("  crashed node: " + (f"found dead {detect:.1f} s after its last heartbeat ({found[1]})" if detect is not None
                                else "NOT found"))
    print(f"  pass time: median {statistics.median(ms):.1f} ms, p99 {p99:.1f} ms, max {ms[-1]:.1f} ms over "
          f"{len(ms)} passes; the slowest at " + ", ".join(
              f"{when[i]:.1f} s ({1000 * passes[i]:.0f} ms)" for i in sorted(
                  range(len(passes)), key=passes.__getitem__)[-3:][::-1]))
    print(f"  probes started: {len(probes_started)} on {len(set(probes_started))} nodes; events: "
          + ", ".join(f"{k} {v}" for k, v in sorted(events.items())))
    missed = [what for what, bad in (("false deaths", bool(false)), ("detection", detect is None or detect > 10),
                                     ("pass time", p99 >= 50)) if bad]
    if missed:
        sys.exit(f"liveness_sim: missed: {', '.join(missed)}")


if __name__ == "__main__":
    main()
