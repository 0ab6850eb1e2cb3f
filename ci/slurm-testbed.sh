#!/bin/bash
# rkit's Slurm test bed: a real Slurm 24.11 cluster of 3 nodes on one Debian machine (root), for the tests of the
# Slurm launcher.
#
# Slurm 24.11 (Debian 13 "trixie") and Apptainer (Debian sid) run inside a debootstrapped trixie root, which runs as
# a persistent "cluster namespace" (own mount + pid namespace via pivot_root; host network). Each fake node c1..c3
# is a slurmd that is PID 1's only child in a nested pid namespace, so `crash` is a real node crash: the node's job
# processes die with it. Host commands in $BASE/bin (sbatch srun salloc squeue sinfo scontrol scancel sacct
# apptainer ci-node cluster-ns) run the real ones inside. `srun/sbatch --container=IMAGE.sif` runs each task with
# `apptainer exec --containall --cleanenv` (ci/testbed/slurm-oci-apptainer).
#
# Host paths visible at the same path inside the cluster (and inside --container tasks): /tmp, this repository,
# $HOME/.pyenv (if it exists), $HOME/.cache/rkit, $BASE/work, and the paths in $RKIT_SLURM_BINDS (space-separated).
#
# usage: ci/slurm-testbed.sh up | down | status | env | crash NODE | restore NODE | slurmd stop|start NODE
#        | timeouts SLURMD MESSAGE | exec CMD...
#   up            build what is missing (root, packages, config) and start the cluster; quick if it is already up
#   down          stop the cluster (kills the cluster namespace from its PID file)
#   status        sinfo -N and the namespace; exit 0 if it is up with 3 responding nodes
#   env           print the export lines for PATH and RKIT_SLURM_BASE
#   crash NODE    kill node NODE (c1..c3) like a machine crash
#   restore NODE  start NODE again and wait until it is idle or allocated
#   slurmd stop NODE, slurmd start NODE
#                 stop NODE's slurmd only (the node and its jobs' processes live on; connections to it are refused), and
#                 start it again (it takes up the running steps, as a restarted slurmd does)
#   timeouts SLURMD MESSAGE
#                 set SlurmdTimeout and MessageTimeout of the running cluster (scontrol reconfigure) and keep them for
#                 later ups; `timeouts 300 10` are Slurm's defaults, `timeouts 20 5` the test bed's fast ones
#   exec CMD...   run CMD inside the cluster namespace
# Environment: RKIT_SLURM_BASE (default /opt/rkit-ci/slurm), RKIT_SLURM_BINDS, RKIT_SLURM_PORT (default 7817; a second
# test bed on the same machine needs its own base and port), DEBIAN_MIRROR, RKIT_SLURMD_TIMEOUT and
# RKIT_MESSAGE_TIMEOUT (a new cluster's timeouts; default: the last `timeouts`, else 20 and 5).
# Changes to the configuration (binds, ports, slurm.conf) apply to a running cluster only after down + up.
# shellcheck disable=SC2016  # single-quoted $ is meant for the inner shell
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)   # the path as the caller sees it (a symlinked checkout is bound at its link)
BASE=${RKIT_SLURM_BASE:-/opt/rkit-ci/slurm}
R=$BASE/root
NODES=3
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
S=/var/lib/slurm-ci
PORT=${RKIT_SLURM_PORT:-7817}   # slurmctld; slurmd PORT+1; nodes c1..c3 listen on PORT+10184+i (18001-18003)
export DEBIAN_FRONTEND=noninteractive
T0=$SECONDS

log() { echo "[slurm-testbed +$((SECONDS - T0))s] $*" >&2; }
die() { echo "error: $*" >&2; exit 1; }
ns() { "$BASE/bin/cluster-ns" "$@"; }
incluster() { ns exec "$@"; }
# daemons start with a clean environment, not the caller's
daemon() { ns exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "$@"; }
ns_alive() { [ -x "$BASE/bin/cluster-ns" ] && ns alive; }

print_env() {
    echo "export PATH=$BASE/bin:\$PATH"
    echo "export RKIT_SLURM_BASE=$BASE"
}

# "NODE STATE" lines, one per node (sinfo's state; a trailing * means not responding)
node_states() { incluster sinfo -h -N -o '%N %t' 2>/dev/null | sort -u; }

# all NODES nodes are in one of the given states (sinfo's short names, e.g. idle alloc mix)
nodes_in() {
    local states count=0 n st
    states=$(node_states) || return 1
    while read -r n st; do
        [ -n "$n" ] || continue
        [[ " $* " == *" $st "* ]] || return 1
        count=$((count + 1))
    done <<< "$states"
    [ "$count" = "$NODES" ]
}

