#!/bin/bash
# Smoke test of rkit's Slurm test bed (run `ci/slurm-testbed.sh up` first):
#   1. srun -N3 -n3: one task per node, SLURM_PROCID 0..2
#   2. sbatch --wait
#   3. srun -N2 -n2 --container=SIF: SLURM_PROCID, node, cwd, environment passed verbatim, host paths visible.
#      SIF: $RKIT_SMOKE_SIF (e.g. the rkit CPU image) if set, else a tiny trixie + python3 image built once with
#      `apptainer build --fakeroot` and cached in $BASE/work (rebuilt only when its definition changes)
#   4. node crash: a --requeue batch job whose srun --container task runs on the node; the crash kills the task,
#      Slurm requeues the job (NODE_FAIL), `scontrol update jobid=J StartTime=now` releases the cred_expire hold,
#      the rerun sees SLURM_RESTART_COUNT=1; then the node is restored
# Prints the time of each step. Exit 0 when all passed.
# shellcheck disable=SC2016,SC2001  # single-quoted $ is for the job; sed indents
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TB=$HERE/slurm-testbed.sh
eval "$("$TB" env)"
unset SLURM_CONF
BASE=$RKIT_SLURM_BASE
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
T0=$SECONDS
TIMES=()
ts() { echo "[smoke +$((SECONDS - T0))s] $*"; }
fail() { echo "[smoke +$((SECONDS - T0))s] FAILED: $*" >&2; exit 1; }
timing() { TIMES+=("$(printf '%-44s %5ss' "$1" "$2")"); }

"$TB" status > /dev/null || fail "the test bed is not up (run: ci/slurm-testbed.sh up)"
W=$BASE/work/smoke-$$
mkdir -p "$W"   # removed when all passed
cd "$W"

jfield() { scontrol show job -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p"; }  # JOBID FIELD
wait_until() {  # TIMEOUT WHAT CMD...: run CMD every 0.5 s until it succeeds
    local timeout=$1 what=$2 t=$SECONDS
    shift 2
    until "$@"; do
        [ $((SECONDS - t)) -lt "$timeout" ] || fail "timed out after ${timeout}s waiting for $what"
        sleep 0.5
    done
}
state_is() {  # JOBID STATE: the job is in STATE; fail at once if it ended in another state
    local st
    st=$(jfield "$1" JobState)
    case $st in
    "$2") return 0 ;;
    COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE | PREEMPTED)
        cat "$W"/requeue-*.out 2>/dev/null | sed 's/^/    /' >&2
        fail "job $1 ended $st ($(jfield "$1" Reason)) while waiting for $2" ;;
    esac
    return 1
}

# ---- 1. srun across the 3 nodes
ts "srun -N3 -n3"
t=$SECONDS
out=$(srun -N3 -n3 bash -c 'echo "$SLURM_PROCID $SLURMD_NODENAME"' | sort)
echo "$out" | sed 's/^/    /'
[ "$(echo "$out" | cut -d' ' -f1 | tr '\n' ' ')" = "0 1 2 " ] || fail "SLURM_PROCID is not 0 1 2"
[ "$(echo "$out" | cut -d' ' -f2 | sort -u | wc -l)" = 3 ] || fail "the 3 tasks did not run on 3 nodes"
timing "srun -N3 -n3" $((SECONDS - t))

# ---- 2. sbatch --wait
ts "sbatch --wait"
t=$SECONDS
j=$(sbatch --parsable --wait -N1 -o "$W/batch-%j.out" --wrap 'echo "batch $SLURM_JOB_ID on $SLURMD_NODENAME"')
sed 's/^/    /' "$W/batch-$j.out"
grep -q "^batch $j on c[1-3]$" "$W/batch-$j.out" || fail "sbatch --wait: unexpected output"
timing "sbatch --wait" $((SECONDS - t))

# ---- 3. srun --container
t=$SECONDS
if [ -n "${RKIT_SMOKE_SIF:-}" ]; then
    SIF=$(readlink -f "$RKIT_SMOKE_SIF")
    [ -f "$SIF" ] || fail "RKIT_SMOKE_SIF=$RKIT_SMOKE_SIF is not a file"
    ts "image: $SIF (RKIT_SMOKE_SIF)"
else
    def=$(printf 'Bootstrap: debootstrap\nOSVersion: trixie\nMirrorURL: %s\nInclude: python3-minimal\n\n%%post\n    echo ok > /etc/rkit-smoke\n' "$MIRROR")
    SIF=$BASE/work/smoke-$(echo "$def" | sha256sum | cut -c1-12).sif
    if [ -f "$SIF" ]; then
        ts "image: $SIF (cached)"
    else
        ts "image: apptainer build --fakeroot $SIF (log: $SIF.log)"
        echo "$def" > "$SIF.def"
        apptainer build --fakeroot --force "$SIF.tmp" "$SIF.def" > "$SIF.log" 2>&1 || { tail -20 "$SIF.log"; fail "apptainer build"; }
        mv "$SIF.tmp" "$SIF"
    fi
