//! Captures a QEMU migration stream into a vmcsnap snapshot image as the
//! stream arrives.
//!
//! The agent has QEMU migrate into a unix socket it listens on (a
//! `background-snapshot`, a plain stop-and-copy `migrate` of a paused VM,
//! or a live pre-copy `migrate` that ends with the VM paused) and hands the
//! accepted connection to [`capture`]. It reads the stream with
//! [`vmcsnap_migstream::StreamReader`] and writes the image with
//! [`vmcsnap_image::ImageWriter`]:
//!
//! ```text
//!  QEMU ──socket──▶ StreamReader ──Event──▶ capture ──▶ ImageWriter (temp dir) ──commit──▶ <root>/<name>
//!                                             │ precopy only:
//!                                             └──▶ PageStage (scratch file, last copy wins) ──at the end──▶ ImageWriter
//! ```
//!
//! * **RAM block list** → the image's `ram_blocks` (same order and names);
//!   the writer and its temporary directory are created here.
//! * **Pages** → `add_page` / `add_zero_page`, keyed by (block index,
//!   offset / page size). A ZERO record only sets the bitmap bit.
//! * **Guest-written pages** ([`PageOrigin::GuestWrite`](vmcsnap_migstream::PageOrigin),
//!   background snapshot only) → the `fafl` trace, in stream order, the
//!   `pages_guest_written` metric, and the image's hot locality blocks
//!   (`add_hot_page`: in the order the guest wrote them, apart from the
//!   address-ordered scan).
//! * **Device state** (every FULL device section, verbatim) → `device.bin`,
//!   format [`DEVICE_STATE_FORMAT`].
//! * **End of stream** → [`Captured`]: complete but uncommitted, so the
//!   caller can add `downtime_ms` and `disk_snapshot_ms` (known only once
//!   QEMU reports the migration `completed`) before [`Captured::commit`].
//!
//! # Re-sent pages: why precopy is staged
//!
//! A background snapshot sends every page exactly once, with its content at
//! the moment the snapshot started, and a stop-and-copy of a paused VM does
//! too; in those modes pages go straight into the image in arrival order
//! (guest-written pages early, which puts the working set at the front of
//! the file) with bounded memory, and a page sent twice is an error
//! ([`CaptureError::PageResent`]: the VM was running). A live pre-copy
//! stream sends dirtied pages again, round after round, and only the copy
//! of the last round (sent while the VM is paused for the switch-over) is
//! valid; the image writer takes each page once. Which copy is last is
//! only known when the stream ends, so [`CaptureMode::Precopy`] stages
//! pages in a sparse scratch file with one slot per guest page inside the
//! writer's temporary directory (a later copy overwrites an earlier one)
//! and writes the image from it, in page order, once the stream has ended;
//! see [`stage`] for the costs. Keeping the memory image in
//! arrival order and only rewriting re-sent pages would have needed the
//! image format to allow a page twice.
//!
//! # Pre-copy: checked against the paused guest's RAM
//!
//! The last copy of each page is only the right one if QEMU's dirty
//! tracking saw every write; under TCG, QEMU 7.2 can miss one. With
//! [`CaptureOptions::final_ram`], once the stream has ended and before the
//! staged pages go into the image, every staged page of the guest's RAM
//! block is compared by hash with the RAM of the guest (still paused), and
//! a page that differs is replaced by RAM's bytes (metrics
//! `precopy_pages_patched`, `precopy_pages_checked`); see [`ram_check`].
//!
//! # Failure
//!
//! A stream that ends early (QEMU killed, migration cancelled, socket shut
//! down by the agent), does not parse, or misses pages fails with
//! [`CaptureError::Stream`]; any error drops the writer, which removes its
//! temporary directory. Nothing is ever created under the final name
//! before [`Captured::commit`], so [`vmcsnap_image::list_snapshots`] never
//! shows a partial capture. (A crash of the capturing process leaves a
//! `.tmp-` directory, which listing ignores and
//! [`vmcsnap_image::cleanup_stale`] removes.)
//!
//! # Memory
//!
//! The stream reader's buffers and its set of pages seen, the image
//! writer's block buffer and index (12 bytes and 1 bit per guest page), the
//! FAFL trace (8 bytes per entry), the device state (held whole by the
//! reader, at most [`ReaderOptions::max_device_state_bytes`](vmcsnap_migstream::ReaderOptions)),
//! and in precopy mode 17 bytes per guest page (state and content hash)
//! plus a 1 MiB write run.
//!
//! # Example
//!
//! ```no_run
//! use std::os::unix::net::UnixListener;
//! use vmcsnap_capture::{capture, CaptureMode, CaptureOptions};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let listener = UnixListener::bind("/run/vmcsnap/a.mig.sock")?;
//! // ... QMP: migrate-set-capabilities background-snapshot, migrate unix:/run/vmcsnap/a.mig.sock
//! let (conn, _) = listener.accept()?;
//! let mut opts = CaptureOptions::new(CaptureMode::BackgroundSnapshot, "a");
//! opts.qemu_version = "7.2.22".into();
//! let mut captured = capture(conn, "/var/lib/vmcsnap/snaps/a-1".as_ref(), opts, &mut |p| {
//!     eprintln!("{} MiB received", p.stream_bytes >> 20)
//! })?;
//! // ... QMP: wait for the migration to be `completed`, read its downtime
//! captured.metrics_mut().downtime_ms = Some(4);
//! let committed = captured.commit()?;
//! println!("{}: {} MB/s", committed.path.display(), committed.stats.stream_mb_per_s());
//! # Ok(()) }
//! ```

#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod captured;
mod error;
mod options;
mod progress;
pub mod ram_check;
mod run;
pub mod stage;

pub use captured::{metric, Captured, CommittedInfo};
pub use error::CaptureError;
pub use options::{CaptureMode, CaptureOptions, DiskMatcherInit, DEVICE_STATE_FORMAT};
pub use progress::{CaptureProgress, CaptureStats, Phase};
pub use ram_check::{FinalRam, FinalRamCheck, FinalRamSource, RamCheckReport};
pub use run::capture;
pub use stage::SCRATCH_NAME;

pub use vmcsnap_image::{
    Codec, DiskMatcher, DiskRef, Metrics, ParentInfo, ParentRef, WorkerInit, WriterOptions,
};
pub use vmcsnap_migstream::ReaderOptions;
