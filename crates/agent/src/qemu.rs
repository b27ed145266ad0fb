//! The QEMU command line of a vmcsnap VM.
//!
//! Every VM is a `microvm` with ACPI (the Debian cloud kernel finds its
//! virtio-mmio devices through ACPI), guest RAM in a shared file under
//! /dev/shm (`memory-backend-file,share=on`: background snapshots, postcopy
//! restore and warm restart all rely on it), one virtio-blk data disk in
//! qcow2 named by a blockdev node, and one virtio-net NIC whose backend is
//! `-netdev stream` connected as a client to the VM's switch port.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::accel::Resolved;
use crate::AgentError;

/// The blockdev node name of a VM's data disk (QMP commands refer to it).
pub const DISK_NODE: &str = "disk0";
/// The netdev id of a VM's NIC.
pub const NETDEV_ID: &str = "net0";

/// KiB of guest RAM added under TCG so that the RAM block is not a multiple
/// of 64 pages.
///
/// QEMU before 9.0 loses guest writes during a live (pre-copy) migration
/// under TCG: the aligned fast path of its dirty-bitmap sync
/// (`cpu_physical_memory_sync_dirty_bitmap` in 7.2's
/// `include/exec/ram_addr.h`) clears the migration dirty bits without
/// resetting TCG's TLB entries that already skip dirty tracking, so a page
/// written again through such an entry is never sent again (upstream fixed
/// it in "physmem: Fix migration dirty bitmap coherency with TCG memory
/// access"). We found it as pre-copy snapshots holding an older generation
/// of memtouch pages than the RAM at the pause (1 run in 4-14 lost
/// 1466-3891 pages). A block whose length is not a multiple of 64 pages
/// takes the per-page slow path, which resets the TLB for every dirty page;
/// QEMU rounds `-m` up to 8 KiB, hence 8. KVM tracks writes in the kernel
/// and keeps the exact size.
pub const TCG_DIRTY_TRACKING_PAD_KIB: u64 = 8;

/// Everything that decides a VM's QEMU command line.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
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
    /// Kernel image.
    pub kernel: PathBuf,
    /// Initramfs.
    pub initrd: PathBuf,
    /// Kernel command line.
    pub cmdline: String,
    /// Serial console log.
    pub console_log: PathBuf,
    /// QMP socket (QEMU listens).
    pub qmp_socket: PathBuf,
    /// Data disk (qcow2).
    pub disk: PathBuf,
    /// Switch port socket (QEMU connects).
    pub port_socket: PathBuf,
    /// NIC MAC address.
    pub mac: String,
    /// QEMU's firmware directory (`-L`), needed when the binary runs from
    /// a copy outside its installation (the fallback of a failed restart).
    #[serde(default)]
    pub data_dir: Option<PathBuf>,
    /// Where QEMU loads its modules from (`QEMU_MODULE_DIR`), for the same
    /// reason as `data_dir`.
    #[serde(default)]
    pub module_dir: Option<PathBuf>,
    /// Start with `-S`: the guest stays paused until `cont` (a restore with
    /// `--paused`).
    #[serde(default)]
    pub paused: bool,
    /// Start with `-incoming defer` (device state, and maybe RAM, will be
    /// loaded through QMP `migrate-incoming` instead of booting).
    pub incoming: bool,
}

impl QemuConfig {
    /// The working-set sampler's QMP socket, beside the main one.
    pub fn sample_socket(&self) -> PathBuf {
        self.qmp_socket.with_file_name(crate::sampler::SOCKET_NAME)
    }

    /// Removes what a stopped QEMU of this config leaves behind: the RAM
    /// file and its sockets (not the disk, not the logs). Files already
    /// gone are fine; other failures are logged.
    pub fn remove_runtime_files(&self) {
        for p in [&self.ram_file, &self.qmp_socket, &self.sample_socket(), &self.port_socket] {
            if let Err(e) = std::fs::remove_file(p) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    crate::log(format!("VM {}: cannot remove {}: {e}", self.name, p.display()));
                }
            }
        }
    }

    /// The guest RAM QEMU is given, in KiB: `memory_mib`, plus
    /// [`TCG_DIRTY_TRACKING_PAD_KIB`] under TCG.
    pub fn ram_kib(&self) -> u64 {
        let pad = if self.accel == Resolved::Tcg { TCG_DIRTY_TRACKING_PAD_KIB } else { 0 };
        self.memory_mib * 1024 + pad
    }

    /// The arguments after the binary's name.
    pub fn args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = Vec::new();
        let mut push = |s: String| a.push(s.into());
        for s in ["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"] {
            push(s.to_string());
        }
        push("-name".into());
        push(format!("guest={},process={},debug-threads=on", self.name, self.name));
        push("-M".into());
        push("microvm,acpi=on,memory-backend=mem".into());
        for s in self.accel.qemu_args() {
            push(s.to_string());
        }
        push("-m".into());
        push(format!("{}K", self.ram_kib()));
        push("-smp".into());
        push(self.vcpus.to_string());
        push("-object".into());
        push(format!(
            "memory-backend-file,id=mem,size={}K,mem-path={},share=on",
            self.ram_kib(),
            self.ram_file.display()
        ));
        push("-kernel".into());
        push(self.kernel.display().to_string());
        push("-initrd".into());
        push(self.initrd.display().to_string());
        push("-append".into());
        push(self.cmdline.clone());
        push("-chardev".into());
        // append=on: a restarted QEMU continues the same console log.
        push(format!("file,id=con,path={},append=on", self.console_log.display()));
        push("-serial".into());
        push("chardev:con".into());
        push("-qmp".into());
        push(format!("unix:{},server=on,wait=off", self.qmp_socket.display()));
        // A second monitor for the working-set sampler (`crate::sampler`),
        // so that sampling never waits for, or interleaves with, requests.
        push("-qmp".into());
        push(format!("unix:{},server=on,wait=off", self.sample_socket().display()));
        push("-blockdev".into());
        push(format!(
            "driver=qcow2,node-name={DISK_NODE},file.driver=file,file.filename={}",
            self.disk.display()
        ));
        push("-device".into());
        push(format!("virtio-blk-device,drive={DISK_NODE}"));
        push("-netdev".into());
        push(format!("stream,id={NETDEV_ID},server=off,addr.type=unix,addr.path={}", self.port_socket.display()));
        push("-device".into());
        push(format!("virtio-net-device,netdev={NETDEV_ID},mac={}", self.mac));
        if let Some(d) = &self.data_dir {
            push("-L".into());
            push(d.display().to_string());
        }
        if self.paused {
            push("-S".into());
        }
        if self.incoming {
            push("-incoming".into());
            push("defer".into());
        }
        a
    }
}

