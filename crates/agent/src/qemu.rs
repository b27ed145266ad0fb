//! The QEMU command line of a vmcsnap VM.
//!
//! Two kinds of VM share one [`QemuConfig`]:
//!
//! - **The lab guest** (`image: None`): a `microvm` with ACPI (the Debian
//!   cloud kernel finds its virtio-mmio devices through ACPI), direct boot
//!   of vmcsnap's initramfs, one virtio-blk qcow2 data disk named
//!   [`DISK_NODE`]. Its command line is kept stable (tests and benchmarks
//!   compare against it).
//! - **An image VM** (`image: Some(ImageDevices)`): `q35` (virtio-*-pci,
//!   SeaBIOS boots the root disk, or a kernel boots directly) or `microvm`
//!   (virtio-*-device, direct boot only); root disk [`ROOT_NODE`] (a qcow2
//!   overlay of the user's image), extra disks `disk0..`, the NoCloud seed
//!   read-only as [`SEED_NODE`], a virtio-serial controller with the guest
//!   agent's port ([`QGA_PORT`], a unix socket QEMU listens on) and the
//!   events port ([`EVENTS_PORT`], a file the guest writes
//!   `VMCSNAP-READY <hostname>` to), and the workload as fw_cfg
//!   [`WORKLOAD_FW_CFG`].
//!
//! Both have guest RAM in a shared file under /dev/shm
//! (`memory-backend-file,share=on`: background snapshots, postcopy restore
//! and warm restart all rely on it), a serial console logged to a file, and
//! one virtio-net NIC whose backend is `-netdev stream` listening on the
//! VM's port socket (QEMU is the server; the switch dials out to it).
//!
//! Paths go into QEMU's option syntax (`key=value,key=value`), where a comma
//! inside a value is written twice; [`opt_value`] does that.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};
pub use vmcsnap_spec::{DiskFormat, Machine};

use crate::accel::Resolved;
use crate::AgentError;

/// The blockdev node name of the lab guest's data disk (QMP commands refer
/// to it).
pub const DISK_NODE: &str = "disk0";
/// The blockdev node name of an image VM's root disk (its overlay).
pub const ROOT_NODE: &str = "root0";
/// The blockdev node name of the NoCloud seed (read-only).
pub const SEED_NODE: &str = "seed";
/// The netdev id of a VM's NIC.
pub const NETDEV_ID: &str = "net0";
/// The virtio-serial port name of the QEMU guest agent.
pub const QGA_PORT: &str = "org.qemu.guest_agent.0";
/// The virtio-serial port the image writes `VMCSNAP-READY <hostname>` to.
pub const EVENTS_PORT: &str = "org.vmcsnap.events";
/// The fw_cfg file holding an image VM's workload script.
pub const WORKLOAD_FW_CFG: &str = "opt/vmcsnap/workload";

/// The blockdev node name of an image VM's `i`-th extra disk (0-based:
/// the first is `disk0`, `/dev/disk/by-id/virtio-disk0` in the guest).
pub fn extra_disk_node(i: usize) -> String {
    format!("disk{i}")
}

/// KiB of guest RAM that VMs launched under TCG before vmcsnap 0.1's
/// stop-copy fix were given on top of `memory_mib`, so that the RAM block
/// was not a multiple of 64 pages. Those VMs (records, snapshots) keep it:
/// their `ram_pad_kib` is absent, and [`QemuConfig::ram_kib`] adds this.
///
/// It was a workaround for QEMU before 9.0 losing guest writes during a
/// pre-copy under TCG (the aligned fast path of 7.2's
/// `cpu_physical_memory_sync_dirty_bitmap` clears dirty bits without
/// resetting TCG's TLB entries): a block of another length takes the
/// per-page slow path, which resets the TLB for every dirty page. That
/// slow path costs (dirty pages x TLB entries) with the big lock held, and
/// the first migration of a VM has every page dirty: the first stop-copy
/// or pre-copy snapshot of a 1 GiB VM running memtouch froze QEMU for
/// minutes (7 of 7 runs). New VMs are not padded: every pre-copy is checked
/// page by page against the paused guest's RAM (`snapshot::final_ram`),
/// which takes the pages QEMU missed, and a stop-copy or hot snapshot has
/// no writes to miss.
pub const TCG_DIRTY_TRACKING_PAD_KIB: u64 = 8;

/// One disk of a VM: a blockdev node on a file, and its virtio-blk device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskConfig {
    /// Blockdev node name ([`DISK_NODE`], [`ROOT_NODE`], `disk0`, ...,
    /// [`SEED_NODE`]).
    pub node: String,
    /// The file QEMU opens (for qcow2, the top of its backing chain).
    pub path: PathBuf,
    /// Its format.
    pub format: DiskFormat,
    /// Opened read-only (the seed); such a disk is never snapshotted.
    #[serde(default)]
    pub read_only: bool,
}

