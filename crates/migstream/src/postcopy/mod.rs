//! A postcopy migration **source**: feeds an unmodified QEMU 7.2 or 10.0
//! destination (`-incoming defer`, `postcopy-ram` on, `migrate-incoming
//! uri=unix:PATH`) from a snapshot, so that vmcsnap decides which pages the
//! destination gets before its guest starts and in which order the rest
//! follow.
//!
//! The stream below is the same for both releases: QEMU 10.0's destination
//! handles every item of it, and every return-path message it sends with
//! these capabilities, as 7.2 does (10.0's additions, SWITCHOVER_START and
//! SWITCHOVER_ACK, belong to capabilities left off: `switchover-ack`,
//! multifd). What differs per release around the stream (the firmware
//! block's size, the destination's thread names, which snapshots a release
//! can load) is handled by the agent (docs/qemu-upgrade-restore.md).
//!
//! [`run_source`] connects nothing itself: it is handed the connected
//! socket, writes the whole stream, serves the destination's page requests
//! from the return path and returns once the destination said SHUT(0).
//! Section numbers (§) refer to
//! `shared/reference/qemu-7.2-migration-wire-format.md`.
//!
//! # Stream layout
//!
//! ```text
//!  QEVM v3 | CONFIG machine                                     §1.2 §1.3
//!  CMD OPEN_RETURN_PATH | CMD PING 1                            §1.5
//!  CMD POSTCOPY_ADVISE (be64 0x1000, be64 0x1000)               §3.2 (zaps all RAM)
//!  START id "ram" 0 4 : MEM_SIZE | (name, used_length)... | EOS | footer   §2.2
//!  [PART id : before-run pages (idstr on each section's first record) | EOS | footer] ...
//!  CMD POSTCOPY_RAM_DISCARD × n   = every page NOT sent above, merged  §8.1 §8.2
//!  CMD PACKAGED be32 L | blob:                                  §3.2
//!        CMD POSTCOPY_LISTEN | device FULL sections | CMD PING 3 | CMD POSTCOPY_RUN
//!  PART id : requested pages first, background pages otherwise | EOS | footer  (× k)
//!  END id : EOS | footer
//!  EOF 0x00
//!  ... then the return path is read until SHUT.
//! ```
//!
//! # State machine
//!
//! ```text
//!            write header..START          write before-run PARTs
//!  Setup ──────────────────────▶ Precopy ─────────────────────▶ Discard
//!                                                                     │ DISCARD cmds,
//!                                                                     ▼ PACKAGED blob
//!                                                                   Postcopy (RunSent)
//!                                                                requests ⟲ background
//!                                                                     │ all pages sent,
//!                                                                     ▼ END, EOF
//!  Done ◀─────────────────────── SHUT(0) ────────────────────────────── Eof
//! ```
//!
//! A caller that wants the guest to start later than RUN (HotRestore's
//! Cohort waiting for START) starts the destination with `-S`: RUN then
//! loads the device state and leaves the guest paused while this source
//! keeps pushing pages, and a QMP `cont` starts it.
//!
//! * **Return path** (§4): a thread reads the destination's messages
//!   (SHUT, PONG, REQ_PAGES_ID, REQ_PAGES) from a clone of the socket with
//!   the pure parser in [`return_path`] and hands them to the sender over a
//!   channel. Any garbage, an unexpected message or a request outside the
//!   RAM ends the thread, which then shuts the socket down so that a sender
//!   blocked in `write` wakes up; the sender reports the thread's error.
//! * **Sender**: keeps a bitmap of pages sent and never sends a page twice
//!   (a second `UFFDIO_COPY` pauses the destination, §3.4). Between any two
//!   page writes it drains the channel; a requested page (plus up to
//!   [`SourceConfig::demand_cluster`]` - 1` unsent pages after it in the
//!   same block) goes before any further background page. Requests for
//!   pages already sent are counted and ignored, as QEMU does. It reports
//!   each change of what it works on ([`SourceEvent::Work`]: preload, held,
//!   demand, background) from its own thread, so that the caller can give
//!   serving faults a higher CPU priority than background loading.
//! * **Holding the background push**: no background page goes out for
//!   [`SourceConfig::background_after`] after RUN, nor while another thread
//!   holds it through [`SourceConfig::hold`] (a caller that starts the
//!   guest with `cont` holds it from there); requested pages are served
//!   meanwhile.
//! * **Discards** (§8.1, §8.2): the complement of the pages sent before
//!   LISTEN, per block, as merged byte ranges. If every page was sent
//!   before LISTEN the last page of [`SourceConfig::before_run`] is held
//!   back (sent after RUN instead), so that at least one DISCARD with one
//!   range exists.
//! * **End**: every page of every block goes out before EOF (§8.3); then
//!   the destination unregisters userfaultfd, sends SHUT(0) and closes.
//!
//! * **Preempt channel** ([`run_source_preempt`], QEMU 10.0's
//!   `postcopy-preempt`): a second connection, made after the main one,
//!   carries each requested page as a bare page record (no section; the
//!   CONTINUE flag refers to that channel's previous record) the moment its
//!   request is read, and ends with an EOS record before the main channel's
//!   END; everything else stays on the main connection
//!   (docs/qemu-10.0-wire-format.md, "postcopy-preempt").
//!
//! The destination must have section footers and the configuration
//! section on (the defaults for every machine type newer than 2.3, §8.9);
//! the source always writes both.

