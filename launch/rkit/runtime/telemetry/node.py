"""One process per node and attempt: the health sampler, this node's Prometheus exporter, and its heartbeat to
the supervisor (heartbeat.py; when the launcher asked for it).

    python -m rkit.runtime.telemetry.node --run DIR --attempt N --node NAME --node-index I

Settings come from the run's resolved.json (`observability`). Node I's exporter listens on prometheus.port + I
(0: any free port; a busy port falls back to a free one) and writes where it listens to
telemetry/<node>.exporter.json. It serves this node's health; node 0 adds every rank's training metrics and
the run's event counters, so each series exists once per attempt. The process ends with its parent (the
training agent) or on SIGTERM, and runs niced: its cost is taken from training.

The agent starts it with `start_node_services` (local rank 0 of each node only).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rkit.contract import heartbeat
from rkit.contract.config import Observability
from rkit.contract.errors import RkitError
from rkit.contract.events import EV
from rkit.contract.rundir import RunDir, open_for_writing, write_json_atomic

PR_SET_PDEATHSIG = 1
# The node's place among the attempt's nodes, where Slurm's SLURM_NODEID cannot say it: a warm attempt is made of
# one standby step per node (backends/slurm_standby.py), each of whose SLURM_NODEID is 0.
NODE_INDEX_ENV = "RKIT_NODE_INDEX"
NICENESS = 10
PARENT_POLL_SECONDS = 1.0


def observability_settings(run: RunDir) -> Observability:
    """The run's `observability` section with the schema's defaults (a run stamped before it existed gets them
    all)."""
    return run.config().observability


def node_name(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def node_index_from_env(launcher: str, environ: Mapping[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    if (given := env.get(NODE_INDEX_ENV, "")).isdigit():  # a warm attempt's node: its place in the attempt
        return int(given)
    raw = env.get("SLURM_NODEID", "0") if launcher != "local" else "0"
    return int(raw) if raw.isdigit() else 0


def is_node_leader(launcher: str, environ: Mapping[str, str] | None = None) -> bool:
    """Local rank 0: one node process per node. The local launcher says it with RKIT_RANK (a SLURM_LOCALID
    there would be the surrounding allocation's, not ours); under Slurm each task has its SLURM_LOCALID."""
    env = os.environ if environ is None else environ
    if launcher != "local" and "SLURM_LOCALID" in env:
        return env["SLURM_LOCALID"] == "0"
    return env.get("RKIT_RANK", "0") == "0"


def start_node_services(run: RunDir, attempt: int, node: str | None = None, node_index: int | None = None, *,
                        environ: Mapping[str, str] | None = None) -> subprocess.Popen | None:
    """Start this node's telemetry process if this process is the node's local rank 0 and the recipe wants a
    sampler or an exporter; None otherwise. Never raises: telemetry must not stop training."""
    env = os.environ if environ is None else environ
    try:
        config = run.config()  # the schema's defaults without the recipe loader (and its jsonschema import)
        launcher = config.launcher
        if not is_node_leader(launcher, env):
            return None
        obs = config.observability
        if obs.telemetry_interval_seconds == 0 and not obs.prometheus.enabled and not heartbeat.wanted(env):
            return None
        node = node or node_name(env)
        index = node_index_from_env(launcher, env) if node_index is None else node_index
        log = run.telemetry_log(attempt, node)
        log.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "rkit.runtime.telemetry.node", "--run", str(run.path), "--attempt", str(attempt),
                "--node", node, "--node-index", str(index), "--parent-pid", str(os.getpid())]
        with os.fdopen(open_for_writing(log), "ab") as out:
            # Same process group as the agent: a backend that stops the rank's group stops this too.
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=dict(env), close_fds=True)
    except Exception as exc:  # noqa: BLE001 - a broken telemetry set-up is reported, training goes on
        sys.stderr.write(f"rkit: warning: node telemetry not started: {type(exc).__name__}: {exc}\n")
        return None


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel for SIGTERM when the parent exits (Linux); the main loop also polls getppid()."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # it died before prctl took effect
        sys.exit(0)


def start_exporter(run: RunDir, node: str, index: int, settings: Observability, attempt: int) -> Any:
    from rkit.runtime.telemetry.exporter import serve
    from rkit.runtime.telemetry.exposure import insecure_warning

    prom = settings.prometheus
    port = prom.port + index if prom.port and prom.port + index <= 65535 else 0
    scope = {"nodes": [node], "training": index == 0, "events": index == 0,
             "tls_cert": prom.tls_cert, "tls_key": prom.tls_key}
    if (warning := insecure_warning(prom.interface, prom.tls_cert, bool(prom.insecure))) is not None:
        sys.stderr.write(warning + "\n")
        run.emit(EV.EXPORTER_INSECURE, attempt=attempt, node=node, interface=prom.interface)
    try:
        exporter = serve(run, interface=prom.interface, port=port, **scope)
    except RkitError:
        if not port:
            raise
        # A busy port (another run on this node, a previous attempt's exporter not yet gone) must not cost
        # this attempt its metrics: any free port, written to exporter.json like any other.
        sys.stderr.write(f"rkit: port {port} on {prom.interface} is not available; serving on a free port\n")
        exporter = serve(run, interface=prom.interface, port=0, **scope)
    run.exporter_file(node).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run.exporter_file(node), {
        "node": node, "node_index": index, "attempt": attempt, "pid": os.getpid(), "host": exporter.host,
        "port": exporter.port, "requested_port": port, "url": exporter.url})
    return exporter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rkit.runtime.telemetry.node", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, type=Path)
    parser.add_argument("--attempt", required=True, type=int)
    parser.add_argument("--node", required=True)
    parser.add_argument("--node-index", type=int, default=0)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = parser.parse_args(argv)
    parent = os.getppid() if args.parent_pid is None else args.parent_pid
    die_with_parent(parent)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        os.nice(NICENESS)
    except OSError:
        pass

    run = RunDir(args.run)
    settings = observability_settings(run)
    exporter = None
    if settings.prometheus.enabled:
        try:
            exporter = start_exporter(run, args.node, args.node_index, settings, args.attempt)
        except Exception as exc:  # noqa: BLE001 - e.g. no prometheus_client in this image: sample anyway
            sys.stderr.write(f"rkit: warning: no Prometheus exporter on {args.node}: {exc}\n")
    # The heartbeat first: it needs only the standard library, and a node whose beats never start looks silent.
    beats = heartbeat.start_sender(args.node, args.attempt, os.environ, stop)
    sampler_thread = None
    if settings.telemetry_interval_seconds:
        try:
            from rkit.runtime.telemetry.health import HealthSampler

            sampler = HealthSampler(run, attempt=args.attempt, node=args.node,
                                    disk_low_fraction=settings.disk_low_fraction)
        except ImportError as exc:  # an image without psutil: beat (and serve) anyway
            sys.stderr.write(f"rkit: warning: no health samples on {args.node}: {exc} (the image lacks psutil)\n")
        else:
            sampler_thread = threading.Thread(target=sampler.run_forever, name="rkit-health", daemon=True,
                                              args=(float(settings.telemetry_interval_seconds), stop))
            sampler_thread.start()

    if exporter is None and sampler_thread is None and beats is None:
        return 0  # nothing asked for (or nothing could start): no idle process beside the trainer
    while not stop.wait(PARENT_POLL_SECONDS):
        if os.getppid() != parent:
            break
    stop.set()
    for thread in (sampler_thread, beats):
        if thread is not None:
            thread.join(timeout=5)
    if exporter is not None:
        exporter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
