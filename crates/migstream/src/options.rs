//! Settings of the stream reader.

use crate::dialect::Dialect;
use crate::wire::X86_TARGET_PAGE_SIZE;

/// Settings of a [`StreamReader`](crate::StreamReader).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReaderOptions {
    /// The target page size, used to split RAM record headers into offset
    /// and flags. 4096 (x86) by default; a `configuration/target-page-bits`
    /// subsection in the stream overrides it.
    pub target_page_size: u32,
    /// Most bytes kept for the end of the stream: device state, EOF and VM
    /// description. The only part of the stream held in memory whole.
    pub max_device_state_bytes: usize,
    /// Fail with [`StreamError::IncompleteRam`](crate::StreamError::IncompleteRam)
    /// if the RAM data ends before every page of every block was sent (with `x-ignore-shared`: of every
    /// block with at least one page sent). On by default: QEMU always sends
    /// every page in precopy and background snapshots, so a gap means the
    /// pages went elsewhere (multifd) or the stream is not what it seems.
    pub require_all_pages: bool,
    /// Whether the stream must end with a VM description.
    pub vmdesc: VmDescPolicy,
    /// Which QEMU wrote the stream: decides which commands are valid
    /// (QEMU 10.0 adds SWITCHOVER_START) and names the version in errors.
    /// Take it from the QEMU's QMP greeting ([`Dialect::for_qemu`]);
    /// QEMU 7.2 by default.
    pub dialect: Dialect,
}

impl ReaderOptions {
    /// The default options for a stream written by `dialect`'s QEMU.
    pub fn for_dialect(dialect: Dialect) -> Self {
        ReaderOptions {
            dialect,
            ..ReaderOptions::default()
        }
    }
}

impl Default for ReaderOptions {
    fn default() -> Self {
        ReaderOptions {
            target_page_size: X86_TARGET_PAGE_SIZE,
            max_device_state_bytes: 256 << 20,
            require_all_pages: true,
            vmdesc: VmDescPolicy::Auto,
            dialect: Dialect::Qemu7_2,
        }
    }
}

/// Whether a stream must end with a VM description (§1.6).
///
/// A stream cut off right after its EOF byte looks exactly like one whose
/// source had `suppress-vmdesc` on, so accepting both means missing that
/// truncation; and without a VM description the device state simply ends
/// at the last byte, so a stream cut inside the device state just after a
/// 0x00 byte is not detected either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmDescPolicy {
    /// Required if the stream has a configuration section (every machine
    /// type newer than 2.3, where `suppress-vmdesc` is off unless set
    /// explicitly), optional otherwise. The default.
    Auto,
    /// Always required.
    Required,
    /// Never required (sources with `suppress-vmdesc=on`).
    Optional,
}
