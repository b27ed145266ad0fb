//! Cluster snapshots: one snapshot of every VM of a cluster, taken together,
//! plus the frames that were in the switch at the cut.
//!
//! ```text
//! <root>/<name>/                   committed cluster snapshot (renamed into place)
//!   cluster.json                   the cluster manifest (JSON, [`ClusterManifest`])
//!   channel-state.bin              frames logged at the cut (see [`crate::channel_log`])
//!   vms/<vm>/                      one ordinary per-VM snapshot per VM (manifest, memory.img, ...)
//! <root>/<name>.tmp-<pid>-<n>/     a cluster snapshot being built (or left by a crash)
//! ```
//!
//! A cluster snapshot is built in a temporary directory and published by
//! [`commit_cluster_dir`] (fsync of everything, rename, fsync of the
//! parent). [`list_cluster_snapshots`] lists the directories holding a
//! `cluster.json` and checks each with [`check_cluster_committed`];
//! [`crate::list_snapshots`] leaves them out (they are not per-VM
//! snapshots), and [`crate::cleanup_stale`] removes abandoned temporary
//! directories. `docs/cluster-snapshot.md` describes every field.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use thiserror::Error;

use crate::channel_log::{ChannelFrame, ChannelLogSummary, EMPTY_CHANNEL_LOG_LEN, RECORD_OVERHEAD};
use crate::error::ReadError;
use crate::fileio::sync_dir;
use crate::list::{check_committed, ListError, TEMP_MARKER};
use crate::manifest::is_plain_name;

/// The `format` tag of every cluster manifest.
pub const FORMAT: &str = "vmcsnap-cluster-snapshot";
/// The cluster manifest version this build writes and reads.
pub const VERSION: u32 = 1;
/// Name of the cluster manifest in a cluster snapshot directory.
pub const CLUSTER_MANIFEST: &str = "cluster.json";
/// Name of the channel-state file v1 writers use.
pub const CHANNEL_LOG: &str = "channel-state.bin";
/// The directory holding the per-VM snapshots (`vms/<vm>`).
pub const VMS_DIR: &str = "vms";
/// Longest VM name, in bytes.
pub const MAX_VM_NAME_LEN: usize = 64;
/// Largest cluster manifest a reader accepts.
pub const MAX_CLUSTER_MANIFEST_LEN: u64 = 16 << 20;

/// A VM name as cluster snapshots store it: 1..=64 bytes, a plain file name
/// (it names the directory `vms/<vm>`), not hidden, without `.tmp-`, no
/// control characters. (The cluster spec's names, `[a-z][a-z0-9-]*`, all are.)
pub fn is_vm_name(name: &str) -> bool {
    name.len() <= MAX_VM_NAME_LEN
        && is_plain_name(name)
        && !name.starts_with('.')
        && !name.contains(TEMP_MARKER)
        && !name.chars().any(char::is_control)
}

/// A snapshot directory name: a plain file name, not hidden, without `.tmp-`.
fn is_snapshot_name(name: &str) -> bool {
    is_plain_name(name) && !name.starts_with('.') && !name.contains(TEMP_MARKER)
}

/// The cluster manifest, `cluster.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterManifest {
    /// Always [`ClusterManifest::FORMAT`].
    pub format: String,
    /// The manifest version; this build writes and reads [`ClusterManifest::VERSION`].
    pub version: u32,
    /// The cluster snapshot's name (its directory name).
    pub name: String,
    /// The cluster's name (from the cluster spec).
    pub cluster: String,
    /// How the VM snapshots were taken: `hot`, `stop-copy` or `precopy`.
    pub mode: String,
    /// When the cluster snapshot was committed (Unix time, ms).
    pub created_unix_ms: u64,
    /// The cluster spec's network section, as the agent gives it.
    #[serde(default)]
    pub network: Value,
    /// The VMs, in cluster-spec order.
    pub vms: Vec<ClusterVm>,
    /// The channel-state file.
    pub channel_state: ChannelStateRef,
    /// W(i,j): frames from VM `from` to VM `to` in the channel-state file.
    pub edges: Vec<Edge>,
    /// Free-form measurements (backoff, switch counters, protocol stats).
    #[serde(default)]
    pub metrics: Value,
}

