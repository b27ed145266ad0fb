//! The cluster specification: what `vmcsnap up SPEC` boots.
//!
//! A spec is a TOML file (documented in `docs/cluster-spec.md`):
//!
//! ```toml
//! [cluster]
//! name = "demo"          # [a-z0-9-], at most 24 characters
//! accel = "auto"         # auto | kvm | tcg
//!
//! [[vm]]
//! name = "alpha"
//! memory_mib = 256
//! vcpus = 1
//! disk_mib = 64
//! workload = "memtouch -m 32 & pingpong server 7000 &"
//! ```
//!
//! Parsing is strict: unknown fields, duplicate names, bad names and bad
//! sizes are each rejected with one error that names the offending field.
//! Addresses and MACs are not part of the spec: vmcsnap assigns them
//! ([`ClusterSpec::addressing`]) so that every VM of a cluster sits on one
//! L2 segment behind vmcsnap's switch.
//!
//! Besides vmcsnap's busybox lab guest, a VM may boot an image of its own
//! (`image = "debian.qcow2"` or `image_recipe = "redis"`);
//! [`VmSpec::kind`] tells which, with every default resolved (see
//! [`GuestKind`]).
//!
//! Workloads may refer to other VMs' addresses with `{ip:NAME}` and to the
//! VM's own name with `{name}`; [`ClusterSpec::expand_workload`] fills them in.

mod addressing;
mod error;
mod guest;
mod model;
mod rules;
mod ssh_key;
pub mod testing;

pub use addressing::{VmAddress, SUBNET_PREFIX};
pub use error::SpecError;
pub use guest::{
    Boot, DiskFormat, DiskSpec, ExtraDisk, GuestKind, HostAccess, ImageGuest, ImageSource,
    ImageSuite, Machine, SshKeys, IMAGE_MIN_MEMORY_MIB, MICROVM_VIRTIO_SLOTS, Q35_PCI_SLOTS,
};
pub use model::{Accel, ClusterSection, ClusterSpec, VmSpec, MAX_BOOT_TIMEOUT_S, MAX_VMS};
pub use ssh_key::{check_public_key, KEY_TYPES};

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_fuzz;
#[cfg(test)]
mod tests_image;
