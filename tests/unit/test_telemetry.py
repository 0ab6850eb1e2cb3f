"""Node health sampler, the Prometheus exporter over a synthetic run directory, the per-node process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rkit.contract.errors import RkitError
from rkit.contract.rundir import RunDir, read_jsonl
from rkit.runtime.telemetry import exporter, health, node

from ..conftest import rkit, wait_until

# ---------------------------------------------------------------- fixtures


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    """An empty run directory under a path with spaces and a quote."""
    path = tmp_path / "it's a run dir" / "tele run"
    path.mkdir(parents=True)
    (path / "resolved.json").write_text(json.dumps({"name": "tele run", "launcher": "local", "observability": {
        "telemetry_interval_seconds": 0.2, "disk_low_fraction": 0.05,
        "prometheus": {"enabled": True, "interface": "127.0.0.1", "port": 0}}}))
    return RunDir(path)


def append(path: Path, *lines: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        for line in lines:
            fh.write(json.dumps(line) + "\n")


def families(registry) -> dict[str, list]:
    """name -> samples, from the text a scrape returns (the parser Prometheus' Python client ships)."""
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: list, **labels: str) -> float:
    hits = [s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (labels, samples)
    return hits[0]


# ---------------------------------------------------------------- sampler


def no_gpus_here() -> bool:
    return not list(Path("/dev").glob("nvidia[0-9]*")) and \
        not list(Path("/sys/class/drm").glob("card*/device/gpu_busy_percent"))


def test_sample_on_this_machine(tmp_path: Path):
    paths = {"run": tmp_path, "checkpoints": tmp_path / "not yet" / "checkpoints"}
    health.sample(paths)
    time.sleep(health.MIN_CPU_INTERVAL)  # CPU use is measured between two samples: let a window pass
    s = health.sample(paths)
    assert s["gpu_backend"] in ("nvml", "amdsmi", "sysfs", "rocm-smi", "absent")
    if no_gpus_here():
        assert s["gpu_backend"] == "absent" and s["gpus"] == []
    assert abs(s["t"] - time.time()) < 60
    assert 0.0 <= s["cpu_percent"] <= 100.0
    assert min(s["load1"], s["load5"], s["load15"]) >= 0
    assert 0 < s["mem_used_bytes"] <= s["mem_total_bytes"] and 0 < s["mem_percent"] <= 100
    run_fs, ckpt_fs = s["disks"]["run"], s["disks"]["checkpoints"]
    assert 0 <= run_fs["free_bytes"] <= run_fs["total_bytes"] and run_fs["path"] == str(tmp_path)
    # A checkpoint directory that does not exist yet is measured on its nearest existing parent.
    assert ckpt_fs["total_bytes"] == run_fs["total_bytes"]
    json.dumps(s, allow_nan=False)


def test_nvml_absent_is_silent(capsys):
    def no_module(name: str):
        raise ImportError(f"No module named {name!r}")

    def no_driver(name: str):
        def init():
            raise OSError("NVML Shared Library Not Found")
        return types.SimpleNamespace(nvmlInit=init)

    assert health.NvmlProbe.open(import_module=no_module) is None
    assert health.NvmlProbe.open(import_module=no_driver) is None
    assert health.AmdSmiProbe.open(import_module=no_module) is None
    assert capsys.readouterr() == ("", "")


def test_nvml_values_are_converted():
    """NVML's units (mW, bytes) become the sample's; what a GPU does not support is null, asked once."""
    calls = []

    def ecc(*_):
        calls.append("ecc")
        raise RuntimeError("NVMLError_NotSupported")

    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=87, memory=40),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=2 << 30, total=141 << 30, free=0),
        nvmlDeviceGetTemperature=lambda h, sensor: 61, nvmlDeviceGetPowerUsage=lambda h: 412345,
        nvmlDeviceGetTotalEccErrors=ecc, NVML_TEMPERATURE_GPU=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0)
    probe = health.NvmlProbe.open(import_module=lambda name: nvml)
    first, second = probe.read(), probe.read()
    assert first == second == [{"index": 0, "name": "NVIDIA H200", "utilization_percent": 87.0,
                                "memory_used_bytes": 2 << 30, "memory_total_bytes": 141 << 30,
                                "temperature_c": 61.0, "power_w": 412.345, "ecc_errors": None}]
    assert calls == ["ecc"]


