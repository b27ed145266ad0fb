//! What a snapshot request asks for ([`Options`], [`Mode`], how the image
//! is stored), the hooks a cluster snapshot places around the pause, and
//! what a snapshot measured ([`Report`]).

use std::path::PathBuf;

use vmcsnap_capture::CaptureMode;

use crate::AgentError;

use vmcsnap_control::{ImageStorage, StorageLayout};
pub use vmcsnap_control::{SnapshotMode as Mode, SnapshotReport as Report};

/// The capture a snapshot mode runs.
pub(super) fn capture_mode(mode: Mode) -> CaptureMode {
    match mode {
        Mode::Hot => CaptureMode::BackgroundSnapshot,
        Mode::StopCopy => CaptureMode::StopCopy,
        Mode::Precopy => CaptureMode::Precopy,
    }
}

/// What the request asks for.
#[derive(Debug, Clone)]
pub struct Options {
    /// The mode.
    pub mode: Mode,
    /// The snapshot's name (default `<vm>-<unix time>`).
    pub name: Option<String>,
    /// Debug: copy the guest RAM file here while the VM is paused for the
    /// snapshot (before the memory copy starts), to check the image against.
    pub reference: Option<PathBuf>,
    /// What the manifest records of the VM (`vm.config`).
    pub vm_config: crate::stored_config::StoredVmConfig,
    /// Testing: a fault for this snapshot's capture to obey (see
    /// [`crate::fault`]).
    pub fault: Option<crate::fault::Fault>,
    /// Where the snapshot goes; `None`: `<run>/snapshots/<name>`, frozen
    /// disks in `<run>/snapshots/.disks/<name>`.
    pub target: Option<Target>,
    /// How the image is stored (format, codec, dedup).
    pub writer: vmcsnap_capture::WriterOptions,
    /// Store every page, even if an earlier snapshot of the VM could be
    /// the parent of an incremental one.
    pub full: bool,
    /// Store pages whose bytes lie on the frozen disk as references to it
    /// (the detection layer, format 2; see `disk_match`).
    pub disk_layer: bool,
    /// How long after the snapshot point to record which pages the guest
    /// accesses, where the host's DAMON can tell (`access`); zero: not.
    pub access_window: std::time::Duration,
}

/// The writer options `storage` (`--storage`, parsed by
/// [`ImageStorage`]'s `FromStr`) names.
pub fn writer_options(storage: ImageStorage) -> vmcsnap_capture::WriterOptions {
    use vmcsnap_capture::{Codec, WriterOptions};
    let codec = |codec| WriterOptions {
        codec,
        ..Default::default()
    };
    match storage.layout {
        StorageLayout::Zstd => WriterOptions::default(),
        StorageLayout::Lz4 => codec(Codec::Lz4),
        StorageLayout::None => codec(Codec::None),
        StorageLayout::V1 => WriterOptions::v1(),
        // Halite's control: LZ4 blocks without locality (for benchmarks).
        StorageLayout::Lz4Random => WriterOptions {
            scatter_blocks: 256,
            ..codec(Codec::Lz4)
        },
    }
}

/// Sets the pages per locality block (`--block-pages`).
pub fn set_block_pages(
    writer: &mut vmcsnap_capture::WriterOptions,
    n: u16,
) -> Result<(), AgentError> {
    let max = vmcsnap_image::format::MAX_PAGES_PER_BLOCK;
    if n == 0 || n > max {
        return Err(AgentError::BadRequest(format!(
            "--block-pages {n}: give 1 to {max}"
        )));
    }
    if writer.format_major < 2 {
        return Err(AgentError::BadRequest(
            "--block-pages needs image format 2 (not --storage v1)".into(),
        ));
    }
    writer.pages_per_block = n;
    Ok(())
}

/// Lowers the calling thread's scheduling priority (nice +10): image
/// compression then takes the CPU time guests leave idle, and a guest's
/// vCPU threads win when both want a CPU. Best effort.
pub(crate) fn background_priority() {
    // SAFETY: gettid and setpriority take and return plain integers; with
    // PRIO_PROCESS and a thread id, setpriority changes only this thread.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 10);
    }
}

/// Where a snapshot goes when it is part of something larger (a VM's
/// snapshot inside a cluster snapshot).
#[derive(Debug, Clone)]
pub struct Target {
    /// The directory the snapshot directory `<name>` is created in.
    pub root: PathBuf,
    /// The directory the frozen disk chain is hard-linked into.
    pub disks_dir: PathBuf,
}

/// Calls a snapshot makes around the VM's pause, so that a cluster snapshot
/// can cut the VM's network exactly (see `cluster_snapshot`). Errors from
/// the hooks fail the snapshot (and the VM is resumed).
pub trait Hooks {
    /// Everything that can be done before the snapshot proper is done (disk
    /// overlay made, capture listening, migration settings in place); the
    /// next step pauses the VM (hot, stop-copy) or starts the pre-copy. A
    /// cluster snapshot waits here until every VM is this far, so that the
    /// pauses start together. An error abandons the snapshot.
    fn ready(&mut self) -> Result<(), AgentError> {
        Ok(())
    }
    /// Hot and stop-copy: just before the VM is paused (a cluster snapshot
    /// prepares the VM's network cut here and waits for every VM's).
    fn before_pause(&mut self) -> Result<(), AgentError> {
        Ok(())
    }
    /// Right after the VM was paused (all modes; for pre-copy, QEMU paused
    /// it for the switch-over and `before_pause` was not called).
    fn paused(&mut self) -> Result<(), AgentError> {
        Ok(())
    }
    /// Whether [`paused`](Self::paused) does anything. If not, the agent
    /// sends `stop`, the disk snapshot and `migrate` to QEMU at once
    /// instead of waiting for each reply while the guest is paused.
    fn works_while_paused(&self) -> bool {
        false
    }
    /// The VM runs again after its transient snapshot (hot: QEMU resumed it
    /// once write protection was on; stop-copy and pre-copy: after `cont`).
    fn running(&mut self) {}
    /// Whether the snapshot should be abandoned (polled while it runs).
    fn cancelled(&self) -> Option<String> {
        None
    }
}

/// No hooks: a snapshot of one VM.
pub struct NoHooks;
impl Hooks for NoHooks {}

#[cfg(test)]
mod block_pages_tests {
    use super::*;

    #[test]
    fn block_pages_are_checked() {
        let mut w = writer_options(ImageStorage::default());
        set_block_pages(&mut w, 16).unwrap();
        assert_eq!(w.pages_per_block, 16);
        for n in [0, 4097] {
            let e = set_block_pages(&mut w, n).unwrap_err().to_string();
            assert!(e.contains("give 1 to 4096"), "{e}");
        }
        let mut v1 = writer_options("v1".parse().unwrap());
        let e = set_block_pages(&mut v1, 64).unwrap_err().to_string();
        assert!(e.contains("needs image format 2"), "{e}");
    }
}
