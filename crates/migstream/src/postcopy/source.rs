//! The sender: writes the stream, serves page requests, waits for SHUT.

use std::collections::{HashSet, VecDeque};
use std::io::{self, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::wire::{CommandKind, SectionType, X86_TARGET_PAGE_SIZE};

use super::encode;
use super::error::{Phase, PostcopyError};
use super::return_path::{reader_thread, FromDest};
use super::{PageId, PageSource, SourceConfig, SourceEvent, SourceReport, Work};

/// Pages per PART section; also how often [`SourceEvent::Progress`] is
/// reported. QEMU closes a section every 50 ms; the count only matters for
/// readability of the stream, the destination loads records as they come.
const PAGES_PER_SECTION: u32 = 256;

/// While the background push is held, how often the sender looks at the
/// hold again (another thread may shorten or lift it).
const HOLD_POLL: Duration = Duration::from_millis(10);

/// SO_SNDBUF asked for on the migration socket (Linux doubles it for its
/// bookkeeping; on AF_UNIX it bounds all bytes written but not yet read by
/// the destination). Everything queued in the kernel is ahead of the next
/// requested page, so a fault waits for it to drain: the default of 208 KiB
/// (net.core.wmem_default) is about 50 background pages ahead of every
/// fault. 32 KiB (≈ 64 KiB effective, ~14 page records) still keeps the
/// destination's listen thread busy between two wake-ups of this sender,
/// while bounding the extra fault latency to a few µs per queued page. The
/// destination's own read buffer (32 KiB in QEMUFile) comes on top.
const SEND_BUFFER_BYTES: usize = 32 * 1024;

/// Connects the destination to a snapshot: writes the postcopy stream to
/// `stream` (connected to the destination's `migrate-incoming` socket),
/// serves page requests from the return path on the same socket, and
/// returns once the destination sent SHUT(0) after EOF. See the
/// [module documentation](super) for the stream and the order of pages.
///
/// `events` is called from this thread as things happen. A write timeout
/// set on `stream` by the caller is kept and bounds how long a destination
/// that stops reading can block the source (a destination that dies or
/// sends garbage ends the call promptly without one). The return-path
/// reader thread has always ended when this function returns.
pub fn run_source(
    cfg: &SourceConfig,
    pages: &mut dyn PageSource,
    stream: UnixStream,
    events: &mut dyn FnMut(SourceEvent),
) -> Result<SourceReport, PostcopyError> {
    run(cfg, pages, stream, None, events)
}

/// [`run_source`] with QEMU's **postcopy-preempt** channel: `preempt` is a
/// second connection to the destination's `migrate-incoming` socket, made
/// after `stream` (the destination takes its second connection for the
/// preempt channel), on a destination whose `postcopy-preempt` capability
/// is on. Every requested page goes on `preempt` as soon as its request is
/// read, so it never waits behind background pages queued on `stream`;
/// everything else (before-run pages, the requested pages' neighbours,
/// background pages, commands, sections) stays on `stream`. The preempt
/// channel carries bare page records and ends with an EOS record before
/// `stream`'s END section (see the [module documentation](super)).
pub fn run_source_preempt(
    cfg: &SourceConfig,
    pages: &mut dyn PageSource,
    stream: UnixStream,
    preempt: UnixStream,
    events: &mut dyn FnMut(SourceEvent),
) -> Result<SourceReport, PostcopyError> {
    run(cfg, pages, stream, Some(preempt), events)
}

fn run(
    cfg: &SourceConfig,
    pages: &mut dyn PageSource,
    stream: UnixStream,
    preempt: Option<UnixStream>,
    events: &mut dyn FnMut(SourceEvent),
) -> Result<SourceReport, PostcopyError> {
    let start = Instant::now();
    validate(cfg)?;
    let socket_err = |what, source| PostcopyError::Socket {
        phase: Phase::BeforeRun,
        what,
        source,
    };
    socket2::SockRef::from(&stream)
        .set_send_buffer_size(SEND_BUFFER_BYTES)
        .map_err(|e| socket_err("setting SO_SNDBUF", e))?;
    let rp = stream
        .try_clone()
        .map_err(|e| socket_err("cloning the socket for the return path", e))?;
    // The clone shares the socket: a read timeout would look like a close.
    rp.set_read_timeout(None)
        .map_err(|e| socket_err("clearing the read timeout", e))?;
    let (tx, rx) = mpsc::channel();
    let (blocks, page_size) = (cfg.blocks.clone(), cfg.page_size as u64);
    let reader = std::thread::Builder::new()
        .name("postcopy-rp".into())
        .spawn(move || reader_thread(rp, blocks, page_size, tx))
        .map_err(|e| socket_err("starting the return-path thread", e))?;

    let mut block_start = Vec::with_capacity(cfg.blocks.len());
    let mut total = 0;
    for b in 0..cfg.blocks.len() as u32 {
        block_start.push(total);
        total += cfg.block_pages(b);
    }
    let mut s = Sender {
        cfg,
        pages,
        events,
        stream,
        preempt: preempt.map(|stream| Preempt {
            stream,
            last_block: None,
        }),
        rx,
        reader: Some(reader),
        start,
        block_start,
        total,
        sent: vec![false; total as usize],
        queued: vec![false; total as usize],
        sent_count: 0,
        demand: VecDeque::new(),
        neighbours: VecDeque::new(),
        companions: Vec::new(),
        section: None,
        run_at: None,
        eof_sent: false,
        shut: None,
        buf: Vec::with_capacity(cfg.page_size + 512),
        page: vec![0; cfg.page_size],
        report: SourceReport {
            pages_total: total,
            ..SourceReport::default()
        },
        work: None,
    };
    let result = s.run();
    s.stop_reader();
    result.map(|()| s.report)
}

fn validate(cfg: &SourceConfig) -> Result<(), PostcopyError> {
    let bad = |r: String| PostcopyError::invalid(r);
    // `is_multiple_of` needs Rust 1.87; the workspace supports 1.75.
    #[allow(clippy::manual_is_multiple_of)]
    let misaligned = cfg.page_size % X86_TARGET_PAGE_SIZE as usize != 0;
    if cfg.page_size == 0 || misaligned {
        return Err(bad(format!(
            "page_size {} is not a positive multiple of 4096",
            cfg.page_size
        )));
    }
    if cfg.ram_section_id == 0 {
        return Err(bad(
            "ram_section_id is 0, which QEMU cannot route PART sections to (use the capturing QEMU's id, e.g. 2)".into(),
        ));
    }
    if cfg.machine.is_empty() || cfg.machine.len() > 1024 {
        return Err(bad("machine name must be 1 to 1024 bytes".into()));
    }
    if cfg.blocks.is_empty() {
        return Err(bad("the block list is empty".into()));
    }
    if u32::try_from(cfg.device_state.len()).is_err() {
        return Err(bad("device state larger than 4 GiB".into()));
    }
    let mut names = HashSet::new();
    for b in &cfg.blocks {
        if b.name.is_empty() || b.name.len() > 255 {
            return Err(bad(format!(
                "block name {:?} is not 1 to 255 bytes",
                b.name
            )));
        }
        if !names.insert(&b.name) {
            return Err(bad(format!("block {:?} is listed twice", b.name)));
        }
        let pages = b.used_length / cfg.page_size as u64;
        if b.used_length == 0
            || b.used_length % cfg.page_size as u64 != 0
            || pages > u64::from(u32::MAX)
        {
            return Err(bad(format!(
                "block {:?} has length {:#x}, not a positive multiple of the page size {:#x} (below 2^32 pages)",
                b.name, b.used_length, cfg.page_size
            )));
        }
    }
    for (list, name) in [
        (&cfg.before_run, "before_run"),
        (&cfg.background, "background"),
    ] {
        if let Some(p) = list
            .iter()
            .find(|p| u64::from(p.page) >= cfg.block_pages(p.block))
        {
            return Err(bad(format!(
                "{name} page {} of block {} is outside the block list",
                p.page, p.block
            )));
        }
    }
    Ok(())
}

/// The postcopy-preempt channel and the block of its last record (its
/// CONTINUE flag refers to that channel's own previous record).
struct Preempt {
    stream: UnixStream,
    last_block: Option<u32>,
}

/// The open PART section: pages in it, block of its last record.
struct Section {
    pages: u32,
    last_block: Option<u32>,
}

struct Sender<'a> {
    cfg: &'a SourceConfig,
    pages: &'a mut dyn PageSource,
    events: &'a mut dyn FnMut(SourceEvent),
    stream: UnixStream,
    /// The postcopy-preempt channel, if the destination has one.
    preempt: Option<Preempt>,
    rx: Receiver<Vec<FromDest>>,
    reader: Option<JoinHandle<()>>,
    start: Instant,
    /// Global index of each block's first page.
    block_start: Vec<u64>,
    total: u64,
    sent: Vec<bool>,
    /// In `demand` (requested, not yet sent).
    queued: Vec<bool>,
    sent_count: u64,
    /// Requested pages not yet sent, with the arrival of their request.
    demand: VecDeque<(PageId, Instant)>,
    neighbours: VecDeque<PageId>,
    /// Scratch for [`PageSource::companions`].
    companions: Vec<PageId>,
    section: Option<Section>,
    run_at: Option<Instant>,
    eof_sent: bool,
    shut: Option<u32>,
    /// Scratch for one item's bytes.
    buf: Vec<u8>,
    /// One page.
    page: Vec<u8>,
    report: SourceReport,
    /// The last [`SourceEvent::Work`] emitted.
    work: Option<Work>,
}

