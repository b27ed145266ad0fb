//! Restoring a VM from a snapshot through QEMU's postcopy machinery.
//!
//! The agent is the migration **source**: a fresh QEMU started with
//! `-incoming defer` and the `postcopy-ram` capability is the destination,
//! and `vmcsnap_migstream::postcopy::run_source` feeds it from the image.
//! The restore plan (`vmcsnap_workingset`) decides which pages go before
//! the guest starts and in which order the rest follow:
//!
//! ```text
//!  request ─▶ open image ─▶ plan ─▶ start QEMU -incoming ─▶ connect
//!     │                                                      │
//!     │   header, ADVISE, ram setup, [working set], DISCARD, PACKAGED(LISTEN, devices, RUN)
//!     │                                                      ▼
//!     └── restore_latency_ms ◀──────── guest running (RESUME) ── demand faults ⇄ pages
//!                                                            │   background push
//!                                         full_load_ms ◀─────┘   EOF, SHUT
//! ```
//!
//! In a cluster restore QEMU runs with `-S`: RUN loads the device state and
//! the guest waits, paused, for the Coordinator's START (a `cont`) while
//! pages keep loading (`feed`).
//!
//! The VM runs on new qcow2 overlays over the snapshot's frozen disks (`disks`), with
//! its snapshot-time MAC and address, and joins the cluster's switch (a
//! cluster of its own if none is up). A VM of that name that is running is
//! refused. A failure at any step stops the new QEMU and removes what the
//! restore created; the snapshot is never modified except for the
//! `restores/` record of what this restore learned ([`traces`]).
//!
//! Corrupt pages: every page's CRC32C is checked when it is read. A bad
//! page among those loaded before the guest starts fails the restore before
//! the guest ever runs; a bad page needed later fails the restore when it is
//! needed and the restored VM is stopped: it never runs on a wrong page.
//! `vmcsnap inspect --verify` checks a whole image beforehand.

pub mod adopt;
pub mod control;
mod disks;
mod early;
mod feed;
mod finish;
mod firmware;
mod job;
pub mod page_source;
pub mod pages;
pub mod postmortem;
mod prefetch;
mod priority;
mod run;
mod start_gate;
pub mod traces;
pub mod versions;
pub mod ws_inputs;

pub use early::vm_status;
pub use job::{InCluster, Options, Report, RestoreEvent, Saved, WssChoice, CLUSTER_START_QUIET};
pub use run::{check_versions, hybrid_size, restore, restore_into, saved_vm};
pub use start_gate::StartGate;
