#!/bin/bash
# mmdebstrap customize hook of build-image.sh: turns the freshly installed
# Debian root ($1) into a vmcsnap lab image. Runs on the host as root; the
# chroot has /proc, /sys and /dev mounted by mmdebstrap.
# Environment: IMAGE_NAME, IMAGE_SERVICES, IMAGE_PROGRAMS, IMAGE_BIN.
set -euo pipefail
R=$1
say() { echo "customize.sh: $*"; }
unit() { # unit NAME: write stdin to /etc/systemd/system/NAME
    mkdir -p "$R/etc/systemd/system/$(dirname "$1")"
    cat >"$R/etc/systemd/system/$1"
}

say "identity: hostname from DHCP, empty machine-id, root locked"
# No static hostname: systemd-networkd sets it from DHCP option 12
# (UseHostname=yes), or `systemd.hostname=` on the kernel command line.
rm -f "$R/etc/hostname"
# Every VM gets its own machine-id (and so DHCP client id) at first boot.
: >"$R/etc/machine-id"
rm -f "$R/var/lib/dbus/machine-id"
chroot "$R" passwd -q -l root
echo "$IMAGE_NAME" >"$R/etc/vmcsnap-image"

echo "/dev/vda / ext4 rw,noatime,errors=remount-ro 0 0" >"$R/etc/fstab"

say "network: systemd-networkd, DHCP on en* eth*"
mkdir -p "$R/etc/systemd/network"
cat >"$R/etc/systemd/network/80-vmcsnap-dhcp.network" <<'UNIT'
[Match]
Name=en* eth*

[Network]
DHCP=yes

[DHCPv4]
UseHostname=yes
UNIT
# One NIC: network-online as soon as any link is up, and do not hold the
# workload for two minutes when DHCP never answers. Without any NIC there is
# nothing to wait for (virtio_net is loaded in the initramfs, so the NIC
# exists before systemd checks this).
unit systemd-networkd-wait-online.service.d/vmcsnap.conf <<'UNIT'
[Unit]
ConditionPathExistsGlob=|/sys/class/net/en*
ConditionPathExistsGlob=|/sys/class/net/eth*

[Service]
ExecStart=
ExecStart=/lib/systemd/systemd-networkd-wait-online --any --timeout=60
UNIT
chroot "$R" systemctl enable systemd-networkd.service

say "modules: qemu_fw_cfg (the workload), virtio for microvm and q35 in the initramfs"
mkdir -p "$R/etc/modules-load.d"
echo qemu_fw_cfg >"$R/etc/modules-load.d/vmcsnap.conf"
mkdir -p "$R/etc/initramfs-tools/conf.d"
echo "MODULES=most" >"$R/etc/initramfs-tools/conf.d/vmcsnap"
for m in virtio_mmio virtio_pci virtio_blk virtio_net; do
    grep -qx "$m" "$R/etc/initramfs-tools/modules" 2>/dev/null || echo "$m" >>"$R/etc/initramfs-tools/modules"
done

say "consoles, sshd, guest agent"
chroot "$R" systemctl enable serial-getty@ttyS0.service ssh.service
# qemu-guest-agent has no [Install]: udev starts it when the virtio port
# org.qemu.guest_agent.0 appears (BindsTo= that device). Check it still does.
if ! grep -rqs 'org.qemu.guest_agent.0' "$R/lib/udev/rules.d" "$R/usr/lib/udev/rules.d"; then
    echo "customize.sh: error: qemu-guest-agent's udev rule for org.qemu.guest_agent.0 not found" >&2
    exit 1
fi

say "masking units that only slow down a lab VM's boot"
# e2scrub_reap cleans up LVM snapshots of e2scrub (there is no LVM); the
# timers do maintenance a throw-away VM never needs, and would run at
# random times in the middle of a measurement.
for u in e2scrub_reap.service e2scrub_all.timer apt-daily.timer apt-daily-upgrade.timer \
    fstrim.timer man-db.timer dpkg-db-backup.timer; do
    chroot "$R" systemctl mask "$u" >/dev/null
done

