#!/bin/bash
# Build the vmcsnap guest: OUT_DIR/vmlinuz and OUT_DIR/initrd.img.
#
#   guest/build.sh OUT_DIR
#
# Everything comes from Debian packages, nothing needs to be installed for
# the guest itself:
#   vmlinuz     the stock Debian cloud kernel: the package that the metapackage
#               linux-image-cloud-amd64 depends on, fetched with apt-get download
#               and unpacked with dpkg-deb (no install, no root needed for this)
#   initrd.img  gzip'd newc cpio with busybox (static) and its applet links,
#               the virtio-mmio/blk/net modules, ./init as /init, and the
#               programs of ./src compiled with gcc -static
#   vmlinux     the same kernel uncompressed (ELF with a PVH entry): QEMU boots
#               it with -kernel ~1 s faster under TCG; only written if it
#               could be extracted (for Debian's LZ4 kernels: package lz4)
# Also written: OUT_DIR/kernel-package (the package and version used).
#
# Host tools needed (Debian packages): apt, dpkg, gcc + libc6-dev, cpio, gzip,
# busybox-static; lz4 (optional: vmlinux); xz-utils or zstd only if the
# kernel's modules are compressed.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
START=$SECONDS
# Virtio modules in dependency order (virtio needs virtio_ring, virtio_net
# needs net_failover needs failover). ext4 is built into the cloud kernel.
MODULES="virtio_ring virtio virtio_mmio virtio_blk failover net_failover virtio_net"
PROGRAMS="memtouch pingpong kvserver kvload"
METAPACKAGE=linux-image-cloud-amd64

say() { echo "build.sh [$((SECONDS - START))s]: $*"; }
die() {
    echo "build.sh: error: $*" >&2
    exit 1
}
need() { # need COMMAND DEBIAN_PACKAGE
    command -v "$1" >/dev/null 2>&1 ||
        die "$1 not found: install the Debian package $2 (apt-get install $2)"
}

