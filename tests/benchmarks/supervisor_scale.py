"""How the supervisor and `rkit status` scale with the ranks (issue 13, item 6): a synthetic attempt of N ranks
(default 512: 64 nodes x 8) whose metrics a generator process writes at one step per second per rank, no
MaxText. The real Supervisor watches it through a backend whose ranks are that generator; the supervisor's own
CPU time over the attempt (getrusage of its process: the generator is another process) against the wall time
is its share of one core. Then `rkit status --json` on the run, cold and warm, in child processes.

    python tests/benchmarks/supervisor_scale.py --ranks 512 --seconds 60
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rkit.backends.base import Handle, RankExit
from rkit.contract.rundir import RunDir
from rkit.readers.outcome import chronicle
from rkit.recipe.load import load_recipe
from rkit.run.policy import Progress
from rkit.run.supervisor import Supervisor

REPO = Path(__file__).resolve().parents[2]
PER_NODE = 8

GENERATOR = """
import json, sys, time
run, ranks, seconds, attempt, per_node = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), \
    int(sys.argv[5])
files = [open(f"{run}/metrics/{r}.jsonl", "a", buffering=1) for r in range(ranks)]
start = time.time()
step = 0
while time.time() - start < seconds:
    t = time.time()
    for r, fh in enumerate(files):
        fh.write(json.dumps({"t": round(t, 3), "attempt": attempt, "rank": r, "node": f"n{r // per_node}",
                             "step": step, "loss": 5.0 - step * 1e-3, "step_time": 1.0,
                             "tokens_per_sec_per_device": 640.0, "host_rss_bytes": 1 << 30}) + "\\n")
    step += 1
    time.sleep(max(0.0, start + step - time.time()))
"""


@dataclass
class GeneratedRequest:
    attempt: int
    processes: int

    def describe(self) -> str:
        return f"generated attempt {self.attempt} ({self.processes} ranks)"

    def as_record(self, root: Path) -> dict:
        return {"generated": True, "processes": self.processes}


@dataclass
class GeneratedHandle(Handle):
    process: subprocess.Popen | None = None
    ranks: int = 0

    def pids(self) -> dict[str, int]:
        return {"generator": self.process.pid} if self.process else {}


@dataclass
class GeneratorBackend:
    """The Backend protocol over one generator process that stands for every rank: they all exit 0 with it."""

    run: RunDir
    seconds: float
    name: str = "generated"
    exclude: list[str] = field(default_factory=list)
    standby: None = None
    liveness: None = None

    def prepare(self, *, attempt, processes, trainer_args, base_env, attempt_dir, cwd, port=None, host_env=None):
        return GeneratedRequest(attempt, processes)

    def submit(self, request: GeneratedRequest) -> GeneratedHandle:
        process = subprocess.Popen([sys.executable, "-c", GENERATOR, str(self.run.path), str(request.processes),
                                    str(self.seconds), str(request.attempt), str(PER_NODE)])
        return GeneratedHandle(process=process, ranks=request.processes)

    def poll(self, handle: GeneratedHandle) -> dict[int, RankExit]:
        code = handle.process.poll()
        if code is not None and not handle.exits:
            handle.exits.update({r: RankExit(r, code) for r in range(handle.ranks)})
        return handle.exits

    def running(self, handle: GeneratedHandle) -> list[int]:
        return [] if handle.process.poll() is not None else list(range(handle.ranks))

    def request_save(self, handle: GeneratedHandle) -> None:
        handle.process.terminate()

    def stop(self, handle: GeneratedHandle, grace: float) -> None:
        if handle.process.poll() is None:
            handle.process.kill()
        handle.process.wait()

    def nodes(self, handle: GeneratedHandle) -> list[str]:
        return [f"n{i}" for i in range(handle.ranks // PER_NODE)]

    def healthy_nodes(self) -> list[str]:  # every node the recipe asks for (none healthy: no attempt would start)
        return [f"n{i}" for i in range(4096)]

    def recheck(self, nodes: list[str]) -> dict[str, str | None]:
        return dict.fromkeys(nodes, "generated")

    def unseen_paths(self, paths: list[str]) -> tuple[dict[str, list[str]], str | None]:
        return {}, None

    def down_nodes(self, handle: GeneratedHandle) -> list[str]:
        return []

    def stopped_ranks(self, handle: GeneratedHandle) -> list[int]:
        return []

    def dump_stacks(self, handle: GeneratedHandle, out_dir: Path, stopped: list[int]) -> str:
        return "not dumped (generated ranks)"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def status_call(run: Path, cache: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one `rkit status --json RUN` in a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rkit.cli", "status", "--json", str(run)], check=True, capture_output=True,
                   env={**os.environ, "RKIT_STATUS_CACHE": str(cache)})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    nodes = max(1, args.ranks // PER_NODE)
    recipe = load_recipe(REPO / "recipes" / "tiny-slurm.yaml", overrides=[
        f"resources.nodes={nodes}", f"resources.processes_per_node={PER_NODE}", "trainer.steps=100000",
        "checkpoint.period=100000", "resilience.hang_timeout=600"])
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(Path(tmp) / "scale")
        run.path.mkdir()
        (run.path / "resolved.json").write_text(json.dumps(recipe.resolved))
        (run.path / "manifest.json").write_text(json.dumps({"config_hash": "sha256:" + "ab" * 32}))
        run.emit("run.submitted")
        sup = Supervisor(run=run, config=recipe.config, injections=[], backend=GeneratorBackend(run, args.seconds),
                         base_env={}, jax_cache_dir=str(Path(tmp) / "jax"), chronicle=chronicle)
        cpu, wall = cpu_seconds(), time.monotonic()
        outcome = sup.run_attempt(Progress(total_steps=100000), [])
        cpu, wall = cpu_seconds() - cpu, time.monotonic() - wall
        lines = sum(1 for _ in open(run.metrics_file(0)))
        print(f"supervisor: {args.ranks} ranks on {nodes} nodes, {lines} steps each, {wall:.1f} s: CPU {cpu:.2f} s "
              f"= {100 * cpu / wall:.1f}% of one core (poll every {sup.poll_seconds} s; attempt ended "
              f"{outcome.cause.value})")
        cache = Path(tmp) / "cache"
        for case in ("cold", "warm"):
            w, c = status_call(run.path, cache)
            print(f"rkit status --json, {case}: {w:.2f} s wall, {c:.2f} s CPU")


if __name__ == "__main__":
    main()
