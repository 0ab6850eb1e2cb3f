#!/bin/bash
# Install a real Apptainer on a fresh Debian 12 machine (root), idempotently.
#
# Debian 12 has no apptainer package; sid's (1.4.x) needs glibc >= 2.38 and Debian 12 has 2.36. So:
# download sid's apptainer .deb and trixie's libc6 with private apt lists (the host's apt is untouched),
# unpack both under $RKIT_CI_BASE/apptainer, and point apptainer and its starter at the private glibc with
# patchelf (DT_RPATH, so apptainer's own LD_LIBRARY_PATH cannot override it). In this sandbox CAP_SYS_RESOURCE
# is missing from the bounding set: root's default capabilities become "file" plus every capability that is
# present, and builds with %post use --fakeroot, which needs root in /etc/subuid and /etc/subgid.
# Result: `apptainer` (and `singularity`, which spython calls) in /usr/local/bin.
set -euo pipefail
BASE=${RKIT_CI_BASE:-/opt/rkit-ci}
APPT=$BASE/apptainer
BIN=${RKIT_CI_BIN:-/usr/local/bin}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
export DEBIAN_FRONTEND=noninteractive
log() { echo "[install-apptainer] $*"; }

works() { "$BIN/apptainer" --version >/dev/null 2>&1 && [ -e "$BIN/singularity" ]; }
if works && [ "${1:-}" != "--force" ]; then
    log "already installed: $("$BIN/apptainer" --version)"
    exit 0
fi
[ "$(id -u)" = 0 ] || { echo "error: run as root (it installs Debian packages and edits /etc/subuid)" >&2; exit 1; }

need=()
for tool in debootstrap:debootstrap mksquashfs:squashfs-tools newuidmap:uidmap patchelf:patchelf \
            unsquashfs:squashfs-tools python3:python3; do
    command -v "${tool%%:*}" >/dev/null || need+=("${tool##*:}")
done
if [ ${#need[@]} -gt 0 ]; then
    log "apt-get install ${need[*]}"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" ca-certificates >/dev/null
fi

log "download apptainer (sid) and libc6 (trixie) with private apt lists"
mkdir -p "$BASE"/apt/{lists/partial,archives/partial}
printf 'deb %s trixie main\ndeb %s sid main\n' "$MIRROR" "$MIRROR" > "$BASE/apt/sources.list"
AO=(-o "Dir::Etc::SourceList=$BASE/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$BASE/apt/lists" -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache=
    -o Acquire::Check-Valid-Until=false -o Acquire::Languages=none)
apt-get "${AO[@]}" update -qq
rm -f "$BASE"/apt/archives/*.deb
(cd "$BASE/apt/archives" && apt-get "${AO[@]}" download -qq apptainer/sid libc6/trixie)

log "unpack and patch"
rm -rf "$APPT" "$BASE/apt/libc6"
mkdir -p "$APPT/glibc"
dpkg -x "$BASE"/apt/archives/apptainer_*.deb "$APPT"
dpkg -x "$BASE"/apt/archives/libc6_*.deb "$BASE/apt/libc6"
for lib in ld-linux-x86-64.so.2 libc.so.6 libm.so.6; do
    cp -L "$(find "$BASE/apt/libc6" -name "$lib" -print -quit)" "$APPT/glibc/"
done
# A relocated (non-suid) apptainer finds <prefix>/etc and <prefix>/var next to its binaries.
ln -sfn ../etc "$APPT/usr/etc"; ln -sfn ../var "$APPT/usr/var"
ln -sfn ../../etc "$APPT/usr/lib/etc"; ln -sfn ../../var "$APPT/usr/lib/var"
for b in "$APPT/usr/bin/apptainer" "$APPT/usr/lib/x86_64-linux-gnu/apptainer/bin/starter"; do
    patchelf --set-interpreter "$APPT/glibc/ld-linux-x86-64.so.2" --force-rpath --set-rpath "$APPT/glibc" "$b"
done
A=$APPT/usr/bin/apptainer

log "capabilities and subuid/subgid"
sed -i 's/^root default capabilities = .*/root default capabilities = file/' "$APPT/etc/apptainer/apptainer.conf"
"$A" capability add --user root "$(python3 "$(dirname "$0")/present-capabilities.py")" 2>/dev/null || true
grep -q '^root:' /etc/subuid 2>/dev/null || echo 'root:1000000:65536' >> /etc/subuid
grep -q '^root:' /etc/subgid 2>/dev/null || echo 'root:1000000:65536' >> /etc/subgid

mkdir -p "$BIN"
ln -sfn "$A" "$BIN/apptainer"
ln -sfn "$A" "$BIN/singularity"
works || { echo "error: apptainer does not run after installation" >&2; exit 1; }
log "installed: $("$BIN/apptainer" --version)"
