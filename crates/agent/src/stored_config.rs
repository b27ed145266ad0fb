//! What a snapshot records of its VM: the manifest's `vm.config`
//! (docs/snapshot.md, "Metrics"). Written once per snapshot from the
//! running cluster (`cluster_snapshot::vm_config`) and read back by a
//! restore (single VM, cluster, adopted after an agent restart) and by the
//! check that a snapshot's disks are its own (`inspect --verify`, restore)
//! through [`StoredVmConfig::from_manifest`]; this type is its one
//! definition.
//!
//! The image crate keeps the field as JSON it does not interpret (its
//! format serves images made outside the agent too): the agent's QEMU
//! configuration is not the image crate's to know.

use serde::{Deserialize, Serialize};
use vmcsnap_image::Manifest;
use vmcsnap_spec::{ClusterSection, VmAddress, VmSpec};

use crate::qemu::QemuConfig;

/// Everything a restore needs to rebuild one VM: its spec entry, the
/// cluster section, its QEMU configuration and address. Fields are in
/// alphabetical order, the order the `json!` map this replaced wrote them
/// in, so manifests keep their bytes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredVmConfig {
    /// The `[cluster]` section of the spec the VM ran in.
    pub cluster: ClusterSection,
    /// The VM's address, `a.b.c.d/prefix`.
    pub ip: String,
    /// The VM's MAC, `52:54:00:..`.
    pub mac: String,
    /// Its QEMU configuration (paths of the snapshot's frozen files).
    pub qemu: QemuConfig,
    /// Its `[[vm]]` entry; `null` if the spec had none under its name.
    pub spec: Option<VmSpec>,
}

/// Why a manifest's `vm.config` is not a [`StoredVmConfig`].
#[derive(Debug, thiserror::Error)]
pub enum StoredConfigError {
    /// Absent, or not in this layout.
    #[error(
        "does not record its VM's configuration in a layout this vmcsnap reads (made by an older vmcsnap, or outside the agent: {0}): take a new snapshot"
    )]
    Unreadable(serde_json::Error),
    /// The spec entry is missing.
    #[error("does not record its VM's spec entry: take a new snapshot")]
    NoSpec,
    /// `ip` or `mac` do not parse.
    #[error(
        "records an address that does not parse (ip {ip:?}, mac {mac:?}): take a new snapshot"
    )]
    BadAddress {
        /// As recorded.
        ip: String,
        /// As recorded.
        mac: String,
    },
}

impl StoredVmConfig {
    /// The configuration of a VM with spec entry `spec` (`None`: the spec
    /// has none under its name), in a cluster with `[cluster]` table
    /// `cluster`, running with `qemu` at `address`.
    pub fn new(
        spec: Option<VmSpec>,
        cluster: ClusterSection,
        qemu: QemuConfig,
        address: &VmAddress,
    ) -> Self {
        Self {
            cluster,
            ip: address.cidr(),
            mac: address.mac_string(),
            qemu,
            spec,
        }
    }

    /// Reads the configuration `manifest` records.
    pub fn from_manifest(manifest: &Manifest) -> Result<Self, StoredConfigError> {
        Self::from_value(&manifest.vm.config)
    }

    /// Reads a manifest's `vm.config`.
    pub fn from_value(config: &serde_json::Value) -> Result<Self, StoredConfigError> {
        Self::deserialize(config).map_err(StoredConfigError::Unreadable)
    }

    /// As the manifest holds it.
    pub fn to_value(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("a VM configuration serialises")
    }

    /// The spec entry (an error for a snapshot without one).
    pub fn spec(&self) -> Result<&VmSpec, StoredConfigError> {
        self.spec.as_ref().ok_or(StoredConfigError::NoSpec)
    }

    /// The VM's address and MAC.
    pub fn address(&self) -> Result<VmAddress, StoredConfigError> {
        parse_address(&self.ip, &self.mac).ok_or_else(|| StoredConfigError::BadAddress {
            ip: self.ip.clone(),
            mac: self.mac.clone(),
        })
    }
}

fn parse_address(cidr: &str, mac: &str) -> Option<VmAddress> {
    let (ip, prefix) = cidr.split_once('/')?;
    let mut m = [0u8; 6];
    let parts: Vec<&str> = mac.split(':').collect();
    if parts.len() != 6 {
        return None;
    }
    for (i, p) in parts.iter().enumerate() {
        m[i] = u8::from_str_radix(p, 16).ok()?;
    }
    Some(VmAddress {
        ip: ip.parse().ok()?,
        prefix: prefix.parse().ok()?,
        mac: m,
    })
}

#[cfg(test)]
mod tests;
