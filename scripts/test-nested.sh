#!/usr/bin/env bash
# make test-nested: the DAMON access-data test in a nested VM (opt-in; not
# part of `make test`). DAMON is never touched on this host: everything
# DAMON happens in a Debian 12 VM with the bookworm-backports 6.12 kernel,
# booted under TCG (-cpu max,-cx16: 6.12 double-faults on cmpxchg16b under
# QEMU 7.2 TCG), which runs the vmcsnap agent and a one-VM lab cluster whose
# guest only reads a 32 MiB buffer; a hot snapshot with an access window
# must give access/accessed.json covering >= 90% of that buffer's pages,
# and listing less than half of the guest's RAM (256 MiB: 65536 pages).
#
# The nested VM's image is built once (root, mmdebstrap, ~1-2 min) and
# cached in $VMCSNAP_CACHE (default ~/.cache/vmcsnap)/nested-damon-<key>/.
# Inputs go in on a second disk (ext4 made with mkfs.ext4 -d, nothing
# mounted on the host), results come back on it (read with debugfs).
#
# Environment: NESTED_ACCESS_WINDOW (s, default 20), NESTED_TIMEOUT (s,
# default 5400), NESTED_SWEEPS_BEFORE (memtouch read sweeps to wait for
# before the snapshot, default 1), NESTED_RESTORES (1, default: then a
# workingset and a lazy restore of the snapshot, for their demand faults;
# not checked), NESTED_KEEP=1 keeps the work directory.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
say() { echo "test-nested [$((SECONDS - START))s]: $*"; }
die() { echo "test-nested: error: $*" >&2; exit 1; }
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
V=$CARGO_TARGET_DIR/release/vmcsnap
WINDOW=${NESTED_ACCESS_WINDOW:-20}
TIMEOUT=${NESTED_TIMEOUT:-5400}
for c in qemu-system-x86_64 qemu-img mkfs.ext4 debugfs strip; do
    command -v $c >/dev/null || die "$c not found (make deps; debugfs is in e2fsprogs, strip in binutils)"
done

say "building vmcsnap and the coverage check"
cargo build --release -p vmcsnap --bins -q
cargo build --release -p vmcsnap-workingset --example access_coverage -q
say "guest assets (inner lab VM)"
GOUT=$("$V" guest build 2>&1) || die "vmcsnap guest build failed: $GOUT"
echo "$GOUT"
GUEST=$(echo "$GOUT" | sed -n 's/^guest assets \([0-9a-f]*\) .*: \(.*\)$/\2/p' | tail -1)
[ -d "$GUEST" ] || die "could not find the guest assets directory in \`vmcsnap guest build\`'s output"

CACHE=${VMCSNAP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vmcsnap}
KEY=$(sha256sum scripts/nested/build-image.sh | cut -c1-16)
IMG=$CACHE/nested-damon-$KEY
if [ ! -f "$IMG/complete" ]; then
    say "building the nested VM image into $IMG (once)"
    rm -rf "$IMG.tmp"
    scripts/nested/build-image.sh "$IMG.tmp"
    rm -rf "$IMG"; mv "$IMG.tmp" "$IMG"
fi
say "nested image: $IMG (kernel $(cat "$IMG/kernel-version"))"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/vmcsnap-nested.XXXXXX")
[ "${NESTED_KEEP:-}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
IN=$WORK/in
mkdir -p "$IN/bin" "$IN/cache" "$IN/out"
strip -o "$IN/bin/vmcsnap" "$V"
cp -a "$GUEST" "$IN/cache/"
cp scripts/nested/run-inside.sh "$IN/run-inside.sh"
printf 'ACCESS_WINDOW=%s\nSWEEPS_BEFORE=%s\nRESTORES=%s\n' "$WINDOW" "${NESTED_SWEEPS_BEFORE:-1}" \
    "${NESTED_RESTORES:-1}" >"$IN/env"
truncate -s 4G "$WORK/in.raw"
mkfs.ext4 -q -F -L nested -d "$IN" "$WORK/in.raw"
qemu-img create -q -f qcow2 -b "$IMG/disk.qcow2" -F qcow2 "$WORK/root.qcow2"

# The guest's TSC ticks at the host's rate under TCG; left to calibrate it
# against the PIT on a busy host, the kernel hangs (as vmcsnap's own guests
# would: see kernel_cmdline() in crates/guest).
KHZ=${NESTED_TSC_KHZ:-$(awk '/^cpu MHz/ { printf "%d", $4 * 1000; exit }' /proc/cpuinfo)}
TSC=${KHZ:+tsc_early_khz=$KHZ tsc=reliable no_timer_check}
say "booting the nested VM (TCG, 3 GiB, -cpu max,-cx16; timeout ${TIMEOUT}s; serial: $WORK/serial.log)"
T_BOOT=$SECONDS
set +e
timeout "$TIMEOUT" nice -n 10 qemu-system-x86_64 -accel tcg -cpu max,-cx16 -M microvm,acpi=on \
    -m 3G -smp 2 -nographic -no-reboot \
    -kernel "$IMG/vmlinuz" -initrd "$IMG/initrd.img" \
    -append "console=ttyS0 root=/dev/vda rw init=/usr/local/sbin/nested-init panic=-1 quiet $TSC" \
    -drive id=root,file="$WORK/root.qcow2",if=none,format=qcow2 -device virtio-blk-device,drive=root \
    -drive id=in,file="$WORK/in.raw",if=none,format=raw -device virtio-blk-device,drive=in \
    </dev/null >"$WORK/serial.log" 2>&1 &
QPID=$!
tail -F -n +1 "$WORK/serial.log" 2>/dev/null | grep --line-buffered '^NESTED' &
TPID=$!
wait $QPID
QRC=$?
kill $TPID 2>/dev/null
set -e
NESTED_S=$((SECONDS - T_BOOT))
say "nested VM ended (rc $QRC) after ${NESTED_S}s"
mkdir -p "$WORK/back"
debugfs -R "rdump /out $WORK/back" "$WORK/in.raw" >/dev/null 2>&1 || true
RESULTS=${NESTED_RESULTS:-$CARGO_TARGET_DIR/nested-damon}
rm -rf "$RESULTS"; mkdir -p "$RESULTS"
cp -a "$WORK/back/out/." "$RESULTS/" 2>/dev/null || true
cp "$WORK/serial.log" "$RESULTS/"
echo "nested_seconds=$NESTED_S" >"$RESULTS/timing.txt"
say "results in $RESULTS"
[ -f "$RESULTS/accessed.json" ] || die "no access/accessed.json came back (see $RESULTS/serial.log)"
"$CARGO_TARGET_DIR/release/examples/access_coverage" "$RESULTS/accessed.json" "$RESULTS/console.log" 90 32768 |
    tee "$RESULTS/coverage.txt"
