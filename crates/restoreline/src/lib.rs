//! HotRestore's restore line (Cui et al., LISA '14, §4.1-4.2 and §5.1):
//! the restore dependency graph of a VM cluster, a causal restore order,
//! and the linear program that revises working-set sizes so that VMs start
//! in that order.
//!
//! # The graph
//!
//! A cluster snapshot's `cluster.json` lists `edges: [{from, to, frames,
//! bytes}]`; W(i,j) = `frames` is the number of frames VM i sent to VM j
//! that were in flight at the cut (logged on the receiver's side, so an
//! ack never makes the reverse edge, §5.1). Edge i → j means j, the
//! receiver, must be running before i, the sender, starts; otherwise i's
//! TCP retransmits into a VM that is still restoring and backs off. The
//! [`Rdg`] ([`graph`]) keeps these edges; its strongly connected
//! components of more than one VM are **rings** (they start together),
//! VMs with no edge are **orphans** (free to start whenever).
//!
//! # The causal order
//!
//! [`Rdg::causal_order`] applies the paper's six rules (their mapping to
//! the code is in [`order`]): rings are one group, receivers come before
//! senders, a sender waits for all its receivers, independent groups are
//! ordered by name, orphans come last. [`Rdg::check_causal_order`] accepts
//! any order the rules allow.
//!
//! # The Checker
//!
//! [`Rdg::start_groups`] ([`start`]) turns the graph into the groups the
//! restore protocol starts together (a ring, or one VM) with the VMs each
//! must wait for; [`Rdg::startable`] is the protocol's Checker (§4.3): the
//! groups that may start once some VMs are loaded and some run. The
//! coordinator of `vmcsnap_coord::restore` only asks this; it is the one
//! implementation of how a cluster restore orders VM starts.
//!
//! # The revision and the restore line
//!
//! A VM starts once its working set (S_i pages) is loaded, so the order of
//! the sizes is the *defacto* order. [`revise_wss`] ([`lp`]) finds integer
//! sizes S*_i ≥ 0 closest to S_i in Σ|S*_i − S_i| such that every sender
//! loads at least W(i,j) pages more than its receiver (rings equal), with
//! a real LP solver (good_lp + microlp, pure Rust). The restore line is
//! the VMs in ascending S*. The paper's W is a frame count used as pages;
//! [`revise_wss_scaled`] multiplies it by `pages_per_frame` so that the
//! gaps are large enough to order real restore times.
//!
//! # Example
//!
//! ```
//! use std::collections::BTreeMap;
//! use vmcsnap_restoreline::{revise_wss, Edge, Rdg};
//!
//! // a sends 2 frames to b: b must start first.
//! let names = ["a", "b", "c"].map(String::from).to_vec();
//! let rdg = Rdg::new(names, vec![Edge::new("a", "b", 2)])?;
//! assert_eq!(rdg.causal_order(), vec![vec!["b"], vec!["a"], vec!["c"]]);
//! assert_eq!(rdg.orphans(), vec!["c"]);
//!
//! // b's working set is larger than a's: the LP moves them 2 pages apart.
//! let sizes = BTreeMap::from([("a".into(), 100), ("b".into(), 105), ("c".into(), 50)]);
//! let rev = revise_wss(&rdg, &sizes)?;
//! assert_eq!(rev.sizes["a"] - rev.sizes["b"], 2);
//! assert_eq!(rev.objective, 7.0); // |S*a - 100| + |S*b - 105| = 7
//! assert_eq!(rev.restore_line, vec!["c", "b", "a"]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod dot;
pub mod graph;
pub mod lp;
pub mod order;
pub mod start;

pub use graph::{Edge, Rdg, RdgError};
pub use lp::{
    check_sizes, l1_distance, restore_line, revise_wss, revise_wss_scaled, LpError, Revision,
};
pub use order::OrderError;
pub use start::StartGroup;
