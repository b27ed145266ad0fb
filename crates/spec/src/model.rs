//! The spec's data model and its validation.

use std::collections::HashSet;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::addressing::{self, VmAddress};
use crate::guest::{
    DiskFormat, DiskSpec, HostAccess, ImageSuite, Machine, SshKeys, IMAGE_MIN_MEMORY_MIB,
};
use crate::SpecError;

/// At most this many VMs per cluster (addresses .2 to .250 of the /24).
pub const MAX_VMS: usize = 248;
/// Longest `boot_timeout_s` accepted: a day. A larger value is surely a
/// typo, and one near `u64::MAX` would overflow the boot deadline
/// (`Instant + Duration` panics).
pub const MAX_BOOT_TIMEOUT_S: u64 = 86_400;
const MAX_CLUSTER_NAME: usize = 24;
const MAX_VM_NAME: usize = 24;
const MAX_VCPUS: u64 = 64;
const MAX_MEMORY_MIB: u64 = 1 << 20;
pub(crate) const MIN_DISK_MIB: u64 = 8;
pub(crate) const MAX_DISK_MIB: u64 = 1 << 20;

/// Which accelerator runs the guests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// KVM where KVM can run a stock guest, TCG otherwise.
    #[default]
    Auto,
    /// KVM, or fail.
    Kvm,
    /// QEMU's software emulation.
    Tcg,
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Accel::Auto => "auto",
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        })
    }
}

/// The `[cluster]` table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    /// Cluster name, used in file names.
    pub name: String,
    /// Accelerator choice.
    #[serde(default)]
    pub accel: Accel,
    /// Seconds to wait for every VM's ready marker (default 120).
    #[serde(default = "default_boot_timeout")]
    pub boot_timeout_s: u64,
    /// How the host reaches the VMs' network (default `netns`).
    #[serde(default)]
    pub host_access: HostAccess,
}

fn default_boot_timeout() -> u64 {
    120
}

/// One `[[vm]]` table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSpec {
    /// VM name, unique in the cluster.
    pub name: String,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// Virtual CPUs (default 1).
    #[serde(default = "default_vcpus")]
    pub vcpus: u64,
    /// Size of the VM's qcow2 data disk in MiB (default 64).
    #[serde(default = "default_disk")]
    pub disk_mib: u64,
    /// Shell script the guest runs at boot, with placeholders: busybox sh
    /// in the lab guest; in an image VM, a /bin/sh script its
    /// `vmcsnap-workload.service` runs (delivered through fw_cfg).
    #[serde(default)]
    pub workload: String,
    /// Root disk image (qcow2 or raw) of an image VM; never written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<PathBuf>,
    /// Format of `image`; absent: the agent detects it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_format: Option<DiskFormat>,
    /// An image vmcsnap builds (`vmcsnap image build`); excludes `image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_recipe: Option<String>,
    /// The Debian release of `image_recipe` (default bookworm).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_suite: Option<ImageSuite>,
    /// Extra disks of an image VM, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DiskSpec>,
    /// Machine type; see [`VmSpec::kind`] for the defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<Machine>,
    /// Kernel for direct boot of an image VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<PathBuf>,
    /// Initrd for direct boot (needs `kernel`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<PathBuf>,
    /// Kernel command line for direct boot (needs `kernel`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
    /// Whether an image VM gets a NoCloud seed (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init: Option<bool>,
    /// Public keys the seed installs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_authorized_keys: Option<SshKeys>,
}

fn default_vcpus() -> u64 {
    1
}
fn default_disk() -> u64 {
    64
}

/// A whole, validated cluster spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// The `[cluster]` table.
    pub cluster: ClusterSection,
    /// The `[[vm]]` tables, in order; the order decides the addresses.
    #[serde(default)]
    pub vm: Vec<VmSpec>,
}

impl ClusterSpec {
    /// Parses and validates a spec. `min_memory_mib` is the guest's floor.
    pub fn from_toml_str(text: &str, min_memory_mib: u64) -> Result<Self, SpecError> {
        let spec: ClusterSpec = toml::from_str(text).map_err(|e| SpecError::Toml(one_line(&e)))?;
        spec.validate(min_memory_mib)?;
        // `disk_mib` has a default, so only the text tells whether an image
        // VM sets it (it would be silently ignored).
        let raw: toml::Table = toml::from_str(text).map_err(|e| SpecError::Toml(one_line(&e)))?;
        let tables = raw
            .get("vm")
            .and_then(|v| v.as_array())
            .map(Vec::as_slice)
            .unwrap_or_default();
        for (vm, table) in spec.vm.iter().zip(tables) {
            if vm.is_image() && table.get("disk_mib").is_some() {
                return Err(SpecError::LabOnly {
                    vm: vm.name.clone(),
                    field: "disk_mib",
                    instead: "give an image VM extra disks with disks = [{ size_mib = N }]",
                });
            }
        }
        Ok(spec)
    }