wait_nodes() {  # TIMEOUT STATE...: wait until all nodes are in one of the STATEs; after 5 s, resume nodes that
    # respond but stay down or drained (ReturnToService=2 returns a node that registers, not a drained one)
    local timeout=$1 t=$SECONDS resumed=" " n st
    shift
    until nodes_in "$@"; do
        [ $((SECONDS - t)) -lt "$timeout" ] || { node_states >&2 || true; return 1; }
        if [ $((SECONDS - t)) -ge 5 ]; then
            while read -r n st; do
                case $st in
                down | drain | drng | fail | failg)
                    [[ $resumed == *" $n "* ]] && continue
                    log "$n is $st ($(incluster sinfo -h -n "$n" -o %E 2>/dev/null)): scontrol update nodename=$n state=resume"
                    incluster scontrol update nodename="$n" state=resume || true
                    resumed+="$n " ;;
                esac
            done <<< "$(node_states || true)"
        fi
        sleep 0.5
    done
}

# the host paths to show inside the cluster, one per line, parents before children
want_binds() {
    local b
    mkdir -p "$HOME/.cache/rkit" "$BASE/work"
    {
        echo /tmp
        echo "$REPO"
        [ -d "$HOME/.pyenv" ] && echo "$HOME/.pyenv"
        echo "$HOME/.cache/rkit"
        echo "$BASE/work"
        for b in ${RKIT_SLURM_BINDS:-}; do
            [[ $b == /?* ]] || die "RKIT_SLURM_BINDS: $b is not an absolute path (or is /)"
            [ -e "$b" ] || die "RKIT_SLURM_BINDS: $b does not exist"
            echo "${b%/}"
        done
    } | sort -u
}

inchroot() {  # run a command chrooted into the root, with /dev /proc /sys, in a throwaway mount namespace
    unshare -m --propagation private /bin/sh -c \
        'mount --rbind /dev "$0/dev" && mount -t proc proc "$0/proc" && mount --rbind /sys "$0/sys" && exec chroot "$0" "$@"' \
        "$R" "$@"
}

put() {  # FILE [MODE]: write stdin to FILE, only if it differs
    local tmp
    tmp=$(mktemp "$1.XXXXXX")
    cat > "$tmp"
    chmod "${2:-644}" "$tmp"
    if cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mv -f "$tmp" "$1"; fi
}

make_root() {
    [ -x "$R/usr/bin/apt-get" ] && return 0
    command -v debootstrap >/dev/null || { log "apt-get install debootstrap (host)"; apt-get update -qq; apt-get install -y -qq debootstrap >/dev/null; }
    local new=$BASE/root.new
    grep -q " ${new}[/ ]" /proc/self/mounts && die "mounts remain under $new from an earlier run: unmount them first"
    rm -rf "$new"
    log "debootstrap trixie into $R (log: $BASE/log/debootstrap.log)"
    # in a private mount namespace, so that no mount debootstrap makes can outlive it
    unshare -m --propagation private debootstrap --variant=minbase trixie "$new" "$MIRROR" \
        > "$BASE/log/debootstrap.log" 2>&1 || { tail -20 "$BASE/log/debootstrap.log" >&2; die "debootstrap failed"; }
    mv "$new" "$R"
}

PKG_FILES="usr/sbin/slurmctld usr/sbin/slurmd usr/bin/sinfo usr/sbin/munged usr/bin/python3 usr/bin/mksquashfs
    usr/bin/newuidmap usr/sbin/debootstrap usr/bin/pgrep etc/ssl/certs/ca-certificates.crt usr/bin/apptainer"