impl DiskConfig {
    /// A writable qcow2 disk.
    pub fn qcow2(node: impl Into<String>, path: impl Into<PathBuf>) -> DiskConfig {
        DiskConfig {
            node: node.into(),
            path: path.into(),
            format: DiskFormat::Qcow2,
            read_only: false,
        }
    }

    /// A read-only raw disk (the NoCloud seed).
    pub fn read_only_raw(node: impl Into<String>, path: impl Into<PathBuf>) -> DiskConfig {
        DiskConfig {
            node: node.into(),
            path: path.into(),
            format: DiskFormat::Raw,
            read_only: true,
        }
    }
}

/// The devices only an image VM has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageDevices {
    /// Unix socket of the guest agent's port (QEMU listens, `wait=off`).
    pub qga_socket: PathBuf,
    /// File the events port is logged to (appended to across restarts).
    pub events_log: PathBuf,
    /// The workload script, passed as fw_cfg [`WORKLOAD_FW_CFG`].
    #[serde(default)]
    pub workload_file: Option<PathBuf>,
}

/// Everything that decides a VM's QEMU command line.
///
/// Persisted in handover files and snapshots: fields added after the lab
/// guest's first version have serde defaults that give the lab guest, and
/// the old `disk` field still loads (as the single [`DISK_NODE`] disk).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QemuConfig {
    /// `-name` of the process.
    pub name: String,
    /// Accelerator.
    pub accel: Resolved,
    /// RAM in MiB, as the spec says (see [`QemuConfig::ram_kib`]).
    pub memory_mib: u64,
    /// vCPUs.
    pub vcpus: u64,
    /// Shared file holding guest RAM.
    pub ram_file: PathBuf,
    /// Machine type (the lab guest: microvm).
    #[serde(default)]
    pub machine: Machine,
    /// `-cpu` model in place of the accelerator's (`max` under TCG, `host`
    /// under KVM), e.g. `max,-cx16` for Linux 6.12 guests under TCG 7.2.
    #[serde(default)]
    pub cpu: Option<String>,
    /// Kernel for direct boot; `None`: the firmware boots the first disk
    /// (q35 only).
    pub kernel: Option<PathBuf>,
    /// Initramfs (direct boot).
    #[serde(default)]
    pub initrd: Option<PathBuf>,
    /// Kernel command line (direct boot; empty: no `-append`).
    #[serde(default)]
    pub cmdline: String,
    /// Serial console log.
    pub console_log: PathBuf,
    /// QMP socket (QEMU listens).
    pub qmp_socket: PathBuf,
    /// Disks in device order: the lab guest has one, [`DISK_NODE`]; an
    /// image VM has [`ROOT_NODE`], then `disk0..`, then maybe the seed.
    #[serde(alias = "disk", deserialize_with = "disks_or_legacy_path")]
    pub disks: Vec<DiskConfig>,
    /// Switch port socket (QEMU listens; the switch connects).
    pub port_socket: PathBuf,
    /// NIC MAC address.
    pub mac: String,
    /// The devices of an image VM; `None` for the lab guest.
    #[serde(default)]
    pub image: Option<ImageDevices>,
    /// QEMU's firmware directory (`-L`), needed when the binary runs from
    /// a copy outside its installation (the fallback of a failed restart).
    #[serde(default)]
    pub data_dir: Option<PathBuf>,
    /// Where QEMU loads its modules from (`QEMU_MODULE_DIR`), for the same
    /// reason as `data_dir`.
    #[serde(default)]
    pub module_dir: Option<PathBuf>,
    /// Firmware image (`-bios`) in place of the QEMU's own: a restored VM
    /// runs the firmware its snapshot recorded (`pc.bios` block), whose
    /// size another QEMU version's default may not have
    /// (`crate::restore::firmware`); a microvm VM moved to another QEMU
    /// release by a warm or saved restart keeps the firmware it booted with
    /// (`crate::qemu_crossing`).
    #[serde(default)]
    pub bios: Option<PathBuf>,
    /// KiB QEMU's RAM has beyond `memory_mib`: 0 for VMs launched now;
    /// absent in records and snapshots of VMs launched before, which got
    /// [`TCG_DIRTY_TRACKING_PAD_KIB`] under TCG (see there) and keep it
    /// (a restore takes it from the image's RAM block).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram_pad_kib: Option<u64>,
    /// microvm's 8259 PIC: `Some(false)` (`pic=off`) for VMs launched now.
    /// With it, about 1 boot in 10 of the Linux guest on QEMU 10.0's
    /// microvm panicked as the kernel first enabled interrupts ("divide
    /// error" in `start_kernel`: an interrupt through the PIC arrived at
    /// vector 0; QEMU exits quietly under `-no-reboot`); 7.2 never did.
    /// Linux routes every interrupt through the IOAPIC (ACPI MADT), so
    /// the guest needs no PIC. Absent in records and snapshots of VMs
    /// launched before: they keep it, since the device is in their
    /// migration stream. Ignored on q35.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub microvm_pic: Option<bool>,
    /// `-machine aux-ram-share=on` (QEMU 10.0 only): every RAM block
    /// shared, which QEMU 10.0's cpr-transfer needs (`vmcsnap rejuvenate
    /// --mode cpr`). Set on a VM by a warm or saved restart onto 10.0.
    #[serde(default)]
    pub cpr_ready: bool,
    /// A second `-incoming`, the cpr channel (a unix socket) of a QEMU
    /// started to take a VM over by cpr-transfer. Never persisted.
    #[serde(skip)]
    pub cpr_channel: Option<PathBuf>,
    /// Start with `-S`: the guest stays paused until `cont` (a restore with
    /// `--paused`).
    #[serde(default)]
    pub paused: bool,
    /// Start with `-incoming defer` (device state, and maybe RAM, will be
    /// loaded through QMP `migrate-incoming` instead of booting).
    pub incoming: bool,
}

