#!/bin/bash
# Install a real Prometheus server (Debian 12's package) for tests/integration/test_prometheus.py, idempotently.
#
# The tests start their own `prometheus` with a generated config, storage in a temporary directory and a
# loopback port, so the package's service must not be left running (it would hold :9090 and scrape nothing
# useful): a policy-rc.d keeps invoke-rc.d from starting it during the install, and on a machine with systemd
# the unit is stopped and disabled afterwards. --no-install-recommends: no prometheus-node-exporter daemon.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
log() { echo "[install-prometheus] $*"; }

if command -v prometheus >/dev/null && [ "${1:-}" != "--force" ]; then
    log "already installed: $(prometheus --version 2>&1 | head -n 1)"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "error: installing Debian packages needs root; run:  sudo $0" >&2
    echo "  (or: sudo apt-get install -y --no-install-recommends prometheus && sudo systemctl disable --now prometheus)" >&2
    exit 1
fi
command -v apt-get >/dev/null || { echo "error: no apt-get; install Prometheus >= 2.x by hand" >&2; exit 1; }

POLICY=/usr/sbin/policy-rc.d
ours=""
if [ ! -e "$POLICY" ]; then
    # 101 = "action not allowed": invoke-rc.d then starts no service of the packages being installed.
    printf '#!/bin/sh\nexit 101\n' > "$POLICY"
    chmod 755 "$POLICY"
    ours=1
fi
cleanup() { if [ -n "$ours" ]; then rm -f "$POLICY"; fi; }
trap cleanup EXIT

log "apt-get install prometheus"
apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null

# A systemd machine may still have started it (policy-rc.d does not cover every path): stop and disable it.
if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
command -v prometheus >/dev/null || { echo "error: prometheus is not on PATH after the install" >&2; exit 1; }
log "installed: $(prometheus --version 2>&1 | head -n 1)"
