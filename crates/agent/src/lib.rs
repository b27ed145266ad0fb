//! The per-host vmcsnap agent.
//!
//! One agent per run directory owns everything of a running cluster: the
//! QEMU processes, their QMP sockets, their console logs, their data disks,
//! the shared-memory files holding guest RAM, and the switch every NIC is
//! plugged into. The CLI talks to it over `<run-dir>/agent.sock` with the
//! protocol of `vmcsnap-control`.
//!
//! ```text
//!  vmcsnap CLI ──agent.sock──▶ agent ─┬─ QMP ──▶ qemu (vm a) ─┐ netdev stream
//!                                     ├─ QMP ──▶ qemu (vm b) ─┤ (unix sockets)
//!                                     └─ switch ◀─────────────┘
//! ```
//!
//! Modules: [`paths`] (where every file lives), [`accel`] (KVM or TCG),
//! [`cloud_init`] (the NoCloud seed of image VMs), [`capacity`] (will the
//! VMs fit on this host),
//! [`qemu`] (the QEMU command line), [`vm`] (one QEMU process), [`cluster`]
//! (boot and tear down a cluster), [`server`] (the control socket).

pub mod accel;
pub mod accessed;
pub mod agent_lock;
pub mod availability;
pub mod block_chains;
pub mod capacity;
pub mod cloud_init;
pub mod cluster;
pub mod cluster_record;
pub mod cluster_restore;
pub mod cluster_snapshot;
pub mod cpu_model;
pub mod disk_chain;
pub mod disk_set;
mod dispatch;
mod error;
pub mod fault;
pub mod frozen_disks;
pub mod gc;
pub mod guest_clock;
pub mod guest_console;
pub mod guest_counters;
pub mod handover;
pub mod host_api;
pub mod host_port;
pub mod image_vm;
pub mod intent;
pub mod intent_recovery;
pub mod loading;
pub mod member;
pub mod metrics;
pub mod metrics_endpoint;
pub mod paths;
mod process;
pub mod qemu;
pub mod qemu_crossing;
pub mod qemu_exit;
pub mod qemu_find;
pub mod qemu_kept;
pub mod qemu_restart;
pub mod record;
pub mod rejuvenate;
pub mod rejuvenate_cpr;
pub mod relay;
pub mod restart_recovery;
pub mod restore;
pub mod restore_journal;
pub mod restore_recovery;
pub mod sampler;
pub mod server;
pub mod snapshot;
pub mod snapshot_removal;
pub mod stored_config;
pub mod thread_priority;
pub mod vm;
pub mod vm_disks;

pub use error::AgentError;
pub use paths::RunDir;
pub use server::{serve, AgentOptions};
/// The snapshot image format (re-exported for the CLI and tests).
pub use vmcsnap_image as image;

/// One line of the agent's log: a `tracing` event at level INFO, inside
/// whatever span the request opened (operation, vm, snapshot). The binary
/// installs the subscriber that writes it, timestamped, to the agent's
/// stderr, as text or JSON (`--log-format`). New code logs with
/// `tracing::info!`/`warn!` and fields directly; this stays for the calls
/// not converted yet.
pub fn log(msg: impl AsRef<str>) {
    tracing::info!("{}", msg.as_ref());
}

/// Milliseconds since the epoch (for `ping`).
pub fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The message of a thread's panic (its payload), for the error that reports it.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}
