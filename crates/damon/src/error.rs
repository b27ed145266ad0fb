//! [`DamonError`]: why a DAMON sysfs tree cannot be configured or read.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

/// Why a DAMON sysfs file could not be written, read or understood.
#[derive(Debug, Error)]
pub enum DamonError {
    /// A file of the tree could not be read (or a directory listed).
    #[error(
        "{path}: {source} (read it as root on a kernel with CONFIG_DAMON_SYSFS, \
         after `probe` said the interface is usable)"
    )]
    Read {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// A value could not be written: the kernel refused it, or the file
    /// does not exist yet (its `nr_*` parent count was not written first).
    #[error(
        "writing {value:?} to {path}: {source} (write the plan's entries in order; \
         on a real host check that the kernel supports the value and that no other \
         user started a kdamond meanwhile, then stop with `plan_stop`)"
    )]
    Write {
        /// The file.
        path: PathBuf,
        /// What was being written.
        value: String,
        /// The error.
        source: io::Error,
    },
    /// A file holds something that is not what the ABI promises.
    #[error(
        "{path}: {reason} (the kernel's DAMON sysfs layout differs from the one \
         vmcsnap knows; record the tree and report it)"
    )]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong with its content.
        reason: String,
    },
    /// Monitoring attributes the kernel would refuse when starting.
    #[error("invalid DAMON monitoring attributes: {0} (fix the configuration)")]
    InvalidAttrs(String),
}