install_packages() {
    local f missing=0
    for f in $PKG_FILES; do [ -e "$R/$f" ] || [ -L "$R/$f" ] || missing=1; done  # -L: alternatives links are absolute
    [ "$missing" = 1 ] || return 0
    log "apt in the root: slurm + munge (trixie), apptainer (sid) (log: $BASE/log/apt.log)"
    printf 'deb %s trixie main\ndeb %s sid main\n' "$MIRROR" "$MIRROR" > "$R/etc/apt/sources.list"
    rm -f "$R/etc/apt/sources.list.d/debian.sources"
    printf 'Package: *\nPin: release n=sid\nPin-Priority: 100\n' > "$R/etc/apt/preferences.d/sid"
    printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\nAcquire::Check-Valid-Until "false";\nAcquire::Languages "none";\n' \
        > "$R/etc/apt/apt.conf.d/99rkit-ci"
    printf '#!/bin/sh\nexit 101\n' > "$R/usr/sbin/policy-rc.d"   # packages must not start daemons
    chmod 755 "$R/usr/sbin/policy-rc.d"
    cp /etc/resolv.conf "$R/etc/resolv.conf"
    {
        inchroot apt-get update -qq
        inchroot apt-get install -y -qq slurmctld slurmd slurm-client munge python3-minimal squashfs-tools uidmap \
            ca-certificates procps debootstrap
        inchroot apt-get install -y -qq apptainer/sid
        inchroot apt-get clean
    } > "$BASE/log/apt.log" 2>&1 || { tail -20 "$BASE/log/apt.log" >&2; die "apt-get in the root failed"; }
    for f in $PKG_FILES; do [ -e "$R/$f" ] || [ -L "$R/$f" ] || die "$R/$f is missing after apt-get (see $BASE/log/apt.log)"; done
}

# The cluster's SlurmdTimeout and MessageTimeout: fast ones by default (a crashed node is DOWN within ~30 s), Slurm's
# own (300 s, 10 s) with `timeouts 300 10`, which the tests of rkit's own node liveness use.
read -r SLURMD_TIMEOUT MESSAGE_TIMEOUT < <(cat "$BASE/timeouts" 2>/dev/null || echo "20 5")
SLURMD_TIMEOUT=${RKIT_SLURMD_TIMEOUT:-$SLURMD_TIMEOUT}
MESSAGE_TIMEOUT=${RKIT_MESSAGE_TIMEOUT:-$MESSAGE_TIMEOUT}

configure() {
    local caps
    printf '127.0.0.1 localhost\n127.0.1.1 %s\n' "$(hostname)" | put "$R/etc/hosts"
    cp /etc/resolv.conf "$R/etc/resolv.conf"
    grep -q '^root:' "$R/etc/subuid" 2>/dev/null || echo 'root:1000000:65536' >> "$R/etc/subuid"
    grep -q '^root:' "$R/etc/subgid" 2>/dev/null || echo 'root:1000000:65536' >> "$R/etc/subgid"
    # apptainer as root here: CAP_SYS_RESOURCE is missing from the bounding set, so root gets "file" capabilities
    # plus every capability that is present (ci/present-capabilities.py; the namespace has the host's bounding set).
    sed -i 's/^root default capabilities = .*/root default capabilities = file/' "$R/etc/apptainer/apptainer.conf"
    caps=$(python3 "$HERE/present-capabilities.py" 2>/dev/null || inchroot python3 - < "$HERE/present-capabilities.py")
    if ! grep -qs "$(echo "$caps" | tr ',' '\n' | tail -1)" "$R/etc/apptainer/capability.json"; then
        inchroot apptainer capability add --user root "$caps" > "$BASE/log/capability.log" 2>&1
    fi
    [ -s "$R/etc/munge/munge.key" ] || inchroot /bin/sh -c 'mungekey --create && chown munge:munge /etc/munge/munge.key'
    mkdir -p "$R$S"/{state,log,spool} "$R/etc/rkit-testbed"
    put "$R/etc/slurm/slurm.conf" <<EOF
# written by rkit ci/slurm-testbed.sh
ClusterName=rkit-ci
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=30
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
StateSaveLocation=$S/state
SlurmdSpoolDir=$S/spool/%n
SlurmctldPidFile=/run/slurm-ci/slurmctld.pid
SlurmdPidFile=/run/slurm-ci/slurmd-%n.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdLogFile=$S/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
# A ping round waits for its slowest node (up to MessageTimeout, and a crashed node is the slowest) before
# it records any reply; with SlurmdTimeout=10 and the default MessageTimeout=10, a crash made slurmctld
# declare a healthy node dead in the same round (and kill the job when it was the batch host). Keep
# SlurmdTimeout well above ping interval (SlurmdTimeout/3) + MessageTimeout.
SlurmdTimeout=$SLURMD_TIMEOUT
MessageTimeout=$MESSAGE_TIMEOUT
SlurmctldTimeout=10
# Pending jobs are looked at every 5 s, not Slurm's 60 s (main loop) and 30 s (backfill): a requeued job whose
# cred_expire hold (AuthInfo above) has ended started up to 30 s later than it could (a USR1 requeue: 51 s from
# job.requeued to job.started, 31 s of it the hold). The same scheduling, only sooner: what the requeue tests prove
# (the job held, requeued and started again, on which nodes) does not change.
SchedulerParameters=bf_interval=5,sched_interval=5
KillWait=5
MinJobAge=300
MailProg=/bin/true
SlurmdParameters=config_overrides
NodeName=c[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$((PORT + 10185))-$((PORT + 10184 + NODES))] CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=c[1-$NODES] Default=YES MaxTime=INFINITE State=UP
EOF
    put "$R/etc/slurm/oci.conf" <<'EOF'
# written by rkit ci/slurm-testbed.sh: srun/sbatch --container=IMAGE runs each task with apptainer
IgnoreFileConfigJson=true
CreateEnvFile=null
EnvExclude="^(SLURM_CONF|SLURM_CONF_SERVER)="
RunTimeEnvExclude="^(SLURM_CONF|SLURM_CONF_SERVER)="
RunTimeRun="/usr/local/bin/slurm-oci-apptainer %e %r %@"
RunTimeKill="kill -s SIGTERM %p"
RunTimeDelete="kill -s SIGKILL %p"
EOF
}

