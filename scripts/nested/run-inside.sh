#!/bin/sh
# Runs inside the nested VM of `make test-nested` (as PID 1's child, root),
# from its inputs disk mounted at /nested: the vmcsnap agent and a one-VM
# lab cluster whose guest only reads a 32 MiB buffer (memtouch -W -P), a hot
# snapshot with an access window, then the files the host checks, into
# /nested/out. Progress lines start with "NESTED:" (on the serial console).
# Then, for the record (RESTORES=1, default), a `workingset` and a `lazy`
# restore of the snapshot with their demand faults.
# Settings: /nested/env (ACCESS_WINDOW, SWEEPS_BEFORE, RESTORES).
set -u
N=/nested
. $N/env
export PATH=$N/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root VMCSNAP_CACHE=$N/cache VMCSNAP_RUN_DIR=$N/run
T0=$(cut -d' ' -f1 /proc/uptime)
say() { echo "NESTED: [$(awk -v t0="$T0" '{printf "%.0f", $1 - t0}' /proc/uptime)s] $*"; }
OUT=$N/out
rm -rf "$OUT" "$VMCSNAP_RUN_DIR"; mkdir -p "$OUT"
say "kernel $(uname -r); DAMON: $(cat /sys/kernel/mm/damon/admin/kdamonds/nr_kdamonds 2>&1) kdamonds"
modprobe tun 2>/dev/null; modprobe veth 2>/dev/null; modprobe bridge 2>/dev/null
ip link set lo up

cat >$N/spec.toml <<SPEC
[cluster]
name = "nested"
accel = "tcg"
boot_timeout_s = 3600

[[vm]]
name = "reader"
memory_mib = 256
vcpus = 1
disk_mib = 64
workload = """
memtouch -m 32 -W -P -n 0 -i 5 &
"""
SPEC
say "vmcsnap up (inner VM: 256 MiB, memtouch -m 32 -W -P)"
if ! vmcsnap up $N/spec.toml >$OUT/up.log 2>&1; then
    say "vmcsnap up failed:"; tail -20 $OUT/up.log
    exit 1
fi
say "inner VM up; waiting for memtouch's fill, page frames and $SWEEPS_BEFORE read sweep(s)"
console() { vmcsnap console reader --bytes 4000000 2>/dev/null; }
i=0
while :; do
    console >$OUT/console-before.log
    if grep -q "^memtouch: pfns total=" $OUT/console-before.log &&
        grep -Eq "^memtouch: t=.* sweeps=([$SWEEPS_BEFORE-9]|[1-9][0-9])" $OUT/console-before.log; then
        break
    fi
    i=$((i + 1))
    if [ $i -gt 360 ]; then say "memtouch never got there:"; tail -5 $OUT/console-before.log; break; fi
    sleep 10
done
grep "^memtouch: \(start\|pfns total\)" $OUT/console-before.log | sed 's/^/NESTED: guest: /'
grep "^memtouch: t=" $OUT/console-before.log | tail -2 | sed 's/^/NESTED: guest: /'

say "hot snapshot with --access-window $ACCESS_WINDOW"
S0=$(date +%s)
vmcsnap snapshot reader --mode hot --name s1 --access-window "$ACCESS_WINDOW" --json >$OUT/snapshot.json 2>$OUT/snapshot.err
rc=$?
say "snapshot returned $rc after $(($(date +%s) - S0)) s: $(head -c 300 $OUT/snapshot.err | tr '\n' ' ')"
# The file comes once the window after the snapshot point is over.
F=$VMCSNAP_RUN_DIR/snapshots/s1/access/accessed.json
i=0
while [ ! -f $F ] && [ $i -lt $((ACCESS_WINDOW + 300)) ]; do sleep 5; i=$((i + 5)); done
say "accessed.json $( [ -f $F ] && echo "written $(($(date +%s) - S0)) s after the request, $(wc -c <$F) bytes" || echo MISSING)"
[ -f $F ] && cp $F $OUT/accessed.json
cp $VMCSNAP_RUN_DIR/snapshots/s1/manifest* $OUT/ 2>/dev/null
vmcsnap inspect s1 --json >$OUT/inspect.json 2>&1
grep -o '"access_data":"[^"]*"' $OUT/inspect.json | head -1 | sed 's/^/NESTED: manifest: /'
console >$OUT/console.log
grep "^memtouch: t=" $OUT/console.log | tail -1 | sed 's/^/NESTED: guest: /'
grep -c "MEMTOUCH-CORRUPTION" $OUT/console.log | sed 's/^/NESTED: corruption lines: /'
ls /sys/kernel/mm/damon/admin/kdamonds/ >$OUT/damon-after.txt; cat /sys/kernel/mm/damon/admin/kdamonds/nr_kdamonds >>$OUT/damon-after.txt
say "DAMON after: nr_kdamonds=$(cat /sys/kernel/mm/damon/admin/kdamonds/nr_kdamonds)"
grep -i "access data" $VMCSNAP_RUN_DIR/*.log 2>/dev/null | tail -5 | sed 's/^/NESTED: agent: /'
cp $VMCSNAP_RUN_DIR/*.log $OUT/ 2>/dev/null
if [ "${RESTORES:-1}" = 1 ] && [ -f $OUT/accessed.json ]; then
    # For the record, not part of the check: the first `workingset` restore
    # of the snapshot (its queue holds the accessed pages) against `lazy`,
    # demand faults in the guest's first 10 s. Workingset first: a restore
    # teaches the next ones.
    for mode in workingset lazy; do
        vmcsnap stop reader >/dev/null 2>&1
        say "restore s1 --mode $mode"
        vmcsnap restore s1 --mode $mode --json >$OUT/restore-$mode.json 2>$OUT/restore-$mode.err
        say "restore $mode returned $?: $(tr -d '\n' <$OUT/restore-$mode.json | grep -o '"restore_latency_ms":[0-9.]*\|"ws_pages":[0-9]*\|"demand_faults":[0-9]*\|"access_data":"[^"]*"\|"demand_faults_per_100ms":\[[0-9,]*\]\|"quality":{[^}]*}' | tr '\n' ' ')"
        sleep 12
    done
fi
vmcsnap down >/dev/null 2>&1
say "finished"
