//! One VM as the agent records it durably: a handle a new agent can adopt.
//!
//! A VM is a handle: its identity (name, address), its QEMU endpoint (the
//! QMP socket), its files (RAM file, disks, logs) and, once launched, the
//! pid of its QEMU ([`VmRecord`]). The cluster's record keeps these
//! handles in `<run-dir>/vms.json` ([`crate::cluster_record`]). This
//! module also finds a VM's live QEMU again by its command line
//! ([`find_qemu`]).

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use vmcsnap_spec::VmAddress;

use crate::qemu::QemuConfig;
use crate::vm::Vm;

/// One VM as recorded.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmRecord {
    /// Everything its QEMU command line is made of.
    pub config: QemuConfig,
    /// QEMU's pid; `None` while it is being started.
    pub pid: Option<u32>,
    /// When its QEMU was started (ms since the epoch).
    pub started_unix_ms: u64,
    /// QEMU start to ready, once seen.
    pub boot_ms: Option<u64>,
    /// QEMU's own output.
    pub qemu_log: PathBuf,
    /// Its place on the cluster network.
    pub address: VmAddress,
    /// The disk it writes (top of its chain).
    pub disk: PathBuf,
}

impl VmRecord {
    /// The record of a running (or exited) VM at `address`, writing `disk`.
    pub fn of(vm: &Vm, address: VmAddress, disk: &Path) -> VmRecord {
        VmRecord {
            config: vm.config.clone(),
            pid: Some(vm.pid).filter(|&p| p != 0),
            started_unix_ms: unix_ms(vm.started_at),
            boot_ms: vm.boot_ms,
            qemu_log: vm.qemu_log.clone(),
            address,
            disk: disk.to_path_buf(),
        }
    }

    /// A VM about to be started (no pid yet).
    pub fn pending(
        config: &QemuConfig,
        qemu_log: &Path,
        address: VmAddress,
        disk: &Path,
    ) -> VmRecord {
        VmRecord {
            config: config.clone(),
            pid: None,
            started_unix_ms: unix_ms(SystemTime::now()),
            boot_ms: None,
            qemu_log: qemu_log.to_path_buf(),
            address,
            disk: disk.to_path_buf(),
        }
    }
}

pub(crate) fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Whether `pid` is a live process whose command line names `qmp_socket`
/// (i.e. the QEMU of that VM, not a process that reused its pid).
pub fn is_qemu_of(pid: u32, qmp_socket: &Path) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let needle = qmp_socket.as_os_str().as_encoded_bytes();
    cmdline
        .split(|&b| b == 0)
        .any(|arg| arg.windows(needle.len()).any(|w| w == needle))
        // A zombie (ours, not reaped yet) is not running, nor is a QEMU
        // that quit and is exiting (the old QEMU of a warm restart, whose
        // exit goes on in the background while the new one runs the VM).
        && !crate::qemu_exit::exiting(pid)
}

/// The live QEMU of the VM whose QMP socket is `qmp_socket`: `pid` if it
/// still is that, else any process whose command line names the socket
/// (the newest, should two be found while one quits).
pub fn find_qemu(pid: Option<u32>, qmp_socket: &Path) -> Option<u32> {
    if let Some(p) = pid.filter(|&p| is_qemu_of(p, qmp_socket)) {
        return Some(p);
    }
    let mut found: Vec<u32> = std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| p != std::process::id() && is_qemu_of(p, qmp_socket))
        .collect();
    found.sort_unstable();
    found.pop()
}

/// Live QEMU processes whose command line mentions `dir` (a cluster
/// directory about to be removed): they must not lose their files.
pub fn qemus_using(dir: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    let needle = dir.as_os_str().as_encoded_bytes().to_vec();
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| p != std::process::id())
        .filter(|p| {
            let exe = std::fs::read_link(format!("/proc/{p}/exe")).unwrap_or_default();
            let is_qemu = exe
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("qemu"));
            is_qemu
                && std::fs::read(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle.as_slice()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn processes_are_recognised_by_their_command_line() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("qmp.sock");
        // `read` is a builtin: the shell never forks a child that would
        // carry the same command line for a moment (a `sleep` did, and the
        // scan found that child: a flaky test).
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg("read x; : \"$0\"")
            .arg(&sock)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        // The child may still be between fork and exec for a moment.
        let t = std::time::Instant::now();
        while !is_qemu_of(pid, &sock) && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(is_qemu_of(pid, &sock));
        assert!(!is_qemu_of(pid, &d.path().join("other.sock")));
        assert_eq!(
            find_qemu(Some(999_999_999), &sock),
            Some(pid),
            "found by scanning when the pid is wrong"
        );
        assert_eq!(find_qemu(None, &sock), Some(pid));
        child.kill().unwrap();
        child.wait().unwrap();
        let left = find_qemu(Some(pid), &sock);
        let cmd = left.map(|p| std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default());
        assert_eq!(
            left,
            None,
            "{:?}",
            cmd.map(|c| String::from_utf8_lossy(&c).into_owned())
        );
    }
}