mod encode;
pub mod error;
pub mod return_path;
mod source;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use error::{Phase, PostcopyError};
pub use source::{run_source, run_source_preempt};

/// A page of the destination: index into [`SourceConfig::blocks`], page
/// number in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageId {
    /// Index of the block in [`SourceConfig::blocks`].
    pub block: u32,
    /// Page number within the block (byte offset / page size).
    pub page: u32,
}

/// A RAM block as the destination has it (name and `used_length` in
/// bytes), in setup order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DestBlock {
    /// The block's idstr, e.g. `mem` or `pc.bios` (1 to 255 bytes).
    pub name: String,
    /// The block's used length in bytes, a positive multiple of the page size.
    pub used_length: u64,
}

/// Where page contents come from (the image reader, a test's memory, ...).
pub trait PageSource: Send {
    /// Fills `buf` (page_size bytes) with the page; `Ok(false)` if the page
    /// is all zeros (then `buf` may be left as it is and a ZERO record is
    /// sent).
    fn read_page(&mut self, id: PageId, buf: &mut [u8]) -> std::io::Result<bool>;

    /// The pages to send right after the requested page `id`, in order
    /// (its locality block, then prefetched blocks), appended to `out`.
    /// `false` (the default): the source has no locality to offer, and the
    /// next [`SourceConfig::demand_cluster`]` - 1` pages by address go
    /// instead.
    fn companions(&mut self, id: PageId, out: &mut Vec<PageId>) -> bool {
        let _ = (id, out);
        false
    }
}

/// Holds the background push from another thread: until the instant last
/// given to [`BackgroundHold::hold_until`], the sender serves requested
/// pages only. A caller that starts the guest itself (`cont`) uses it to
/// leave the CPUs to a guest that has just started. Clones share the hold;
/// the default holds nothing.
#[derive(Clone, Debug, Default)]
pub struct BackgroundHold(Arc<Mutex<Option<Instant>>>);

impl BackgroundHold {
    /// Serve requested pages only until `until` (replaces any earlier hold).
    pub fn hold_until(&self, until: Instant) {
        *self.lock() = Some(until);
    }

