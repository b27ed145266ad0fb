#!/usr/bin/env bash
# The Redis demo: examples/redis.toml on Debian images vmcsnap builds
# (`vmcsnap image build redis`, about a minute the first time): a primary,
# a replica and a client checking every value it wrote. Shows replication
# from the host (`vmcsnap exec`), a warm restart of every QEMU, a hot
# cluster snapshot under load, the cluster destroyed and restored whole,
# and the replica and client carrying on without a full resync.
set -euo pipefail
cd "$(dirname "$0")/.."
V=target/release/vmcsnap
export VMCSNAP_RUN_DIR="${VMCSNAP_RUN_DIR:-$(mktemp -d /tmp/vmcsnap-redis.XXXXXX)}"
cleanup() { $V down >/dev/null 2>&1 || true; }
trap cleanup EXIT
cli() { $V exec -- redis-cli -h "$@"; }
load() { $V console client --bytes 4000 | grep -E 'redisload: t=.*(sets=|full-check)' | tail -n "${1:-2}" || true; }
link_up() { cli 10.77.0.3 info replication | grep -q 'master_link_status:up'; }
wait_link() { for _ in $(seq 120); do link_up && return 0; sleep 1; done; echo "replica link not up" >&2; return 1; }

echo "== vmcsnap up examples/redis.toml   (Debian bookworm + systemd + Redis; boots in 15-60 s under TCG)"
$V up examples/redis.toml
echo "== waiting for the replica to sync"
wait_link
echo "== from the host, through the cluster's network namespace: vmcsnap exec -- redis-cli -h 10.77.0.2 info replication"
cli 10.77.0.2 info replication | grep -E '^(role|connected_slaves|slave0)'
echo "== the client's load (every GET checked against what it wrote; a full check of every key every 10 s)"
sleep 12
load 3
sync_full=$(cli 10.77.0.2 info stats | grep sync_full | tr -d '\r')
echo
echo "== vmcsnap rejuvenate --all --mode warm   (every QEMU replaced; Redis keeps its memory and connections)"
$V rejuvenate --all --mode warm
sleep 4
load 2
echo
echo "== vmcsnap snapshot --cluster   (hot, under load: each VM paused for milliseconds)"
$V snapshot --cluster --name demo-redis
echo "== vmcsnap down   (the cluster is gone)"
$V down
echo "== vmcsnap restore --cluster demo-redis"
$V restore --cluster demo-redis
wait_link
echo "== after the restore: $sync_full before, now $(cli 10.77.0.2 info stats | grep sync_full | tr -d '\r') (no full resync)"
cli 10.77.0.3 info replication | grep -E '^(role|master_link_status)'
echo "== the client carries on, on the same connection, and its next full check finds every acknowledged key"
sleep 15
load 4
echo
echo "== vmcsnap down"
$V down
trap - EXIT
