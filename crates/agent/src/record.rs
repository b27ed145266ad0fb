//! One VM as the agent records it durably: a handle a new agent can adopt.
//!
//! A VM is a handle: its identity (name, address), its QEMU endpoint (the
//! QMP socket), its files (RAM file, disks, logs) and, once launched, the
//! pid of its QEMU ([`VmRecord`]). The cluster's record keeps these
//! handles in `<run-dir>/vms.json` ([`crate::cluster_record`]); a new
//! agent finds each VM's live QEMU again with [`crate::qemu_find`].

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
