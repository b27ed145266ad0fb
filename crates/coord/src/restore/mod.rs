//! The cluster-restore protocol of HotRestore: messages, the coordinator's
//! and the cohort's state machines, and blocking drivers for both. The
//! order in which VMs start is not decided here: the coordinator asks the
//! Checker of `vmcsnap_restoreline` ([`Rdg::start_groups`],
//! [`StartGroup::may_start`]), the one implementation of it.
//!
//! One [`Coordinator`] restores a cluster with one [`Cohort`] per VM. It
//! sends `LOAD` to every cohort; each loads its VM's working set (the VM
//! does not run yet, the other pages keep loading in the background) and
//! answers `LOAD_FIN`. The **Checker** decides when each loaded VM may
//! start ([`Policy::RestoreLine`]): once every VM it sends to (an edge of
//! the restore dependency graph, [`Rdg`]) runs, and for a ring once all its
//! members are loaded (a ring starts together). The cohort starts the VM on `START`, answers
//! `START_FIN` with the guest's start time, and `RESTORE_FIN` once every
//! page is loaded; when all have, the coordinator sends `ALL_RESTORE_FIN`
//! and the restore is complete. [`Policy::Independent`] starts every VM as
//! soon as it is loaded (the baseline without a restore line).
//!
//! The state machines are sans-IO like those of [`snapshot`](crate::snapshot),
//! and follow the same rules (details on each type and in
//! `docs/cluster-protocol.md`):
//!
//! - Every handler is idempotent; duplicates are answered, never acted on
//!   twice (no second `Load` or `Start`).
//! - The coordinator re-sends `LOAD` every `retry` to cohorts missing
//!   `LOAD_FIN` and `START` to cohorts missing `START_FIN`; cohorts re-send
//!   each FIN every `retry` until it is acknowledged (`LOAD_FIN` by
//!   `START`, `START_FIN` by `START_ACK`, `RESTORE_FIN` by
//!   `ALL_RESTORE_FIN`).
//! - The coordinator aborts when a cohort reports `FAILED` or a deadline
//!   passes; cohorts abandon (stop their VM) on `ABORT`, ignored after
//!   `Done`.
//! - Messages of another epoch are ignored and counted.
//! - The rings of an [`Rdg`] are its strongly connected components, so the
//!   start groups form a DAG and the Checker cannot deadlock.
//!
//! # Example
//!
//! ```
//! use std::sync::mpsc;
//! use std::thread;
//! use vmcsnap_coord::restore::*;
//! use vmcsnap_coord::transport::*;
//!
//! // A worker whose VM loads and starts at once.
//! struct Quick(mpsc::Sender<CohortInput>);
//! impl CohortWorker for Quick {
//!     fn load(&mut self) {
//!         self.0.send(CohortInput::Loaded).unwrap();
//!         self.0.send(CohortInput::Restored).unwrap();
//!     }
//!     fn start(&mut self) {
//!         self.0.send(CohortInput::Started { unix_us: 1 }).unwrap();
//!     }
//!     fn abandon(&mut self, _reason: &str) {}
//! }
//!
//! let net = InProcessNetwork::<Msg>::new();
//! let (ctx, crx) = mpsc::channel();
//! let coord_ep = net.join("manager", move |e| { let _ = ctx.send(e); });
//! let t = Timeouts { retry: std::time::Duration::from_millis(10), ..Timeouts::default() };
//! let mut handles = Vec::new();
//! for vm in ["web", "db"] {
//!     let (tx, rx) = mpsc::channel();
//!     let tx2 = tx.clone();
//!     let ep = net.join(vm, move |e| { let _ = tx2.send(CohortInput::Message(e)); });
//!     let cohort = Cohort::new(1, vm.into(), "manager".into(), t.clone());
//!     handles.push(thread::spawn(move || run_cohort(cohort, &ep, &rx, &mut Quick(tx))));
//! }
//! // web sends to db: db must run before web starts.
//! let rdg = Rdg::new(vec!["web".into(), "db".into()], vec![Edge::new("web", "db", 1)])?;
//! let mut coord = Coordinator::new(1, "manager".into(), &rdg, Policy::RestoreLine, t)?;
//! let outcome = run_coordinator(&mut coord, &coord_ep, &crx, &mut |_ev| {});
//! assert_eq!(outcome, CoordinatorOutcome::Completed);
//! let order: Vec<_> = coord.start_order().into_iter().map(|(vm, _)| vm).collect();
//! assert_eq!(order, ["db", "web"]);
//! for h in handles {
//!     assert_eq!(h.join().unwrap(), CohortOutcome::Completed);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod cohort;
mod coordinator;
mod driver;
mod msg;
mod report;

pub use crate::snapshot::Ignored;
pub use cohort::{Cohort, CohortAction, CohortState};
pub use coordinator::{Coordinator, Policy};
pub use driver::{
    run_cohort, run_coordinator, CohortInput, CohortOutcome, CohortWorker, CoordinatorOutcome,
};
pub use msg::{Msg, RestoreProtocolError, Timeouts};
pub use report::{CohortPhase, CoordinatorEvent, CoordinatorEventKind, CoordinatorState};
pub use vmcsnap_restoreline::{Edge, Rdg, StartGroup};