def test_sysfs_absent_and_rocm_smi_absent(tmp_path: Path):
    assert health.SysfsProbe.open(tmp_path / "no drm") is None
    (tmp_path / "drm" / "card0-DP-1").mkdir(parents=True)  # a connector, not a GPU
    (tmp_path / "drm" / "card1" / "device").mkdir(parents=True)  # a GPU without amdgpu's files
    assert health.SysfsProbe.open(tmp_path / "drm") is None
    assert health.RocmSmiProbe.open(exe=str(tmp_path / "no rocm-smi")) is None


def test_sysfs_reads_an_amdgpu_tree(tmp_path: Path):
    device = tmp_path / "d r m" / "card1" / "device"
    hwmon = device / "hwmon" / "hwmon3"
    hwmon.mkdir(parents=True)
    files = {device / "gpu_busy_percent": "97\n", device / "mem_info_vram_used": str(40 << 30),
             device / "mem_info_vram_total": str(192 << 30), device / "product_name": "AMD Instinct MI300X",
             hwmon / "temp1_label": "edge", hwmon / "temp1_input": "40000", hwmon / "temp2_label": "junction",
             hwmon / "temp2_input": "71000", hwmon / "power1_average": "650000000",
             device / "ras" / "umc_err_count": "ue: 2\nce: 17\n"}
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    probe = health.SysfsProbe.open(tmp_path / "d r m")
    assert probe is not None and probe.name == "sysfs"
    assert probe.read() == [{"index": 0, "name": "AMD Instinct MI300X", "utilization_percent": 97.0,
                             "memory_used_bytes": 40 << 30, "memory_total_bytes": 192 << 30,
                             "temperature_c": 71.0, "power_w": 650.0, "ecc_errors": 2}]


def test_detection_degrades_to_absent_without_output(tmp_path: Path, capfd):
    probe = health.detect_gpu(sysfs_root=tmp_path, environ={health.GPU_BACKEND_ENV: "sysfs"})
    assert probe is health.ABSENT
    assert health.detect_gpu(environ={health.GPU_BACKEND_ENV: "absent"}) is health.ABSENT
    s = health.sample({"run": tmp_path}, gpu=probe)
    assert s["gpu_backend"] == "absent" and s["gpus"] == []
    assert health.sample({"run": tmp_path}, gpu=probe)["cpu_percent"] is None  # no window to measure over
    assert capfd.readouterr() == ("", "")


