//! The flushing layer (format v2): full blocks are compressed by a pool of
//! worker threads and appended to the memory image in the order they were
//! submitted.
//!
//! ```text
//!  add_page ──▶ open block (hot | cold) ──full──▶ try_send ──▶ workers (N) ──▶ results
//!                                                   │ queue full                  │
//!                                                   └──▶ stored raw, inline ──────┴──▶ reorder ──▶ append (writev)
//! ```
//!
//! The job queue is bounded ([`QUEUE_BYTES`] of blocks) and never waited
//! on: a block that finds it full is stored uncompressed at once, so the
//! capture thread, and QEMU's stream behind it, never wait for compression
//! (the manifest counts such blocks as `blocks_raw_fallback`). The queue
//! absorbs a stream faster than the compressors (a TCG guest's stream
//! comes in bursts): the backlog is compressed after the stream has ended,
//! before the commit, which lengthens the snapshot but not the guest's
//! pause. Results come back in any order and are appended in submission
//! order, so the file keeps the locality order the writer chose. Memory:
//! the queue, one block per worker and their compressed copies; payload
//! buffers are recycled.

use std::collections::BTreeMap;
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::codec::{compress, Codec};
use crate::format::PageKey;

/// Bytes of full blocks the queue holds at most before blocks are stored
/// raw (64 MiB: 256 blocks of 64 4-KiB pages).
pub const QUEUE_BYTES: usize = 64 << 20;

/// A callback each worker thread runs first (e.g. to lower its priority).
#[derive(Clone)]
pub struct WorkerInit(pub Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for WorkerInit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkerInit")
    }
}

/// One full block on its way to the file.
#[derive(Debug)]
pub(crate) struct Job {
    /// Submission number: blocks are appended in this order.
    pub seq: u64,
    /// A locality block of guest-written pages.
    pub hot: bool,
    /// Pages and their CRCs, in slot order.
    pub keys: Vec<(PageKey, u32)>,
    /// The pages' bytes, in slot order.
    pub raw: Vec<u8>,
}

/// A block ready to append.
#[derive(Debug)]
pub(crate) struct Done {
    pub job: Job,
    /// The codec used ([`Codec::None`]: `stored` is empty, write `raw`).
    pub codec: Codec,
    pub stored: Vec<u8>,
}

impl Done {
    /// The payload as stored.
    pub fn payload(&self) -> &[u8] {
        match self.codec {
            Codec::None => &self.job.raw,
            _ => &self.stored,
        }
    }
}

/// Worker threads, their queues and the reorder buffer.
pub(crate) struct Pool {
    codec: Codec,
    threads: usize,
    queue_blocks: usize,
    init: Option<WorkerInit>,
    jobs: Option<SyncSender<Job>>,
    results: Option<Receiver<Done>>,
    workers: Vec<JoinHandle<()>>,
    next_seq: u64,
    next_append: u64,
    ready: BTreeMap<u64, Done>,
    spare: Vec<Vec<u8>>,
    /// Blocks stored raw because the queue was full.
    pub raw_fallback: u32,
}

impl Pool {
    /// A pool compressing with `codec` on `threads` workers (0: every
    /// block is stored as is, inline). Threads start with the first job.
    pub fn new(codec: Codec, threads: usize, block_bytes: usize) -> Pool {
        Pool {
            codec,
            threads: if codec == Codec::None { 0 } else { threads },
            queue_blocks: (QUEUE_BYTES / block_bytes.max(1)).max(2 * threads),
            init: None,
            jobs: None,
            results: None,
            workers: Vec::new(),
            next_seq: 0,
            next_append: 0,
            ready: BTreeMap::new(),
            spare: Vec::new(),
            raw_fallback: 0,
        }
    }

    /// Sets the worker start hook (before the first block).
    pub fn set_init(&mut self, init: WorkerInit) {
        self.init = Some(init);
    }

