//! What the local commands (`snapshots`, `inspect`) print with `--json`,
//! as types: the text output reads the same fields. Fields are in
//! alphabetical order, the order of the `json!` maps these replaced, so
//! `--json` keeps its bytes (the manifest inside `inspect` keeps its own
//! field order, that of the manifest file).

use std::path::{Path, PathBuf};

use serde::Serialize;
use vmcsnap_agent::availability::Kind;
use vmcsnap_agent::image::cluster::ClusterSnapshotEntry;
use vmcsnap_agent::image::list::SnapshotEntry;
use vmcsnap_agent::image::{ImageStats, Manifest, VerifyReport};
use vmcsnap_control::ClusterSnapshotMetrics;

/// `snapshots --json`.
#[derive(Debug, Serialize)]
pub struct SnapshotsView<'a> {
    /// Cluster snapshots first (the text output lists them first).
    pub cluster_snapshots: Vec<ClusterSnapshotRow<'a>>,
    /// Where the snapshots are.
    pub root: &'a Path,
    /// Per-VM snapshots.
    pub snapshots: Vec<SnapshotRow<'a>>,
}

/// One directory that is not a readable snapshot.
#[derive(Debug, Serialize)]
pub struct InvalidRow<'a> {
    /// Why.
    pub error: String,
    /// Its name.
    pub name: &'a str,
    /// Its path.
    pub path: &'a Path,
    /// Always false.
    pub valid: bool,
}

impl<'a> InvalidRow<'a> {
    fn new(name: &'a str, path: &'a Path, error: &impl std::fmt::Display) -> Self {
        InvalidRow {
            error: error.to_string(),
            name,
            path,
            valid: false,
        }
    }
}

/// A row of `snapshots`: one VM's snapshot.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum SnapshotRow<'a> {
    /// Committed and readable.
    Valid(ValidSnapshot<'a>),
    /// Not.
    Invalid(InvalidRow<'a>),
}

/// A readable VM snapshot.
#[derive(Debug, Serialize)]
pub struct ValidSnapshot<'a> {
    /// Data files' bytes.
    pub bytes_written: Option<u64>,
    /// Commit time.
    pub created_unix_ms: u64,
    /// The guest's pause.
    pub downtime_ms: Option<u64>,
    /// Request to commit.
    pub duration_ms: Option<u64>,
    /// `hot`, `stop-copy`, `precopy` (its label).
    pub mode: Option<&'a str>,
    /// Its name.
    pub name: &'a str,
    /// Pages covered.
    pub pages_total: Option<u64>,
    /// Its path.
    pub path: &'a Path,
    /// Always true.
    pub valid: bool,
    /// The VM.
    pub vm: &'a str,
}

impl<'a> SnapshotRow<'a> {
    /// The row of `entry`.
    pub fn of(e: &'a SnapshotEntry) -> Self {
        match &e.status {
            Ok(m) => SnapshotRow::Valid(ValidSnapshot {
                bytes_written: m.metrics.bytes_written,
                created_unix_ms: m.created_unix_ms,
                downtime_ms: m.metrics.downtime_ms,
                duration_ms: m.metrics.duration_ms,
                mode: m
                    .labels
                    .get("snapshot_mode")
                    .or(m.labels.get("capture_mode"))
                    .map(String::as_str),
                name: &e.name,
                pages_total: m.metrics.pages_total,
                path: &e.path,
                valid: true,
                vm: &m.vm.name,
            }),
            Err(err) => SnapshotRow::Invalid(InvalidRow::new(&e.name, &e.path, err)),
        }
    }
}

/// A row of `snapshots`: a cluster snapshot.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum ClusterSnapshotRow<'a> {
    /// Committed and readable.
    Valid(ValidClusterSnapshot<'a>),
    /// Not.
    Invalid(InvalidRow<'a>),
}

/// A readable cluster snapshot.
#[derive(Debug, Serialize)]
pub struct ValidClusterSnapshot<'a> {
    /// The cluster's backoff at the snapshot, ms.
    pub backoff_avg_ms: Option<f64>,
    /// Frames logged at the cut.
    pub channel_state_frames: u64,
    /// The cluster.
    pub cluster: &'a str,
    /// Commit time.
    pub created_unix_ms: u64,
    /// How the VMs were snapshotted.
    pub mode: &'a str,
    /// Its name.
    pub name: &'a str,
    /// Its path.
    pub path: &'a Path,
    /// Always true.
    pub valid: bool,
    /// Its VMs.
    pub vms: Vec<&'a str>,
}