/// The QEMU binary: `$VMCSNAP_QEMU` if set, else `qemu-system-x86_64` on
/// PATH. A missing binary names the Debian package to install.
pub fn find_qemu() -> Result<PathBuf, AgentError> {
    let name = std::env::var_os("VMCSNAP_QEMU").unwrap_or_else(|| "qemu-system-x86_64".into());
    find_program(Path::new(&name), "qemu-system-x86")
}

/// `qemu-img`, from qemu-utils.
pub fn find_qemu_img() -> Result<PathBuf, AgentError> {
    find_program(Path::new("qemu-img"), "qemu-utils")
}

/// Finds `program` (a path, or a name to look up on PATH).
pub fn find_program(program: &Path, package: &'static str) -> Result<PathBuf, AgentError> {
    let missing = || AgentError::MissingProgram { program: program.display().to_string(), package };
    if program.components().count() > 1 {
        return if is_executable(program) { Ok(program.to_path_buf()) } else { Err(missing()) };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|d| d.join(program)).find(|p| is_executable(p)).ok_or_else(missing)
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata().map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> QemuConfig {
        QemuConfig {
            name: "vm1".into(),
            accel: Resolved::Tcg,
            memory_mib: 256,
            vcpus: 2,
            ram_file: "/dev/shm/x".into(),
            kernel: "/k".into(),
            initrd: "/i".into(),
            cmdline: "console=ttyS0 a=b".into(),
            console_log: "/c.log".into(),
            qmp_socket: "/q.sock".into(),
            disk: "/d.qcow2".into(),
            port_socket: "/p.sock".into(),
            mac: "52:54:00:77:00:02".into(),
            incoming: false,
            paused: false,
            data_dir: None,
            module_dir: None,
        }
    }

    #[test]
    fn command_line_has_shared_ram_stream_nic_and_tcg() {
        let args: Vec<String> = cfg().args().into_iter().map(|s| s.into_string().unwrap()).collect();
        let joined = args.join(" ");
        // TCG: 8 KiB more than asked, so that pre-copy tracks every write.
        assert!(joined.contains("memory-backend-file,id=mem,size=262152K,mem-path=/dev/shm/x,share=on"));
        assert!(joined.contains("-m 262152K -smp 2"));
        assert!(joined.contains("stream,id=net0,server=off,addr.type=unix,addr.path=/p.sock"));
        assert!(joined.contains("-accel tcg -cpu max"));
        // The cmdline stays one argument even with spaces.
        assert!(args.contains(&"console=ttyS0 a=b".to_string()));
        assert!(!joined.contains("-incoming"));
        let mut c = cfg();
        c.incoming = true;
        let joined: Vec<String> = c.args().into_iter().map(|s| s.into_string().unwrap()).collect();
        assert!(joined.join(" ").ends_with("-incoming defer"));
        c.accel = Resolved::Kvm;
        let joined: Vec<String> = c.args().into_iter().map(|s| s.into_string().unwrap()).collect();
        assert!(joined.join(" ").contains("-m 262144K -smp 2"), "KVM keeps the exact size");
    }

    #[test]
    fn missing_program_names_the_package() {
        let e = find_program(Path::new("/nonexistent/qemu"), "qemu-system-x86").unwrap_err();
        assert!(e.to_string().contains("apt-get install qemu-system-x86"), "{e}");
        let e = find_program(Path::new("surely-not-a-program-xyz"), "pkg").unwrap_err();
        assert!(e.to_string().contains("surely-not-a-program-xyz"), "{e}");
    }
}
