//! Faults injected on purpose, for the tests of what a failed snapshot or
//! cluster restore leaves behind.
//!
//! A failure in the middle of a migration is hard to provoke from outside
//! (a disk that fills or hangs while the image is written), yet it is the
//! case where a careless failure path leaves a guest paused. Faults exist
//! only in a build with the cargo feature `fault-injection` (the test
//! command enables it; `cargo build --release` leaves it out, and then every
//! hook here is a no-op twin in `off.rs` and the fault types are empty).
//!
//! A fault never travels in a request. It is armed on the agent's host,
//! as a file `<run-dir>/faults/<operation>` ([`arm`]; the CLI's hidden
//! `--inject-fault FAULT` of a fault-injection build writes it), and the
//! agent takes it (reads and removes it) when it starts that operation:
//! `snapshot-<VM>` for `vmcsnap snapshot VM`, `rejuvenate-<VM>` (or
//! `rejuvenate-all`) for `vmcsnap rejuvenate`, `cluster-restore` for
//! `vmcsnap restore --cluster`. A snapshot's capture obeys:
//!
//! | FAULT | what the capture does |
//! |---|---|
//! | `capture-error-after=BYTES` | reads BYTES of QEMU's stream, then fails as a full disk would |
//! | `capture-stall-after=BYTES` | reads BYTES, then stops reading without closing, as a hung disk would |
//! | `commit-stall-deadline=SECONDS` | the image's commit hangs (as fsync on a hung disk) until the agent gives up on it, after SECONDS |
//! | `panic-when-paused` | the request's handler panics right after the VM was paused, as a bug in the agent would |
//! | `precopy-untracked-write=PAGE` | pre-copy only: in the switch-over pause, page PAGE of guest RAM is changed through the RAM file, a write QEMU's dirty tracking never sees (as TCG can miss one); the original bytes are put back before the guest resumes |
//! | `ram-read-delay=SECONDS` | a first hot snapshot's read of guest RAM (before the pause) takes SECONDS longer, as it does for a large guest on a busy host |
//! | `hang-when-paused` | the request's handler stops for `HANG_WHEN_PAUSED` right after the VM was paused (in a hot snapshot, with QEMU's priority raised), then fails: time for a test to kill the agent there |
//!
//! A cluster restore obeys a `RestoreFault` (the CLI's hidden
//! `vmcsnap restore --cluster SNAP --inject-fault FAULT`):
//!
//! | FAULT | what the restore does |
//! |---|---|
//! | `cohort-fail-when-peers-loaded=VM` | VM's Cohort, once VM is loaded, waits until every other VM is loaded too, then reports a failure in place of LOAD_FIN |
//! | `qemu-killed-when-peers-loaded=VM` | at the same moment, VM's QEMU is killed (SIGKILL) as a crash would, and no LOAD_FIN is sent: the restore has to notice the dead QEMU by itself |
//!
//! | `background-held-until=PATH` | every VM's page source pushes no page in the background (demand faults only) until PATH exists: the guests run while most of their pages are still to load |
//! | `start-held-until=PATH` | START reaches no VM until PATH exists (the Coordinator sent it; the Cohort's worker waits): every VM is loaded and paused, waiting for START |
//!
//! With VM in a ring (or every other VM after it on the restore line), no
//! guest can have started when the failure comes: every other VM is
//! abandoned while paused, waiting for START, which a real failure hits
//! only by chance. The last two leave time for a test to kill the agent
//! at those stages of a cluster restore (docs/reliability.md).
//!
//! A rejuvenation obeys `new-qemu-dies` and `fallback-fails`
//! (docs/rejuvenation.md).
//!
//! An unknown FAULT is refused, so a typo cannot silently test nothing.

#[cfg(feature = "fault-injection")]
mod armed;
#[cfg(feature = "fault-injection")]
pub use armed::*;

#[cfg(not(feature = "fault-injection"))]
mod off;
#[cfg(not(feature = "fault-injection"))]
pub use off::*;
