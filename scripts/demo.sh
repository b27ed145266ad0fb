#!/usr/bin/env bash
# The demo: boot examples/demo.toml, show the VMs talking, snapshot one VM
# and the whole cluster (consistent, HotSnap), warm restart, restore one VM
# (eager vs working set), destroy the cluster and restore it whole from the
# cluster snapshot (HotRestore, restore line), tear it down.
set -euo pipefail
cd "$(dirname "$0")/.."
V=target/release/vmcsnap
export VMCSNAP_RUN_DIR="${VMCSNAP_RUN_DIR:-$(mktemp -d /tmp/vmcsnap-demo.XXXXXX)}"
cleanup() { $V down >/dev/null 2>&1 || true; }
trap cleanup EXIT

echo "== vmcsnap up examples/demo.toml"
$V up examples/demo.toml
echo
echo "== letting the workloads run for 10 s"
sleep 10
echo "== vmcsnap status"
$V status
echo
for vm in alpha beta gamma; do
    echo "== last workload lines of $vm"
    $V console "$vm" --bytes 6000 | grep -E '^(memtouch|pingpong|kvload|kvserver)' | tail -n 3 || true
done
echo
echo "== vmcsnap snapshot alpha --mode hot   (ms pause; memory saved copy-on-write while alpha runs)"
$V snapshot alpha --mode hot --name demo-alpha
$V snapshots
echo "== vmcsnap inspect demo-alpha --verify"
$V inspect demo-alpha --verify | sed -n 1,12p
echo
echo "== vmcsnap snapshot --cluster   (every VM at once, consistent: pauses start together, the switch logs frames in flight)"
$V snapshot --cluster --name demo-cluster
echo "== vmcsnap inspect demo-cluster --verify"
$V inspect demo-cluster --verify
if python3 bench/timeline.py "$VMCSNAP_RUN_DIR/snapshots/demo-cluster" >/dev/null 2>&1; then
    echo "   timeline (HotSnap's figure 6): $VMCSNAP_RUN_DIR/snapshots/demo-cluster/timeline.png"
fi
echo
echo "== vmcsnap rejuvenate --all --mode warm   (restart every QEMU; guests keep memory and TCP sessions)"
$V rejuvenate --all --mode warm
sleep 3
echo "== beta after the restart (same pingpong connection: conn=1)"
$V console beta --bytes 3000 | grep -E '^(pingpong|kvload)' | tail -n 2 || true
echo
echo "== restore alpha from demo-alpha: eager (every page first) vs workingset (HotRestore: working set first, rest on demand)"
latency() { python3 -c 'import json,sys; r=json.load(sys.stdin); print("%8.1f ms  (%d pages before start, %d demand faults, full load %.0f ms)" % (r["restore_latency_ms"], r["ws_pages"], r["demand_faults"], r["full_load_ms"]))'; }
for mode in eager workingset; do
    $V stop alpha >/dev/null
    printf '%-11s guest running after ' "$mode"
    $V restore demo-alpha --mode "$mode" --wait --json 2>/dev/null | latency
done
echo "== beta's pingpong client and the restored alpha"
echo "   (alpha is back at its snapshot while beta kept going: their TCP connection no longer"
echo "    matches, so beta's client reconnects once TCP gives up; the cluster restore below avoids this)"
for _ in $(seq 1 60); do
    sleep 1
    $V console beta --bytes 3000 | grep -qE '^pingpong: t=.* conn=2 reqs=[1-9]' && break
done
$V console beta --bytes 3000 | grep -E '^pingpong' | tail -n 3 || true
echo
echo "== vmcsnap down   (the whole cluster is destroyed)"
$V down
echo
echo "== vmcsnap restore --cluster demo-cluster   (HotRestore: working sets first, starts in restore-line order,"
echo "   frames that were in flight at the cut replayed to their receivers)"
$V restore --cluster demo-cluster --mode hotrestore-rl
sleep 4
for vm in alpha beta gamma; do
    echo "== $vm after the cluster restore (its workloads go on from the snapshot, same TCP connections: conn=1)"
    $V console "$vm" --bytes 4000 | grep -E '^(memtouch|pingpong|kvload)' | tail -n 2 || true
done
echo
echo "== vmcsnap down"
$V down
trap - EXIT
