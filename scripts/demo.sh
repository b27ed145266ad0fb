#!/usr/bin/env bash
# The demo: boot examples/demo.toml, show the VMs talking, tear it down.
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
$V inspect demo-alpha --verify | head -n 12
echo
echo "== vmcsnap rejuvenate --all --mode warm   (restart every QEMU; guests keep memory and TCP sessions)"
$V rejuvenate --all --mode warm
sleep 3
echo "== beta after the restart (same pingpong connection: conn=1)"
$V console beta --bytes 3000 | grep -E '^(pingpong|kvload)' | tail -n 2 || true
echo
echo "== vmcsnap down"
$V down
trap - EXIT
