//! Guest-read access data from the kernel's DAMON, as pure helpers over its
//! sysfs interface (`/sys/kernel/mm/damon/admin`, kernels 5.18+; the
//! `update_schemes_tried_regions` command needs 6.2+).
//!
//! Write-protection and userfaultfd only see a guest's writes and first
//! faults; DAMON's virtual-address monitoring of QEMU's guest-RAM mapping
//! also sees reads. Every function takes the admin directory as a
//! parameter ([`DEFAULT_ROOT`] only in production), so tests run on
//! recorded trees; nothing here starts threads or talks to QEMU.
//!
//! * [`probe`]: is vaddr monitoring usable, and if not why
//!   ([`Availability`], serializable for snapshot metadata).
//! * [`plan_setup`], [`plan_refresh`], [`plan_stop`], [`apply`]: the
//!   ordered writes that create one kdamond, one context on a pid (`fvaddr`
//!   over one address range such as QEMU's guest-RAM mapping, or `vaddr`)
//!   and one `stat` scheme matching accessed regions; refresh its
//!   `tried_regions`; stop it.
//! * [`read_tried_regions`], [`accessed_pages`]: the accessed regions and
//!   the mapping's pages they cover.
//!
//! The ABI followed is the kernel's
//! `Documentation/ABI/testing/sysfs-kernel-mm-damon` and
//! `Documentation/admin-guide/mm/damon/usage.rst`.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod availability;
mod error;
pub mod regions;
pub mod setup;
#[cfg(test)]
mod tests;

pub use availability::{can_open_for_write, from_kernel_config, probe, probe_with, Availability};
pub use error::DamonError;
pub use regions::{
    accessed_pages, parse_region, parse_value, read_tried_regions, tried_regions_dir, Region,
};
pub use setup::{
    apply, plan_refresh, plan_setup, plan_stop, MonitorAttrs, Target, Write, CONTEXT, KDAMOND,
    SCHEME,
};

/// The DAMON sysfs admin directory of a real host. Never used by this
/// crate's tests.
pub const DEFAULT_ROOT: &str = "/sys/kernel/mm/damon/admin";
