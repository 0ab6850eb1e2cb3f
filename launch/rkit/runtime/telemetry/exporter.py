"""Prometheus exporter: a run directory's files as metrics, for a live run (one per node) or a finished one
(`rkit metrics serve`).

It reads only the run directory: metrics/<rank>.jsonl (training gauges per rank), telemetry/<node>.jsonl (node
health) and events.jsonl (attempts, failures by cause, restarts). Each file is followed from the offset where
the previous scrape stopped, so a scrape costs what was appended since, not the size of the file. It has a
registry of its own (never prometheus_client's global one) and binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import ssl
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler, make_wsgi_app
from prometheus_client.registry import Collector

from rkit.contract.errors import RkitError
from rkit.contract.events import EV
from rkit.contract.rundir import JsonlTail, RunDir
from rkit.runtime.telemetry import metrics as step_metrics
from rkit.runtime.telemetry.exposure import exposure, insecure_warning

DEFAULT_INTERFACE = "127.0.0.1"
DEFAULT_PORT = 9400
NOT_FAILURES = ("completed", "interrupted")  # attempt causes that are not a failure of the attempt
HANDSHAKE_SECONDS = 10.0  # a client's whole TLS handshake, and then each read or write of its connection
CONNECTION_SECONDS = 30.0  # a connection's whole life (handshake, request, answer); then it is cut

# rkit line field -> (metric name, help). Units are in the names (Prometheus convention).
TRAINING_GAUGES = {
    "step": ("rkit_step", "Newest training step written by this rank."),
    "loss": ("rkit_loss", "Training loss at the newest step."),
    "step_time": ("rkit_step_time_seconds", "Duration of the newest step."),
    "tokens_per_sec_per_device": ("rkit_tokens_per_second_per_device", "Training throughput per device."),
    "tflops_per_device": ("rkit_tflops_per_device", "Model TFLOP/s per device at the newest step."),
    "mfu": ("rkit_mfu_ratio", "Model FLOPs utilisation (0-1) at the newest step."),
    "device_memory_bytes": ("rkit_device_memory_bytes", "Device memory in use."),
    "device_memory_peak_bytes": ("rkit_device_memory_peak_bytes", "Peak device memory in use."),
    "host_rss_bytes": ("rkit_host_rss_bytes", "Resident memory of the training process."),
    "attempt": ("rkit_attempt", "Attempt that wrote the newest step."),
    "t": ("rkit_step_timestamp_seconds", "Unix time the newest step was written."),
}
NODE_GAUGES = {
    "cpu_percent": ("rkit_node_cpu_percent", "CPU utilisation of the node, all cores (0-100)."),
    "load1": ("rkit_node_load1", "1-minute load average."),
    "load5": ("rkit_node_load5", "5-minute load average."),
    "load15": ("rkit_node_load15", "15-minute load average."),
    "mem_used_bytes": ("rkit_node_memory_used_bytes", "Memory in use (total - available)."),
    "mem_total_bytes": ("rkit_node_memory_total_bytes", "Physical memory."),
    "mem_percent": ("rkit_node_memory_percent", "Memory in use (0-100)."),
    "attempt": ("rkit_node_attempt", "Attempt of the newest health sample."),
    "t": ("rkit_node_sample_timestamp_seconds", "Unix time of the newest health sample."),
}
DISK_GAUGES = {
    "free_bytes": ("rkit_node_disk_free_bytes", "Free space on the run's or checkpoints' file system."),
    "total_bytes": ("rkit_node_disk_total_bytes", "Size of the run's or checkpoints' file system."),
}
GPU_GAUGES = {
    "utilization_percent": ("rkit_gpu_utilization_percent", "GPU busy (0-100)."),
    "memory_used_bytes": ("rkit_gpu_memory_used_bytes", "GPU memory in use."),
    "memory_total_bytes": ("rkit_gpu_memory_total_bytes", "GPU memory."),
    "temperature_c": ("rkit_gpu_temperature_celsius", "GPU temperature (junction/hotspot where reported)."),
    "power_w": ("rkit_gpu_power_watts", "GPU power draw."),
    "ecc_errors": ("rkit_gpu_ecc_errors", "Uncorrectable ECC errors since the driver loaded."),
}


def _value(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


@dataclass
class _EventTally:
    attempts_started: int = 0
    current_attempt: int = 0
    restarts: int = 0
    ended: Counter[str] = field(default_factory=Counter)
    events: Counter[str] = field(default_factory=Counter)

    def add(self, event: dict) -> None:
        name = str(event.get("event", ""))
        self.events[name] += 1
        if name == EV.ATTEMPT_STARTED:
            self.attempts_started += 1
            attempt = event.get("attempt")
            if isinstance(attempt, int):
                self.current_attempt = max(self.current_attempt, attempt)
        elif name == EV.ATTEMPT_ENDED:
            self.ended[str(event.get("cause"))] += 1
            if event.get("decision") in ("restart", "requeue"):
                self.restarts += 1


class RunCollector(Collector):
    """Collects one run's metrics from its files, incrementally.

    nodes: only these nodes' health (None: every node with a telemetry file);
    training / events: include the per-rank training gauges / the run's event counters. A node's exporter
    serves its own health, and the first node adds training and events, so that summing over the nodes of an
    attempt counts each series once.
    """

    def __init__(self, run: RunDir, *, nodes: Iterable[str] | None = None, training: bool = True,
                 events: bool = True):
        self.run = run
        self.label = run.name
        self.nodes = None if nodes is None else set(nodes)
        self.training, self.events = training, events
        self._lock = threading.Lock()  # scrapes run in threads of their own
        self._rank_tails: dict[int, JsonlTail] = {}
        self._rank_latest: dict[int, dict] = {}
        self._node_tails: dict[str, JsonlTail] = {}
        self._node_latest: dict[str, dict] = {}
        self._events_tail = JsonlTail(run.events_file)
        self._tally = _EventTally()

    def describe(self) -> list[Metric]:
        return []  # names are dynamic; registering must not read the run

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self.refresh()
            families = list(self._families())
        yield from families

    # ------------------------------------------------------------ reading

    def refresh(self) -> None:
        """Read what was appended to the run's files since the previous call."""
        if self.training:
            for rank in step_metrics.ranks(self.run):
                tail = self._rank_tails.setdefault(rank, JsonlTail(self.run.metrics_file(rank)))
                for raw in tail.poll_raw():
                    line = step_metrics.normalize(raw)
                    if line is not None:
                        self._rank_latest[rank] = line
        for node, path in self._telemetry_files():
            tail = self._node_tails.setdefault(node, JsonlTail(path))
            for sample in tail.poll_raw():
                self._node_latest[node] = sample
        if self.events:
            for event in self._events_tail.poll_raw():
                self._tally.add(event)

    def _telemetry_files(self) -> list[tuple[str, Any]]:
        directory = self.run.telemetry_dir
        try:
            names = sorted(os.listdir(directory))
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            node = name[: -len(".jsonl")]
            if name.endswith(".jsonl") and node and not name.startswith(".") and \
                    (self.nodes is None or node in self.nodes):
                out.append((node, directory / name))
        return out

    # ------------------------------------------------------------ metrics

    def _families(self) -> Iterator[Metric]:
        if self.training:
            yield from self._training_families()
        yield from self._node_families()
        if self.events:
            yield from self._event_families()

    def _training_families(self) -> Iterator[Metric]:
        labels = ["run", "node", "rank"]
        for key, (name, doc) in TRAINING_GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=labels)
            for rank, line in sorted(self._rank_latest.items()):
                value = _value(line.get(key))
                if value is not None:
                    family.add_metric([self.label, str(line.get("node") or ""), str(rank)], value)
            yield family

    def _node_families(self) -> Iterator[Metric]:
        latest = sorted(self._node_latest.items())
        for key, (name, doc) in NODE_GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=["run", "node"])
            for node, sample in latest:
                value = _value(sample.get(key))
                if value is not None:
                    family.add_metric([self.label, node], value)
            yield family
        info = GaugeMetricFamily("rkit_node_gpu_backend_info", "Where the node's GPU numbers come from "
                                 "(nvml, amdsmi, sysfs, rocm-smi, absent).", labels=["run", "node", "gpu_backend"])
        for node, sample in latest:
            info.add_metric([self.label, node, str(sample.get("gpu_backend", "absent"))], 1.0)
        yield info
        for key, (name, doc) in DISK_GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=["run", "node", "fs", "path"])
            for node, sample in latest:
                disks = sample.get("disks") if isinstance(sample.get("disks"), dict) else {}
                for fs, disk in sorted(disks.items()):
                    value = _value(disk.get(key)) if isinstance(disk, dict) else None
                    if value is not None:
                        family.add_metric([self.label, node, fs, str(disk.get("path", ""))], value)
            yield family
        for key, (name, doc) in GPU_GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=["run", "node", "gpu", "name"])
            for node, sample in latest:
                for gpu in sample.get("gpus") or []:
                    value = _value(gpu.get(key)) if isinstance(gpu, dict) else None
                    if value is not None:
                        family.add_metric([self.label, node, str(gpu.get("index")), str(gpu.get("name") or "")],
                                          value)
            yield family

    def _event_families(self) -> Iterator[Metric]:
        tally, run = self._tally, [self.label]
        started = CounterMetricFamily("rkit_attempts_started", "Attempts started.", labels=["run"])
        started.add_metric(run, tally.attempts_started)
        yield started
        current = GaugeMetricFamily("rkit_current_attempt", "Newest attempt started.", labels=["run"])
        current.add_metric(run, tally.current_attempt)
        yield current
        ended = CounterMetricFamily("rkit_attempts_ended", "Attempts ended, by cause.", labels=["run", "cause"])
        failures = CounterMetricFamily("rkit_attempt_failures", "Attempts that failed, by cause (every ending "
                                       "but completed and interrupted).", labels=["run", "cause"])
        for cause, count in sorted(tally.ended.items()):
            ended.add_metric([self.label, cause], count)
            if cause not in NOT_FAILURES:
                failures.add_metric([self.label, cause], count)
        yield ended
        yield failures
        restarts = CounterMetricFamily("rkit_restarts", "Attempts the supervisor restarted or requeued.",
                                       labels=["run"])
        restarts.add_metric(run, tally.restarts)
        yield restarts
        events = CounterMetricFamily("rkit_events", "Run events (events.jsonl), by name.", labels=["run", "event"])
        for name, count in sorted(tally.events.items()):
            events.add_metric([self.label, name], count)
        yield events