impl<'a> ClusterSnapshotRow<'a> {
    /// The row of `entry`.
    pub fn of(e: &'a ClusterSnapshotEntry) -> Self {
        match &e.status {
            Ok(m) => ClusterSnapshotRow::Valid(ValidClusterSnapshot {
                backoff_avg_ms: ClusterSnapshotMetrics::read(&m.metrics)
                    .backoff
                    .map(|b| b.avg_ms),
                channel_state_frames: m.channel_state.frames,
                cluster: &m.cluster,
                created_unix_ms: m.created_unix_ms,
                mode: &m.mode,
                name: &e.name,
                path: &e.path,
                valid: true,
                vms: m.vms.iter().map(|v| v.name.as_str()).collect(),
            }),
            Err(err) => ClusterSnapshotRow::Invalid(InvalidRow::new(&e.name, &e.path, err)),
        }
    }
}

/// `inspect --json` of a VM snapshot.
#[derive(Debug, Serialize)]
pub struct InspectView<'a> {
    /// Pages in the FAFL trace.
    pub fafl_len: usize,
    /// Image format version.
    pub format: String,
    /// The manifest.
    pub manifest: &'a Manifest,
    /// The parent of an incremental snapshot.
    pub parent: Option<ParentView<'a>>,
    /// The snapshot directory.
    pub path: &'a Path,
    /// QEMU releases it restores into.
    pub restores_into: &'a [&'static str],
    /// Page and block statistics.
    pub stats: StatsView,
    /// With `--verify`.
    pub verify: Option<VerifyView>,
}

/// The parent, as `inspect` shows it.
#[derive(Debug, Serialize)]
pub struct ParentView<'a> {
    /// Its depth in the chain.
    pub depth: u32,
    /// Its name.
    pub name: &'a str,
}

/// Smallest, median and largest stored block.
#[derive(Debug, Serialize)]
pub struct BlockBytes {
    /// Largest.
    pub max: u32,
    /// Median.
    pub median: u32,
    /// Smallest.
    pub min: u32,
}

/// The image's statistics (`inspect`'s `stats`).
#[derive(Debug, Serialize)]
#[allow(missing_docs)]
pub struct StatsView {
    pub block_bytes: BlockBytes,
    pub blocks: u32,
    pub blocks_compressed: u32,
    pub blocks_hot: u32,
    pub compression_ratio: f64,
    pub device_state_bytes: u64,
    pub memory_bytes: u64,
    pub pages_absent: u64,
    pub pages_duplicate: u64,
    pub pages_in_parent: u64,
    pub pages_on_disk: u64,
    pub pages_stored: u64,
    pub pages_total: u64,
    pub pages_zero: u64,
    pub payload_raw_bytes: u64,
    pub payload_stored_bytes: u64,
    /// Bytes of QEMU's migration stream (the manifest's `stream_bytes`).
    pub stream_bytes: Option<u64>,
    pub total_bytes: u64,
}

impl StatsView {
    /// From the reader's statistics.
    pub fn new(st: &ImageStats, block_bytes: BlockBytes, stream_bytes: Option<u64>) -> Self {
        let compression_ratio = if st.payload_stored_bytes > 0 {
            st.payload_raw_bytes as f64 / st.payload_stored_bytes as f64
        } else {
            1.0
        };
        StatsView {
            block_bytes,
            blocks: st.blocks,
            blocks_compressed: st.blocks_compressed,
            blocks_hot: st.blocks_hot,
            compression_ratio,
            device_state_bytes: st.device_state_bytes,
            memory_bytes: st.memory_bytes,
            pages_absent: st.pages_absent,
            pages_duplicate: st.pages_duplicate,
            pages_in_parent: st.pages_in_parent,
            pages_on_disk: st.pages_on_disk,
            pages_stored: st.pages_stored,
            pages_total: st.pages_total,
            pages_zero: st.pages_zero,
            payload_raw_bytes: st.payload_raw_bytes,
            payload_stored_bytes: st.payload_stored_bytes,
            stream_bytes,
            total_bytes: st.total_bytes,
        }
    }
}

/// `inspect --verify`'s result.
#[derive(Debug, Serialize)]
#[allow(missing_docs)]
pub struct VerifyView {
    pub bad_pages: u64,
    pub blocks_checked: u32,
    pub bytes_read: u64,
    pub disk_pages_checked: u64,
    pub hashes_checked: u64,
    /// Every check passed, the disks' too.
    pub ok: bool,
    pub pages_checked: u64,
    pub parent_pages_checked: u64,
    pub problems: Vec<Problem>,
}

