"""A node's heartbeat to its supervisor: one UDP datagram a second from every node of an attempt, so that the
supervisor sees a node die in seconds instead of waiting for Slurm's SlurmdTimeout (300 s by default).

The sender is a thread of the node's telemetry process (telemetry/node.py: one per node, beside the trainer and
not inside it, so a trainer that holds the GIL, compiles for minutes or is stopped does not silence its node).
The receiver is the supervisor's (liveness.py). Each datagram is

    rkit-hb1 <node> <attempt> <seq> <hmac>

where <hmac> is HMAC-SHA256 of the first four fields under the supervisor's per-job token (RKIT_LIVENESS_TOKEN,
which reaches the ranks in their environment only). A datagram that does not verify is dropped: a stranger can
neither fake a live node nor make one look dead (it can only fail to be heard). UDP, because the receiver must
never block on a peer: it reads what has arrived, without waiting, on every pass of its loop.

Image side: the standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass

JAX_HEARTBEAT_ENV = "RKIT_JAX_HEARTBEAT_SECONDS"  # the agents' jax.distributed heartbeat timeout (agent.py)
ADDRESS_ENV = "RKIT_LIVENESS_ADDRESS"  # host:port of the supervisor's heartbeat socket
TOKEN_ENV = "RKIT_LIVENESS_TOKEN"
MAGIC = "rkit-hb1"
INTERVAL_SECONDS = 1.0
MAX_DATAGRAM = 512


def _mac(token: str, body: str) -> str:
    return hmac.new(token.encode(), body.encode(), hashlib.sha256).hexdigest()


def encode(token: str, node: str, attempt: int, seq: int) -> bytes:
    body = f"{MAGIC} {node} {attempt} {seq}"
    return f"{body} {_mac(token, body)}".encode()


@dataclass(frozen=True)
class Beat:
    node: str
    attempt: int
    seq: int


def decode(token: str, data: bytes) -> Beat | None:
    """The heartbeat in `data` if it is one of ours (well formed, signed with `token`); else None."""
    try:
        parts = data.decode("ascii").split(" ")
    except UnicodeDecodeError:
        return None
    if len(parts) != 5 or parts[0] != MAGIC or not parts[2].isdigit() or not parts[3].isdigit():
        return None
    if not hmac.compare_digest(_mac(token, " ".join(parts[:4])), parts[4]):
        return None
    return Beat(parts[1], int(parts[2]), int(parts[3]))


def target(environ: Mapping[str, str]) -> tuple[tuple[str, int], str] | None:
    """Where this node's heartbeats go and the token, from the environment; None when no supervisor asked."""
    address, token = environ.get(ADDRESS_ENV, ""), environ.get(TOKEN_ENV, "")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not token:
        return None
    return (host, int(port)), token


def start_sender(node: str, attempt: int, environ: Mapping[str, str], stop: threading.Event,
                 interval: float = INTERVAL_SECONDS) -> threading.Thread | None:
    """A daemon thread sending this node's heartbeat every `interval` s until `stop` is set; None when the
    environment names no supervisor. A send that fails (no route yet) is tried again at the next beat."""
    found = target(environ)
    if found is None:
        return None
    (host, port), token = found
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    def beat() -> None:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            seq, to = 0, None
            while True:
                try:
                    # the name resolved once (a stalled DNS lookup would hold every beat), again after a failure
                    to = to or socket.getaddrinfo(host, port, family, socket.SOCK_DGRAM)[0][4]
                    sock.sendto(encode(token, node, attempt, seq), to)
                except OSError:
                    to = None
                seq += 1
                if stop.wait(interval):
                    return

    thread = threading.Thread(target=beat, name="rkit-heartbeat", daemon=True)
    thread.start()
    return thread


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    return target(os.environ if environ is None else environ) is not None
