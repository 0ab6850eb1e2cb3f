"""A real Prometheus scrapes a real tiny training run's node exporter; `rkit metrics serve` on the finished run.

One training run (60 steps, default observability settings but a 1 s health sample) serves the whole module.
"""

from __future__ import annotations

import ipaddress
import json
import re
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rkit.contract.rundir import RunDir
from rkit.runtime.telemetry.metrics import merged
from rkit.runtime.telemetry.node import node_name

from ..conftest import TINY, free_port, require_maxtext, require_prometheus, wait_until

pytestmark = [pytest.mark.maxtext, pytest.mark.slow]

NAME = "prom"
STEPS = 60
START_TIMEOUT = 420  # imports, jax.distributed and XLA compilation on a small shared CPU


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@dataclass
class LiveRun:
    run: RunDir
    training: subprocess.Popen
    training_log: Path
    prometheus: subprocess.Popen
    prometheus_url: str
    exporter: dict

    def query(self, promql: str) -> list[dict]:
        url = f"{self.prometheus_url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        body = get_json(url)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def training_output(self) -> str:
        return self.training_log.read_text(errors="replace")[-4000:]


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> LiveRun:
    require_maxtext()
    prometheus_bin = require_prometheus()
    workspace = tmp_path_factory.mktemp("prometheus") / "a prometheus workspace"
    workspace.mkdir()
    runs = workspace / "runs"
    log = workspace / "training.log"
    with open(log, "wb") as out:
        training = subprocess.Popen(
            [sys.executable, "-m", "rkit.cli", "run", str(TINY), "-o", f"name={NAME}", "-o", f"runs_dir={runs}",
             "-o", f"trainer.steps={STEPS}", "-o", "observability.telemetry_interval_seconds=1", "--quiet"],
            cwd=workspace, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    run = RunDir(runs / NAME)
    prometheus = None
    try:
        # The node process writes where its exporter listens (9400 by default, a free port if that is taken).
        exporter = wait_until(lambda: read_json(run.exporter_file(node_name())), START_TIMEOUT,
                              "the node exporter's address", every=0.25, alive=training,
                              log=lambda: log.read_text())
        data = workspace / "prometheus data"
        config = workspace / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "rkit",
                                "static_configs": [{"targets": [f"{exporter['host']}:{exporter['port']}"]}]}]}))
        web = f"127.0.0.1:{free_port()}"
        with open(workspace / "prometheus.log", "wb") as out:
            prometheus = subprocess.Popen(
                [prometheus_bin, f"--config.file={config}", f"--storage.tsdb.path={data}",
                 f"--web.listen-address={web}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://{web}/-/ready", timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False

        wait_until(ready, 60, "Prometheus to be ready", every=0.25, alive=prometheus,
                   log=lambda: (workspace / "prometheus.log").read_text())
        yield LiveRun(run, training, log, prometheus, f"http://{web}", exporter)
    finally:
        if prometheus is not None and prometheus.poll() is None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        try:
            training.wait(timeout=600)
        except subprocess.TimeoutExpired:
            training.send_signal(signal.SIGINT)
            training.wait(timeout=60)


def test_exporter_and_jax_coordinator_listen_on_loopback_only(live: LiveRun):
    assert live.exporter["host"] == "127.0.0.1"
    addresses = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not addresses:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    # Rank 0 hosts JAX's coordination service (JAX binds every interface unless told otherwise).
    pids = wait_until(lambda: (read_json(live.run.attempt_dir(1) / "attempt.json") or {}).get("pids"), 60,
                      "the ranks' pids", every=0.25)
    rank0 = psutil.Process(int(pids["0"]))
    coordinator = int(rank0.environ()["RKIT_COORDINATOR"].rsplit(":", 1)[1])

    def listening() -> list:  # rank 0 starts the service after its imports, well after the node's exporter
        return [c.laddr for c in rank0.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == coordinator]

    bound = [ipaddress.ip_address(a.ip) for a in wait_until(listening, 300, "rank 0's coordination service",
                                                            alive=live.training)]
    assert live.training.poll() is None, "the run ended before its exporter could be checked"
    assert all((getattr(ip, "ipv4_mapped", None) or ip).is_loopback for ip in bound), bound
    with urllib.request.urlopen(f"http://127.0.0.1:{live.exporter['port']}/metrics", timeout=10) as response:
        assert response.status == 200  # it is up on loopback...
    for address in addresses:
        for port in (live.exporter["port"], coordinator):
            with pytest.raises(ConnectionRefusedError):  # ...and refused on every other address of this machine
                socket.create_connection((address, port), timeout=5).close()


def test_prometheus_scrapes_the_step_as_it_advances(live: LiveRun):
    """Two different step values > 0 over time, with the run, node and rank labels, from a real scrape."""
    found: dict[float, dict] = {}

    def advanced() -> bool:
        for series in live.query('rkit_step{job="rkit",rank="0"}'):
            found.setdefault(float(series["value"][1]), series["metric"])
        return len([v for v in found if v > 0]) >= 2

    wait_until(advanced, 600, "two different scraped steps", every=0.25, alive=live.training,
               log=live.training_output)
    labels = next(iter(found.values()))
    assert labels["run"] == NAME and labels["rank"] == "0" and labels["node"] == node_name()
    assert labels["instance"] == f"{live.exporter['host']}:{live.exporter['port']}"
    print(f"scraped rkit_step values: {sorted(found)}; labels {labels}")
    # Node health from the same exporter.
    memory = live.query('rkit_node_memory_total_bytes{job="rkit"}')
    assert memory and float(memory[0]["value"][1]) == psutil.virtual_memory().total
    assert memory[0]["metric"]["node"] == node_name()
    assert live.query('rkit_attempts_started_total{job="rkit"}')[0]["value"][1] == "1"


def test_metrics_serve_on_the_finished_run(live: LiveRun):
    assert live.training.wait(timeout=900) == 0, live.training_output()
    final = max(merged(live.run, rank=0))
    assert final == STEPS - 1
    serve = subprocess.Popen([sys.executable, "-m", "rkit.cli", "metrics", "serve", str(live.run.path), "--port", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = serve.stdout.readline()
        match = re.search(r"(http://127\.0\.0\.1:\d+/metrics)", first)
        assert match, (first, serve.stderr.read() if serve.poll() is not None else "")
        with urllib.request.urlopen(match.group(1), timeout=10) as response:
            text = response.read().decode()
    finally:
        serve.send_signal(signal.SIGTERM)  # (SIGINT is ignored when the suite itself runs in the background)
        assert serve.wait(timeout=30) == 0
    metrics = {f.name: f.samples for f in text_string_to_metric_families(text)}
    steps = {s.labels["rank"]: s.value for s in metrics["rkit_step"]}
    assert steps == {"0": final, "1": final}
    assert all(s.labels["run"] == NAME and s.labels["node"] == node_name() for s in metrics["rkit_step"])
    ended = {s.labels["cause"]: s.value for s in metrics["rkit_attempts_ended"]}
    assert ended == {"completed": 1.0}
    assert not metrics["rkit_attempt_failures"]
    assert [s.labels["node"] for s in metrics["rkit_node_cpu_percent"]] == [node_name()]