impl Sender<'_> {
    /// Emits [`SourceEvent::Work`] if `work` differs from the last one.
    fn work(&mut self, work: Work) {
        if self.work != Some(work) {
            self.work = Some(work);
            (self.events)(SourceEvent::Work(work));
        }
    }

    fn run(&mut self) -> Result<(), PostcopyError> {
        let cfg = self.cfg;
        self.work(Work::Preload);
        // Header up to the RAM setup (§3.5).
        let mut out = std::mem::take(&mut self.buf);
        out.clear();
        encode::header(&mut out, &cfg.machine);
        encode::command(&mut out, CommandKind::OpenReturnPath, &[]);
        encode::ping(&mut out, encode::PING_SETUP);
        encode::advise(&mut out, cfg.page_size as u64);
        encode::ram_setup(&mut out, cfg.ram_section_id, &cfg.blocks);
        self.write(&out)?;
        self.buf = out;

        // Before-run pages. If that is every page, hold the last one back:
        // LISTEN needs a DISCARD before it (§8.1), and a discarded page
        // must not have been sent (§8.2, §8.3).
        let mut before = Vec::with_capacity(cfg.before_run.len());
        let mut planned = vec![false; self.total as usize];
        for &id in &cfg.before_run {
            let i = self.index(id);
            if !planned[i] {
                planned[i] = true;
                before.push(id);
            }
        }
        if before.len() as u64 == self.total {
            before.pop();
        }
        for id in before {
            self.poll(None)?;
            self.report.bytes_before_run += self.send_page(id)?;
            self.report.pages_before_run += 1;
        }
        self.close_section()?;

        // The complement, as DISCARD commands.
        let mut out = std::mem::take(&mut self.buf);
        out.clear();
        for (b, block) in cfg.blocks.iter().enumerate() {
            let first = self.block_start[b] as usize;
            let ranges =
                encode::unsent_ranges(cfg.block_pages(b as u32), cfg.page_size as u64, |p| {
                    !self.sent[first + p as usize]
                });
            self.report.discard_commands +=
                encode::discard_commands(&mut out, &block.name, &ranges) as u64;
        }
        debug_assert!(self.report.discard_commands > 0);
        encode::packaged(&mut out, &cfg.device_state);
        self.write(&out)?;
        self.buf = out;
        let run_at = Instant::now();
        self.run_at = Some(run_at);
        self.report.run_sent_after = run_at - self.start;
        (self.events)(SourceEvent::RunSent);

        self.postcopy(run_at)?;

        // END "ram" and EOF; then wait for SHUT.
        self.report.all_sent_after = self.start.elapsed();
        (self.events)(SourceEvent::AllSent);
        self.close_section()?;
        if self.preempt.is_some() {
            // Ends the destination's preempt thread before the main
            // channel's END (QEMU 7.2's thread has no other way out).
            let mut out = Vec::with_capacity(8);
            encode::preempt_eos(&mut out);
            self.write_preempt(&out)?;
        }
        let mut out = std::mem::take(&mut self.buf);
        out.clear();
        encode::section_open(&mut out, SectionType::End, cfg.ram_section_id);
        encode::section_close(&mut out, cfg.ram_section_id);
        out.push(SectionType::Eof as u8);
        self.write(&out)?;
        self.buf = out;
        self.eof_sent = true;
        let deadline = Instant::now() + cfg.shut_timeout;
        while self.shut.is_none() {
            if Instant::now() >= deadline {
                return Err(PostcopyError::NoShut {
                    timeout: cfg.shut_timeout,
                });
            }
            self.poll(Some(deadline))?;
        }
        self.report.shut_value = self.shut.unwrap_or_default();
        Ok(())
    }

    /// The next page neither sent nor requested: from `background`, then
    /// the first in (block, page) order at or after `scan`.
    fn next_background(
        &self,
        background: &mut impl Iterator<Item = PageId>,
        scan: &mut u64,
    ) -> Option<PageId> {
        let taken = |i: usize| self.sent[i] || self.queued[i];
        background.find(|&id| !taken(self.index(id))).or_else(|| {
            while *scan < self.total && taken(*scan as usize) {
                *scan += 1;
            }
            (*scan < self.total).then(|| self.page_at(*scan))
        })
    }

    /// After RUN: requested pages (and their neighbours) first, background
    /// pages otherwise, until every page is sent.
    fn postcopy(&mut self, run_at: Instant) -> Result<(), PostcopyError> {
        let cfg = self.cfg;
        let after_run = run_at + cfg.background_after.unwrap_or_default();
        let mut background = cfg.background.iter().copied();
        let mut scan = 0u64; // global index of the (block, page) order scan
        while self.sent_count < self.total {
            self.poll(None)?;
            let background_at = cfg.hold.until().map_or(after_run, |h| h.max(after_run));
            if !self.demand.is_empty()
                || !self.neighbours.is_empty()
                || Instant::now() < background_at
            {
                self.work(Work::Demand);
            }
            if let Some((id, asked)) = self.demand.pop_front() {
                let i = self.index(id);
                self.queued[i] = false;
                if self.preempt.is_some() {
                    self.send_urgent(id)?;
                    self.report.pages_on_preempt += 1;
                } else {
                    self.send_page(id)?;
                }
                self.report.demand_served.push(asked.elapsed());
                self.report.pages_on_demand += 1;
                self.queue_neighbours(id);
                continue;
            }
            if let Some(id) = self.neighbours.pop_front() {
                if !self.sent[self.index(id)] {
                    self.send_page(id)?;
                    self.report.pages_on_demand += 1;
                }
                continue;
            }
            if Instant::now() < background_at {
                // Tracing or held: only requested pages until `background_at`
                // (looked at again every HOLD_POLL: the hold may change).
                self.close_section()?;
                self.poll(Some(background_at.min(Instant::now() + HOLD_POLL)))?;
                continue;
            }
            // No page is queued here: every request has been served.
            let Some(id) = self.next_background(&mut background, &mut scan) else {
                break;
            };
            self.work(Work::Background);
            self.send_page(id)?;
            self.report.pages_background += 1;
        }
        debug_assert_eq!(self.sent_count, self.total);
        Ok(())
    }

    /// After the requested page `id`: the unsent pages among its companions
    /// (the page source's locality block and prefetch), or else of its
    /// cluster (the next `demand_cluster - 1` pages of its RAM block).
    fn queue_neighbours(&mut self, id: PageId) {
        let mut companions = std::mem::take(&mut self.companions);
        companions.clear();
        if self.pages.companions(id, &mut companions) {
            for &n in &companions {
                if self.cfg.block_pages(n.block) <= u64::from(n.page) {
                    continue; // not a page of the destination: ignore
                }
                // Not marked queued: a request for it still goes first.
                if !self.sent[self.index(n)] {
                    self.neighbours.push_back(n);
                }
            }
            self.companions = companions;
            return;
        }
        self.companions = companions;
        let block_pages = self.cfg.block_pages(id.block);
        let page = u64::from(id.page);
        let end = (page + u64::from(self.cfg.demand_cluster.max(1))).min(block_pages);
        for p in page + 1..end {
            let n = PageId {
                block: id.block,
                page: p as u32,
            };
            let i = self.index(n);
            if !self.sent[i] && !self.queued[i] {
                self.neighbours.push_back(n);
            }
        }
    }

    fn index(&self, id: PageId) -> usize {
        (self.block_start[id.block as usize] + u64::from(id.page)) as usize
    }

    fn page_at(&self, index: u64) -> PageId {
        let block = self.block_start.partition_point(|&s| s <= index) - 1;
        PageId {
            block: block as u32,
            page: (index - self.block_start[block]) as u32,
        }
    }

    fn phase(&self) -> Phase {
        if self.eof_sent {
            Phase::AfterEof
        } else if self.run_at.is_some() {
            Phase::AfterRun {
                outstanding: self.total - self.sent_count,
            }
        } else {
            Phase::BeforeRun
        }
    }

    /// Writes one page record (opening a PART section if none is open);
    /// returns the page bytes sent (0 for a ZERO record).
    fn send_page(&mut self, id: PageId) -> Result<u64, PostcopyError> {
        let nonzero = self.read_page(id)?;
        let cfg = self.cfg;
        let mut out = std::mem::take(&mut self.buf);
        out.clear();
        let section = self.section.get_or_insert_with(|| {
            encode::section_open(&mut out, SectionType::Part, cfg.ram_section_id);
            Section {
                pages: 0,
                last_block: None,
            }
        });
        let name = (section.last_block != Some(id.block))
            .then(|| cfg.blocks[id.block as usize].name.as_str());
        section.last_block = Some(id.block);
        section.pages += 1;
        let full = section.pages >= PAGES_PER_SECTION;
        let offset = u64::from(id.page) * cfg.page_size as u64;
        encode::page_record(&mut out, offset, name, nonzero.then_some(&self.page[..]));
        if full {
            encode::section_close(&mut out, cfg.ram_section_id);
            self.section = None;
        }
        let written = self.write(&out);
        self.buf = out;
        written?;
        self.mark_sent(id, full);
        Ok(if nonzero { cfg.page_size as u64 } else { 0 })
    }

    /// Reads page `id` (never sent before) into `self.page`; whether it is
    /// not all zeros.
    fn read_page(&mut self, id: PageId) -> Result<bool, PostcopyError> {
        debug_assert!(!self.sent[self.index(id)], "{id:?} sent twice");
        match self.pages.read_page(id, &mut self.page) {
            Ok(nonzero) => Ok(nonzero && self.page.iter().any(|&b| b != 0)),
            Err(source) => Err(PostcopyError::PageSource {
                id,
                phase: self.phase(),
                source,
            }),
        }
    }

    /// Counts `id` as sent; reports progress after a full section and at
    /// the last page.
    fn mark_sent(&mut self, id: PageId, section_full: bool) {
        let i = self.index(id);
        self.sent[i] = true;
        self.sent_count += 1;
        if section_full || self.sent_count == self.total {
            (self.events)(SourceEvent::Progress {
                sent: self.sent_count,
                total: self.total,
            });
        }
    }

    /// Writes the requested page `id` as one bare record on the preempt
    /// channel (no section: the destination's preempt thread reads page
    /// records until EOS).
    fn send_urgent(&mut self, id: PageId) -> Result<(), PostcopyError> {
        let nonzero = self.read_page(id)?;
        let cfg = self.cfg;
        let p = self
            .preempt
            .as_mut()
            .expect("send_urgent with a preempt channel");
        let name =
            (p.last_block != Some(id.block)).then(|| cfg.blocks[id.block as usize].name.as_str());
        p.last_block = Some(id.block);
        let mut out = std::mem::take(&mut self.buf);
        out.clear();
        let offset = u64::from(id.page) * cfg.page_size as u64;
        encode::page_record(&mut out, offset, name, nonzero.then_some(&self.page[..]));
        let written = self.write_preempt(&out);
        self.buf = out;
        written?;
        self.mark_sent(id, false);
        Ok(())
    }

    fn write_preempt(&mut self, bytes: &[u8]) -> Result<(), PostcopyError> {
        let p = self.preempt.as_mut().expect("a preempt channel");
        match p.stream.write_all(bytes) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.write_failed(e)),
        }
    }

    fn close_section(&mut self) -> Result<(), PostcopyError> {
        if self.section.take().is_some() {
            let mut out = Vec::with_capacity(13);
            encode::section_close(&mut out, self.cfg.ram_section_id);
            self.write(&out)?;
        }
        Ok(())
    }

    /// Handles every message the reader thread has sent; with `until`,
    /// first waits for one until then.
    fn poll(&mut self, until: Option<Instant>) -> Result<(), PostcopyError> {
        let mut first = match until {
            None => None,
            Some(t) => {
                match self
                    .rx
                    .recv_timeout(t.saturating_duration_since(Instant::now()))
                {
                    Ok(m) => Some(m),
                    Err(RecvTimeoutError::Timeout) => return Ok(()),
                    Err(RecvTimeoutError::Disconnected) => {
                        return Err(self.closed(None));
                    }
                }
            }
        };
        loop {
            let batch = match first.take() {
                Some(m) => m,
                None => match self.rx.try_recv() {
                    Ok(m) => m,
                    Err(TryRecvError::Empty) => return Ok(()),
                    Err(TryRecvError::Disconnected) => return Err(self.closed(None)),
                },
            };
            for msg in batch {
                self.handle(msg)?;
            }
            if self.shut.is_some() {
                // The reader thread has ended after SHUT.
                return Ok(());
            }
        }
    }

    fn closed(&self, source: Option<io::Error>) -> PostcopyError {
        PostcopyError::DestinationClosed {
            phase: self.phase(),
            source,
        }
    }

    fn handle(&mut self, msg: FromDest) -> Result<(), PostcopyError> {
        match msg {
            FromDest::Request { first, count, at } => {
                let since_run = self
                    .run_at
                    .map_or(Duration::ZERO, |r| at.saturating_duration_since(r));
                for k in 0..count {
                    let id = PageId {
                        block: first.block,
                        page: first.page + k,
                    };
                    let i = self.index(id);
                    if self.sent[i] || self.queued[i] {
                        self.report.requests_already_sent += 1;
                        continue;
                    }
                    self.queued[i] = true;
                    self.demand.push_back((id, at));
                    self.report.demand.push((since_run, id));
                    (self.events)(SourceEvent::Demand { id, since_run });
                }
                Ok(())
            }
            FromDest::Pong(v) => {
                self.report.pongs.push(v);
                Ok(())
            }
            FromDest::Shut(0) if self.eof_sent => {
                self.shut = Some(0);
                Ok(())
            }
            FromDest::Shut(0) => Err(self.closed(None)),
            FromDest::Shut(value) => Err(PostcopyError::ShutFailed {
                value,
                phase: self.phase(),
            }),
            // SHUT and the close often come in one read: the close after a
            // good SHUT is the normal end.
            FromDest::Closed(_) if self.shut == Some(0) => Ok(()),
            FromDest::Closed(source) => Err(self.closed(source)),
            FromDest::Failed(e) => Err(e),
        }
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), PostcopyError> {
        match self.stream.write_all(bytes) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.write_failed(e)),
        }
    }

    /// A write failed: the destination closed the socket, or the reader
    /// thread shut it down because of garbage. Prefer the thread's story.
    fn write_failed(&mut self, e: io::Error) -> PostcopyError {
        self.stop_reader();
        let msgs: Vec<FromDest> = self.rx.try_iter().flatten().collect();
        for msg in msgs {
            match msg {
                FromDest::Failed(err) => return err,
                FromDest::Shut(value) if value != 0 => {
                    return PostcopyError::ShutFailed {
                        value,
                        phase: self.phase(),
                    }
                }
                _ => {}
            }
        }
        use io::ErrorKind::*;
        match e.kind() {
            BrokenPipe | ConnectionReset | ConnectionAborted | NotConnected | UnexpectedEof
            | WriteZero => self.closed(Some(e)),
            _ => PostcopyError::Socket {
                phase: self.phase(),
                what: "writing the migration stream",
                source: e,
            },
        }
    }

    /// Shuts the socket down (waking the reader thread if it is blocked)
    /// and joins the thread.
    fn stop_reader(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(p) = &self.preempt {
            let _ = p.stream.shutdown(Shutdown::Both);
        }
        if let Some(h) = self.reader.take() {
            let _ = h.join();
        }
    }
}