/// `disks` as written now, or the single qcow2 `disk` path of configs
/// persisted before image VMs.
fn disks_or_legacy_path<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<DiskConfig>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Wire {
        Disks(Vec<DiskConfig>),
        Legacy(PathBuf),
    }
    Ok(match Wire::deserialize(d)? {
        Wire::Disks(v) => v,
        Wire::Legacy(path) => vec![DiskConfig::qcow2(DISK_NODE, path)],
    })
}

/// `value` for QEMU's `key=value,...` option syntax: commas doubled.
pub fn opt_value(value: &str) -> String {
    value.replace(',', ",,")
}

/// A path for QEMU's option syntax (see [`opt_value`]).
fn opt_path(p: &Path) -> String {
    opt_value(&p.display().to_string())
}

/// File name of the working-set sampler's QMP socket in a VM's directory
/// (`crate::sampler` uses it).
pub const SAMPLER_SOCKET: &str = "sample.sock";

impl QemuConfig {
    /// The working-set sampler's QMP socket, beside the main one.
    pub fn sample_socket(&self) -> PathBuf {
        self.qmp_socket.with_file_name(SAMPLER_SOCKET)
    }

    /// The node names of the writable disks, in device order: what a hot
    /// snapshot must snapshot (all in one transaction). The lab guest:
    /// `["disk0"]`.
    pub fn disk_nodes(&self) -> Vec<&str> {
        self.disks
            .iter()
            .filter(|d| !d.read_only)
            .map(|d| d.node.as_str())
            .collect()
    }

    /// The disk with this node name.
    pub fn disk(&self, node: &str) -> Option<&DiskConfig> {
        self.disks.iter().find(|d| d.node == node)
    }

    /// The disk with this node name, to point it at a new overlay.
    pub fn disk_mut(&mut self, node: &str) -> Option<&mut DiskConfig> {
        self.disks.iter_mut().find(|d| d.node == node)
    }

