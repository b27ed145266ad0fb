//! The orchestrator's per-host API ([`vmcsnap_orchestrator::host::HostApi`])
//! served in-process by this agent, for the VMs and snapshots of its host.

use std::path::Path;

use vmcsnap_orchestrator::host::{HostApi, HostError};

/// This host, asked in-process.
pub struct LocalHost;

impl HostApi for LocalHost {
    fn working_set_pages(&self, vm_snapshot: &Path) -> Result<u64, HostError> {
        crate::restore::hybrid_size(vm_snapshot).map_err(|e| HostError(e.to_string()))
    }
}
