//! What a capture is of and how it runs: [`CaptureMode`] and
//! [`CaptureOptions`].

use std::collections::BTreeMap;
use std::fmt;

use serde_json::Value;
use vmcsnap_image::{DiskMatcher, DiskRef, ParentInfo, WorkerInit, WriterOptions};
use vmcsnap_migstream::ReaderOptions;

use crate::ram_check::FinalRamCheck;

/// What `device.bin` holds in an image written by this crate (the
/// manifest's `device_state_format`, unless
/// [`CaptureOptions::device_state_format`] says otherwise).
///
/// The FULL device sections of a QEMU 7.2 migration stream (stream version
/// 3), byte for byte as QEMU sent them: from the type byte of the first
/// device section up to, not including, the EOF byte (`0x00`). Section
/// footers are in it if the source sent them (`send-section-footer`, on
/// for every machine type newer than 2.3). The EOF byte and the VM
/// description are not. To replay it, a feeder writes the stream header,
/// a configuration section for the destination's machine, the RAM
/// sections, this blob and an EOF byte (or, inside a postcopy package, the
/// blob without EOF).
pub const DEVICE_STATE_FORMAT: &str = "qemu-7.2-device-sections";

/// How QEMU produced the stream, which decides how pages are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// `migrate` with the `background-snapshot` capability: every page is
    /// sent exactly once, holding its content at the moment the snapshot
    /// started; pages the guest writes during the snapshot come out of scan
    /// order and form the FAFL trace. Pages are streamed straight into the
    /// image.
    BackgroundSnapshot,
    /// A plain `migrate` of a paused VM (stop-and-copy): every page once, in
    /// scan order. Streamed straight into the image.
    StopCopy,
    /// A live (pre-copy) `migrate` of a running VM that ends paused: pages
    /// the guest dirtied are sent again in later rounds and the last copy
    /// is the valid one. Pages are staged in a scratch file (one slot per
    /// guest page, last copy wins) and written into the image once the
    /// stream has ended. Also correct for the other two kinds of stream,
    /// only slower and needing the guest's RAM size again in free space.
    Precopy,
}

impl CaptureMode {
    /// The name used in messages and the `capture_mode` label.
    pub fn name(self) -> &'static str {
        match self {
            CaptureMode::BackgroundSnapshot => "background-snapshot",
            CaptureMode::StopCopy => "stop-copy",
            CaptureMode::Precopy => "precopy",
        }
    }

    /// Whether pages go straight into the image (each page arrives once).
    pub fn streams_directly(self) -> bool {
        !matches!(self, CaptureMode::Precopy)
    }
}

impl fmt::Display for CaptureMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything a capture needs besides the stream and the target directory.
///
/// `CaptureOptions::new(mode, vm_name)` fills the rest with defaults; set
/// the public fields for the others.
#[derive(Debug, Clone)]
pub struct CaptureOptions {
    /// How QEMU produces the stream.
    pub mode: CaptureMode,
    /// The VM's name (manifest `vm.name`).
    pub vm_name: String,
    /// The VM's configuration, opaque (manifest `vm.config`; the cluster
    /// spec's VM entry). `null` by default.
    pub vm_config: Value,
    /// QEMU's version, e.g. `"7.2.22"` (the stream does not carry it).
    pub qemu_version: String,
    /// The machine type for the manifest. `None`: the resolved machine type
    /// the stream's configuration section names (e.g. `microvm`); a stream
    /// without one (`send-configuration=off`) then fails with
    /// [`CaptureError::UnknownMachine`](crate::CaptureError::UnknownMachine).
    pub machine: Option<String>,
    /// Disks frozen with the snapshot (manifest `disks`).
    pub disks: Vec<DiskRef>,
    /// Free-form labels (manifest `labels`). The capture adds
    /// `capture_mode` unless it is set.
    pub labels: BTreeMap<String, String>,
    /// What `device.bin` holds; [`DEVICE_STATE_FORMAT`] by default.
    pub device_state_format: String,
    /// Image writer tuning (pages per block).
    /// `require_complete` should stay on: a capture whose stream misses
    /// pages is not a snapshot.
    pub writer: WriterOptions,
    /// Runs first in each compression worker thread of the image writer
    /// (the agent lowers their priority there, so that compression takes
    /// CPU the guests leave idle).
    pub compress_worker_init: Option<WorkerInit>,
    /// Make the image incremental to this parent (format 2): pages equal
    /// to the parent's same page are not stored. Ignored (a full image is
    /// written) if the stream's RAM blocks differ from the parent's.
    pub parent: Option<ParentInfo>,
    /// Makes the matcher the image writer asks whether a page's bytes lie
    /// on one of [`disks`](Self::disks) (the detection layer; see
    /// [`DiskMatcher`]). Called once, when the writer is created.
    pub disk_matcher: Option<DiskMatcherInit>,
    /// Precopy only: the guest's RAM at the switch-over, to check the
    /// staged pages against (and replace the ones QEMU's stream got wrong)
    /// before the image is written; see [`crate::ram_check`]. Without it
    /// the image holds what the stream said. Ignored in the other modes
    /// (each page is sent once, from the paused or write-protected guest).
    pub final_ram: Option<FinalRamCheck>,
    /// Stream reader settings (page size, device-state limit, vmdesc policy).
    pub reader: ReaderOptions,
    /// The progress callback runs each time this many more stream bytes
    /// (or, while a precopy capture writes its image, image page bytes)
    /// were processed, and once at the end. 64 MiB by default; 0 means only
    /// at the end.
    pub progress_interval_bytes: u64,
}

impl CaptureOptions {
    /// Options with defaults for everything but the mode and the VM name.
    pub fn new(mode: CaptureMode, vm_name: impl Into<String>) -> Self {
        CaptureOptions {
            mode,
            vm_name: vm_name.into(),
            vm_config: Value::Null,
            qemu_version: String::new(),
            machine: None,
            disks: Vec::new(),
            labels: BTreeMap::new(),
            device_state_format: DEVICE_STATE_FORMAT.to_owned(),
            writer: WriterOptions::default(),
            compress_worker_init: None,
            parent: None,
            disk_matcher: None,
            final_ram: None,
            reader: ReaderOptions::default(),
            progress_interval_bytes: 64 << 20,
        }
    }
}

/// Makes a [`DiskMatcher`] for one capture's image writer.
#[derive(Clone)]
pub struct DiskMatcherInit(pub std::sync::Arc<dyn Fn() -> Box<dyn DiskMatcher> + Send + Sync>);

impl fmt::Debug for DiskMatcherInit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DiskMatcherInit")
    }
}
