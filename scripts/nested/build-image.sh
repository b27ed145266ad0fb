#!/bin/bash
# Build (once) the nested-VM image of `make test-nested`: Debian 12 with the
# bookworm-backports 6.12 cloud kernel (DAMON with virtual-address
# monitoring), QEMU 7.2 and what the vmcsnap agent needs, as a qcow2 plus
# the kernel and initramfs to boot it with -kernel/-initrd.
#
#   scripts/nested/build-image.sh OUT_DIR
#
# Writes OUT_DIR/{disk.qcow2,vmlinuz,initrd.img,kernel-version,damon-config}
# and OUT_DIR/complete last. The image has no systemd boot: the kernel runs
# /usr/local/sbin/nested-init, which mounts the second disk (/dev/vdb, the
# run's inputs) and runs its run-inside.sh.
#
# Environment: NESTED_MIRROR (default http://deb.debian.org/debian).
# Needs root (mmdebstrap --mode=root), mmdebstrap, e2fsprogs, qemu-utils.
set -euo pipefail
START=$SECONDS
say() { echo "nested/build-image.sh [$((SECONDS - START))s]: $*"; }
die() { echo "nested/build-image.sh: error: $*" >&2; exit 1; }
[ $# -eq 1 ] && [ -n "$1" ] || die "usage: build-image.sh OUT_DIR"
OUT=$1
MIRROR=${NESTED_MIRROR:-http://deb.debian.org/debian}
[ "$(id -u)" = 0 ] || die "building the nested image needs root (mmdebstrap --mode=root)"
for c in mmdebstrap mkfs.ext4 qemu-img; do
    command -v $c >/dev/null || die "$c not found (apt-get install mmdebstrap e2fsprogs qemu-utils)"
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/vmcsnap-nested-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
ROOT=$WORK/root
# The 6.12 kernel from backports (apt's pkg/suite syntax); everything else
# from bookworm: QEMU 7.2 as on the host, qemu-img, kmod for modprobe.
PKGS="udev kmod procps iproute2 e2fsprogs initramfs-tools qemu-system-x86 qemu-utils"
say "mmdebstrap bookworm + bookworm-backports kernel from $MIRROR"
mmdebstrap --mode=root --variant=minbase --components=main \
    --include="$(echo $PKGS | tr ' ' ',')" \
    --customize-hook='mkdir -p "$1/etc/initramfs-tools/conf.d" && echo MODULES=most >"$1/etc/initramfs-tools/conf.d/vmcsnap"' \
    --customize-hook='chroot "$1" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends -t bookworm-backports linux-image-cloud-amd64' \
    --customize-hook='echo "/dev/vda / ext4 rw,noatime 0 0" >"$1/etc/fstab"; echo nested >"$1/etc/hostname"' \
    --customize-hook='install -m 0755 /dev/stdin "$1/usr/local/sbin/nested-init" <<"INIT"
#!/bin/sh
# PID 1 of the nested test VM: mount the basics and the inputs disk, run it.
mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sys /sys
mountpoint -q /dev || mount -t devtmpfs dev /dev; mkdir -p /dev/shm /dev/pts
mount -t tmpfs -o size=2g shm /dev/shm; mount -t devpts pts /dev/pts
mount -t tmpfs tmp /tmp; mount -t tmpfs run /run
mount -o remount,rw /
mkdir -p /nested && mount /dev/vdb /nested
if [ -x /nested/run-inside.sh ]; then /nested/run-inside.sh; else echo "NESTED: no /nested/run-inside.sh"; fi
sync; umount /nested; echo "NESTED: done, rebooting"
# No systemd here: reboot through sysrq (QEMU runs with -no-reboot, so it exits).
echo b >/proc/sysrq-trigger
INIT' \
    bookworm "$ROOT" "deb $MIRROR bookworm main" "deb $MIRROR bookworm-backports main"

VMLINUZ=$(ls "$ROOT"/boot/vmlinuz-*6.1[2-9]* 2>/dev/null | tail -1 || true)
[ -n "$VMLINUZ" ] || die "no 6.12+ kernel in /boot: $(ls "$ROOT/boot")"
KVER=${VMLINUZ##*/vmlinuz-}
for k in "$ROOT"/boot/vmlinuz-*; do
    [ "$k" = "$VMLINUZ" ] || say "note: also installed: $k"
done
grep -E '^(# )?CONFIG_DAMON[A-Z_]*' "$ROOT/boot/config-$KVER" >"$WORK/damon-config" || true
say "kernel $KVER: $(tr '\n' ' ' <"$WORK/damon-config")"
grep -q '^CONFIG_DAMON_VADDR=y' "$WORK/damon-config" && grep -q '^CONFIG_DAMON_SYSFS=y' "$WORK/damon-config" ||
    die "kernel $KVER lacks CONFIG_DAMON_VADDR or CONFIG_DAMON_SYSFS (use the non-cloud flavour)"
cp "$VMLINUZ" "$WORK/vmlinuz"
cp "$ROOT/boot/initrd.img-$KVER" "$WORK/initrd.img"
echo "$KVER" >"$WORK/kernel-version"
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*
say "root file system: $(du -sh --apparent-size "$ROOT" | cut -f1); making the disk"
truncate -s 3G "$WORK/disk.raw"
mkfs.ext4 -q -F -L root -d "$ROOT" "$WORK/disk.raw"
qemu-img convert -q -f raw -O qcow2 "$WORK/disk.raw" "$WORK/disk.qcow2"
mkdir -p "$OUT"
for f in disk.qcow2 vmlinuz initrd.img kernel-version damon-config; do mv "$WORK/$f" "$OUT/$f"; done
touch "$OUT/complete"
say "done: $OUT ($(du -sh "$OUT" | cut -f1))"
