//! Constants and small enums of QEMU's migration wire format (7.2 and
//! 10.0; what 10.0 adds is marked, see `docs/qemu-10.0-wire-format.md`).
//!
//! Shared by the reader and by the postcopy writer, so both agree on every
//! magic number. Section numbers (§) refer to
//! `shared/reference/qemu-7.2-migration-wire-format.md`. All multi-byte
//! integers on the wire are big-endian.

use crate::dialect::Dialect;

/// `QEMU_VM_FILE_MAGIC`: the first four bytes of every stream ("QEVM", §1.1).
pub const FILE_MAGIC: u32 = 0x5145_564d;
/// `QEMU_VM_FILE_VERSION`: the only stream version QEMU 7.2 and 10.0 write or accept (§1.1).
pub const FILE_VERSION: u32 = 3;

/// `QEMU_VM_SUBSECTION`: starts a subsection inside vmstate data, and
/// inside the configuration section (§1.3).
pub const SUBSECTION: u8 = 0x05;
/// `QEMU_VM_SECTION_FOOTER`: starts a section footer (`0x7e | be32 section_id`, §1.4).
pub const SECTION_FOOTER: u8 = 0x7e;

/// The top-level record types of a stream (§1.1): the byte that starts
/// each top-level item after the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum SectionType {
    /// `QEMU_VM_EOF`: end of the section list.
    Eof = 0x00,
    /// `QEMU_VM_SECTION_START`: first section of an iterative device (full header).
    Start = 0x01,
    /// `QEMU_VM_SECTION_PART`: a middle section of an iterative device (id only).
    Part = 0x02,
    /// `QEMU_VM_SECTION_END`: last section of an iterative device (id only).
    End = 0x03,
    /// `QEMU_VM_SECTION_FULL`: a whole non-iterative device (full header).
    Full = 0x04,
    /// `QEMU_VM_VMDESCRIPTION`: the JSON VM description after EOF (§1.6).
    VmDescription = 0x06,
    /// `QEMU_VM_CONFIGURATION`: the configuration section after the header (§1.3).
    Configuration = 0x07,
    /// `QEMU_VM_COMMAND`: a command (`be16 cmd | be16 len | payload`, §1.5).
    Command = 0x08,
}

impl SectionType {
    /// The type for a top-level byte, or `None` if the byte starts no
    /// top-level item (0x05 subsection and 0x7e footer are not top-level).
    pub fn from_byte(byte: u8) -> Option<Self> {
        Some(match byte {
            0x00 => Self::Eof,
            0x01 => Self::Start,
            0x02 => Self::Part,
            0x03 => Self::End,
            0x04 => Self::Full,
            0x06 => Self::VmDescription,
            0x07 => Self::Configuration,
            0x08 => Self::Command,
            _ => return None,
        })
    }

    /// Whether sections of this type carry the full header
    /// (`idstr | instance_id | version_id`) rather than the id alone.
    pub fn has_full_header(self) -> bool {
        matches!(self, Self::Start | Self::Full)
    }

    /// A short upper-case name, as QEMU's sources spell it without prefix.
    pub fn name(self) -> &'static str {
        match self {
            Self::Eof => "EOF",
            Self::Start => "START",
            Self::Part => "PART",
            Self::End => "END",
            Self::Full => "FULL",
            Self::VmDescription => "VMDESCRIPTION",
            Self::Configuration => "CONFIGURATION",
            Self::Command => "COMMAND",
        }
    }
}

/// Names of the subsections of the configuration section (§1.3).
pub mod config_subsection {
    /// Body: be32 target page bits. Never sent on x86.
    pub const TARGET_PAGE_BITS: &str = "configuration/target-page-bits";
    /// Body: be32 count, then per capability `u8 len | name`.
    pub const CAPABILITIES: &str = "configuration/capabilities";
    /// Body: 16 raw bytes.
    pub const UUID: &str = "configuration/uuid";
}

/// The capability that changes the RAM setup layout (§2.2) and the set of
/// blocks whose pages are sent.
pub const CAP_X_IGNORE_SHARED: &str = "x-ignore-shared";

/// QEMU 10.0's capability that puts each RAM block at a fixed offset of a
/// file (`file:` migrations only); listed in the configuration section
/// like `x-ignore-shared`. The reader refuses it.
pub const CAP_MAPPED_RAM: &str = "mapped-ram";

/// The idstr of the RAM section (§2).
pub const RAM_IDSTR: &str = "ram";
/// The only RAM section version QEMU 7.2 and 10.0 accept (§2).
pub const RAM_SECTION_VERSION: u32 = 4;
/// The RAM section's instance id (§2).
pub const RAM_INSTANCE_ID: u32 = 0;

