"""The exporter against clients that connect and then say nothing, or drip their bytes: each holds only its own
connection (the TLS handshake runs in that connection's thread, not in the accept loop), until the handshake or
connection deadline cuts it, quietly, and scrapes go on meanwhile."""

from __future__ import annotations

import importlib.util
import json
import socket
import ssl
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rkit.contract.rundir import RunDir
from rkit.runtime.telemetry import exporter

from ..conftest import wait_until
from .test_telemetry import self_signed, synthetic_run

METRIC = b"rkit_node_cpu_percent{"  # a series synthetic_run's node health file gives


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    path = tmp_path / "tls run"
    path.mkdir()
    (path / "resolved.json").write_text(json.dumps({"name": "tls run", "launcher": "local"}))
    run = RunDir(path)
    synthetic_run(run)
    return run


def cert_and_key(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key: with `cryptography` where installed, else openssl."""
    if importlib.util.find_spec("cryptography") is not None:
        return self_signed(tmp_path)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def client_hello() -> bytes:
    """The first bytes a real TLS client sends."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


@contextmanager
def slow_clients(port: int, drip: bytes, *, idle: int = 3, every: float = 1.0) -> Iterator[list[socket.socket]]:
    """`idle` connections that send nothing, and one that sends `drip` a byte every `every` s (the last one)."""
    stop = threading.Event()
    clients: list[socket.socket] = []

    def dripping(sock: socket.socket) -> None:
        for byte in drip:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                return
            if stop.wait(every):
                return

    try:
        for _ in range(idle + 1):  # connect() returning: the kernel has queued it for the server's accept()
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        dripper = threading.Thread(target=dripping, args=(clients[-1],), daemon=True)
        dripper.start()
        yield clients
    finally:
        stop.set()
        for sock in clients:
            sock.close()


def scrape(url: str, cert: Path | None = None) -> bytes:
    context = ssl.create_default_context(cafile=str(cert)) if cert else None
    with urllib.request.urlopen(url, timeout=5, context=context) as response:
        return response.read()


def test_idle_and_dripping_clients_do_not_stop_an_https_scrape(run: RunDir, tmp_path: Path):
    cert, key = cert_and_key(tmp_path)
    served = exporter.serve(run, port=0, tls_cert=str(cert), tls_key=str(key))
    try:
        assert served.url.startswith("https://127.0.0.1:")
        with slow_clients(served.port, client_hello()):
            assert METRIC in scrape(served.url, cert)
            assert METRIC in scrape(served.url, cert)
    finally:
        served.close()


def test_idle_and_dripping_clients_do_not_stop_a_plain_http_scrape(run: RunDir):
    served = exporter.serve(run, port=0)
    try:
        with slow_clients(served.port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"):
            assert METRIC in scrape(served.url)
    finally:
        served.close()


def cut_by_server(sock: socket.socket) -> bool:
    """Whether the server closes `sock` within 10 s (end of file or a reset; a timeout fails)."""
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


@pytest.mark.parametrize("tls", [True, False], ids=["https", "http"])
def test_slow_clients_are_cut_quietly_at_the_deadlines(run: RunDir, tmp_path: Path, monkeypatch, capfd, tls: bool):
    monkeypatch.setattr(exporter, "HANDSHAKE_SECONDS", 0.5, raising=False)
    monkeypatch.setattr(exporter, "CONNECTION_SECONDS", 1.5, raising=False)
    cert, key = cert_and_key(tmp_path) if tls else (None, None)
    served = exporter.serve(run, port=0, tls_cert=cert and str(cert), tls_key=key and str(key))
    try:
        # the dripping client sends well within every per-read timeout: only a deadline for the whole cuts it
        drip = client_hello() if tls else b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: x\r\n" * 99
        with slow_clients(served.port, drip, idle=1, every=0.1) as clients:
            assert all(cut_by_server(sock) for sock in clients)
            assert METRIC in scrape(served.url, cert)  # and the server goes on
        wait_until(lambda: not any("process_request_thread" in t.name for t in threading.enumerate()), 10,
                   "the connections' threads end")
    finally:
        served.close()
    assert "Traceback" not in capfd.readouterr().err