say "vmcsnap units: workload (fw_cfg opt/vmcsnap/workload), ready (port org.vmcsnap.events)"
mkdir -p "$R/usr/local/lib/vmcsnap"
cat >"$R/usr/local/lib/vmcsnap/run-workload" <<'SH'
#!/bin/sh
# Runs the script QEMU passed with -fw_cfg name=opt/vmcsnap/workload,file=F.
set -e
mkdir -p /run/vmcsnap
cat /sys/firmware/qemu_fw_cfg/by_name/opt/vmcsnap/workload/raw >/run/vmcsnap/workload.sh
cd /run/vmcsnap
exec /bin/sh /run/vmcsnap/workload.sh
SH
cat >"$R/usr/local/lib/vmcsnap/ready" <<'SH'
#!/bin/sh
# Tells the host the VM is up: VMCSNAP-READY <hostname> on the virtio port
# org.vmcsnap.events, once systemd finished starting (degraded counts too)
# and, if there is a NIC, the network is online (or 60 s passed).
state=$(systemctl is-system-running --wait)
if ls -d /sys/class/net/en* /sys/class/net/eth* >/dev/null 2>&1; then
    /lib/systemd/systemd-networkd-wait-online --any --timeout=60 || true
fi
host=$(hostname)
echo "vmcsnap-ready: system $state, hostname $host" >/dev/console
[ "$state" = running ] || systemctl --failed --no-legend --plain >/dev/console 2>&1
port=/dev/virtio-ports/org.vmcsnap.events
if [ -e "$port" ]; then
    printf 'VMCSNAP-READY %s\n' "$host" >"$port"
fi
SH
chmod 0755 "$R/usr/local/lib/vmcsnap/run-workload" "$R/usr/local/lib/vmcsnap/ready"

# A path unit starts the workload only when QEMU provided one, so that a VM
# without a workload does not pull in network-online.target at boot.
unit vmcsnap-workload.path <<'UNIT'
[Unit]
Description=vmcsnap workload from fw_cfg (opt/vmcsnap/workload)
After=systemd-modules-load.service

[Path]
PathExists=/sys/firmware/qemu_fw_cfg/by_name/opt/vmcsnap/workload/raw

[Install]
WantedBy=paths.target
UNIT
AFTER=""
for s in $IMAGE_SERVICES; do AFTER="$AFTER $s"; done
unit vmcsnap-workload.service <<UNIT
[Unit]
Description=vmcsnap workload (script from fw_cfg opt/vmcsnap/workload)
ConditionPathExists=/sys/firmware/qemu_fw_cfg/by_name/opt/vmcsnap/workload/raw
Wants=network-online.target
After=network-online.target$AFTER

[Service]
Type=exec
ExecStart=/usr/local/lib/vmcsnap/run-workload
StandardOutput=journal+console
StandardError=journal+console
Restart=no
# Stay active once the script ended: else the path unit, whose file still
# exists, would start it again and again.
RemainAfterExit=yes
UNIT
unit vmcsnap-ready.service <<'UNIT'
[Unit]
Description=vmcsnap readiness marker on virtio port org.vmcsnap.events
After=vmcsnap-workload.service

[Service]
# exec, not oneshot: is-system-running --wait waits for every start job,
# this unit's own included.
Type=exec
ExecStart=/usr/local/lib/vmcsnap/ready
RemainAfterExit=yes

[Install]
WantedBy=multi-user.target
UNIT
chroot "$R" systemctl enable vmcsnap-workload.path vmcsnap-ready.service

if [ -f "$R/etc/redis/redis.conf" ]; then
    say "redis: listen on every address (other VMs are its clients)"
    sed -i -e 's/^bind .*/bind * -::*/' -e 's/^protected-mode .*/protected-mode no/' "$R/etc/redis/redis.conf"
fi

for p in $IMAGE_PROGRAMS; do
    install -m 0755 "$IMAGE_BIN/$p" "$R/usr/local/bin/$p"
done

say "regenerating the initramfs"
chroot "$R" update-initramfs -u -k all
# apt's caches and lists: not needed in the image.
rm -rf "$R"/var/cache/apt/*.bin "$R"/var/lib/apt/lists/* "$R"/var/log/*.log
