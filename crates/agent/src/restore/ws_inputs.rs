//! What a restore's working set is made from, read from the snapshot
//! directory: the sizes the snapshot recorded, the pages the host kernel
//! saw accessed (if any), and what the newest earlier restore learned.
//!
//! | input | from | used for |
//! |---|---|---|
//! | WSS_sample | `metrics.wss_sample_pages` (accessed bits: reads included) | hybrid size |
//! | WSS_snapshot | the largest of the pages written during the snapshot (FAFL trace), `metrics.wss_snapshot_touched_pages` (the window before the snapshot point) and, with access data, the written and accessed pages together | hybrid size |
//! | written pages | the image's FAFL trace | queue, first |
//! | accessed pages | `access/accessed.json` (DAMON), if present and valid | queue, after the written pages |
//! | learned | the newest `restores/` record with a learned state ([`vmcsnap_workingset::learn`]) | size and queue head of `workingset` |
//!
//! Access data that is missing or does not parse never fails a restore:
//! the restore goes on with the written pages and says why
//! ([`AccessData`]).

use std::path::Path;

use vmcsnap_control::SnapshotMetrics;
use vmcsnap_image::{Image, PageKey};
use vmcsnap_workingset::{self as ws, access, Mode};

use super::traces::{self, Learned};

/// What became of the snapshot's access data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccessData {
    /// Used: its source and page count.
    Used {
        /// `damon`.
        source: String,
        /// Distinct pages.
        pages: u64,
    },
    /// The snapshot has none.
    Absent {
        /// Why, as the snapshot recorded it (or that it did not).
        why: String,
    },
    /// Present but not usable.
    Ignored {
        /// The error.
        why: String,
    },
}

impl std::fmt::Display for AccessData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AccessData::Used { source, pages } => {
                write!(f, "{source}: {pages} accessed pages after the written ones")
            }
            AccessData::Absent { why } => {
                write!(f, "none ({why}): written pages, sizes from accessed bits")
            }
            AccessData::Ignored { why } => write!(f, "ignored: {why}; written pages only"),
        }
    }
}

/// Everything the plan is made from.
#[derive(Debug, Clone)]
pub struct WsInputs {
    /// WSS_sample (pages), if the VM was sampled.
    pub wss_sample: Option<u64>,
    /// WSS_snapshot (pages).
    pub wss_snapshot: u64,
    /// The snapshot's own queue: written pages, then accessed ones.
    pub queue: Vec<PageKey>,
    /// What became of the access data.
    pub access: AccessData,
    /// What the newest earlier restore learned.
    pub learned: Option<Learned>,
}

fn metrics(img: &Image) -> SnapshotMetrics {
    SnapshotMetrics::read(&img.manifest().metrics.other)
}

/// Reads the inputs of the snapshot `img` in `dir`.
pub fn read(img: &Image, dir: &Path) -> WsInputs {
    let block_pages: Vec<u32> = (0..img.ram_blocks().len() as u32)
        .map(|b| img.ram_block_pages(b))
        .collect();
    let fafl = img.fafl();
    let (accessed, access) = access_data(img, dir, &block_pages);
    let mut queue = ws::fafl_queue(fafl, None);
    let mut seen: std::collections::HashSet<PageKey> = queue.iter().copied().collect();
    queue.extend(accessed.into_iter().filter(|k| seen.insert(*k)));
    let written = fafl.len() as u64;
    // With access data, the pages written or accessed after the snapshot
    // point are HotRestore's WSS_snapshot itself (reads included).
    let wss_snapshot = written
        .max(metrics(img).wss_snapshot_touched_pages.unwrap_or(0))
        .max(queue.len() as u64);
    // A learned queue naming pages this snapshot does not have is not its own.
    let learned = traces::newest_learned(dir).filter(|l| {
        l.queue
            .iter()
            .all(|&(b, p)| block_pages.get(b as usize).is_some_and(|&n| p < n))
    });
    WsInputs {
        wss_sample: metrics(img).wss_sample_pages,
        wss_snapshot,
        queue,
        access,
        learned,
    }
}

fn access_data(img: &Image, dir: &Path, block_pages: &[u32]) -> (Vec<PageKey>, AccessData) {
    let path = dir.join(access::FILE);
    match std::fs::read(&path) {
        Ok(bytes) => match access::AccessedPages::parse(&bytes, block_pages) {
            Ok(a) => {
                let pages = a.pages();
                let used = AccessData::Used {
                    source: a.source.clone(),
                    pages: pages.len() as u64,
                };
                (pages, used)
            }
            Err(e) => (vec![], AccessData::Ignored { why: e.to_string() }),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let noted = metrics(img).access_data;
            let why = match noted.as_deref() {
                // The collector runs on after the snapshot returns.
                Some("damon") => "still being collected: the snapshot's access window has not ended, or its collector was stopped".to_string(),
                Some(why) => why.strip_prefix("none: ").unwrap_or(why).to_string(),
                None => "the snapshot recorded no access data".to_string(),
            };
            (vec![], AccessData::Absent { why })
        }
        Err(e) => (
            vec![],
            AccessData::Ignored {
                why: format!("{}: {e}", path.display()),
            },
        ),
    }
}

impl WsInputs {
    /// HotRestore's hybrid size.
    pub fn hybrid(&self) -> u64 {
        ws::hybrid_wss(self.wss_sample, self.wss_snapshot)
    }

    /// The size `mode` asks for with `--wss auto`: what the last restore
    /// learned for `workingset`, else the hybrid size.
    pub fn auto_size(&self, mode: Mode) -> u64 {
        match (mode, &self.learned) {
            (Mode::Workingset, Some(l)) => l.size,
            _ => self.hybrid(),
        }
    }

    /// The queue `mode` uses: for `workingset`, the learned queue first.
    pub fn queue(&self, mode: Mode) -> Vec<PageKey> {
        match (mode, &self.learned) {
            (Mode::Workingset, Some(l)) => {
                let head: Vec<PageKey> = l.queue.iter().map(|&(b, p)| PageKey::new(b, p)).collect();
                ws::fafl_queue(&self.queue, Some((&head, &[])))
            }
            _ => self.queue.clone(),
        }
    }
}