/// One VM of a cluster snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterVm {
    /// The VM's name (see [`is_vm_name`]).
    pub name: String,
    /// Its per-VM snapshot directory, relative to the cluster snapshot
    /// directory (`vms/<name>`).
    pub snapshot: String,
    /// Guest RAM, MiB.
    pub memory_mib: u64,
    /// The VM's IPv4 address (e.g. `10.77.0.2`).
    pub ip: String,
    /// The VM's MAC address (e.g. `52:54:00:77:00:02`).
    pub mac: String,
    /// When the VM's snapshot went through its phases.
    pub timeline: Timeline,
    /// Free-form per-VM measurements.
    #[serde(default)]
    pub metrics: Value,
}

/// When one VM's snapshot went through its phases (Unix time, µs).
/// Always `start ≤ pause_start ≤ pause_end ≤ transient_done ≤ complete`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Timeline {
    /// The snapshot request reached the VM's peer (its agent-side handler).
    pub start_us: u64,
    /// QEMU's STOP event: the guest paused.
    pub pause_start_us: u64,
    /// QEMU's RESUME event: the guest runs again.
    pub pause_end_us: u64,
    /// The transient part was over: VM running, switch port released.
    pub transient_done_us: u64,
    /// The VM's image was committed.
    pub complete_us: u64,
}

/// The channel-state file, as the manifest records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelStateRef {
    /// Plain file name inside the cluster snapshot directory.
    pub file: String,
    /// Number of frames (records).
    pub frames: u64,
    /// Sum of the frames' lengths, bytes.
    pub bytes: u64,
    /// Exact size of the file, bytes.
    pub file_size: u64,
}

impl ChannelStateRef {
    /// The reference to a channel-state file named [`CHANNEL_LOG`] that
    /// [`crate::channel_log::write_channel_log`] wrote.
    pub fn from_summary(summary: &ChannelLogSummary) -> Self {
        ChannelStateRef {
            file: CHANNEL_LOG.into(),
            frames: summary.frames,
            bytes: summary.bytes,
            file_size: summary.file_size,
        }
    }
}

/// W(i,j): what the channel-state file holds from one VM to another.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Edge {
    /// The sending VM.
    pub from: String,
    /// The receiving VM.
    pub to: String,
    /// Frames from `from` to `to`.
    pub frames: u64,
    /// Their total length, bytes.
    pub bytes: u64,
}

/// The edges W(i,j) of `frames`: one per (sender, receiver) pair that has
/// frames, sorted by sender then receiver.
pub fn edges_from_frames(frames: &[ChannelFrame]) -> Vec<Edge> {
    let mut w: BTreeMap<(&str, &str), (u64, u64)> = BTreeMap::new();
    for f in frames {
        let e = w.entry((&f.sender, &f.receiver)).or_default();
        e.0 += 1;
        e.1 += f.data.len() as u64;
    }
    w.into_iter()
        .map(|((from, to), (frames, bytes))| Edge {
            from: from.into(),
            to: to.into(),
            frames,
            bytes,
        })
        .collect()
}

/// Why reading, checking or committing a cluster snapshot failed.
#[derive(Debug, Error)]
pub enum ClusterError {
    /// A file or directory the cluster snapshot needs does not exist.
    #[error(
        "{file}: missing; the cluster snapshot is incomplete or this is not a cluster snapshot \
         directory (an interrupted one is a .tmp- directory that `vmcsnap gc` removes): check the \
         path, or restore from another snapshot"
    )]
    Missing {
        /// The missing path.
        file: PathBuf,
    },
    /// An I/O error other than "not found".
    #[error("{path}: I/O error: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The manifest file is larger than any cluster manifest.
    #[error(
        "{file}: {size} bytes, more than the {max} a cluster manifest may have: it is not a \
         cluster manifest or it is damaged; restore from another snapshot"
    )]
    TooLarge {
        /// The file.
        file: PathBuf,
        /// Its size.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// The manifest is not JSON of the expected shape.
    #[error(
        "{file}: not a valid cluster manifest: {source}; the file is damaged or was edited: \
         restore from another snapshot"
    )]
    Json {
        /// The file.
        file: PathBuf,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// The manifest's `format` is not [`ClusterManifest::FORMAT`].
    #[error(
        "{file}: format is {found}, not \"vmcsnap-cluster-snapshot\": this is not a vmcsnap \
         cluster manifest; check the path"
    )]
    BadFormat {
        /// The file.
        file: PathBuf,
        /// The `format` value found (as JSON).
        found: String,
    },
    /// The manifest's `version` is not one this build reads.
    #[error(
        "{file}: cluster manifest version {found} is not supported: this build reads version \
         {supported} only; use a vmcsnap release that reads version {found}"
    )]
    UnsupportedVersion {
        /// The file.
        file: PathBuf,
        /// The `version` value found (as JSON).
        found: String,
        /// The version this build reads and writes.
        supported: u32,
    },
    /// The manifest parses but breaks a rule (see [`ClusterManifest::validate`]).
    #[error(
        "{file}: invalid cluster manifest: {what}; vmcsnap writes only valid manifests, so the \
         file was edited or damaged (restore from another snapshot) or the program writing it \
         has a bug"
    )]
    Invalid {
        /// The file (or, for a commit, the directory).
        file: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// A VM's snapshot directory is not a committed snapshot.
    #[error("VM {vm} of the cluster snapshot ({dir}): {source}")]
    Vm {
        /// The VM.
        vm: String,
        /// Its snapshot directory.
        dir: PathBuf,
        /// Why its snapshot is not valid.
        #[source]
        source: ReadError,
    },
    /// The channel-state file's size is not what the manifest records.
    #[error(
        "{file}: {found} bytes, the cluster manifest says {expected}: the channel-state file \
         was cut short or replaced; restore from another snapshot"
    )]
    ChannelLogSize {
        /// The channel-state file.
        file: PathBuf,
        /// The size the manifest records.
        expected: u64,
        /// The size it has.
        found: u64,
    },
    /// The commit target already exists.
    #[error(
        "{path}: already exists; a committed cluster snapshot is never replaced: choose another \
         name, or delete the old snapshot first"
    )]
    Exists {
        /// The final directory.
        path: PathBuf,
    },
}

