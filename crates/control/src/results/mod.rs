//! The typed result of every request: [`Response`], one variant per kind
//! of answer, and the reports the variants carry.

pub mod cluster_manifest;
pub mod cluster_restore;
pub mod cluster_snapshot;
pub mod rejuvenate;
pub mod restore;
pub mod snapshot;
pub mod snapshot_manifest;

use serde::{Deserialize, Serialize};

use crate::{ConsoleResult, GcResult, SnapshotsDeleteResult, StatusResult, UpResult};
use cluster_restore::{ClusterRestoreReport, ClusterRunning};
use cluster_snapshot::ClusterSnapshotReport;
use rejuvenate::{RecoverResult, RejuvenateResult};
use restore::{RestoreReport, RestoreRunning};
use snapshot::{PauseLimitReport, SnapshotReport};

/// What a request succeeded with (`Reply::Done`). Each request has its
/// variant (two for a restore: once the guests run, or with every page
/// loaded; two for `rejuvenate`: a restart, or a recovery).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "data", rename_all = "kebab-case")]
pub enum Response {
    /// `ping`.
    Ping(AgentInfo),
    /// `up`.
    Up(UpResult),
    /// `status`.
    Status(StatusResult),
    /// `console`.
    Console(ConsoleResult),
    /// `rejuvenate`: the restarts.
    Rejuvenate(RejuvenateResult),
    /// `rejuvenate --resume|--rollback`.
    Recover(RecoverResult),
    /// `snapshot`.
    Snapshot(Box<SnapshotReport>),
    /// `pause-limit`.
    PauseLimit(PauseLimitReport),
    /// `snapshot --cluster`.
    ClusterSnapshot(Box<ClusterSnapshotReport>),
    /// `restore --cluster --wait`, or once every page is loaded.
    ClusterRestore(Box<ClusterRestoreReport>),
    /// `restore --cluster`: every guest runs, pages still load.
    ClusterRunning(ClusterRunning),
    /// `restore --wait`, or once every page is loaded.
    Restore(Box<RestoreReport>),
    /// `restore`: the guest runs, pages still load.
    RestoreRunning(RestoreRunning),
    /// `stop`.
    Stop(Stopped),
    /// `down`.
    Down(ClusterDown),
    /// `gc`.
    Gc(GcResult),
    /// `snapshots delete` and `snapshots prune`.
    SnapshotsDelete(SnapshotsDeleteResult),
    /// `agent restart`: the image that handed over.
    RestartAgent(AgentInfo),
    /// `agent stop`.
    Shutdown(AgentInfo),
}

/// Which agent image answered (`ping`, `agent restart`, `agent stop`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentInfo {
    /// The agent's pid.
    pub pid: u32,
    /// How many times it was restarted in place (`vmcsnap agent restart`).
    #[serde(default)]
    pub generation: u64,
    /// When this image started, unix ms.
    #[serde(default)]
    pub started_unix_ms: u64,
}

/// Result of `stop`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stopped {
    /// The VM stopped.
    pub vm: String,
}

/// Result of `down`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterDown {
    /// The cluster torn down.
    pub cluster: String,
}

/// A [`Response`] of another kind than the request asked for.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the agent answered {got} to a request that expects {wanted}: is it another vmcsnap version? (`vmcsnap agent restart`)")]
pub struct Unexpected {
    /// What came.
    pub got: &'static str,
    /// What the caller expected.
    pub wanted: &'static str,
}

impl Response {
    /// The variant's name, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Response::Ping(_) => "ping",
            Response::Up(_) => "up",
            Response::Status(_) => "status",
            Response::Console(_) => "console",
            Response::Rejuvenate(_) => "rejuvenate",
            Response::Recover(_) => "recover",
            Response::Snapshot(_) => "snapshot",
            Response::PauseLimit(_) => "pause-limit",
            Response::ClusterSnapshot(_) => "cluster-snapshot",
            Response::ClusterRestore(_) => "cluster-restore",
            Response::ClusterRunning(_) => "cluster-running",
            Response::Restore(_) => "restore",
            Response::RestoreRunning(_) => "restore-running",
            Response::Stop(_) => "stop",
            Response::Down(_) => "down",
            Response::Gc(_) => "gc",
            Response::SnapshotsDelete(_) => "snapshots-delete",
            Response::RestartAgent(_) => "restart-agent",
            Response::Shutdown(_) => "shutdown",
        }
    }

    /// The error for a caller that expected `wanted`.
    pub fn unexpected(&self, wanted: &'static str) -> Unexpected {
        Unexpected {
            got: self.kind(),
            wanted,
        }
    }
}

/// Takes the payload of one variant out of a [`Response`], or says what
/// came instead: `expect!(resp, Response::Up)`.
#[macro_export]
macro_rules! expect_response {
    ($resp:expr, $variant:path) => {
        match $resp {
            $variant(v) => Ok(v),
            other => Err(other.unexpected(stringify!($variant))),
        }
    };
}