    /// Removes what a stopped QEMU of this config leaves behind: the RAM
    /// file and its sockets (not the disks, not the logs). Files already
    /// gone are fine; other failures are logged.
    pub fn remove_runtime_files(&self) {
        let qga = self.image.as_ref().map(|i| &i.qga_socket);
        for p in [
            &self.ram_file,
            &self.qmp_socket,
            &self.sample_socket(),
            &self.port_socket,
        ]
        .into_iter()
        .chain(qga)
        {
            if let Err(e) = std::fs::remove_file(p) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    crate::log(format!(
                        "VM {}: cannot remove {}: {e}",
                        self.name,
                        p.display()
                    ));
                }
            }
        }
    }

    /// The guest RAM QEMU is given, in KiB: `memory_mib` plus
    /// `ram_pad_kib` (for a VM launched before it existed: the old
    /// [`TCG_DIRTY_TRACKING_PAD_KIB`] under TCG).
    pub fn ram_kib(&self) -> u64 {
        let legacy = if self.accel == Resolved::Tcg {
            TCG_DIRTY_TRACKING_PAD_KIB
        } else {
            0
        };
        self.memory_mib * 1024 + self.ram_pad_kib.unwrap_or(legacy)
    }

    /// The virtio device model suffix of the machine: PCI on q35, MMIO on
    /// microvm.
    fn bus(&self) -> &'static str {
        match self.machine {
            Machine::Q35 => "pci",
            Machine::Microvm => "device",
        }
    }

    /// The arguments after the binary's name.
    pub fn args(&self) -> Vec<OsString> {
        [
            self.machine_args(),
            self.boot_args(),
            self.monitor_args(),
            self.disk_args(),
            self.net_args(),
            self.image_args(),
            self.start_args(),
        ]
        .into_iter()
        .flatten()
        .map(OsString::from)
        .collect()
    }

    /// The machine: its name, type, accelerator, memory and vCPUs.
    fn machine_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        let mut push = |s: String| a.push(s);
        for s in [
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ] {
            push(s.to_string());
        }
        push("-name".into());
        push(format!(
            "guest={},process={},debug-threads=on",
            self.name, self.name
        ));
        push("-M".into());
        let aux = if self.cpr_ready {
            ",aux-ram-share=on"
        } else {
            ""
        };
        push(match self.machine {
            Machine::Microvm => {
                let pic = if self.microvm_pic == Some(false) {
                    ",pic=off"
                } else {
                    ""
                };
                format!("microvm,acpi=on,memory-backend=mem{pic}{aux}")
            }
            // Versioned: the same machine on QEMU 7.2 and 10.0 (plain `q35`
            // is each version's newest), so that a VM moves between them.
            Machine::Q35 => format!("{Q35_MACHINE},memory-backend=mem{aux}"),
        });
        let mut accel = self.accel.qemu_args().map(str::to_string);
        if let Some(cpu) = &self.cpu {
            accel[3] = cpu.clone();
        }
        for s in accel {
            push(s);
        }
        push("-m".into());
        push(format!("{}K", self.ram_kib()));
        push("-smp".into());
        push(self.vcpus.to_string());
        push("-object".into());
        push(format!(
            "memory-backend-file,id=mem,size={}K,mem-path={},share=on",
            self.ram_kib(),
            opt_path(&self.ram_file)
        ));
        a
    }

    /// A direct kernel boot: kernel, initrd, command line.
    fn boot_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        let mut push = |s: String| a.push(s);
        // -kernel, -initrd and -append are plain strings (no option syntax).
        if let Some(kernel) = &self.kernel {
            push("-kernel".into());
            push(kernel.display().to_string());
            if let Some(initrd) = &self.initrd {
                push("-initrd".into());
                push(initrd.display().to_string());
            }
            if !self.cmdline.is_empty() {
                push("-append".into());
                push(self.cmdline.clone());
            }
        }
        a
    }

    /// The serial console and the two QMP monitors.
    fn monitor_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        let mut push = |s: String| a.push(s);
        push("-chardev".into());
        // append=on: a restarted QEMU continues the same console log.
        push(format!(
            "file,id=con,path={},append=on",
            opt_path(&self.console_log)
        ));
        push("-serial".into());
        push("chardev:con".into());
        push("-qmp".into());
        push(format!(
            "unix:{},server=on,wait=off",
            opt_path(&self.qmp_socket)
        ));
        // A second monitor for the working-set sampler (`crate::sampler`),
        // so that sampling never waits for, or interleaves with, requests.
        push("-qmp".into());
        push(format!(
            "unix:{},server=on,wait=off",
            opt_path(&self.sample_socket())
        ));
        a
    }

    /// The disks, each a virtio-blk device.
    fn disk_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        let mut push = |s: String| a.push(s);
        for (i, d) in self.disks.iter().enumerate() {
            let ro = if d.read_only { ",read-only=on" } else { "" };
            push("-blockdev".into());
            push(format!(
                "driver={},node-name={}{ro},file.driver=file,file.filename={}",
                d.format.driver(),
                d.node,
                opt_path(&d.path)
            ));
            let mut dev = format!("virtio-blk-{},drive={}", self.bus(), d.node);
            if self.image.is_some() {
                // /dev/disk/by-id/virtio-<node> in the guest.
                dev.push_str(&format!(",serial={}", d.node));
                // Firmware boot starts from the root disk; with -kernel the
                // linuxboot option ROM holds bootindex 0 (QEMU refuses both).
                if i == 0 && self.machine == Machine::Q35 && self.kernel.is_none() {
                    dev.push_str(",bootindex=0");
                }
            }
            push("-device".into());
            push(dev);
        }
        a
    }

    /// The NIC: a stream netdev the switch dials.
    fn net_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        let mut push = |s: String| a.push(s);
        push("-netdev".into());
        push(format!(
            "stream,id={NETDEV_ID},server=on,addr.type=unix,addr.path={}",
            opt_path(&self.port_socket)
        ));
        push("-device".into());
        push(format!(
            "virtio-net-{},netdev={NETDEV_ID},mac={}",
            self.bus(),
            self.mac
        ));
        a
    }

    /// An image VM's guest agent, event channel and workload.
    fn image_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        let mut push = |s: String| a.push(s);
        if let Some(img) = &self.image {
            push("-chardev".into());
            push(format!(
                "socket,id=qga0,path={},server=on,wait=off",
                opt_path(&img.qga_socket)
            ));
            push("-chardev".into());
            push(format!(
                "file,id=events,path={},append=on",
                opt_path(&img.events_log)
            ));
            push("-device".into());
            push(format!("virtio-serial-{},id=vser0", self.bus()));
            push("-device".into());
            push(format!(
                "virtserialport,bus=vser0.0,chardev=qga0,name={QGA_PORT}"
            ));
            push("-device".into());
            push(format!(
                "virtserialport,bus=vser0.0,chardev=events,name={EVENTS_PORT}"
            ));
            if let Some(w) = &img.workload_file {
                push("-fw_cfg".into());
                push(format!("name={WORKLOAD_FW_CFG},file={}", opt_path(w)));
            }
        }
        a
    }

    /// Firmware, and how the VM starts: paused, incoming, or from CPR.
    fn start_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        let mut push = |s: String| a.push(s);
        if let Some(d) = &self.data_dir {
            push("-L".into());
            push(d.display().to_string());
        }
        if let Some(b) = &self.bios {
            push("-bios".into());
            push(b.display().to_string());
        }
        if self.paused {
            push("-S".into());
        }
        if self.incoming {
            push("-incoming".into());
            push("defer".into());
        }
        if let Some(cpr) = &self.cpr_channel {
            push("-incoming".into());
            push(
                serde_json::json!({
                    "channel-type": "cpr",
                    "addr": { "transport": "socket", "type": "unix", "path": cpr },
                })
                .to_string(),
            );
        }
        a
    }
}