impl ClusterError {
    fn io(path: &Path, source: io::Error) -> Self {
        if source.kind() == io::ErrorKind::NotFound {
            ClusterError::Missing { file: path.into() }
        } else {
            ClusterError::Io {
                path: path.into(),
                source,
            }
        }
    }
}

static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

impl ClusterManifest {
    /// The `format` tag of every cluster manifest ([`FORMAT`]).
    pub const FORMAT: &'static str = FORMAT;
    /// The manifest version this build writes and reads ([`VERSION`]).
    pub const VERSION: u32 = VERSION;

    /// Checks every rule a reader relies on: format tag, version, names
    /// (snapshot, cluster, unique VM names), each VM's snapshot a relative
    /// path without `.`/`..` (and no two the same), timelines in order
    /// (`start ≤ pause_start ≤ pause_end ≤ transient_done ≤ complete`), the
    /// channel-state file a plain name with a size that fits its counts,
    /// edges between two different known VMs, each pair once, and summing
    /// to the channel-state counts. Errors name the file `cluster.json`.
    pub fn validate(&self) -> Result<(), ClusterError> {
        self.validate_in(Path::new(CLUSTER_MANIFEST))
    }

    fn validate_in(&self, file: &Path) -> Result<(), ClusterError> {
        let bad = |what: String| {
            Err(ClusterError::Invalid {
                file: file.into(),
                what,
            })
        };
        if self.format != Self::FORMAT {
            return Err(ClusterError::BadFormat {
                file: file.into(),
                found: format!("{:?}", self.format),
            });
        }
        if self.version != Self::VERSION {
            return Err(ClusterError::UnsupportedVersion {
                file: file.into(),
                found: self.version.to_string(),
                supported: Self::VERSION,
            });
        }
        if !is_snapshot_name(&self.name) {
            return bad(format!(
                "name {:?} is not a plain directory name (not hidden, without \".tmp-\")",
                self.name
            ));
        }
        if !is_plain_name(&self.cluster) {
            return bad(format!("cluster {:?} is not a plain name", self.cluster));
        }
        if self.vms.is_empty() {
            return bad("no VMs".into());
        }
        let mut names = BTreeSet::new();
        let mut dirs = BTreeSet::new();
        for vm in &self.vms {
            if !is_vm_name(&vm.name) {
                return bad(format!(
                    "VM name {:?} is not valid (1..={MAX_VM_NAME_LEN} bytes, a plain file name, \
                     not hidden, without \".tmp-\")",
                    vm.name
                ));
            }
            if !names.insert(vm.name.as_str()) {
                return bad(format!("VM {:?} appears twice", vm.name));
            }
            if !is_relative_dir(&vm.snapshot) {
                return bad(format!(
                    "VM {:?}: snapshot {:?} is not a relative path inside the cluster snapshot \
                     (no leading '/', no '.' or '..')",
                    vm.name, vm.snapshot
                ));
            }
            let normalized: Vec<&str> = vm.snapshot.split('/').filter(|c| !c.is_empty()).collect();
            if normalized.len() == 1
                && (normalized[0] == CLUSTER_MANIFEST || normalized[0] == self.channel_state.file)
            {
                return bad(format!(
                    "VM {:?}: snapshot {:?} names a file of the cluster snapshot",
                    vm.name, vm.snapshot
                ));
            }
            if !dirs.insert(normalized) {
                return bad(format!(
                    "VM {:?}: snapshot {:?} is another VM's snapshot too",
                    vm.name, vm.snapshot
                ));
            }
            let t = &vm.timeline;
            let steps = [
                ("start_us", t.start_us),
                ("pause_start_us", t.pause_start_us),
                ("pause_end_us", t.pause_end_us),
                ("transient_done_us", t.transient_done_us),
                ("complete_us", t.complete_us),
            ];
            for w in steps.windows(2) {
                let ((a, ta), (b, tb)) = (w[0], w[1]);
                if ta > tb {
                    return bad(format!(
                        "VM {:?}: timeline out of order: {a} {ta} is after {b} {tb} (must be \
                         start ≤ pause_start ≤ pause_end ≤ transient_done ≤ complete)",
                        vm.name
                    ));
                }
            }
        }
        let cs = &self.channel_state;
        if !is_plain_name(&cs.file) || cs.file == CLUSTER_MANIFEST {
            return bad(format!(
                "channel_state.file {:?} is not a plain file name",
                cs.file
            ));
        }
        // Each record is RECORD_OVERHEAD bytes plus names of 1..=64 bytes
        // each plus its frame.
        let min = cs
            .frames
            .checked_mul(RECORD_OVERHEAD as u64 + 2)
            .and_then(|r| r.checked_add(cs.bytes))
            .and_then(|r| r.checked_add(EMPTY_CHANNEL_LOG_LEN));
        let max = cs
            .frames
            .checked_mul((RECORD_OVERHEAD + 2 * MAX_VM_NAME_LEN) as u64)
            .and_then(|r| r.checked_add(cs.bytes))
            .and_then(|r| r.checked_add(EMPTY_CHANNEL_LOG_LEN));
        match (min, max) {
            (Some(min), Some(max)) if (min..=max).contains(&cs.file_size) => {}
            _ => {
                return bad(format!(
                    "channel_state: a file of {} frames and {} frame bytes cannot be {} bytes",
                    cs.frames, cs.bytes, cs.file_size
                ))
            }
        }
        let mut pairs = BTreeSet::new();
        let (mut frames, mut bytes) = (0u64, 0u64);
        for e in &self.edges {
            for end in [&e.from, &e.to] {
                if !names.contains(end.as_str()) {
                    return bad(format!(
                        "edge {:?} -> {:?} names {end:?}, which is not a VM of this snapshot",
                        e.from, e.to
                    ));
                }
            }
            if e.from == e.to {
                return bad(format!(
                    "edge {:?} -> {:?}: a VM's frames never come back to it",
                    e.from, e.to
                ));
            }
            if !pairs.insert((e.from.as_str(), e.to.as_str())) {
                return bad(format!("edge {:?} -> {:?} appears twice", e.from, e.to));
            }
            frames = frames.saturating_add(e.frames);
            bytes = bytes.saturating_add(e.bytes);
        }
        if (frames, bytes) != (cs.frames, cs.bytes) {
            return bad(format!(
                "the edges add up to {frames} frames and {bytes} bytes, channel_state says {} \
                 frames and {} bytes",
                cs.frames, cs.bytes
            ));
        }
        Ok(())
    }