/// The flags of a RAM record header (§2.1). They live in the bits below
/// the target page size of the record's `be64 offset | flags`.
pub mod ram_flags {
    /// Obsolete whole-RAM flag; never valid in a 7.2 stream.
    pub const FULL: u64 = 0x01;
    /// A page filled with one byte; `u8 fill` follows.
    pub const ZERO: u64 = 0x02;
    /// The RAM block list (setup); the offset bits hold the total size.
    pub const MEM_SIZE: u64 = 0x04;
    /// A raw target page follows.
    pub const PAGE: u64 = 0x08;
    /// End of this section's RAM data.
    pub const EOS: u64 = 0x10;
    /// Same RAM block as the previous record: no idstr follows.
    pub const CONTINUE: u64 = 0x20;
    /// XBZRLE-encoded page (capability `xbzrle`).
    pub const XBZRLE: u64 = 0x40;
    /// RDMA hook.
    pub const HOOK: u64 = 0x80;
    /// zlib-compressed page (capability `compress`; QEMU 10.0 removed
    /// that capability and never writes this flag).
    pub const COMPRESS_PAGE: u64 = 0x100;
    /// QEMU 8.x and later (10.0): a multifd sync point in the main channel
    /// (capability `multifd` only); no payload.
    pub const MULTIFD_FLUSH: u64 = 0x200;
}

/// The target page size of x86 (and the default of the reader): 4096.
pub const X86_TARGET_PAGE_SIZE: u32 = 4096;

/// Command numbers of `QEMU_VM_COMMAND` (`enum qemu_vm_cmd`, §1.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum CommandKind {
    /// Open the return path (payload length 0).
    OpenReturnPath = 1,
    /// Ping (payload be32 value).
    Ping = 2,
    /// Postcopy advise (payload 0 or 16 bytes).
    PostcopyAdvise = 3,
    /// Postcopy listen (payload length 0).
    PostcopyListen = 4,
    /// Postcopy run (payload length 0).
    PostcopyRun = 5,
    /// Postcopy RAM discard (variable payload).
    PostcopyRamDiscard = 6,
    /// A packaged blob follows (payload be32 blob length).
    Packaged = 7,
    /// COLO.
    EnableColo = 8,
    /// Postcopy recovery resume (payload length 0).
    PostcopyResume = 9,
    /// Postcopy recovery bitmap request (variable payload).
    RecvBitmap = 10,
    /// QEMU 10.0: the source is about to switch over (payload length 0).
    /// Sent after the last iterative pass of a precopy migration, just
    /// before the RAM section's END, when the migration property
    /// `send-switchover-start` is on (the default, except for machine
    /// types ≤ 9.2 such as `pc-q35-7.2`).
    SwitchoverStart = 11,
}

impl CommandKind {
    /// The kind for a command number of any supported QEMU, `None` for 0
    /// and ≥ 12 (which numbers a given version defines:
    /// [`CommandKind::max_for`]).
    pub fn from_u16(cmd: u16) -> Option<Self> {
        Some(match cmd {
            1 => Self::OpenReturnPath,
            2 => Self::Ping,
            3 => Self::PostcopyAdvise,
            4 => Self::PostcopyListen,
            5 => Self::PostcopyRun,
            6 => Self::PostcopyRamDiscard,
            7 => Self::Packaged,
            8 => Self::EnableColo,
            9 => Self::PostcopyResume,
            10 => Self::RecvBitmap,
            11 => Self::SwitchoverStart,
            _ => return None,
        })
    }

    /// QEMU's name of the command (without the `MIG_CMD_` prefix).
    pub fn name(self) -> &'static str {
        match self {
            Self::OpenReturnPath => "OPEN_RETURN_PATH",
            Self::Ping => "PING",
            Self::PostcopyAdvise => "POSTCOPY_ADVISE",
            Self::PostcopyListen => "POSTCOPY_LISTEN",
            Self::PostcopyRun => "POSTCOPY_RUN",
            Self::PostcopyRamDiscard => "POSTCOPY_RAM_DISCARD",
            Self::Packaged => "PACKAGED",
            Self::EnableColo => "ENABLE_COLO",
            Self::PostcopyResume => "POSTCOPY_RESUME",
            Self::RecvBitmap => "RECV_BITMAP",
            Self::SwitchoverStart => "SWITCHOVER_START",
        }
    }

    /// The highest command number `dialect` defines (its commands are
    /// `1..=max_for(dialect)`).
    pub fn max_for(dialect: Dialect) -> u16 {
        match dialect {
            Dialect::Qemu7_2 => Self::RecvBitmap as u16,
            Dialect::Qemu10_0 => Self::SwitchoverStart as u16,
        }
    }

    /// The kind for `cmd` if `dialect` defines it.
    pub fn for_dialect(cmd: u16, dialect: Dialect) -> Option<Self> {
        (cmd <= Self::max_for(dialect))
            .then(|| Self::from_u16(cmd))
            .flatten()
    }
}
