#!/usr/bin/env bash
# Installs the Debian packages vmcsnap needs, if any is missing.
# qemu-system-x86: the hypervisor; qemu-utils: qemu-img; busybox-static,
# cpio, e2fsprogs: guest initramfs and data disks; gcc: guest programs;
# graphviz: the PNG of `inspect --rdg --dot FILE`; genisoimage: the cloud-init
# NoCloud seed of image VMs (and isoinfo, its tests); mmdebstrap: `image
# build`; redis-server, redis-tools: the test of the guest program redisload
# and `vmcsnap exec -- redis-cli` against the Redis example cluster;
# openssh-client: the cloud-init test logs in with the key its seed gave.
set -euo pipefail
pkgs=(qemu-system-x86 qemu-utils busybox-static cpio e2fsprogs gcc libc6-dev binutils lz4 make graphviz genisoimage mmdebstrap redis-server redis-tools openssh-client)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "installing: ${missing[*]}" >&2
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null; then
    echo "cargo not found: install Rust (rustup) first" >&2
    exit 1
fi
# `make lint` (part of `make test`) needs clippy and rustfmt.
for c in clippy rustfmt; do
    if ! cargo "${c/rustfmt/fmt}" --version >/dev/null 2>&1; then
        rustup component add "$c"
    fi
done