impl VerifyView {
    /// From the reader's report and the problems of the snapshot's disks.
    pub fn new(r: &VerifyReport, own_disks: &[String]) -> Self {
        let problems = r
            .bad_blocks
            .iter()
            .map(|b| Problem {
                block: Some(b.index),
                image: Some(b.image.clone()),
                offset: Some(b.offset),
                ..Problem::new(&b.error)
            })
            .chain(r.bad_pages.iter().map(|p| Problem {
                page: Some(format!("{}:{}", p.key.ram_block, p.key.page)),
                ..Problem::new(&p.error)
            }))
            .chain(r.other.iter().map(Problem::new))
            .chain(own_disks.iter().map(Problem::new))
            .collect();
        VerifyView {
            bad_pages: r.bad_pages_total,
            blocks_checked: r.blocks_checked,
            bytes_read: r.bytes_read,
            disk_pages_checked: r.disk_pages_checked,
            hashes_checked: r.hashes_checked,
            ok: r.is_ok() && own_disks.is_empty(),
            pages_checked: r.pages_checked,
            parent_pages_checked: r.parent_pages_checked,
            problems,
        }
    }
}

/// One problem `--verify` found: a bad block (`block`, `image`,
/// `offset`), a bad page (`page`, `ram_block:page`), or another one.
#[derive(Debug, Serialize)]
pub struct Problem {
    /// The bad block's index.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block: Option<u32>,
    /// What is wrong.
    pub error: String,
    /// The image file of the bad block.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<PathBuf>,
    /// The bad block's offset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// The bad page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub page: Option<String>,
}

impl Problem {
    fn new(error: &impl std::fmt::Display) -> Self {
        Problem {
            block: None,
            error: error.to_string(),
            image: None,
            offset: None,
            page: None,
        }
    }
}

/// `inspect --cluster --json`.
#[derive(Debug, Serialize)]
pub struct ClusterInspectView<'a> {
    /// `cluster.json`.
    pub manifest: &'a vmcsnap_agent::image::cluster::ClusterManifest,
    /// The cluster snapshot directory.
    pub path: &'a Path,
    /// With `--verify`.
    pub verify: Option<ClusterVerifyView>,
}

/// `inspect --cluster --verify`'s result.
#[derive(Debug, Serialize)]
pub struct ClusterVerifyView {
    /// No problem.
    pub ok: bool,
    /// What is wrong.
    pub problems: Vec<String>,
    /// Each VM's image.
    pub vms: Vec<VmChecked>,
}

/// One VM's image checked.
#[derive(Debug, Serialize)]
pub struct VmChecked {
    /// Its image verified.
    pub ok: bool,
    /// Pages checked.
    pub pages_checked: u64,
    /// QEMU releases it restores into.
    pub restores_into: Vec<&'static str>,
    /// The VM.
    pub vm: String,
}

/// `analyze-ws --json`.
#[derive(Debug, Serialize)]
pub struct AnalyzeWsView<'a> {
    /// What became of the snapshot's access data.
    pub access_data: String,
    /// Hit rate and accuracy per multiple of the WSS.
    pub fafl: &'a [vmcsnap_workingset::Quality],
    /// The snapshot directory.
    pub snapshot: &'a Path,
    /// First accesses in the trace.
    pub trace_pages: usize,
    /// When the traced restore ran.
    pub trace_unix_ms: u64,
    /// The computed working-set size, pages.
    pub wss: u64,
    /// WSS_sample, pages.
    pub wss_sample: Option<u64>,
    /// WSS_snapshot, pages.
    pub wss_snapshot: u64,
}

/// `guest build --json`.
#[derive(Debug, Serialize)]
pub struct GuestBuildView<'a> {
    /// The assets' directory.
    pub dir: &'a Path,
    /// The initramfs.
    pub initrd: &'a Path,
    /// The kernel.
    pub kernel: &'a Path,
    /// Their cache key.
    pub key: &'a str,
    /// How long `guest build` took.
    pub seconds: f64,
}

/// `availability --json`.
#[derive(Debug, Serialize)]
pub struct AvailabilityView {
    /// One row per restart mode.
    pub modes: Vec<AvailabilityRow>,
    /// The measured OS reboot, s.
    pub os_reboot_s: f64,
    /// T_os, days.
    pub t_os_days: f64,
    /// T_vmm, days.
    pub t_vmm_days: f64,
}

/// One restart mode's availability (`None`: not measured yet).
#[derive(Debug, Serialize)]
pub struct AvailabilityRow {
    /// The availability.
    pub availability: Option<f64>,
    /// The longest per-VM downtime of the latest restart, s.
    pub downtime_s: Option<f64>,
    /// The mode.
    pub mode: Kind,
    /// VMs of the latest restart.
    pub vms: Option<usize>,
}

/// A restart mode's name, as `--json` spells it.
pub fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::Warm => "warm",
        Kind::Cold => "cold",
        Kind::Saved => "saved",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_names_are_serdes() {
        for k in [Kind::Warm, Kind::Cold, Kind::Saved] {
            assert_eq!(
                serde_json::to_string(&k).unwrap(),
                format!("\"{}\"", kind_name(k))
            );
        }
    }
}