    /// A payload buffer to fill (recycled when possible).
    pub fn buffer(&mut self) -> Vec<u8> {
        self.spare.pop().unwrap_or_default()
    }

    /// Returns a payload buffer for reuse.
    pub fn recycle(&mut self, mut buf: Vec<u8>) {
        if self.spare.len() < 2 * self.threads + 8 {
            buf.clear();
            self.spare.push(buf);
        }
    }

    fn start(&mut self) {
        let (jtx, jrx) = mpsc::sync_channel::<Job>(self.queue_blocks);
        let (rtx, rrx) = mpsc::channel::<Done>();
        let jrx = Arc::new(std::sync::Mutex::new(jrx));
        for i in 0..self.threads {
            let (jrx, rtx, codec, init) = (jrx.clone(), rtx.clone(), self.codec, self.init.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("vmcsnap-compress-{i}"))
                .spawn(move || {
                    if let Some(f) = init {
                        (f.0)();
                    }
                    let mut out = Vec::new();
                    loop {
                        // The lock is held only to take one job.
                        let job = match jrx.lock() {
                            Ok(rx) => rx.recv(),
                            Err(_) => return,
                        };
                        let Ok(job) = job else { return };
                        let used = compress(codec, &job.raw, &mut out);
                        let stored = if used == Codec::None {
                            Vec::new()
                        } else {
                            std::mem::take(&mut out)
                        };
                        if rtx
                            .send(Done {
                                job,
                                codec: used,
                                stored,
                            })
                            .is_err()
                        {
                            return;
                        }
                    }
                });
            // A thread that cannot start leaves fewer workers; with none,
            // every block is stored raw (never an error).
            if let Ok(h) = spawned {
                self.workers.push(h);
            }
        }
        if !self.workers.is_empty() {
            self.jobs = Some(jtx);
            self.results = Some(rrx);
        }
    }

    /// Submits a full block; returns the blocks now ready to append, in
    /// order.
    pub fn submit(&mut self, hot: bool, keys: Vec<(PageKey, u32)>, raw: Vec<u8>) -> Vec<Done> {
        let seq = self.next_seq;
        self.next_seq += 1;
        let job = Job {
            seq,
            hot,
            keys,
            raw,
        };
        if self.threads > 0 && self.jobs.is_none() && self.workers.is_empty() {
            self.start();
        }
        let job = match &self.jobs {
            Some(tx) => match tx.try_send(job) {
                Ok(()) => None,
                Err(TrySendError::Full(j)) => {
                    self.raw_fallback += 1;
                    Some(j)
                }
                Err(TrySendError::Disconnected(j)) => Some(j),
            },
            None => Some(job),
        };
        if let Some(job) = job {
            self.ready.insert(
                job.seq,
                Done {
                    job,
                    codec: Codec::None,
                    stored: Vec::new(),
                },
            );
        }
        if let Some(rx) = &self.results {
            while let Ok(d) = rx.try_recv() {
                self.ready.insert(d.job.seq, d);
            }
        }
        self.take_ready()
    }

    fn take_ready(&mut self) -> Vec<Done> {
        let mut out = Vec::new();
        while let Some(d) = self.ready.remove(&self.next_append) {
            self.next_append += 1;
            out.push(d);
        }
        out
    }

    /// Waits for every submitted block; returns them in order. `None` if
    /// a worker died with a block (the snapshot cannot be completed).
    pub fn finish(&mut self) -> Option<Vec<Done>> {
        self.jobs = None; // workers exit once the queue is empty
        if let Some(rx) = self.results.take() {
            for d in rx.iter() {
                self.ready.insert(d.job.seq, d);
            }
        }
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
        let out = self.take_ready();
        (self.next_append == self.next_seq).then_some(out)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.jobs = None;
        self.results = None;
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

/// Worker threads for `auto` (0): one fewer than the CPUs, 1 to 4, so
/// that a guest keeps a CPU while its snapshot is compressed.
pub(crate) fn auto_threads() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    cpus.saturating_sub(1).clamp(1, 4)
}