    /// Checks everything serde cannot: names, ranges, duplicates, placeholders.
    pub fn validate(&self, min_memory_mib: u64) -> Result<(), SpecError> {
        check_name("cluster", &self.cluster.name, MAX_CLUSTER_NAME)?;
        if !(1..=MAX_BOOT_TIMEOUT_S).contains(&self.cluster.boot_timeout_s) {
            return Err(SpecError::BootTimeoutOutOfRange(
                self.cluster.boot_timeout_s,
            ));
        }
        if self.vm.is_empty() {
            return Err(SpecError::NoVms);
        }
        if self.vm.len() > MAX_VMS {
            return Err(SpecError::TooManyVms(self.vm.len()));
        }
        let mut seen = HashSet::new();
        for vm in &self.vm {
            check_name("VM", &vm.name, MAX_VM_NAME)?;
            if !seen.insert(vm.name.as_str()) {
                return Err(SpecError::DuplicateVm(vm.name.clone()));
            }
        }
        for vm in &self.vm {
            vm.check_guest_fields()?;
            let min_memory_mib = if vm.is_image() {
                IMAGE_MIN_MEMORY_MIB.max(min_memory_mib)
            } else {
                min_memory_mib
            };
            if vm.memory_mib < min_memory_mib {
                return Err(SpecError::MemoryTooSmall {
                    vm: vm.name.clone(),
                    got: vm.memory_mib,
                    min: min_memory_mib,
                });
            }
            range(
                vm,
                "memory_mib",
                vm.memory_mib,
                min_memory_mib.max(1),
                MAX_MEMORY_MIB,
                "up to 1048576",
            )?;
            range(vm, "vcpus", vm.vcpus, 1, MAX_VCPUS, "1-64")?;
            range(
                vm,
                "disk_mib",
                vm.disk_mib,
                MIN_DISK_MIB,
                MAX_DISK_MIB,
                "8-1048576",
            )?;
            self.expand_workload(&vm.name)?;
        }
        Ok(())
    }

    /// The VM with this name.
    pub fn vm(&self, name: &str) -> Option<&VmSpec> {
        self.vm.iter().find(|v| v.name == name)
    }

    /// Address and MAC of every VM, in spec order.
    pub fn addressing(&self) -> Vec<VmAddress> {
        (0..self.vm.len()).map(addressing::for_index).collect()
    }

    /// The workload of `vm` with `{ip:NAME}` and `{name}` filled in.
    pub fn expand_workload(&self, vm: &str) -> Result<String, SpecError> {
        let spec = self.vm(vm).expect("expand_workload on a VM of this spec");
        let mut out = String::with_capacity(spec.workload.len());
        let mut rest = spec.workload.as_str();
        while let Some(open) = rest.find('{') {
            out.push_str(&rest[..open]);
            let after = &rest[open + 1..];
            let Some(close) = after.find('}') else {
                // A lone '{' (shell braces) is kept as it is.
                out.push('{');
                rest = after;
                continue;
            };
            let inner = &after[..close];
            if inner == "name" {
                out.push_str(vm);
            } else if let Some(target) = inner.strip_prefix("ip:") {
                let idx = self
                    .vm
                    .iter()
                    .position(|v| v.name == target)
                    .ok_or_else(|| SpecError::UnknownWorkloadVm {
                        vm: vm.to_string(),
                        target: target.to_string(),
                    })?;
                out.push_str(&addressing::for_index(idx).ip.to_string());
            } else if inner
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == ':' || c == '_')
                && !inner.is_empty()
            {
                return Err(SpecError::UnknownPlaceholder {
                    vm: vm.to_string(),
                    placeholder: format!("{{{inner}}}"),
                });
            } else {
                // Not a placeholder (e.g. a shell group `{ a; b; }`): keep it.
                out.push('{');
                rest = after;
                continue;
            }
            rest = &after[close + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }
}

pub(crate) fn range(
    vm: &VmSpec,
    field: &'static str,
    got: u64,
    lo: u64,
    hi: u64,
    text: &'static str,
) -> Result<(), SpecError> {
    if got < lo || got > hi {
        return Err(SpecError::OutOfRange {
            vm: vm.name.clone(),
            field,
            got,
            range: text,
        });
    }
    Ok(())
}

pub(crate) fn check_name(what: &'static str, name: &str, max: usize) -> Result<(), SpecError> {
    let ok = !name.is_empty()
        && name.len() <= max
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if ok {
        Ok(())
    } else {
        Err(SpecError::BadName {
            what,
            name: name.to_string(),
            max,
        })
    }
}

/// toml's errors span several lines with a source excerpt; keep the message
/// and the line number so the CLI prints one line.
fn one_line(e: &toml::de::Error) -> String {
    let msg = e.message().trim().replace('\n', " ");
    match e.span() {
        Some(span) => format!("{msg} (at byte {})", span.start),
        None => msg,
    }
}
