//! The control protocol between the `vmcsnap` CLI and the per-host agent.
//!
//! Transport: a unix stream socket (`<run-dir>/agent.sock`, mode 0600, in a
//! 0700 directory), one request per connection.
//!
//! ```text
//!  CLI                                   agent
//!   | -- {"op":"hello","version":3}\n ->  |   the client's PROTOCOL_VERSION
//!   | -- {"op":"up", ...}\n  ----------->  |
//!   | <- {"kind":"hello","version":3}      |   the agent's; another version
//!   |                                      |   is a VersionMismatch error
//!   | <- {"kind":"progress","message":..}  |   zero or more, for long operations
//!   | <- {"kind":"progress","message":..}  |
//!   | <- {"kind":"done","result":{"type":"up","data":{...}}}
//!   |                                      |   exactly one of done / failed,
//!   |    or {"kind":"failed","error":".."} |   then the agent closes
//! ```
//!
//! A done reply carries a typed [`Response`] (one variant per kind of
//! result, the reports defined in [`results`]); the option enums of
//! requests are in `modes` ([`SnapshotMode`], ...). No `serde_json::Value`
//! is part of the contract.
//!
//! Every message is one line of JSON. Lines longer than [`MAX_LINE`] are a
//! protocol error (the reader never buffers without bound).

mod messages;
mod modes;
pub mod results;
mod storage;
pub mod testing;
mod wire;

pub use messages::{
    Busy, ConsoleResult, GcResult, Recover, RemovedSnapshot, Reply, Request, SnapshotKind,
    SnapshotsDeleteResult, StatusResult, UpResult, VmLoad, VmStatus, VmUp,
};
pub use modes::{ClusterRestoreMode, RejuvenateMode, RestoreMode, SnapshotMode};
pub use results::cluster_manifest::{ClusterSnapshotMetrics, VmCutCounters};
pub use results::cluster_restore::{
    ClusterRestoreReport, ClusterRunning, VmRestoreReport, VmRunning,
};
pub use results::cluster_snapshot::{
    Backoff, ClusterSnapshotReport, PairBackoff, ProtocolStats, TcpCounters, TcpGrowth,
    VmSnapshotReport,
};
pub use results::rejuvenate::{RecoverResult, Recovered, RejuvenateReport, RejuvenateResult};
pub use results::restore::{
    ClockOutcome, ClockSync, Quality, RestoreReport, RestoreRunning, Spread,
};
pub use results::snapshot::{PauseLimitReport, RamResidency, SnapshotReport};
pub use results::snapshot_manifest::SnapshotMetrics;
pub use results::{AgentInfo, ClusterDown, Response, Stopped, Unexpected};
pub use storage::{ImageStorage, StorageLayout, NO_DISK};
pub use wire::{
    accept_request, call, call_on, read_request, restart_agent, write_reply, ControlError, Hello,
    MAX_LINE, PROTOCOL_VERSION,
};

#[cfg(test)]
mod tests_fuzz;