def registry_for(run: RunDir, **scope: Any) -> CollectorRegistry:
    """A registry of its own holding one RunCollector (never the process-wide default registry)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(run, **scope))
    return registry


@dataclass
class Exporter:
    """A running HTTP server for one registry (a daemon thread); close() stops it and frees the port."""

    server: Any
    thread: threading.Thread
    tls: bool = False

    @property
    def host(self) -> str:
        return str(self.server.server_address[0])

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class _Server(ThreadingWSGIServer):
    """prometheus-client's server (a thread per connection), with TLS done in that thread: the listening socket
    stays plain, so a client that never finishes its handshake (or its request) holds only its own thread, until
    HANDSHAKE_SECONDS / CONNECTION_SECONDS, and never the accept loop (prometheus-client wraps the listening
    socket, so one silent client there stops every scrape)."""

    tls: ssl.SSLContext | None = None

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        conn = [request]  # the socket to cut when the connection outlives CONNECTION_SECONDS (the TLS one, once made)
        cut = threading.Timer(CONNECTION_SECONDS, _cut, (conn,))
        cut.daemon = True
        cut.start()
        try:
            if self.tls is not None:
                request.settimeout(HANDSHAKE_SECONDS)
                conn[0] = self.tls.wrap_socket(request, server_side=True)
            self.finish_request(conn[0], client_address)
        except Exception:
            self.handle_error(conn[0], client_address)
        finally:
            cut.cancel()
            self.shutdown_request(conn[0])

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client gone, too slow or not speaking TLS: not reported
            super().handle_error(request, client_address)


def _cut(conn: list) -> None:
    try:  # the plain socket's shutdown (an SSLSocket's would drop its TLS state under the thread reading it)
        socket.socket.shutdown(conn[0], socket.SHUT_RDWR)
    except OSError:
        pass


def _tls_context(cert: str, key: str | None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def serve(run: RunDir, *, interface: str = DEFAULT_INTERFACE, port: int = DEFAULT_PORT,
          nodes: Iterable[str] | None = None, training: bool = True, events: bool = True,
          tls_cert: str | None = None, tls_key: str | None = None) -> Exporter:
    """Serve `run`'s metrics at http(s)://interface:port/metrics (port 0: any free port; HTTPS with a
    certificate and key)."""
    registry = registry_for(run, nodes=nodes, training=training, events=events)
    try:
        tls = _tls_context(tls_cert, tls_key) if tls_cert else None
    except OSError as exc:
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc)
        raise RkitError(f"TLS certificate {tls_cert} / key {tls_key}: cannot be loaded ({reason}); give a PEM "
                        "certificate and the key that belongs to it.") from None
    try:
        family, host = _get_best_family(interface, port)
        server_class = type("_Server", (_Server,), {"address_family": family, "tls": tls})
        server = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_SilentHandler)
    except OSError as exc:
        raise bind_error(interface, port, exc) from None
    thread = threading.Thread(target=server.serve_forever, name="rkit-exporter", daemon=True)
    thread.start()
    return Exporter(server, thread, tls=tls is not None)


def bind_error(interface: str, port: int, exc: OSError) -> RkitError:
    if exc.errno == errno.EADDRINUSE:
        return RkitError(f"port {port} on {interface} is already in use (another exporter, a live run's node "
                         f"exporter, or another program). Pick another with --port N, or --port 0 for any free port.")
    if isinstance(exc, PermissionError) or exc.errno == errno.EACCES:
        return RkitError(f"not allowed to listen on port {port} (ports below 1024 need root). "
                         "Pick another with --port N (default 9400), or --port 0 for any free port.")
    reason = exc.strerror or str(exc)
    return RkitError(f"cannot listen on {interface}:{port}: {reason}. Give an address of this machine with "
                     "--interface (127.0.0.1: this machine only, the default; 0.0.0.0: every interface).")


def serve_until_interrupted(run: RunDir, *, interface: str = DEFAULT_INTERFACE, port: int = DEFAULT_PORT,
                            echo: Callable[[str], None] = print, tls_cert: str | None = None,
                            tls_key: str | None = None, insecure: bool = False) -> None:
    """`rkit metrics serve`: every node, rank and event of the run, until Ctrl-C or SIGTERM (both exit 0)."""
    why = exposure(interface, tls_cert, tls_key, insecure, tls_hint="pass --tls-cert and --tls-key",
                   insecure_hint="pass --insecure")
    if why is not None:
        raise RkitError(f"--interface {interface}: {why}")
    if (warning := insecure_warning(interface, tls_cert, insecure)) is not None:
        echo(warning)
    exporter = serve(run, interface=interface, port=port, tls_cert=tls_cert, tls_key=tls_key)
    stop = threading.Event()
    # SIGTERM as well as SIGINT: a process started in the background by a shell ignores SIGINT.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    echo(f"rkit: serving {run.path}'s metrics at {exporter.url} (Ctrl-C to stop)")
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        exporter.close()
