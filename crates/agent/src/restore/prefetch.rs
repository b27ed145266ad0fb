//! Parallel decompression ahead of a restore's sequential reads.
//!
//! The pages a restore sends before the guest starts (all of them for an
//! eager restore, the working set for the others) are known in advance, and
//! so is the order of the blocks that hold them. Worker threads read and
//! decompress those blocks in that order, at most [`WINDOW`] blocks ahead of
//! the sender, and hand them over; the sender only copies pages out. A
//! block asked for out of that order (a demand fault) is read directly.
//! The workers read through their own handle on the image (opened again:
//! an `Image` is read with positioned reads and shared by reference only).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use vmcsnap_image::{Block, Image, PageKey, PageState};

/// Blocks decompressed ahead of the sender at most (16 MiB of 256 KiB
/// blocks).
pub const WINDOW: usize = 64;

/// The workers and what they have delivered.
pub struct Prefetch {
    /// Block number → its place in the order.
    place: HashMap<u32, usize>,
    /// The sender's place in the order.
    at: Arc<AtomicUsize>,
    rx: Receiver<(usize, Result<Arc<Block>, String>)>,
    ready: HashMap<usize, Result<Arc<Block>, String>>,
    stop: Arc<AtomicBool>,
    workers: Vec<JoinHandle<()>>,
}

impl Prefetch {
    /// Starts `threads` workers over the blocks of `img` that hold the
    /// pages of `sequential` (own blocks only, compressed ones only: an
    /// uncompressed block is read by the merged extents of the read plan),
    /// in the order the pages come. `None` if there is nothing to prefetch
    /// or the image cannot be opened again.
    pub fn start(img: &Image, sequential: &[PageKey], threads: usize) -> Option<Prefetch> {
        let mut order = Vec::new();
        let mut place = HashMap::new();
        for &k in sequential {
            if let Ok(PageState::Stored(loc)) = img.locate(k) {
                if loc.offset.is_none() && !place.contains_key(&loc.block) {
                    place.insert(loc.block, order.len());
                    order.push(loc.block);
                }
            }
        }
        if order.len() < 2 || threads == 0 {
            return None;
        }
        let shared = Arc::new(Image::open(img.dir()).ok()?);
        let order = Arc::new(order);
        let next = Arc::new(AtomicUsize::new(0));
        let at = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let mut workers = Vec::new();
        for i in 0..threads {
            let (img, order, next, at, stop, tx) = (
                shared.clone(),
                order.clone(),
                next.clone(),
                at.clone(),
                stop.clone(),
                tx.clone(),
            );
            let spawned = std::thread::Builder::new()
                .name(format!("vmcsnap-prefetch-{i}"))
                .spawn(move || loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    if j >= order.len() {
                        return;
                    }
                    while j > at.load(Ordering::Relaxed) + WINDOW {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let b = img
                        .read_block(order[j])
                        .map(Arc::new)
                        .map_err(|e| e.to_string());
                    if tx.send((j, b)).is_err() {
                        return;
                    }
                });
            if let Ok(h) = spawned {
                workers.push(h);
            }
        }
        (!workers.is_empty()).then_some(Prefetch {
            place,
            at,
            rx,
            ready: HashMap::new(),
            stop,
            workers,
        })
    }

    /// Block `b` if it is the next the workers bring (or close to it):
    /// waits for it. `None`: read it directly (out of order, or a worker
    /// failed).
    pub fn get(&mut self, b: u32) -> Option<Result<Arc<Block>, String>> {
        let &j = self.place.get(&b)?;
        let at = self.at.load(Ordering::Relaxed);
        if j < at || j > at + WINDOW {
            return None;
        }
        self.at.store(j, Ordering::Relaxed);
        if self.ready.len() > 2 * WINDOW {
            self.ready.retain(|&k, _| k >= j);
        }
        loop {
            if let Some(r) = self.ready.remove(&j) {
                return Some(r);
            }
            // Every job below the window's end is taken by a worker in
            // order, so `j` comes unless the workers are gone.
            let (k, r) = self.rx.recv_timeout(Duration::from_secs(30)).ok()?;
            self.ready.insert(k, r);
        }
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Workers blocked on nothing but the window or one block read.
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmcsnap_image::{ImageMeta, ImageWriter, RamBlock, WriterOptions};

    #[test]
    fn blocks_come_in_order_and_out_of_order_ones_are_read_directly() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("s");
        let meta = ImageMeta {
            page_size: 4096,
            ram_blocks: vec![RamBlock {
                name: "mem".into(),
                used_length: 4096 * 4096,
            }],
            ..Default::default()
        };
        let opts = WriterOptions {
            pages_per_block: 16,
            ..Default::default()
        };
        let mut w = ImageWriter::create_with(&dir, meta, opts).unwrap();
        for p in 0..4096u32 {
            let mut d = vec![0u8; 4096];
            d[..4].copy_from_slice(&p.to_le_bytes());
            d[8] = 1;
            w.add_page(0, p, &d).unwrap();
        }
        w.set_device_state(b"d").unwrap();
        w.commit().unwrap();
        let img = Image::open(&dir).unwrap();
        let keys: Vec<PageKey> = (0..4096).map(|p| PageKey::new(0, p)).collect();
        let mut pf = Prefetch::start(&img, &keys, 3).unwrap();
        // In order: every compressed block, with the right pages (a block
        // the writer stored raw, its compressors busy, is read by extents).
        let compressed: Vec<u32> = (0..img.blocks().len() as u32)
            .filter(|&b| img.blocks()[b as usize].compression != 0)
            .collect();
        assert!(compressed.len() > 100, "{}", compressed.len());
        for b in 0..img.blocks().len() as u32 {
            let Some(blk) = pf.get(b) else {
                assert!(!compressed.contains(&b), "block {b}");
                continue;
            };
            let blk = blk.unwrap();
            assert_eq!(blk.index, b);
            for (k, data) in blk.iter() {
                assert_eq!(data[..4], k.page.to_le_bytes());
            }
        }
        // Behind the sender, or unknown: read directly.
        assert!(pf.get(0).is_none());
        assert!(pf.get(100_000).is_none());
        let mut pf = Prefetch::start(&img, &keys, 2).unwrap();
        let far = compressed[WINDOW + 10];
        assert!(pf.get(far).is_none(), "far ahead of the window");
        assert_eq!(pf.get(compressed[3]).unwrap().unwrap().index, compressed[3]);
        drop(pf); // workers stop
    }
}