    /// When the current hold ends (`None`: none was set).
    pub fn until(&self) -> Option<Instant> {
        *self.lock()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        // An `Option<Instant>` cannot be left half-written by a panic.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What to send and in which order.
#[derive(Clone, Debug)]
pub struct SourceConfig {
    /// The configuration section's machine name: the destination's resolved
    /// machine type, e.g. `microvm` or `pc-i440fx-7.2` (§8.10).
    pub machine: String,
    /// The destination's RAM blocks, in setup order.
    pub blocks: Vec<DestBlock>,
    /// The target page size: 4096 on x86 (must be a multiple of 4096).
    pub page_size: usize,
    /// The "ram" section id: non-zero, and not the id of any FULL section
    /// in `device_state` (§1.4); the capturing QEMU's "ram" id (2) is safe.
    pub ram_section_id: u32,
    /// The device state: FULL sections verbatim, no EOF, no vmdesc (§5.3).
    pub device_state: Vec<u8>,
    /// Pages sent before LISTEN, in this order (duplicates ignored).
    pub before_run: Vec<PageId>,
    /// Per page request: the requested page plus the unsent pages among the
    /// following pages of the same block, `demand_cluster` pages in total at
    /// most (a window starting at the requested page). 1 (or 0) = only the
    /// requested page. HotRestore's DMA cluster is 4.
    pub demand_cluster: u32,
    /// Background push order; already-sent pages are skipped; every page
    /// not in it is pushed afterwards in (block, page) order.
    pub background: Vec<PageId>,
    /// `None`: push in the background right after RUN; `Some(d)`: for `d`
    /// after RUN send only requested pages (tracing), then push the rest.
    pub background_after: Option<Duration>,
    /// Holds the background push while another thread says so (in
    /// addition to `background_after`); requested pages are always served.
    pub hold: BackgroundHold,
    /// How long to wait for SHUT after EOF.
    pub shut_timeout: Duration,
}

impl SourceConfig {
    /// Number of pages of block `block` (0 if there is no such block).
    pub fn block_pages(&self, block: u32) -> u64 {
        self.blocks
            .get(block as usize)
            .map_or(0, |b| b.used_length / self.page_size.max(1) as u64)
    }

    /// Number of pages of all blocks.
    pub fn total_pages(&self) -> u64 {
        (0..self.blocks.len() as u32)
            .map(|b| self.block_pages(b))
            .sum()
    }
}

/// Progress of [`run_source`], reported as it happens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceEvent {
    /// The PACKAGED blob (ending in POSTCOPY_RUN) has been written: the
    /// destination starts its guest once it has loaded the device state
    /// (unless it was started with `-S`).
    RunSent,
    /// The destination faulted on a page not yet sent.
    Demand {
        /// The requested page.
        id: PageId,
        /// When the request arrived, counted from RUN being written.
        since_run: Duration,
    },
    /// Pages written so far (every 256 pages, and at the end).
    Progress {
        /// Pages written.
        sent: u64,
        /// Pages in all blocks.
        total: u64,
    },
    /// The last page has been written; END and EOF follow.
    AllSent,
    /// The sender turns to another kind of work (emitted on changes only,
    /// from the sender's own thread), e.g. for its caller to give serving
    /// faults a higher scheduling priority than background loading.
    Work(Work),
}

/// What the sender is busy with ([`SourceEvent::Work`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// Before RUN: the before-run pages and RUN. The guest waits for this
    /// work.
    Preload,
    /// After RUN: requested pages and their neighbours, or waiting for
    /// requests; the guest runs and a vCPU may be blocked on a fault.
    Demand,
    /// After RUN: background pages (no request is pending).
    Background,
}

/// What happened during [`run_source`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceReport {
    /// Pages in all blocks (all of them are sent).
    pub pages_total: u64,
    /// Pages sent before LISTEN.
    pub pages_before_run: u64,
    /// Page bytes (zero pages count 0) read and sent before LISTEN.
    pub bytes_before_run: u64,
    /// From the start of [`run_source`] until the PACKAGED blob was written.
    pub run_sent_after: Duration,
    /// Every page request for a page not yet sent when it arrived (a real
    /// fault), in arrival order, with its arrival time since RUN was written.
    pub demand: Vec<(Duration, PageId)>,
    /// Requests for pages already sent or already queued (ignored, as QEMU
    /// does).
    pub requests_already_sent: u64,
    /// Pages sent because of requests (including cluster neighbours).
    pub pages_on_demand: u64,
    /// Requested pages sent on the postcopy-preempt channel
    /// ([`run_source_preempt`]; 0 without one).
    pub pages_on_preempt: u64,
    /// Per requested page, in the order served: from its request's
    /// arrival until its record was written to the socket (the part of a
    /// demand fault's latency the source sees; the destination still has
    /// to read what is queued ahead of it on that socket).
    pub demand_served: Vec<Duration>,
    /// Pages sent after RUN in background order.
    pub pages_background: u64,
    /// From the start of [`run_source`] until the last page was written.
    pub all_sent_after: Duration,
    /// The value of the destination's SHUT message (0: success).
    pub shut_value: u32,
    /// PONG values received, in order (PING 1 and PING 3 are sent).
    pub pongs: Vec<u32>,
    /// Number of DISCARD commands sent.
    pub discard_commands: u64,
}