    /// Validates the manifest and writes it to `dir/cluster.json`
    /// atomically (temporary file, fsync, rename, fsync of `dir`). Replaces
    /// an existing `cluster.json`.
    pub fn save(&self, dir: &Path) -> Result<(), ClusterError> {
        let path = dir.join(CLUSTER_MANIFEST);
        self.validate_in(&path)?;
        let mut body = serde_json::to_vec_pretty(self).map_err(|e| ClusterError::Json {
            file: path.clone(),
            source: e,
        })?;
        body.push(b'\n');
        let tmp = dir.join(format!(
            ".{CLUSTER_MANIFEST}{TEMP_MARKER}{}-{}",
            std::process::id(),
            TEMP_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let written = File::options()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .and_then(|mut f| {
                f.write_all(&body)?;
                f.sync_all()
            })
            .and_then(|()| fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(ClusterError::io(&path, e));
        }
        sync_dir(dir).map_err(|e| ClusterError::io(dir, e))
    }

    /// Reads `dir/cluster.json` (at most [`MAX_CLUSTER_MANIFEST_LEN`]
    /// bytes), checks its format tag and version before anything else, then
    /// parses and validates it. Unknown fields are ignored.
    pub fn load(dir: &Path) -> Result<ClusterManifest, ClusterError> {
        let path = dir.join(CLUSTER_MANIFEST);
        let file = File::open(&path).map_err(|e| ClusterError::io(&path, e))?;
        let mut data = Vec::new();
        file.take(MAX_CLUSTER_MANIFEST_LEN + 1)
            .read_to_end(&mut data)
            .map_err(|e| ClusterError::io(&path, e))?;
        if data.len() as u64 > MAX_CLUSTER_MANIFEST_LEN {
            let size = fs::metadata(&path).map_or(data.len() as u64, |m| m.len());
            return Err(ClusterError::TooLarge {
                file: path,
                size,
                max: MAX_CLUSTER_MANIFEST_LEN,
            });
        }
        Self::decode(&path, &data)
    }

    /// Parses and validates the bytes of a cluster manifest; `file` names
    /// it in errors.
    pub fn decode(file: &Path, data: &[u8]) -> Result<ClusterManifest, ClusterError> {
        let json = |e| ClusterError::Json {
            file: file.into(),
            source: e,
        };
        let v: Value = serde_json::from_slice(data).map_err(json)?;
        // Format and version first: a manifest of another version may not
        // have this version's shape.
        let format = v.get("format").unwrap_or(&Value::Null);
        if format.as_str() != Some(Self::FORMAT) {
            return Err(ClusterError::BadFormat {
                file: file.into(),
                found: format.to_string(),
            });
        }
        let version = v.get("version").unwrap_or(&Value::Null);
        if version.as_u64() != Some(u64::from(Self::VERSION)) {
            return Err(ClusterError::UnsupportedVersion {
                file: file.into(),
                found: version.to_string(),
                supported: Self::VERSION,
            });
        }
        let m: ClusterManifest = serde_json::from_value(v).map_err(json)?;
        m.validate_in(file)?;
        Ok(m)
    }

    /// The VM named `vm`, if it is in the snapshot.
    pub fn vm(&self, vm: &str) -> Option<&ClusterVm> {
        self.vms.iter().find(|v| v.name == vm)
    }

    /// The per-VM snapshot directory of `vm` in the cluster snapshot at
    /// `dir`, if the VM is in the snapshot.
    pub fn vm_dir(&self, dir: &Path, vm: &str) -> Option<PathBuf> {
        self.vm(vm).map(|v| dir.join(&v.snapshot))
    }

    /// The channel-state file of the cluster snapshot at `dir`.
    pub fn channel_log_path(&self, dir: &Path) -> PathBuf {
        dir.join(&self.channel_state.file)
    }
}

/// True for a relative path whose components are plain names: not empty,
/// no leading `/`, no `.` or `..` component.
fn is_relative_dir(p: &str) -> bool {
    !p.starts_with('/')
        && !p.contains('\0')
        && p.split('/').any(|c| !c.is_empty())
        && p.split('/').all(|c| c != "." && c != "..")
}

/// True if `dir` holds a `cluster.json` (valid or not): a cluster snapshot,
/// listed by [`list_cluster_snapshots`] and not by [`crate::list_snapshots`].
pub fn is_cluster_snapshot(dir: &Path) -> bool {
    fs::symlink_metadata(dir.join(CLUSTER_MANIFEST)).is_ok()
}

/// Checks that `dir` holds a committed cluster snapshot: a valid manifest,
/// every VM's directory a committed per-VM snapshot
/// ([`crate::check_committed`]) of that VM, and the channel-state file of
/// the size the manifest records. Cheap: reads only the manifests.
pub fn check_cluster_committed(dir: &Path) -> Result<ClusterManifest, ClusterError> {
    let m = ClusterManifest::load(dir)?;
    for vm in &m.vms {
        let vm_dir = dir.join(&vm.snapshot);
        let vm_manifest = check_committed(&vm_dir).map_err(|source| ClusterError::Vm {
            vm: vm.name.clone(),
            dir: vm_dir.clone(),
            source,
        })?;
        if vm_manifest.vm.name != vm.name {
            return Err(ClusterError::Invalid {
                file: dir.join(CLUSTER_MANIFEST),
                what: format!(
                    "VM {:?}: {} holds a snapshot of VM {:?}",
                    vm.name,
                    vm_dir.display(),
                    vm_manifest.vm.name
                ),
            });
        }
    }
    let log = m.channel_log_path(dir);
    let found = fs::metadata(&log)
        .map_err(|e| ClusterError::io(&log, e))?
        .len();
    if found != m.channel_state.file_size {
        return Err(ClusterError::ChannelLogSize {
            file: log,
            expected: m.channel_state.file_size,
            found,
        });
    }
    Ok(m)
}

/// One entry of [`list_cluster_snapshots`].
#[derive(Debug)]
pub struct ClusterSnapshotEntry {
    /// Directory name.
    pub name: String,
    /// Directory path.
    pub path: PathBuf,
    /// Whether it is a committed, intact-looking cluster snapshot
    /// ([`check_cluster_committed`]).
    pub status: Result<Box<ClusterManifest>, ClusterError>,
}

impl ClusterSnapshotEntry {
    /// True if [`check_cluster_committed`] passed.
    pub fn is_valid(&self) -> bool {
        self.status.is_ok()
    }
}

/// Lists the cluster snapshots under `root` (directories holding a
/// `cluster.json`), sorted by name, each checked with
/// [`check_cluster_committed`]. Temporary directories, hidden entries and
/// plain files are skipped.
pub fn list_cluster_snapshots(root: &Path) -> Result<Vec<ClusterSnapshotEntry>, ListError> {
    Ok(crate::list::snapshot_dirs(root)?
        .into_iter()
        .filter(|(_, path)| is_cluster_snapshot(path))
        .map(|(name, path)| {
            let status = check_cluster_committed(&path).map(Box::new);
            ClusterSnapshotEntry { name, path, status }
        })
        .collect())
}

/// fsyncs every regular file and directory under `dir` (directories after
/// their entries), then `dir` itself. Symbolic links are not followed.
fn sync_tree(dir: &Path) -> Result<(), ClusterError> {
    let rd = fs::read_dir(dir).map_err(|e| ClusterError::io(dir, e))?;
    for ent in rd {
        let ent = ent.map_err(|e| ClusterError::io(dir, e))?;
        let path = ent.path();
        let ty = ent.file_type().map_err(|e| ClusterError::io(&path, e))?;
        if ty.is_dir() {
            sync_tree(&path)?;
        } else if ty.is_file() {
            File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(|e| ClusterError::io(&path, e))?;
        }
    }
    sync_dir(dir).map_err(|e| ClusterError::io(dir, e))
}

/// Publishes the cluster snapshot built in `tmp` as `final_dir`: checks it
/// ([`check_cluster_committed`]; its manifest's `name` must be
/// `final_dir`'s name), fsyncs every file and directory in it, renames it
/// to `final_dir` and fsyncs the parent. Refuses if `final_dir` exists. On
/// error `tmp` is left as it was (the caller removes it, or
/// [`crate::cleanup_stale`] does once the process is gone).
pub fn commit_cluster_dir(tmp: &Path, final_dir: &Path) -> Result<ClusterManifest, ClusterError> {
    let name = final_dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if !is_snapshot_name(name) {
        return Err(ClusterError::Invalid {
            file: final_dir.into(),
            what: format!(
                "the snapshot name {name:?} is not a plain directory name (not hidden, without \
                 \".tmp-\")"
            ),
        });
    }
    let exists = || fs::symlink_metadata(final_dir).is_ok();
    if exists() {
        return Err(ClusterError::Exists {
            path: final_dir.into(),
        });
    }
    let m = check_cluster_committed(tmp)?;
    if m.name != name {
        return Err(ClusterError::Invalid {
            file: tmp.join(CLUSTER_MANIFEST),
            what: format!(
                "name is {:?}, but the snapshot is committed as {name:?}",
                m.name
            ),
        });
    }
    sync_tree(tmp)?;
    // rename(2) replaces an empty directory, so check again right before.
    if exists() {
        return Err(ClusterError::Exists {
            path: final_dir.into(),
        });
    }
    fs::rename(tmp, final_dir).map_err(|e| ClusterError::io(final_dir, e))?;
    let parent_of = |p: &Path| match p.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let (parent, tmp_parent) = (parent_of(final_dir), parent_of(tmp));
    sync_dir(&parent).map_err(|e| ClusterError::io(&parent, e))?;
    if tmp_parent != parent {
        sync_dir(&tmp_parent).map_err(|e| ClusterError::io(&tmp_parent, e))?;
    }
    Ok(m)
}

#[cfg(test)]
mod mutation_tests;
#[cfg(test)]
mod tests;
