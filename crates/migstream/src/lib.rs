//! Reader for QEMU 7.2 and 10.0 migration streams: precopy migrations and
//! background snapshots (`migrate` with the `background-snapshot`
//! capability), read incrementally from any [`std::io::Read`]; and, in
//! [`postcopy`], a writer: a postcopy migration *source* that restores a
//! snapshot into an unmodified QEMU 7.2 destination, choosing which pages
//! go before the guest starts and in which order the rest follow (serving
//! the destination's page requests first).
//!
//! vmcsnap takes VM snapshots by having QEMU migrate into a socket the
//! agent reads. This crate turns those bytes into [`Event`]s: the RAM block
//! list, every page (with where it came from, see below), and the device
//! state as one opaque run of bytes that can be replayed verbatim later.
//! Section numbers (§) refer to the wire-format reference,
//! `shared/reference/qemu-7.2-migration-wire-format.md`.
//!
//! # QEMU versions
//!
//! The reader reads the stream of the QEMU named by
//! [`ReaderOptions::dialect`] (a [`Dialect`], chosen from the version QEMU
//! reports; 7.2 by default). QEMU 10.0 writes the same layout as 7.2 with
//! one addition the reader must know: the SWITCHOVER_START command (11,
//! no payload), sent in precopy right before the RAM section's END when
//! the machine type is newer than 9.2 (microvm; not `pc-q35-7.2`). A 7.2
//! reader refuses it as an unknown command naming 7.2's range. What else
//! differs (section ids, ROM sizes, the VM description's `configuration`
//! member, capabilities a stream may announce) is in
//! `docs/qemu-10.0-wire-format.md`.
//!
//! # Stream layout
//!
//! All integers are big-endian. `[..]` is optional.
//!
//! ```text
//! +--------------------------------------------------------------------+
//! | "QEVM" be32 0x5145564d | version be32 3                     §1.2    |
//! +--------------------------------------------------------------------+
//! | [CONFIGURATION] 0x07 | be32 len | machine name                §1.3  |
//! |    [0x05 | u8 len | "configuration/..." | be32 1 | body] ...       |
//! +--------------------------------------------------------------------+
//! | [COMMAND] 0x08 | be16 cmd | be16 len | payload   (return path,    |
//! |                                                    ping, advise)   |
//! |   (10.0: SWITCHOVER_START 11, len 0, before the last RAM END)       |
//! +--------------------------------------------------------------------+
//! | START 0x01 | be32 id | u8 3 "ram" | be32 instance 0 | be32 ver 4   |
//! |   be64 total|MEM_SIZE  (u8 len | name | be64 length                |
//! |                         [| be64 guest addr if x-ignore-shared])... |
//! |   be64 EOS | [footer 0x7e be32 id]                          §2.2   |
//! +--------------------------------------------------------------------+
//! | PART 0x02 | be32 id    (× N; END 0x03 the same, precopy only)      |
//! |   be64 offset|PAGE [| u8 len | block name] | page bytes     §2.3   |
//! |   be64 offset|ZERO [| u8 len | block name] | u8 fill              |
//! |   ... (CONTINUE 0x20 = same block as the previous record, no name) |
//! |   be64 EOS | [footer 0x7e be32 id]                                 |
//! +--------------------------------------------------------------------+
//! | FULL 0x04 | be32 id | u8 len | idstr | be32 inst | be32 ver | data  |
//! |   | [footer]   × one per device    = Event::DeviceState, opaque §5 |
//! +--------------------------------------------------------------------+
//! | EOF 0x00                                                     §1.6  |
//! +--------------------------------------------------------------------+
//! | [VMDESC 0x06 | be32 N | N bytes JSON]            → end of stream    |
//! +--------------------------------------------------------------------+
//! ```
//!
//! Device sections are not self-delimiting without understanding every
//! device, so the device state is found from both ends (§5.3): it starts at
//! the first FULL section that is not "ram" (the RAM sections before it are
//! self-delimiting) and ends at the EOF byte, which is either the last
//! byte of the stream or precedes the VM description that ends it. The
//! reader therefore holds the device state in memory until the stream
//! ends; everything else is streamed with one page buffer.
//!
//! # Guest-written pages
//!
//! In a background snapshot QEMU saves a page out of scan order when the
//! guest writes it (a userfaultfd write-protect fault); those pages, in
//! stream order, are what the guest touched first. Each page event carries
//! a [`PageOrigin`]; the rule and its limits are in [`page_origin`].
//!
//! # Example
//!
//! ```no_run
//! use vmcsnap_migstream::{Event, PageOrigin, StreamReader};
//!
//! let file = std::fs::File::open("snapshot.mig")?;
//! let mut reader = StreamReader::new(file);
//! let mut written = Vec::new();
//! while let Some(event) = reader.next_event()? {
//!     match event {
//!         Event::Page { block, offset, origin: PageOrigin::GuestWrite, .. }
//!         | Event::ZeroPage { block, offset, origin: PageOrigin::GuestWrite, .. } => {
//!             written.push((block, offset))
//!         }
//!         Event::DeviceState { data, .. } => println!("device state: {} bytes", data.len()),
//!         _ => {}
//!     }
//! }
//! println!("{} pages written by the guest during the snapshot", written.len());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # What is not supported
//!
//! By the reader, each with a specific [`StreamError`]: reading postcopy
//! streams (any postcopy command but ADVISE; the crate only *writes* them,
//! see [`postcopy`]), XBZRLE, compressed pages, multifd (a MULTIFD_FLUSH
//! record, or pages missing when the RAM data ends), QEMU 10.0's
//! `mapped-ram`, devices saved early (`early_setup`, e.g. virtio-mem: a
//! device section before the RAM data), RDMA, COLO, iterative sections other
//! than "ram" (block migration, dirty bitmaps, VFIO), and hugepage-backed
//! RAM with postcopy-ram advised.
//!
//! By the postcopy source: hugepage-backed destination RAM, postcopy
//! recovery (RECV_BITMAP, RESUME_ACK, `migrate-recover`), postcopy-preempt
//! and multifd channels, `x-ignore-shared`, destinations without section
//! footers or configuration section (machine types ≤ 2.3), and any
//! transport but a connected unix socket.
//!
//! # Limits
//!
//! * Memory: a 64 KiB read buffer, one page, the block list (at most
//!   [`MAX_RAM_BLOCKS`] entries), the set of pages seen, and at the end the
//!   device state and VM description (at most
//!   [`ReaderOptions::max_device_state_bytes`] together). The set of pages
//!   seen is kept as runs of consecutive page numbers: a handful for a QEMU
//!   stream (one per island of guest-written pages), at most one per page
//!   record for a hostile one, so it grows with the input, never with a
//!   length field.
//! * The end of the device state is found from the end of the stream, so
//!   [`Event::DeviceState`] comes only once the source reports end of file
//!   (QEMU closes the channel when it is done).
//! * A stream cut right after its EOF byte cannot be told from one whose
//!   source had `suppress-vmdesc` on; see [`VmDescPolicy`].
//! * The `x-ignore-shared` capability changes the RAM block list layout and
//!   is only announced in the configuration section. A source with
//!   `send-configuration=off` (machine types ≤ 2.3) and `x-ignore-shared`
//!   on cannot be read correctly (the block list then fails to add up, or
//!   in the worst case is misread).
//! * Only one target page size per stream: 4096 unless set in
//!   [`ReaderOptions`] or the stream's configuration section.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod command;
mod config;
mod device_state;
mod dialect;
mod error;
mod event;
mod input;
mod options;
pub mod page_origin;
pub mod postcopy;
mod ram;
mod reader;
mod stats;
pub mod wire;

pub use command::Command;
pub use config::Configuration;
pub use device_state::{VmDescDevice, VmDescription};
pub use dialect::{BackgroundResume, Dialect, UnsupportedQemu};
pub use error::StreamError;
pub use event::{Event, SectionHeader, SectionIdent};
pub use options::{ReaderOptions, VmDescPolicy};
pub use page_origin::PageOrigin;
pub use ram::{RamBlock, MAX_RAM_BLOCKS};
pub use reader::StreamReader;
pub use stats::{PageCounts, Stats};
pub use wire::{CommandKind, SectionType};