install_scripts() {  # the host commands in $BASE/bin and the helpers in the root, from ci/testbed
    local c
    put "$R/usr/local/bin/ci-node" 755 < "$HERE/testbed/ci-node"
    put "$R/usr/local/bin/slurm-oci-apptainer" 755 < "$HERE/testbed/slurm-oci-apptainer"
    mkdir -p "$BASE/bin"
    put "$BASE/bin/cluster-ns" 755 < "$HERE/testbed/cluster-ns"
    for c in sbatch srun salloc squeue sinfo scontrol scancel sacct apptainer ci-node; do
        printf '#!/bin/sh\n# rkit Slurm test bed: %s inside the cluster namespace\nexec "$(dirname "$0")/cluster-ns" exec %s "$@"\n' "$c" "$c" \
            | put "$BASE/bin/$c" 755
    done
}

cmd_up() {
    [ "$(id -u)" = 0 ] || die "run as root (it debootstraps a root and starts namespaces)"
    local binds
    # The host's iptables: the liveness tests drop the heartbeats and the traffic to slurmctld with it (the nodes
    # share the host's network).
    command -v iptables >/dev/null || { log "apt-get install iptables (host)"; { apt-get install -y -qq iptables ||
        { apt-get update -qq && apt-get install -y -qq iptables; }; } >/dev/null || die "apt-get install iptables failed"; }
    if ns_alive && nodes_in idle; then
        install_scripts                     # cheap: rewrites only what changed in ci/testbed
        binds=$(want_binds)
        if [ "$binds" = "$(cat "$BASE/binds" 2>/dev/null)" ]; then
            log "already up, all $NODES nodes idle"
            print_env
            return 0
        fi
        # Another checkout (a CI clone) needs its own path visible inside: an idle cluster is restarted with it.
        log "the running cluster shows $(tr '\n' ' ' < "$BASE/binds")- restarting it to show $(tr '\n' ' ' <<< "$binds")"
        cmd_down
    fi
    mkdir -p "$BASE"/{bin,log,work}
    make_root
    install_packages
    install_scripts
    binds=$(want_binds)
    if ns_alive; then
        # the daemons read slurm.conf when they start: rewriting it under a running cluster would split it
        log "cluster namespace already running: starting what is missing (config changes need down + up)"
        [ "$binds" = "$(cat "$BASE/binds")" ] || log "note: binds differ from the running namespace's: down + up to apply"
    else
        log "configure"
        configure
        echo "$binds" > "$BASE/binds"
        cp "$BASE/binds" "$R/etc/rkit-testbed/binds"
        log "start the cluster namespace; visible inside: $(tr '\n' ' ' <<< "$binds")"
        ns start
    fi
    daemon ci-node up "$NODES"
    log "wait for $NODES nodes"
    wait_nodes 120 idle mix alloc || die "nodes did not come up; logs: $R$S/log"
    incluster sinfo -N >&2
    log "up"
    print_env
}

cmd_down() {
    if [ -x "$BASE/bin/cluster-ns" ]; then
        if ns alive; then log "stopping the cluster namespace"; else log "not running"; fi
        ns stop
    else
        rm -f "$BASE/ns.pid"
        log "not installed"
    fi
}

check_node() { [[ "$1" =~ ^c[1-$NODES]$ ]] || die "no node '$1' (nodes: c1..c$NODES)"; }

cmd_crash() {
    check_node "$1"
    incluster ci-node crash "$1"
}

RESTORE_SETTLE=${RKIT_SLURM_RESTORE_SETTLE:-2}