fi
timing "image (build or cache)" $((SECONDS - t))
case $SIF in /tmp/* | "$BASE"/work/* | "$HOME"/.cache/rkit/*) ;; *) ts "note: $SIF must lie under a path the test bed binds" ;; esac

ts "srun -N2 -n2 --container"
t=$SECONDS
echo probe > "$W/probe"
out=$(RKIT_SMOKE_VALUE='a b$c `d` "e" \n (x3)' srun -N2 -n2 --container="$SIF" python3 -c '
import os
e = os.environ
print(e["SLURM_PROCID"], e["SLURMD_NODENAME"], os.getcwd(), repr(e.get("RKIT_SMOKE_VALUE")),
      open("probe").read().strip(), os.path.isdir("/tmp"), e.get("SLURM_JOB_ID") is not None)' | sort)
echo "$out" | sed 's/^/    /'
want="$W 'a b\$c \`d\` \"e\" \\\\n (x3)' probe True True"
[ "$(echo "$out" | cut -d' ' -f1 | tr '\n' ' ')" = "0 1 " ] || fail "srun --container: SLURM_PROCID is not 0 1"
[ "$(echo "$out" | cut -d' ' -f2 | sort -u | wc -l)" = 2 ] || fail "srun --container: the tasks did not run on 2 nodes"
[ "$(echo "$out" | cut -d' ' -f3- | sort -u)" = "$want" ] || fail "srun --container: expected '$want' (cwd, value, file, /tmp, SLURM_JOB_ID)"
timing "srun -N2 -n2 --container" $((SECONDS - t))

# ---- 4. node crash -> requeue -> rerun with SLURM_RESTART_COUNT=1
ts "node crash -> requeue"
t=$SECONDS
cat > "$W/requeue.sh" <<EOF
#!/bin/bash
echo "start on \$SLURMD_NODENAME restart=\${SLURM_RESTART_COUNT:-0}"
# the task sleeps 300 s on the first run (the node crashes under it), 1 s on the rerun
srun -n1 --container=$SIF python3 -c 'import sys, time; time.sleep(float(sys.argv[2]))' rkit-smoke-sleeper-$$ \
    "\$([ "\${SLURM_RESTART_COUNT:-0}" = 0 ] && echo 300 || echo 1)"
echo "end restart=\${SLURM_RESTART_COUNT:-0}"
EOF
j=$(sbatch --parsable --requeue -N1 --open-mode=append -o "$W/requeue-%j.out" "$W/requeue.sh")
sleeper_runs() { cluster-ns exec pgrep -f "^[^ ]*python3 -c .* rkit-smoke-sleeper-$$ " > /dev/null; }
wait_until 60 "job $j to start its container task" sleeper_runs
node=$(jfield "$j" NodeList)
timing "  submit -> container task running" $((SECONDS - t))
ts "crash $node under job $j"
"$TB" crash "$node"
tc=$SECONDS
sleep 1
if sleeper_runs; then fail "the job's container task outlived the crash of $node"; fi
ts "the job's container task died with $node"
wait_until 120 "job $j to be requeued" state_is "$j" PENDING
ts "job $j requeued $((SECONDS - tc))s after the crash ($(jfield "$j" Reason), restarts=$(jfield "$j" Restarts))"
timing "  crash -> requeued (PENDING)" $((SECONDS - tc))
tr=$SECONDS
scontrol update jobid="$j" StartTime=now
wait_until 120 "job $j to complete" state_is "$j" COMPLETED
timing "  release (StartTime=now) -> rerun done" $((SECONDS - tr))
sed 's/^/    /' "$W/requeue-$j.out"
grep -q '^start on c[1-3] restart=0$' "$W/requeue-$j.out" || fail "no first run in the output"
grep -q '^start on c[1-3] restart=1$' "$W/requeue-$j.out" || fail "no rerun in the output"
grep -q '^end restart=1$' "$W/requeue-$j.out" || fail "the rerun did not finish with SLURM_RESTART_COUNT=1"
! grep -q '^end restart=0$' "$W/requeue-$j.out" || fail "the first run finished despite the crash"
ts "restore $node"
t2=$SECONDS
"$TB" restore "$node"
timing "  restore $node" $((SECONDS - t2))
[ "$(srun -N3 -n3 bash -c 'echo $SLURMD_NODENAME' | sort -u | wc -l)" = 3 ] || fail "srun -N3 after restore"
"$TB" status > /dev/null || fail "the test bed is not healthy after the crash test"
timing "node crash test, total" $((SECONDS - t))

rm -rf "$W"
ts "all passed"
printf '    %s\n' "${TIMES[@]}"
echo "    total: $((SECONDS - T0))s"
