#!/usr/bin/env bash
# Installs Debian's build of a QEMU version beside the system's, without
# replacing or configuring anything host-wide, and prints the path of its
# qemu-system-x86_64 as the last line (give it to vmcsnap as VMCSNAP_QEMU).
#
#   scripts/install-qemu.sh 10.0      # bookworm-backports on Debian 12, trixie on 13
#   scripts/install-qemu.sh 7.2       # the system's QEMU on Debian 12
#
# The packages (qemu-system-x86, -common, -data, seabios, ipxe-qemu) are
# downloaded with a private apt state (its own sources list and lists under the
# prefix: the host's apt configuration is read-only to this script) and
# unpacked with `dpkg -x` into
#   ${VMCSNAP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vmcsnap}/qemu-VERSION/root
# with the BIOS and option ROMs linked into its usr/share/qemu. vmcsnap finds
# that firmware (-L) and the modules (usr/lib/x86_64-linux-gnu/qemu) from the
# binary's path (docs/qemu-versions.md). A second run finds the installation
# and prints the same path.
set -euo pipefail

want=${1:-}
case "$want" in
    7.2 | 10.0) ;;
    *)
        echo "usage: $0 7.2|10.0 (the QEMU versions vmcsnap supports)" >&2
        exit 2
        ;;
esac

log() { echo "install-qemu: $*" >&2; }

# `qemu --version` of BIN is WANT.x?
is_version() {
    local bin=$1
    shift
    local out
    out=$("$bin" --version 2>/dev/null | head -1) || return 1
    [[ "$out" == "QEMU emulator version $want"* ]]
}

. /etc/os-release
system_qemu=/usr/bin/qemu-system-x86_64
if [ -x "$system_qemu" ] && is_version "$system_qemu"; then
    log "the system's QEMU is $want already"
    echo "$system_qemu"
    exit 0
fi

case "$VERSION_CODENAME:$want" in
    bookworm:10.0) suite=bookworm-backports ;;
    trixie:10.0) suite=trixie ;;
    *)
        echo "install-qemu: no Debian package of QEMU $want for $PRETTY_NAME here; QEMU 7.2 is Debian 12's system QEMU (apt-get install qemu-system-x86), QEMU 10.0 is in bookworm-backports (Debian 12) and trixie (Debian 13)" >&2
        exit 1
        ;;
esac

cache=${VMCSNAP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vmcsnap}
prefix=$cache/qemu-$want
bin=$prefix/root/usr/bin/qemu-system-x86_64
if [ -x "$bin" ] && is_version "$bin" && [ -f "$prefix/installed" ]; then
    log "QEMU $want is installed in $prefix"
    echo "$bin"
    exit 0
fi

command -v dpkg >/dev/null && command -v apt-get >/dev/null || {
    echo "install-qemu: needs Debian's apt-get and dpkg" >&2
    exit 1
}
mirror=$(sed -n 's/^URIs: *\(http[^ ]*debian\)\/* *$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
mirror=${mirror:-http://deb.debian.org/debian}
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

# A fresh staging directory: a half-done earlier run never counts.
stage=$prefix.stage
rm -rf "$stage"
mkdir -p "$stage/lists/partial" "$stage/cache/archives/partial" "$stage/debs"
# The base suite too: ipxe-qemu has no backport.
{
    echo "deb [signed-by=$keyring] $mirror $VERSION_CODENAME main"
    [ "$suite" = "$VERSION_CODENAME" ] || echo "deb [signed-by=$keyring] $mirror $suite main"
} >"$stage/sources.list"
apt_opts=(
    -o "Dir::Etc::SourceList=$stage/sources.list"
    -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::State::Lists=$stage/lists"
    -o "Dir::Cache=$stage/cache"
    -o "Debug::NoLocking=1"
    -o "APT::Sandbox::User=root"
)
log "reading $suite's package list from $mirror"
apt-get "${apt_opts[@]}" -qq update >&2
pkgs=(qemu-system-x86 qemu-system-common qemu-system-data seabios ipxe-qemu)
log "downloading ${pkgs[*]} ($suite)"
for p in "${pkgs[@]}"; do
    (cd "$stage/debs" && { apt-get "${apt_opts[@]}" -qq download "$p/$suite" >&2 2>/dev/null ||
        apt-get "${apt_opts[@]}" -qq download "$p" >&2; })
done
for deb in "$stage"/debs/*.deb; do
    dpkg -x "$deb" "$stage/root"
done
# One firmware directory for `-L`: the BIOS and option ROMs linked beside
# QEMU's own files (Debian's build looks for them under /usr only).
for f in "$stage"/root/usr/share/seabios/* "$stage"/root/usr/lib/ipxe/qemu/*; do
    name=$(basename "$f")
    [ -e "$stage/root/usr/share/qemu/$name" ] && continue
    case "$f" in
        */seabios/*) ln -s "../seabios/$name" "$stage/root/usr/share/qemu/$name" ;;
        *) ln -s "../../lib/ipxe/qemu/$name" "$stage/root/usr/share/qemu/$name" ;;
    esac
done

missing=$(ldd "$stage/root/usr/bin/qemu-system-x86_64" | awk '/not found/ {print $1}' | tr '\n' ' ')
if [ -n "$missing" ]; then
    echo "install-qemu: QEMU $want from $suite needs libraries this system lacks: $missing(install the Debian packages that ship them, then run this again)" >&2
    exit 1
fi
if ! is_version "$stage/root/usr/bin/qemu-system-x86_64"; then
    echo "install-qemu: the downloaded qemu-system-x86_64 does not report version $want: $("$stage/root/usr/bin/qemu-system-x86_64" --version 2>&1 | head -1)" >&2
    exit 1
fi

rm -rf "$prefix"
mkdir -p "$prefix"
mv "$stage/root" "$prefix/root"
ls "$stage/debs" >"$prefix/packages"
rm -rf "$stage"
"$bin" --version | head -1 >"$prefix/installed"
log "installed $(cat "$prefix/installed") in $prefix"
echo "$bin"
