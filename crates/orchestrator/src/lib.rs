//! The cluster orchestrator (issue 31, item 2): what a cluster operation
//! computes across its VMs, in a crate of its own that knows no VM layer.
//!
//! It reaches a host only through [`host::HostApi`] and knows no VM layer;
//! the per-host agent depends on it, never the reverse. So far it holds
//! the cluster snapshot's computations that need no VM
//! ([`cluster_snapshot::metrics`]: HotSnap's backoff per pair, the guests'
//! view read from their consoles) and the cluster restore's plan
//! ([`cluster_restore::plan`]: dependency graph, working-set sizes, LP,
//! restore line). The protocols themselves (cluster boot, snapshot and
//! restore) still run in the agent, next to the VMs they drive;
//! docs/architecture.md lists what the per-host API must offer for them
//! to move here.

pub mod cluster_restore;
pub mod cluster_snapshot;
pub mod host;