cmd_restore() {
    # The node comes back drained and is resumed $RESTORE_SETTLE s after it registered. Without that, slurmctld
    # 24.11.5 segfaulted (NULL write in a worker thread; 3 times out of 3) when a requeued job released with
    # StartTime=now was allocated the node in the same second it returned to service and then ran `srun`.
    local node=$1 t=$SECONDS st
    check_node "$node"
    if ! incluster ci-node alive "$node"; then
        incluster scontrol update nodename="$node" state=drain reason="rkit-ci restore" 2>/dev/null || true
    fi
    daemon ci-node start "$node"
    while :; do
        st=$(incluster sinfo -h -n "$node" -o %t 2>/dev/null | head -1)
        case $st in
        idle | alloc | mix) break ;;
        drain | down | drng | fail | failg)   # responding again, but not in service
            sleep "$RESTORE_SETTLE"
            log "$node registered ($st): scontrol update nodename=$node state=resume"
            incluster scontrol update nodename="$node" state=resume || true
            t=$SECONDS ;;
        esac
        [ $((SECONDS - t)) -lt 120 ] || die "$node is not back after 120 s (state: ${st:-?})"
        sleep 0.5
    done
    if [ "$st" != idle ]; then
        # Seen once: slurmctld 24.11.5 kept the CPU of a job requeued off the crashed node allocated on it, so the
        # node came back "mix" with no job on it. `scontrol reconfigure` (the controller rebuilds its state) clears it.
        sleep 1
        st=$(incluster sinfo -h -n "$node" -o %t 2>/dev/null | head -1)
        if [ "$st" != idle ] && [ -z "$(incluster squeue -h -w "$node" -o %i 2>/dev/null)" ]; then
            log "$node is $st with no job on it: scontrol reconfigure"
            incluster scontrol reconfigure || true
            t=$SECONDS
            until st=$(incluster sinfo -h -n "$node" -o %t 2>/dev/null | head -1) && [ "$st" = idle ]; do
                [ $((SECONDS - t)) -lt 30 ] || { log "warning: $node is still $st"; break; }
                sleep 0.5
            done
        fi
    fi
    log "$node is $st"
}

cmd_timeouts() {
    [[ "$1" =~ ^[0-9]+$ && "$2" =~ ^[0-9]+$ ]] || die "timeouts: SLURMD and MESSAGE are seconds (e.g. 300 10)"
    ns_alive || die "the cluster is not up: ci/slurm-testbed.sh up"
    SLURMD_TIMEOUT=$1 MESSAGE_TIMEOUT=$2
    mkdir -p "$BASE"
    echo "$1 $2" > "$BASE/timeouts"
    configure
    incluster scontrol reconfigure || die "scontrol reconfigure failed"
    local t=$SECONDS seen
    until seen=$(incluster scontrol show config 2>/dev/null | sed -n 's/^SlurmdTimeout *= *\([0-9]*\) sec.*/\1/p') \
            && [ "$seen" = "$1" ]; do
        [ $((SECONDS - t)) -lt 60 ] || die "slurmctld still reports SlurmdTimeout=${seen:-?} after 60 s"
        sleep 0.5
    done
    wait_nodes 120 idle mix alloc || die "nodes did not come back after the reconfigure"
    log "SlurmdTimeout=$1 MessageTimeout=$2"
}

cmd_status() {
    local rc=0
    if ns_alive; then
        echo "cluster namespace: running (pid $(cut -d' ' -f1 "$BASE/ns.pid"), base $BASE)"
        incluster sinfo -N || rc=1
        nodes_in idle mix alloc comp || rc=1
    else
        echo "cluster namespace: not running (base $BASE)"
        rc=1
    fi
    return $rc
}

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
status) cmd_status ;;
env) print_env ;;
crash) [ $# = 2 ] || die "usage: $0 crash NODE"; cmd_crash "$2" ;;
restore) [ $# = 2 ] || die "usage: $0 restore NODE"; cmd_restore "$2" ;;
slurmd) [ $# = 3 ] && [[ "$2" =~ ^(stop|start)$ ]] || die "usage: $0 slurmd stop|start NODE"; check_node "$3"
    incluster ci-node "slurmd-$2" "$3" ;;
timeouts) [ $# = 3 ] || die "usage: $0 timeouts SLURMD MESSAGE"; cmd_timeouts "$2" "$3" ;;
exec) shift; [ $# -gt 0 ] || die "usage: $0 exec CMD..."; incluster "$@" ;;
*) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