/// The q35 machine type every q35 VM runs: 7.2's, which QEMU 10.0 also
/// has, so that a VM started on 7.2 restarts or restores on 10.0. microvm
/// has no versions: it promises nothing across QEMU versions.
pub const Q35_MACHINE: &str = "pc-q35-7.2";

/// The QEMU binary: `$VMCSNAP_QEMU` if set, else `qemu-system-x86_64` on
/// PATH. A missing binary names the Debian package to install.
pub fn find_qemu() -> Result<PathBuf, AgentError> {
    let name = std::env::var_os("VMCSNAP_QEMU").unwrap_or_else(|| "qemu-system-x86_64".into());
    find_program(Path::new(&name), "qemu-system-x86")
}

/// Where a QEMU binary finds its firmware (`-L`) and modules
/// (`QEMU_MODULE_DIR`): `None`s for a system QEMU under `/usr`, which finds
/// its own; the directories of its prefix for one installed elsewhere, such
/// as `scripts/install-qemu.sh`'s `<cache>/qemu-10.0/root/usr/bin/…`, which
/// Debian builds non-relocatable: without them it would load the system
/// QEMU's firmware and modules, of another version.
pub fn installation_dirs(bin: &Path) -> (Option<PathBuf>, Option<PathBuf>) {
    let bin = std::fs::canonicalize(bin).unwrap_or_else(|_| bin.to_path_buf());
    let Some(prefix) = bin.parent().and_then(Path::parent) else {
        return (None, None);
    };
    if prefix == Path::new("/usr") || prefix == Path::new("/") {
        return (None, None);
    }
    let data_dir = Some(prefix.join("share/qemu")).filter(|d| d.is_dir());
    (data_dir, module_dir(prefix))
}

/// `<prefix>/lib/<triple>/qemu` or `<prefix>/lib/qemu`, if it holds modules.
pub(crate) fn module_dir(prefix: &Path) -> Option<PathBuf> {
    let lib = prefix.join("lib");
    let mut candidates = vec![lib.join("qemu")];
    candidates.extend(
        std::fs::read_dir(&lib)
            .ok()?
            .flatten()
            .map(|e| e.path().join("qemu")),
    );
    candidates.into_iter().find(|d| {
        std::fs::read_dir(d)
            .map(|r| {
                r.flatten()
                    .any(|e| e.file_name().to_string_lossy().ends_with(".so"))
            })
            .unwrap_or(false)
    })
}

/// `config` with the firmware and module directories of `bin`'s
/// installation ([`installation_dirs`]).
pub fn for_installation(config: &QemuConfig, bin: &Path) -> QemuConfig {
    let mut c = config.clone();
    (c.data_dir, c.module_dir) = installation_dirs(bin);
    c
}

/// `qemu-img`, from qemu-utils.
pub fn find_qemu_img() -> Result<PathBuf, AgentError> {
    find_program(Path::new("qemu-img"), "qemu-utils")
}

