#!/bin/bash
# Build a vmcsnap lab image: a Debian root file system (bookworm or trixie) with systemd,
# made from Debian's packages only, as a qcow2 disk plus the kernel and
# initramfs to boot it directly (QEMU -kernel/-initrd, no boot loader).
#
#   guest/image/build-image.sh OUT_DIR
#
# Inputs (environment; the Rust crate vmcsnap-guest sets them, see
# docs/images.md):
#   IMAGE_NAME       recipe name (written into /etc/vmcsnap-image)
#   IMAGE_SUITE      Debian suite: bookworm (12, kernel 6.1) or trixie (13, kernel 6.12)
#   IMAGE_MIRROR     Debian archive URI with that suite's main
#   IMAGE_PACKAGES   extra packages, space-separated
#   IMAGE_SERVICES   units the workload starts after, space-separated
#   IMAGE_PROGRAMS   programs of ../src to compile (gcc -static) into /usr/local/bin
#   IMAGE_SIZE_MIB   virtual size of the disk (ext4; sparse)
# Writes OUT_DIR/disk.qcow2, vmlinuz, initrd.img, kernel-version, packages.txt.
#
# Needs root (mmdebstrap --mode=root) and the Debian packages mmdebstrap,
# e2fsprogs (mkfs.ext4 -d), qemu-utils (qemu-img), gcc + libc6-dev.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
START=$SECONDS
say() { echo "build-image.sh [$((SECONDS - START))s]: $*"; }
die() {
    echo "build-image.sh: error: $*" >&2
    exit 1
}
need() { # need COMMAND DEBIAN_PACKAGE
    command -v "$1" >/dev/null 2>&1 ||
        die "$1 not found: install the Debian package $2 (apt-get install $2)"
}

[ $# -eq 1 ] && [ -n "$1" ] || die "usage: build-image.sh OUT_DIR"
OUT=$1
: "${IMAGE_NAME:?}" "${IMAGE_SUITE:?}" "${IMAGE_MIRROR:?}" "${IMAGE_SIZE_MIB:?}"
IMAGE_PACKAGES=${IMAGE_PACKAGES:-}
IMAGE_SERVICES=${IMAGE_SERVICES:-}
IMAGE_PROGRAMS=${IMAGE_PROGRAMS:-}
[ "$(id -u)" = 0 ] || die "building an image needs root (mmdebstrap --mode=root)"
need mmdebstrap mmdebstrap
need mkfs.ext4 e2fsprogs
need qemu-img qemu-utils
need gcc gcc

# What every image has: systemd as init, udev, networkd, the suite's Debian
# cloud kernel (bookworm 6.1, trixie 6.12: a 6.12 guest needs -cpu max,-cx16
# under QEMU 7.2's TCG, which the agent gives it) with its own initramfs, the
# QEMU guest agent, sshd, hwclock (util-linux-extra: the agent sets the RTC
# after a restore).
BASE="systemd-sysv udev dbus iproute2 procps linux-image-cloud-amd64 initramfs-tools qemu-guest-agent openssh-server util-linux-extra"
case $IMAGE_SUITE in
bookworm | trixie) ;;
*) die "unknown suite $IMAGE_SUITE: bookworm or trixie" ;;
esac
INCLUDE=$(echo $BASE $IMAGE_PACKAGES | tr ' ' ',')

WORK=$(mktemp -d "${TMPDIR:-/tmp}/vmcsnap-image-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/bin"
for p in $IMAGE_PROGRAMS; do
    say "compiling $p"
    gcc -static -O2 -Wall -Wextra -s -o "$WORK/bin/$p" "$HERE/../src/$p.c"
done

ROOT=$WORK/root
say "mmdebstrap $IMAGE_SUITE ($IMAGE_NAME): $INCLUDE"
# The customize hook runs on the host with the root directory as $1.
export IMAGE_NAME IMAGE_SERVICES IMAGE_PROGRAMS
export IMAGE_BIN=$WORK/bin
mmdebstrap --mode=root --variant=minbase --components=main \
    --include="$INCLUDE" \
    --customize-hook="bash '$HERE/customize.sh' \"\$1\"" \
    "$IMAGE_SUITE" "$ROOT" "$IMAGE_MIRROR"

say "root file system: $(du -sh --apparent-size "$ROOT" | cut -f1)"
VMLINUZ=$(ls "$ROOT"/boot/vmlinuz-* 2>/dev/null | head -1 || true)
[ -n "$VMLINUZ" ] || die "no /boot/vmlinuz-* in the image"
KVER=${VMLINUZ##*/vmlinuz-}
[ -f "$ROOT/boot/initrd.img-$KVER" ] || die "no /boot/initrd.img-$KVER in the image (initramfs-tools failed?)"
cp "$VMLINUZ" "$WORK/vmlinuz"
cp "$ROOT/boot/initrd.img-$KVER" "$WORK/initrd.img"
echo "$KVER" >"$WORK/kernel-version"
chroot "$ROOT" dpkg-query -W -f '${Package} ${Version}\n' >"$WORK/packages.txt"

say "making the ext4 file system (${IMAGE_SIZE_MIB} MiB, mkfs.ext4 -d) and the qcow2"
truncate -s "${IMAGE_SIZE_MIB}M" "$WORK/disk.raw"
mkfs.ext4 -q -F -L root -d "$ROOT" "$WORK/disk.raw"
qemu-img convert -q -f raw -O qcow2 "$WORK/disk.raw" "$WORK/disk.qcow2"

mkdir -p "$OUT"
for f in disk.qcow2 vmlinuz initrd.img kernel-version packages.txt; do
    mv "$WORK/$f" "$OUT/$f"
done
say "done: kernel $KVER, disk $(du -h "$OUT/disk.qcow2" | cut -f1)," \
    "$(wc -l <"$OUT/packages.txt") packages"