if [ $# -ne 1 ] || [ -z "$1" ]; then
    die "usage: build.sh OUT_DIR"
fi
OUT=$1

need apt-cache apt
need apt-get apt
need dpkg-deb dpkg
need gcc gcc
need cpio cpio
need gzip gzip
need find findutils
need busybox busybox-static
BUSYBOX=$(command -v busybox)
if ldd "$BUSYBOX" >/dev/null 2>&1; then
    die "$BUSYBOX is dynamically linked: install the Debian package busybox-static (apt-get install busybox-static)"
fi
LIBC_A=$(gcc -print-file-name=libc.a)
[ -f "$LIBC_A" ] || die "static libc (libc.a) not found: install the Debian package libc6-dev (apt-get install libc6-dev)"
for f in init src/common.h; do
    [ -f "$HERE/$f" ] || die "missing $HERE/$f (build.sh must sit next to init and src/)"
done

mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vmcsnap-guest-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# ---------------------------------------------------------------- kernel
resolve_kernel() {
    apt-cache depends "$METAPACKAGE" 2>/dev/null |
        awk '$1 ~ /Depends:$/ && $2 ~ /^linux-image-[0-9]/ { print $2; exit }'
}

say "resolving the kernel package behind $METAPACKAGE"
KPKG=$(resolve_kernel || true)
if [ -z "$KPKG" ]; then
    say "apt-cache does not know $METAPACKAGE: running apt-get update"
    apt-get update -qq || die "apt-get update failed (run it as root, and check the Debian mirror is reachable)"
    KPKG=$(resolve_kernel || true)
    [ -n "$KPKG" ] || die "cannot resolve $METAPACKAGE with apt-cache: is this Debian with main in sources.list?"
fi

mkdir -p "$WORK/deb"
# apt drops privileges to _apt for downloads: let it write here.
if [ "$(id -u)" = 0 ] && id _apt >/dev/null 2>&1; then
    chown _apt "$WORK/deb"
fi
download() {
    (cd "$WORK/deb" && apt-get download -q "$KPKG" >"$WORK/download.log" 2>&1)
}
say "downloading $KPKG"
if ! download; then
    say "download failed (stale package lists?): running apt-get update and retrying"
    apt-get update -qq || die "apt-get update failed: $(tail -3 "$WORK/download.log")"
    KPKG=$(resolve_kernel || true)
    [ -n "$KPKG" ] || die "cannot resolve $METAPACKAGE after apt-get update"
    download || die "apt-get download $KPKG failed: $(tail -3 "$WORK/download.log")"
fi
DEB=$(ls "$WORK"/deb/*.deb)
KVER_PKG=$(dpkg-deb -f "$DEB" Version)
say "unpacking $(basename "$DEB")"
dpkg-deb -x "$DEB" "$WORK/kernel"
VMLINUZ=$(find "$WORK/kernel/boot" -name 'vmlinuz-*' 2>/dev/null | head -1 || true)
[ -n "$VMLINUZ" ] || die "no boot/vmlinuz-* in $DEB"
MODDIR=$(find "$WORK/kernel/lib/modules" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | head -1 || true)
[ -n "$MODDIR" ] || die "no lib/modules/*/ in $DEB"

# An uncompressed copy for QEMU's PVH entry (-kernel vmlinux): the kernel
# then needs no self-decompression, which under TCG saves about 1 s per boot.
# Like the kernel's scripts/extract-vmlinux: find the payload's magic, unpack
# from there (trailing data makes the tool complain: judge by the result).
extract_vmlinux() { # MAGIC(grep -P) TOOL PACKAGE
    local off
    command -v "$2" >/dev/null 2>&1 || return 1
    for off in $(LC_ALL=C grep -obUaP "$1" "$VMLINUZ" | head -5 | cut -d: -f1); do
        tail -c +$((off + 1)) "$VMLINUZ" | "$2" -dc >"$WORK/vmlinux" 2>/dev/null || true
        if [ "$(head -c 4 "$WORK/vmlinux" | od -An -c | tr -d ' ')" = '177ELF' ]; then
            return 0
        fi
    done
    rm -f "$WORK/vmlinux"
    return 1
}
VMLINUX_NOTE=
if LC_ALL=C grep -qaP '\x02\x21\x4c\x18' "$VMLINUZ" && ! command -v lz4 >/dev/null 2>&1; then
    VMLINUX_NOTE="install the Debian package lz4 for an uncompressed vmlinux (about 1 s faster boots)"
elif extract_vmlinux '\x02\x21\x4c\x18' lz4 lz4 ||
    extract_vmlinux '\x28\xb5\x2f\xfd' zstd zstd ||
    extract_vmlinux '\xfd\x37\x7a\x58\x5a\x00' xz xz-utils ||
    extract_vmlinux '\x1f\x8b\x08' gzip gzip; then
    say "extracted the uncompressed kernel (vmlinux, PVH entry)"
else
    VMLINUX_NOTE="could not extract an uncompressed vmlinux from $(basename "$VMLINUZ")"
fi
[ -z "$VMLINUX_NOTE" ] || say "warning: $VMLINUX_NOTE; the guest boots from vmlinuz instead"

# ---------------------------------------------------------------- root fs
ROOT=$WORK/root
mkdir -p "$ROOT"/{bin,dev,proc,sys,tmp,run,data,root,etc,lib/modules}
ln -s bin "$ROOT/sbin"
mkdir -p "$ROOT/usr"
ln -s ../bin "$ROOT/usr/bin"
ln -s ../bin "$ROOT/usr/sbin"

say "adding modules: $MODULES"
: >"$ROOT/lib/modules/order"
for m in $MODULES; do
    src=$(find "$MODDIR" -name "$m.ko" -o -name "$m.ko.xz" -o -name "$m.ko.zst" -o -name "$m.ko.gz" | head -1 || true)
    [ -n "$src" ] || die "module $m not found in $KPKG"
    dst=$ROOT/lib/modules/$m.ko
    case "$src" in
    *.ko) cp "$src" "$dst" ;;
    *.ko.xz)
        need xz xz-utils
        xz -dc "$src" >"$dst"
        ;;
    *.ko.zst)
        need zstd zstd
        zstd -qdc "$src" >"$dst"
        ;;
    *.ko.gz) gzip -dc "$src" >"$dst" ;;
    esac
    echo "$m" >>"$ROOT/lib/modules/order"
done

say "adding busybox ($BUSYBOX) and its applet links"
cp "$BUSYBOX" "$ROOT/bin/busybox"
for applet in $("$BUSYBOX" --list); do
    case "$applet" in
    busybox | */*) ;;
    *) ln -sf busybox "$ROOT/bin/$applet" ;;
    esac
done

for p in $PROGRAMS; do
    say "compiling $p"
    gcc -static -O2 -Wall -Wextra -s -o "$ROOT/bin/$p" "$HERE/src/$p.c"
done

install -m 0755 "$HERE/init" "$ROOT/init"
echo "root:x:0:0:root:/root:/bin/sh" >"$ROOT/etc/passwd"
echo "root:x:0:" >"$ROOT/etc/group"

say "writing initrd.img"
(cd "$ROOT" && find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) | gzip -6 -n >"$WORK/initrd.img"

# Move into OUT_DIR only once everything succeeded.
cp "$VMLINUZ" "$OUT/vmlinuz"
if [ -f "$WORK/vmlinux" ]; then
    mv "$WORK/vmlinux" "$OUT/vmlinux"
else
    rm -f "$OUT/vmlinux"
fi
mv "$WORK/initrd.img" "$OUT/initrd.img"
echo "$KPKG $KVER_PKG" >"$OUT/kernel-package"
say "done in $OUT: $KPKG $KVER_PKG, initrd.img $(stat -c %s "$OUT/initrd.img") bytes," \
    "$([ -f "$OUT/vmlinux" ] && echo "vmlinux + vmlinuz" || echo "vmlinuz only")"