/// Finds `program` (a path, or a name to look up on PATH).
pub fn find_program(program: &Path, package: &'static str) -> Result<PathBuf, AgentError> {
    let missing = || AgentError::MissingProgram {
        program: program.display().to_string(),
        package,
    };
    if program.components().count() > 1 {
        return if is_executable(program) {
            Ok(program.to_path_buf())
        } else {
            Err(missing())
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| is_executable(p))
        .ok_or_else(missing)
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {

    /// A QEMU under a private prefix gets that prefix's firmware and
    /// modules; the system's finds its own.
    #[test]
    fn a_qemu_installed_under_a_prefix_gets_its_firmware_and_modules() {
        let d = tempfile::tempdir().unwrap();
        let usr = d.path().join("root/usr");
        std::fs::create_dir_all(usr.join("bin")).unwrap();
        std::fs::create_dir_all(usr.join("share/qemu")).unwrap();
        let mods = usr.join("lib/x86_64-linux-gnu/qemu");
        std::fs::create_dir_all(&mods).unwrap();
        std::fs::write(mods.join("accel-tcg-x86_64.so"), b"").unwrap();
        let bin = usr.join("bin/qemu-system-x86_64");
        std::fs::write(&bin, b"").unwrap();
        let usr = std::fs::canonicalize(&usr).unwrap();
        assert_eq!(
            installation_dirs(&bin),
            (
                Some(usr.join("share/qemu")),
                Some(usr.join("lib/x86_64-linux-gnu/qemu"))
            )
        );
        assert_eq!(
            installation_dirs(Path::new("/usr/bin/qemu-system-x86_64")),
            (None, None)
        );
    }
    use super::*;

    fn cfg() -> QemuConfig {
        QemuConfig {
            name: "vm1".into(),
            accel: Resolved::Tcg,
            memory_mib: 256,
            vcpus: 2,
            ram_file: "/dev/shm/x".into(),
            machine: Machine::Microvm,
            cpu: None,
            kernel: Some("/k".into()),
            initrd: Some("/i".into()),
            cmdline: "console=ttyS0 a=b".into(),
            console_log: "/c.log".into(),
            qmp_socket: "/q.sock".into(),
            disks: vec![DiskConfig::qcow2(DISK_NODE, "/d.qcow2")],
            port_socket: "/p.sock".into(),
            mac: "52:54:00:77:00:02".into(),
            image: None,
            incoming: false,
            paused: false,
            data_dir: None,
            module_dir: None,
            bios: None,
            ram_pad_kib: Some(0),
            microvm_pic: Some(false),
            cpr_ready: false,
            cpr_channel: None,
        }
    }

    /// An image VM on q35 booting through its firmware, with one extra disk
    /// and a seed.
    fn image_cfg() -> QemuConfig {
        QemuConfig {
            machine: Machine::Q35,
            kernel: None,
            initrd: None,
            cmdline: String::new(),
            disks: vec![
                DiskConfig::qcow2(ROOT_NODE, "/vm/root.qcow2"),
                DiskConfig::qcow2(extra_disk_node(1), "/vm/disk1.qcow2"),
                DiskConfig::read_only_raw(SEED_NODE, "/vm/seed.iso"),
            ],
            image: Some(ImageDevices {
                qga_socket: "/vm/qga.sock".into(),
                events_log: "/vm/events.log".into(),
                workload_file: Some("/vm/workload.sh".into()),
            }),
            ..cfg()
        }
    }

    fn strings(c: &QemuConfig) -> Vec<String> {
        c.args()
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect()
    }

    /// `flag`'s value (the argument after the n-th occurrence of it).
    fn values<'a>(args: &'a [String], flag: &str) -> Vec<&'a str> {
        args.windows(2)
            .filter(|w| w[0] == flag)
            .map(|w| w[1].as_str())
            .collect()
    }

    #[test]
    fn q35_direct_boot_leaves_bootindex_to_the_kernel() {
        // QEMU refuses bootindex=0 on a disk when -kernel's option ROM has it.
        let c = QemuConfig {
            kernel: Some("/k".into()),
            ..image_cfg()
        };
        let args = strings(&c);
        assert!(args.iter().all(|a| !a.contains("bootindex")), "{args:?}");
        assert_eq!(values(&args, "-kernel"), ["/k"]);
    }

    #[test]
    fn lab_command_line_is_unchanged_but_for_the_listening_netdev() {
        let expected = [
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
            "-name",
            "guest=vm1,process=vm1,debug-threads=on",
            "-M",
            "microvm,acpi=on,memory-backend=mem,pic=off",
            "-accel",
            "tcg",
            "-cpu",
            "max",
            "-m",
            "262144K",
            "-smp",
            "2",
            "-object",
            "memory-backend-file,id=mem,size=262144K,mem-path=/dev/shm/x,share=on",
            "-kernel",
            "/k",
            "-initrd",
            "/i",
            "-append",
            "console=ttyS0 a=b",
            "-chardev",
            "file,id=con,path=/c.log,append=on",
            "-serial",
            "chardev:con",
            "-qmp",
            "unix:/q.sock,server=on,wait=off",
            "-qmp",
            "unix:/sample.sock,server=on,wait=off",
            "-blockdev",
            "driver=qcow2,node-name=disk0,file.driver=file,file.filename=/d.qcow2",
            "-device",
            "virtio-blk-device,drive=disk0",
            "-netdev",
            "stream,id=net0,server=on,addr.type=unix,addr.path=/p.sock",
            "-device",
            "virtio-net-device,netdev=net0,mac=52:54:00:77:00:02",
        ];
        assert_eq!(strings(&cfg()), expected);
        assert_eq!(cfg().disk_nodes(), vec![DISK_NODE]);
    }

    /// Regression test: about 1 boot in 10 of the lab guest on QEMU 10.0's
    /// microvm ended at once, QEMU exiting with status 0 (CI: "QEMU exited
    /// during boot (exit status: 0)"; the kernel's "divide error" panic as
    /// it enabled interrupts, through the PIC). New VMs have no PIC; VMs
    /// launched with one (records without the field) keep it, since their
    /// migration streams carry it.
    #[test]
    fn new_microvm_vms_have_no_pic_and_old_ones_keep_theirs() {
        let args = strings(&cfg());
        assert_eq!(
            values(&args, "-M"),
            ["microvm,acpi=on,memory-backend=mem,pic=off"]
        );
        let old = QemuConfig {
            microvm_pic: None,
            ..cfg()
        };
        assert_eq!(
            values(&strings(&old), "-M"),
            ["microvm,acpi=on,memory-backend=mem"]
        );
        let json = serde_json::to_value(&old).unwrap();
        assert!(
            json.get("microvm_pic").is_none(),
            "an old record writes back unchanged"
        );
        let back: QemuConfig =
            serde_json::from_value(serde_json::to_value(cfg()).unwrap()).unwrap();
        assert_eq!(back.microvm_pic, Some(false));
        let q35 = QemuConfig {
            machine: Machine::Q35,
            ..cfg()
        };
        assert!(
            !values(&strings(&q35), "-M")[0].contains("pic"),
            "q35 keeps its PIC"
        );
    }

    /// Regression test: the first stop-copy snapshot of a 1 GiB VM running
    /// memtouch froze QEMU 7.2 for minutes (7 of 7), its dirty-bitmap sync
    /// taking the per-page slow path that the TCG padding forced.
    #[test]
    fn new_vms_get_the_exact_ram_and_old_tcg_vms_keep_their_padding() {
        let args = strings(&cfg());
        assert_eq!(values(&args, "-m"), ["262144K"], "TCG, launched now");
        let old = QemuConfig {
            ram_pad_kib: None,
            ..cfg()
        };
        let args = strings(&old);
        assert_eq!(values(&args, "-m"), ["262152K"], "TCG, launched padded");
        let old_kvm = QemuConfig {
            accel: Resolved::Kvm,
            ..old
        };
        assert_eq!(old_kvm.ram_kib(), 262144);
        // A record written before the field existed loads as "launched
        // padded".
        let mut json = serde_json::to_value(cfg()).unwrap();
        json.as_object_mut().unwrap().remove("ram_pad_kib");
        let loaded: QemuConfig = serde_json::from_value(json).unwrap();
        assert_eq!(loaded.ram_kib(), 262152);
    }

    #[test]
    fn command_line_has_shared_ram_stream_nic_and_tcg() {
        let joined = strings(&cfg()).join(" ");
        assert!(!joined.contains("-incoming"));
        let mut c = cfg();
        c.incoming = true;
        assert!(strings(&c).join(" ").ends_with("-incoming defer"));
        c.accel = Resolved::Kvm;
        assert!(
            strings(&c).join(" ").contains("-m 262144K -smp 2"),
            "KVM keeps the exact size"
        );
        c.cpu = Some("max,-cx16".into());
        assert!(strings(&c)
            .join(" ")
            .contains("-accel kvm -cpu max,-cx16 -m"));
    }

    #[test]
    fn q35_image_vm_has_pci_devices_channels_seed_and_workload() {
        let args = strings(&image_cfg());
        assert_eq!(values(&args, "-M"), ["pc-q35-7.2,memory-backend=mem"]);
        assert!(args
            .iter()
            .any(|a| a.starts_with("memory-backend-file,id=mem,") && a.ends_with(",share=on")));
        for flag in ["-kernel", "-initrd", "-append"] {
            assert!(
                !args.iter().any(|a| a == flag),
                "firmware boot has no {flag}"
            );
        }
        assert_eq!(
            values(&args, "-blockdev"),
            [
                "driver=qcow2,node-name=root0,file.driver=file,file.filename=/vm/root.qcow2",
                "driver=qcow2,node-name=disk1,file.driver=file,file.filename=/vm/disk1.qcow2",
                "driver=raw,node-name=seed,read-only=on,file.driver=file,file.filename=/vm/seed.iso",
            ]
        );
        let devices = values(&args, "-device");
        assert_eq!(
            devices,
            [
                "virtio-blk-pci,drive=root0,serial=root0,bootindex=0",
                "virtio-blk-pci,drive=disk1,serial=disk1",
                "virtio-blk-pci,drive=seed,serial=seed",
                "virtio-net-pci,netdev=net0,mac=52:54:00:77:00:02",
                "virtio-serial-pci,id=vser0",
                "virtserialport,bus=vser0.0,chardev=qga0,name=org.qemu.guest_agent.0",
                "virtserialport,bus=vser0.0,chardev=events,name=org.vmcsnap.events",
            ]
        );
        assert_eq!(
            values(&args, "-chardev"),
            [
                "file,id=con,path=/c.log,append=on",
                "socket,id=qga0,path=/vm/qga.sock,server=on,wait=off",
                "file,id=events,path=/vm/events.log,append=on",
            ]
        );
        assert_eq!(values(&args, "-serial"), ["chardev:con"]);
        assert_eq!(
            values(&args, "-fw_cfg"),
            ["name=opt/vmcsnap/workload,file=/vm/workload.sh"]
        );
        assert_eq!(
            image_cfg().disk_nodes(),
            vec!["root0", "disk1"],
            "the read-only seed is not snapshotted"
        );
    }

    #[test]
    fn microvm_image_vm_uses_mmio_devices_and_direct_boot() {
        let mut c = image_cfg();
        c.machine = Machine::Microvm;
        c.kernel = Some("/boot/vmlinuz".into());
        c.initrd = None;
        c.cmdline = "root=/dev/vda1".into();
        c.image.as_mut().unwrap().workload_file = None;
        let args = strings(&c);
        assert_eq!(
            values(&args, "-M"),
            ["microvm,acpi=on,memory-backend=mem,pic=off"]
        );
        assert_eq!(values(&args, "-kernel"), ["/boot/vmlinuz"]);
        assert_eq!(values(&args, "-append"), ["root=/dev/vda1"]);
        assert!(values(&args, "-initrd").is_empty());
        assert!(values(&args, "-fw_cfg").is_empty());
        let devices = values(&args, "-device");
        assert_eq!(
            devices[0], "virtio-blk-device,drive=root0,serial=root0",
            "no bootindex on microvm"
        );
        assert!(devices.contains(&"virtio-net-device,netdev=net0,mac=52:54:00:77:00:02"));
        assert!(devices.contains(&"virtio-serial-device,id=vser0"));
        assert!(!devices.iter().any(|d| d.contains("-pci")), "{devices:?}");
    }

    #[test]
    fn commas_in_paths_are_doubled_in_option_values_only() {
        assert_eq!(opt_value("a,b,,c"), "a,,b,,,,c");
        let mut c = image_cfg();
        c.ram_file = "/dev/shm/a,b".into();
        c.disks[0].path = "/x,y/root.qcow2".into();
        c.port_socket = "/r,un/port.sock".into();
        c.qmp_socket = "/r,un/qmp.sock".into();
        c.kernel = Some("/k,1".into());
        c.cmdline = "a=1,2".into();
        let args = strings(&c);
        let joined = args.join(" ");
        assert!(
            joined.contains("mem-path=/dev/shm/a,,b,share=on"),
            "{joined}"
        );
        assert!(
            joined.contains("file.filename=/x,,y/root.qcow2"),
            "{joined}"
        );
        assert!(joined.contains("addr.path=/r,,un/port.sock"), "{joined}");
        assert!(
            joined.contains("unix:/r,,un/qmp.sock,server=on"),
            "{joined}"
        );
        assert!(
            joined.contains("unix:/r,,un/sample.sock,server=on"),
            "{joined}"
        );
        // -kernel and -append are not option syntax: left alone.
        assert_eq!(values(&args, "-kernel"), ["/k,1"]);
        assert_eq!(values(&args, "-append"), ["a=1,2"]);
    }

    #[test]
    fn configs_persisted_before_image_vms_still_load_as_lab_vms() {
        let old = r#"{"name":"vm1","accel":"tcg","memory_mib":256,"vcpus":2,"ram_file":"/dev/shm/x",
            "kernel":"/k","initrd":"/i","cmdline":"console=ttyS0 a=b","console_log":"/c.log",
            "qmp_socket":"/q.sock","disk":"/d.qcow2","port_socket":"/p.sock","mac":"52:54:00:77:00:02",
            "data_dir":null,"module_dir":null,"paused":false,"incoming":false}"#;
        let c: QemuConfig = serde_json::from_str(old).unwrap();
        // Launched padded (TCG, before `ram_pad_kib`).
        let padded = QemuConfig {
            ram_pad_kib: None,
            microvm_pic: None,
            ..cfg()
        };
        assert_eq!(strings(&c), strings(&padded));
        assert_eq!(c.disks, vec![DiskConfig::qcow2(DISK_NODE, "/d.qcow2")]);
        // And the new form round-trips.
        let json = serde_json::to_string(&image_cfg()).unwrap();
        let back: QemuConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(strings(&back), strings(&image_cfg()));
        // A malformed disks value is an error, not a silent lab disk.
        let bad = old.replace(r#""disk":"/d.qcow2""#, r#""disks":[{"node":"x"}]"#);
        assert!(serde_json::from_str::<QemuConfig>(&bad).is_err());
    }

    #[test]
    fn missing_program_names_the_package() {
        let e = find_program(Path::new("/nonexistent/qemu"), "qemu-system-x86").unwrap_err();
        assert!(
            e.to_string().contains("apt-get install qemu-system-x86"),
            "{e}"
        );
        let e = find_program(Path::new("surely-not-a-program-xyz"), "pkg").unwrap_err();
        assert!(e.to_string().contains("surely-not-a-program-xyz"), "{e}");
    }
}
