"""Who can reach an exporter: metrics leave this machine only over TLS, unless the user says insecure. Standard
library only: the recipe loader checks this without importing prometheus-client."""

from __future__ import annotations

import ipaddress
import os
import stat


def is_loopback(interface: str) -> bool:
    if interface == "localhost":
        return True
    try:
        return ipaddress.ip_address(interface.strip("[]")).is_loopback
    except ValueError:
        return False


MAX_PEM_BYTES = 1 << 20


def pem_file_problem(path: str) -> str | None:
    """Why a PEM file cannot be one (missing, not a regular file: a FIFO or /dev/zero would hang the TLS
    library's read, larger than 1 MiB); None when it may be."""
    try:
        info = os.stat(path)
    except OSError as exc:
        return f"{exc.strerror}; give a PEM file"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file; give a PEM file"
    if info.st_size > MAX_PEM_BYTES:
        return f"{info.st_size / 1e6:.1f} MB, larger than any PEM file; give the certificate's or key's PEM file"
    return None


def exposure(interface: str, tls_cert: str | None, tls_key: str | None, insecure: bool, *,
             tls_hint: str = "give a certificate and key (PEM)", insecure_hint: str = "say insecure") -> str | None:
    """Why serving on `interface` this way is refused, or None. Metrics leave this machine only over TLS (a
    certificate and its key, TLS done per connection, exporter._Server), unless the user says `insecure`. The hints
    name the settings as the caller spells them (recipe keys, command-line options)."""
    if bool(tls_cert) != bool(tls_key):
        return "give both a TLS certificate and its key (PEM files), or neither."
    for what, path in (("certificate", tls_cert), ("key", tls_key)):
        if path and (why := pem_file_problem(path)) is not None:
            return f"the TLS {what} {path}: {why}"
    if is_loopback(interface) or tls_cert or insecure:
        return None
    return (f"{interface} is reachable from other machines and the metrics would be served without TLS; "
            f"{tls_hint} to serve HTTPS, or {insecure_hint} to serve plain HTTP anyway (warned about on every "
            "start).")


def insecure_warning(interface: str, tls_cert: str | None, insecure: bool) -> str | None:
    """The line to print on every start that serves plain HTTP beyond loopback, or None."""
    if not insecure or tls_cert or is_loopback(interface):
        return None
    return (f"rkit: warning: serving metrics over plain HTTP on {interface}, reachable from other machines "
            "(insecure: true); anyone who can reach the port reads them")