def test_sampler_appends_one_line_per_tick(run: RunDir):
    sampler = health.HealthSampler(run, attempt=3, node="node-a", gpu=health.ABSENT)
    for _ in range(3):
        sampler.tick()
    lines = [json.loads(x) for x in (run.path / "telemetry" / "node-a.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    assert all(x["node"] == "node-a" and x["attempt"] == 3 and x["gpu_backend"] == "absent" for x in lines)
    assert lines[0]["t"] <= lines[1]["t"] <= lines[2]["t"]
    assert set(lines[0]["disks"]) == {"run", "checkpoints"}


def test_disk_low_is_one_event_per_file_system_per_attempt(run: RunDir):
    """Threshold 1.0: every file system is "low". Run and checkpoints share one here: one event, once,
    even with a second node sampling the same shared file system."""
    a = health.HealthSampler(run, attempt=1, node="node-a", disk_low_fraction=1.0, gpu=health.ABSENT)
    b = health.HealthSampler(run, attempt=1, node="node-b", disk_low_fraction=1.0, gpu=health.ABSENT)
    for _ in range(3):
        a.tick()
        b.tick()
    low = [e for e in run.events() if e["event"] == "disk.low"]
    assert len(low) == 1
    event = low[0]
    assert event["attempt"] == 1 and event["node"] == "node-a" and event["fs"] == "run"
    assert 0 <= event["free_bytes"] <= event["total_bytes"] and event["fraction"] < 1.0
    health.HealthSampler(run, attempt=2, node="node-a", disk_low_fraction=1.0, gpu=health.ABSENT).tick()
    assert [e["attempt"] for e in run.events() if e["event"] == "disk.low"] == [1, 2]
    health.HealthSampler(run, attempt=3, node="node-a", disk_low_fraction=0.0, gpu=health.ABSENT).tick()
    assert len([e for e in run.events() if e["event"] == "disk.low"]) == 2


def test_sampler_cost_is_small(tmp_path: Path):
    """The sampler runs beside training every few seconds: one sample costs well under 50 ms of CPU."""
    paths = {"run": tmp_path, "checkpoints": tmp_path}
    health.sample(paths, gpu=health.ABSENT)
    start = time.process_time()
    for _ in range(50):
        health.sample(paths, gpu=health.ABSENT)
    assert (time.process_time() - start) / 50 < 0.05


# ---------------------------------------------------------------- exporter


def rkit_line(step: int, **extra) -> dict:
    line = {"t": 1000.0 + step, "attempt": 2, "rank": 0, "node": "node-a", "step": step, "loss": 5.0 - step / 10,
            "step_time": 0.25, "tokens_per_sec_per_device": 256.0, "tflops_per_device": 1.5, "mfu": None,
            "device_memory_bytes": None, "device_memory_peak_bytes": None, "host_rss_bytes": 123456789}
    line.update(extra)
    return line


def synthetic_run(run: RunDir) -> None:
    append(run.metrics_file(0), rkit_line(1), rkit_line(2))
    # rank 1 still has MaxText's raw lines (runs from before the rkit line format)
    append(run.metrics_file(1), {"step": 2, "learning/loss": 4.5, "perf/step_time_seconds": 0.5,
                                 "perf/per_device_tokens_per_sec": 128.0, "perf/per_device_tflops": 0.75})
    gpu = {"index": 0, "name": "AMD Instinct MI300X", "utilization_percent": 97.0, "memory_used_bytes": 1 << 30,
           "memory_total_bytes": 192 << 30, "temperature_c": 71.0, "power_w": 650.0, "ecc_errors": 0}
    append(run.path / "telemetry" / "node-a.jsonl",
           {"t": 1001.0, "node": "node-a", "attempt": 2, "cpu_percent": 12.5, "load1": 1.0, "load5": 0.5,
            "load15": 0.25, "mem_used_bytes": 1 << 30, "mem_total_bytes": 8 << 30, "mem_percent": 12.5,
            "disks": {"run": {"path": str(run.path), "free_bytes": 10, "total_bytes": 100},
                      "checkpoints": {"path": str(run.checkpoints), "free_bytes": 10, "total_bytes": 100}},
            "gpu_backend": "sysfs", "gpus": [gpu]})
    append(run.events_file,
           {"event": "run.submitted"}, {"event": "attempt.started", "attempt": 1},
           {"event": "attempt.ended", "attempt": 1, "cause": "task_signal", "decision": "restart"},
           {"event": "attempt.started", "attempt": 2})
    (run.path / "telemetry" / "node-a.exporter.json").write_text("{}")  # not a health file


def test_exporter_text_parses_with_labels_and_units(run: RunDir):
    synthetic_run(run)
    registry = exporter.registry_for(run)
    got = families(registry)
    assert value(got["rkit_step"], run="tele run", node="node-a", rank="0") == 2
    assert value(got["rkit_step"], rank="1") == 2 and value(got["rkit_loss"], rank="1") == 4.5
    assert value(got["rkit_step_time_seconds"], rank="1") == 0.5
    assert value(got["rkit_tokens_per_second_per_device"], rank="0") == 256.0
    assert value(got["rkit_tflops_per_device"], rank="1") == 0.75
    assert value(got["rkit_host_rss_bytes"], rank="0") == 123456789
    assert value(got["rkit_attempt"], rank="0") == 2
    assert not got["rkit_mfu_ratio"]  # null: no series rather than a made-up 0
    assert value(got["rkit_node_cpu_percent"], node="node-a") == 12.5
    assert value(got["rkit_node_memory_total_bytes"], node="node-a") == 8 << 30
    assert value(got["rkit_node_disk_free_bytes"], fs="checkpoints", path=str(run.checkpoints)) == 10
    assert value(got["rkit_gpu_temperature_celsius"], node="node-a", gpu="0", name="AMD Instinct MI300X") == 71
    assert value(got["rkit_gpu_power_watts"], gpu="0") == 650
    assert value(got["rkit_node_gpu_backend_info"], gpu_backend="sysfs") == 1
    assert value(got["rkit_attempts_started"], run="tele run") == 2  # samples named ..._total
    assert got["rkit_attempts_started"][0].name == "rkit_attempts_started_total"
    assert value(got["rkit_attempt_failures"], cause="task_signal") == 1
    assert value(got["rkit_restarts"], run="tele run") == 1
    assert value(got["rkit_current_attempt"], run="tele run") == 2
    assert value(got["rkit_events"], event="attempt.started") == 2
    assert "node-a.exporter" not in json.dumps([s.labels for f in got.values() for s in f])

    # A scrape reads what was appended since the previous one.
    append(run.metrics_file(0), rkit_line(3, mfu=0.41))
    append(run.events_file, {"event": "attempt.ended", "attempt": 2, "cause": "completed", "decision": "finish"})
    got = families(registry)
    assert value(got["rkit_step"], rank="0") == 3 and value(got["rkit_mfu_ratio"], rank="0") == 0.41
    assert value(got["rkit_attempts_ended"], cause="completed") == 1
    assert [s.labels["cause"] for s in got["rkit_attempt_failures"]] == ["task_signal"]


def test_exporter_reads_files_incrementally(run: RunDir):
    synthetic_run(run)
    collector = exporter.RunCollector(run)
    collector.refresh()
    tail = collector._rank_tails[0]
    assert tail.offset == run.metrics_file(0).stat().st_size
    append(run.metrics_file(0), rkit_line(3))
    half = json.dumps(rkit_line(4))[:20]
    with open(run.metrics_file(0), "a") as fh:
        fh.write(half)  # a line still being written
    collector.refresh()
    assert collector._rank_latest[0]["step"] == 3
    with open(run.metrics_file(0), "a") as fh:
        fh.write(json.dumps(rkit_line(4))[20:] + "\n")
    collector.refresh()
    assert collector._rank_latest[0]["step"] == 4


def test_node_scope_serves_its_own_health_only(run: RunDir):
    synthetic_run(run)
    append(run.path / "telemetry" / "node-b.jsonl", {"t": 1.0, "node": "node-b", "cpu_percent": 1.0})
    got = families(exporter.registry_for(run, nodes=["node-b"], training=False, events=False))
    assert [s.labels["node"] for s in got["rkit_node_cpu_percent"]] == ["node-b"]
    assert "rkit_step" not in got and "rkit_attempts_started" not in got


def test_serve_on_loopback_and_port_in_use(run: RunDir):
    synthetic_run(run)
    served = exporter.serve(run, port=0)
    try:
        assert served.host == "127.0.0.1"
        text = urllib.request.urlopen(served.url, timeout=10).read().decode()
        assert 'rkit_step{node="node-a",rank="0",run="tele run"} 2.0' in text
        with pytest.raises(RkitError, match=f"port {served.port} on 127.0.0.1 is already in use.*--port"):
            exporter.serve(run, port=served.port)
    finally:
        served.close()
    with pytest.raises(RkitError, match="--interface"):
        exporter.serve(run, interface="192.0.2.1", port=0)  # TEST-NET-1: not an address of this machine


def test_cli_metrics_serve_errors(run: RunDir, tmp_path: Path):
    done = rkit("metrics", "serve", str(tmp_path / "no such run"), check=2)
    assert "not an rkit run directory" in done.stderr and "Traceback" not in done.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = rkit("metrics", "serve", str(run.path), "--port", str(port), check=2)
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr and "--port 0" in done.stderr


# ---------------------------------------------------------------- the node process


def test_node_leader_and_index():
    assert node.is_node_leader("local", {"RKIT_RANK": "0", "SLURM_LOCALID": "1"})
    assert not node.is_node_leader("local", {"RKIT_RANK": "1"})
    assert node.is_node_leader("slurm", {"SLURM_LOCALID": "0", "SLURM_PROCID": "8"})
    assert not node.is_node_leader("slurm", {"SLURM_LOCALID": "3"})
    assert node.node_index_from_env("slurm", {"SLURM_NODEID": "2"}) == 2
    assert node.node_index_from_env("local", {"SLURM_NODEID": "2"}) == 0
    assert node.node_name({"SLURMD_NODENAME": "gpu-017"}) == "gpu-017"


def test_non_leader_or_disabled_starts_nothing(run: RunDir):
    assert node.start_node_services(run, 1, environ={"RKIT_RANK": "1"}) is None
    resolved = json.loads(run.resolved.read_text())
    resolved["observability"].update(telemetry_interval_seconds=0, prometheus={"enabled": False})
    run.resolved.write_text(json.dumps(resolved))
    assert node.start_node_services(run, 1, environ={"RKIT_RANK": "0"}) is None
    # Started anyway (an old run without the section), it ends at once.
    subprocess.run([sys.executable, "-m", "rkit.runtime.telemetry.node", "--run", str(run.path), "--attempt", "1",
                    "--node", "n"], check=True, timeout=60)
    assert not (run.path / "telemetry").exists()


def read_exporter(run: RunDir, name: str):
    try:
        return json.loads(run.exporter_file(name).read_text())
    except (FileNotFoundError, ValueError):
        return None


def test_node_process_samples_serves_and_stops_on_sigterm(run: RunDir):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    resolved = json.loads(run.resolved.read_text())
    resolved["observability"]["prometheus"]["port"] = taken - 1  # node index 1 asks for port + 1: taken
    run.resolved.write_text(json.dumps(resolved))
    proc = node.start_node_services(run, 1, "node-a", 1, environ={**os.environ, "RKIT_RANK": "0"})
    assert proc is not None
    try:
        info = wait_until(lambda: read_exporter(run, "node-a"), 20, "exporter.json", every=0.05)
        assert info["host"] == "127.0.0.1" and info["attempt"] == 1 and info["pid"] == proc.pid
        assert info["requested_port"] == taken and info["port"] != taken  # a busy port: any free one instead
        wait_until(lambda: len(list(read_jsonl(run.telemetry_file("node-a")))) >= 2, 20, "samples", every=0.05)
        text = urllib.request.urlopen(info["url"], timeout=10).read().decode()
        assert 'rkit_node_cpu_percent{node="node-a",run="tele run"}' in text
        assert psutil.Process(proc.pid).nice() >= node.NICENESS
    finally:
        busy.close()
        proc.terminate()
        assert proc.wait(timeout=10) == 0


PARENT = """
import os, sys
from rkit.contract.rundir import RunDir
from rkit.runtime.telemetry.node import start_node_services
proc = start_node_services(RunDir(sys.argv[1]), 1, "node-b", 1, environ={**os.environ, "RKIT_RANK": "0"})
print(proc.pid, flush=True)
"""


def test_node_process_exits_with_its_parent(run: RunDir):
    parent = subprocess.run([sys.executable, "-c", PARENT, str(run.path)], capture_output=True, text=True,
                            timeout=60, check=True)
    child = psutil.Process(int(parent.stdout.strip()))
    try:
        child.wait(timeout=15)
    except psutil.TimeoutExpired:
        child.kill()
        raise AssertionError("the node process outlived its parent") from None


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tls_serves_https_and_plain_http_beyond_loopback_needs_insecure(run: RunDir, tmp_path: Path):
    import ssl

    cert, key = self_signed(tmp_path)
    served = exporter.serve(run, port=0, tls_cert=str(cert), tls_key=str(key))
    try:
        assert served.url.startswith("https://127.0.0.1:")
        context = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(served.url, timeout=10, context=context) as response:
            assert b"rkit_" in response.read()
        with pytest.raises(OSError):  # plain HTTP to the TLS port is not answered with metrics
            urllib.request.urlopen(served.url.replace("https://", "http://"), timeout=10).read()
    finally:
        served.close()
    assert exporter.exposure("0.0.0.0", None, None, False) is not None
    assert exporter.exposure("0.0.0.0", str(cert), str(key), False) is None
    assert exporter.exposure("0.0.0.0", None, None, True) is None
    assert exporter.exposure("::1", None, None, False) is None and exporter.exposure("127.0.0.2", None, None, False) \
        is None
    assert "both" in exporter.exposure("127.0.0.1", str(cert), None, False)
    done = rkit("metrics", "serve", str(run.path), "--interface", "0.0.0.0", "--port", "0", check=2)
    assert "without TLS" in done.stderr and "--insecure" in done.stderr and "Traceback" not in done.stderr
    done = rkit("metrics", "serve", str(run.path), "--tls-cert", str(key), "--tls-key", str(key), "--port", "0",
                check=2)
    assert "TLS certificate" in done.stderr and "Traceback" not in done.stderr


def test_a_recipe_serving_beyond_loopback_needs_tls_or_insecure():
    from rkit.contract.errors import RecipeError
    from rkit.recipe.load import load_recipe

    from ..conftest import TINY

    with pytest.raises(RecipeError, match=r"observability.prometheus.interface: 0.0.0.0 .*set tls_cert and tls_key"):
        load_recipe(TINY, ["observability.prometheus.interface=0.0.0.0"])
    loaded = load_recipe(TINY, ["observability.prometheus.interface=0.0.0.0", "observability.prometheus.insecure=true"])
    assert loaded.config.observability.prometheus.insecure is True
    assert load_recipe(TINY).config_hash == load_recipe(TINY).config_hash  # no new default: hashes unchanged


WITHOUT_PSUTIL = """
import sys
sys.modules["psutil"] = None  # an image without psutil: importing it raises ImportError
from rkit.runtime.telemetry import node
sys.exit(node.main(sys.argv[1:]))
"""


def test_a_node_without_psutil_still_sends_its_heartbeats(run: RunDir):
    """An image without psutil (one that lacks rkit, made by its users): the node process says it samples nothing,
    and its heartbeats still reach the supervisor (a node without them would look silent and be probed)."""
    import signal

    from rkit.run.liveness import HeartbeatListener

    listener = HeartbeatListener("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-c", WITHOUT_PSUTIL, "--run", str(run.path), "--attempt", "1",
                             "--node", "node-p", "--parent-pid", str(os.getpid())],
                            env={**os.environ, **listener.environment()}, stderr=subprocess.PIPE, text=True)
    try:
        beats = wait_until(listener.drain, 30, "a heartbeat from the node without psutil", alive=proc)
        assert beats[0][0].node == "node-p" and beats[0][0].attempt == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        listener.close()
    assert "no health samples on node-p" in err and "psutil" in err and "Traceback" not in err
