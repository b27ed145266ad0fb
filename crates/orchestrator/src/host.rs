//! The per-host API: what the orchestrator asks of the host that runs a
//! VM. The agent implements it in-process today; a network client of a
//! remote agent will implement the same trait (issue 33), so the
//! orchestrator's code is the same either way. It grows with each part of
//! the cluster protocols that moves here (docs/architecture.md lists what
//! they still reach directly).

use std::path::Path;

/// A host's answer that failed, with the host's own message.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct HostError(pub String);

/// The operations the orchestrator needs from a host.
pub trait HostApi {
    /// HotRestore's hybrid working-set size, in pages, of the VM snapshot
    /// in `vm_snapshot` (the size a restore loads before the guest runs,
    /// without a sampled measurement).
    fn working_set_pages(&self, vm_snapshot: &Path) -> Result<u64, HostError>;
}
