//! The vmcsnap snapshot image format, version 2 (reads version 1).
//!
//! A snapshot of one VM is a directory:
//!
//! ```text
//! <root>/<name>/
//!   manifest     "VMCSNAP-MANIFEST 2.0 len=N crc32c=X\n" + JSON: VM config, QEMU version and
//!                machine, RAM blocks, disks, metrics, storage, and the name + size of every file below
//!   memory.img   header | block 0 | block 1 | ...    non-zero pages in locality blocks
//!   pages.idx    header | block table | per RAM block: page → (block, slot, flags, crc)
//!   zero.bmp     header | per RAM block: one bit per page, set = zero page
//!   device.bin   header | device-state blob
//!   trace.bin    header | named sections of page keys ("fafl": guest writes, in order)
//!
//! memory.img
//! +-------------------+----------------------------------------------+-------
//! | file header (64)  | block 0                                      | block 1 ...
//! | magic VMCSNMEM,   | +-------------+-------------------+--------+ |
//! | version, image id,| | header (32) | page list         | pages, | |
//! | page size, blocks | | MBLK seq n  | n × (ram_block,   | LZ4 or | |
//! | header CRC        | | codec, flags| page, page CRC)   | zstd   | |
//! |                   | | CRC32C of header+list+stored payload       | |
//! +-------------------+----------------------------------------------+-------
//! ```
//!
//! Version 2 adds hot blocks (pages the guest wrote during the snapshot,
//! in first-write order; the rest in address order), per-block
//! compression ([`codec`]) by a worker pool that never blocks the capture
//! (`writer::pipeline`), and duplicate pages stored once (index flag).
//! Every binary file starts with the same 64-byte header (magic, version,
//! image id, body length, CRC of the body, CRC of the header). Integers are
//! little-endian. `docs/image-format.md` describes every byte, the commit
//! protocol and the compatibility policy.
//!
//! * [`ImageWriter`] streams pages in (bounded memory, buffered appends, no
//!   per-page syscalls) and commits atomically: temporary directory, fsync,
//!   rename, fsync of the parent. An interrupted snapshot is never listed.
//! * [`Image`] opens and checks an image with bounded reads, and reads pages,
//!   blocks, bitmaps and traces; [`Image::verify`] checks every CRC and names
//!   each bad block; [`Image::plan_reads`] turns a set of pages into merged
//!   sequential reads.
//! * [`list_snapshots`] and [`cleanup_stale`] manage a directory of snapshots.
//! * [`cluster`] and [`channel_log`] hold the formats of a *cluster
//!   snapshot* (`cluster.json`, `channel-state.bin`, one per-VM snapshot per
//!   VM under `vms/`); `docs/cluster-snapshot.md` describes them.
//!
//! ```no_run
//! use vmcsnap_image::{Image, ImageMeta, ImageWriter, PageKey, RamBlock};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let meta = ImageMeta {
//!     page_size: 4096,
//!     ram_blocks: vec![RamBlock { name: "pc.ram".into(), used_length: 1 << 20 }],
//!     ..Default::default()
//! };
//! let mut w = ImageWriter::create("/snaps/s1".as_ref(), meta)?;
//! for page in 0..256 {
//!     w.add_page(0, page, &[page as u8; 4096])?; // page 0 is all zeros: goes to the bitmap
//! }
//! w.trace_push(PageKey::new(0, 7))?;
//! w.set_device_state(b"...")?;
//! w.metrics_mut().downtime_ms = Some(3);
//! w.commit()?;
//!
//! let img = Image::open("/snaps/s1".as_ref())?;
//! let mut page = vec![0u8; 4096];
//! img.read_page(PageKey::new(0, 7), &mut page)?;
//! assert!(img.verify().is_ok());
//! # Ok(()) }
//! ```

#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod channel_log;
pub mod cluster;
pub mod codec;
pub mod error;
mod fileio;
pub mod format;
pub mod hashes;
pub mod index;
pub mod list;
pub mod manifest;
pub mod plan;
pub mod reader;
pub mod testing;
pub mod trace;
pub mod verify;
pub mod writer;

pub use channel_log::{
    encode_channel_log, parse_channel_log, read_channel_log, write_channel_log, ChannelFrame,
    ChannelLogError, ChannelLogSummary, FrameReason,
};
pub use cluster::{
    check_cluster_committed, commit_cluster_dir, edges_from_frames, is_cluster_snapshot,
    list_cluster_snapshots, ChannelStateRef, ClusterError, ClusterManifest, ClusterSnapshotEntry,
    ClusterVm, Edge, Timeline, CHANNEL_LOG, CLUSTER_MANIFEST,
};
pub use codec::Codec;
pub use error::{ReadError, Version};
pub use format::{FileKind, PageKey, FORMAT_MAJOR, FORMAT_MINOR, FORMAT_V1, FORMAT_VERSION};
pub use index::{BlockInfo, ZeroBitmap};
pub use list::{
    check_committed, cleanup_stale, cleanup_where, list_snapshots, process_running, ListError,
    SnapshotEntry,
};
pub use manifest::{
    DiskRef, FileRef, Files, Manifest, Metrics, ParentRef, PauseBreakdown, PausePart, QemuInfo,
    RamBlock, Storage, VmInfo,
};
pub use plan::{ReadExtent, ReadPlan};
pub use reader::{Block, DiskPages, Image, ImageStats, PageLocation, PageState};
pub use trace::{TraceSection, TRACE_FAFL};
pub use verify::{BadBlock, BadPage, VerifyReport};
pub use writer::pipeline::WorkerInit;
pub use writer::{
    Committed, DiskMatcher, ImageMeta, ImageWriter, ParentInfo, WriteError, WriterOptions,
};
