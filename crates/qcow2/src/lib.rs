//! A small read-only reader of disk images as QEMU writes them: qcow2
//! (versions 2 and 3) and raw files, with their backing chains.
//!
//! vmcsnap uses it to read the frozen disks of a snapshot without QEMU:
//! guest pages stored in an image as references to a disk block (the
//! detection layer, `docs/image-format.md`) are read back through it, and
//! the snapshot code indexes the blocks of a disk with
//! [`Disk::allocated_blocks`].
//!
//! What it reads: the header and its extensions, the L1 table (in memory)
//! and L2 tables (a small cache); unallocated clusters fall through to the
//! backing file named in the header (a relative name is resolved against
//! the image's directory; the backing format extension, else the file's
//! magic, decides its format); zero clusters read as zeros; a backing file
//! shorter than the disk reads as zeros past its end. Every size and offset
//! from a header is checked against the file before use, and the chain is
//! at most [`MAX_CHAIN`] files long.
//!
//! What it refuses, with an error that names the feature: compressed
//! clusters (vmcsnap's own images are written without `-c`), encryption,
//! external data files, extended L2 entries, `json:` backing names.

use std::path::{Path, PathBuf};

mod error;
mod header;
mod layer;
#[cfg(test)]
mod tests;

pub use error::DiskError;
pub use layer::Format;

use layer::{Layer, Mapping};

/// Most files in a backing chain.
pub const MAX_CHAIN: usize = 64;
/// The block size of [`Disk::allocated_blocks`].
pub const BLOCK: u64 = 4096;

/// A disk image and its backing chain, open for reading.
#[derive(Debug)]
pub struct Disk {
    /// Top first.
    layers: Vec<Layer>,
}

/// One file of a chain, as [`Disk::layers`] describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerInfo {
    /// Its path (backing files: resolved against the directory of the file
    /// naming them).
    pub path: PathBuf,
    /// Its format.
    pub format: Format,
    /// Its virtual size.
    pub size: u64,
}

/// A file's identity, to key caches by: a file with the same identity has
/// the same bytes (vmcsnap never writes a frozen disk).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileIdentity {
    /// Device number.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
    /// Length in bytes.
    pub len: u64,
    /// Modification time, ns since the epoch.
    pub mtime_ns: i128,
}

impl Disk {
    /// Opens `path` (format by its magic: qcow2 or raw) and its whole
    /// backing chain.
    pub fn open(path: &Path) -> Result<Disk, DiskError> {
        Self::open_as(path, None)
    }

    /// [`open`](Self::open) with the top file's format given.
    pub fn open_as(path: &Path, format: Option<Format>) -> Result<Disk, DiskError> {
        let mut layers = vec![Layer::open(path, format)?];
        loop {
            let top = layers.last().map(|l| (l.path.clone(), l.backing.clone()));
            let Some((child, Some((name, fmt)))) = top else {
                break;
            };
            if layers.len() >= MAX_CHAIN {
                return Err(DiskError::ChainTooLong {
                    path: path.into(),
                    max: MAX_CHAIN,
                });
            }
            let backing_err = |why: String| DiskError::Backing {
                path: child.clone(),
                backing: name.clone(),
                why,
            };
            if name.starts_with("json:") || name.contains("://") {
                return Err(backing_err(
                    "is a QEMU protocol or json: name, which this reader cannot open".into(),
                ));
            }
            let resolved = match child.parent() {
                Some(dir) => dir.join(&name),
                None => PathBuf::from(&name),
            };
            let format = match fmt.as_deref() {
                None => None,
                Some("qcow2") => Some(Format::Qcow2),
                Some("raw") => Some(Format::Raw),
                Some(other) => {
                    return Err(backing_err(format!(
                        "has format {other:?}; only qcow2 and raw are read"
                    )))
                }
            };
            if !resolved.exists() {
                return Err(backing_err(format!(
                    "({}) does not exist",
                    resolved.display()
                )));
            }
            layers.push(Layer::open(&resolved, format)?);
        }
        Ok(Disk { layers })
    }

    /// The virtual size in bytes (the top file's).
    pub fn len(&self) -> u64 {
        self.layers[0].size
    }

    /// Whether the disk has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The files of the chain, top first.
    pub fn layers(&self) -> Vec<LayerInfo> {
        self.layers
            .iter()
            .map(|l| LayerInfo {
                path: l.path.clone(),
                format: l.format,
                size: l.size,
            })
            .collect()
    }

    /// The identity of file `layer` of the chain (0 = top).
    pub fn identity(&self, layer: usize) -> Result<FileIdentity, DiskError> {
        let l = self.layer(layer)?;
        let (dev, ino, len, mtime_ns) = l.identity()?;
        Ok(FileIdentity {
            dev,
            ino,
            len,
            mtime_ns,
        })
    }

    fn layer(&self, i: usize) -> Result<&Layer, DiskError> {
        self.layers.get(i).ok_or_else(|| DiskError::OutOfRange {
            path: self.layers[0].path.clone(),
            offset: i as u64,
            len: 0,
            size: self.layers.len() as u64,
        })
    }

    /// Fills `buf` with the disk's bytes at `offset`, as the guest sees
    /// them.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), DiskError> {
        let len = buf.len() as u64;
        if offset.checked_add(len).is_none_or(|e| e > self.len()) {
            return Err(DiskError::OutOfRange {
                path: self.layers[0].path.clone(),
                offset,
                len,
                size: self.len(),
            });
        }
        self.read_from(0, offset, buf)
    }

    /// Reads `buf` at `offset` from layer `i` down.
    fn read_from(&self, i: usize, offset: u64, buf: &mut [u8]) -> Result<(), DiskError> {
        let Some(l) = self.layers.get(i) else {
            buf.fill(0);
            return Ok(());
        };
        let mut done = 0usize;
        while done < buf.len() {
            let off = offset + done as u64;
            let rest = buf.len() - done;
            if off >= l.size {
                buf[done..].fill(0);
                break;
            }
            let cluster = l.cluster_size();
            let in_cluster = off % cluster;
            let n = (cluster - in_cluster).min(rest as u64).min(l.size - off) as usize;
            let out = &mut buf[done..done + n];
            match l.map(off)? {
                Mapping::Data(host) => l.read_host(host + in_cluster, out)?,
                Mapping::Zero => out.fill(0),
                Mapping::Unallocated => self.read_from(i + 1, off, out)?,
                Mapping::Compressed => return Err(l.compressed_error()),
            }
            done += n;
        }
        Ok(())
    }

    /// The [`BLOCK`]-sized blocks that file `layer` of the chain holds data
    /// for (its own data clusters: not unallocated, not zero clusters), in
    /// disk order, with their bytes as the guest sees them from that file
    /// down; all-zero blocks are skipped. Raw files: every non-zero block.
    pub fn allocated_blocks(&self, layer: usize) -> Result<AllocatedBlocks<'_>, DiskError> {
        self.layer(layer)?;
        Ok(AllocatedBlocks {
            disk: self,
            layer,
            next: 0,
            end: self.layers[layer].size.min(self.len()),
            buf: Vec::new(),
            pos: 0,
            buf_at: 0,
            done: false,
        })
    }
}

/// Iterator of [`Disk::allocated_blocks`]: `(block number, bytes)`.
#[derive(Debug)]
pub struct AllocatedBlocks<'a> {
    disk: &'a Disk,
    layer: usize,
    /// Next virtual offset to look at.
    next: u64,
    end: u64,
    /// Bytes of the current data run, starting at `buf_at`.
    buf: Vec<u8>,
    /// Next unread byte of `buf`.
    pos: usize,
    buf_at: u64,
    done: bool,
}

impl AllocatedBlocks<'_> {
    /// Loads the next run of data clusters (at most 1 MiB) into `buf`;
    /// false at the end.
    fn fill(&mut self) -> Result<bool, DiskError> {
        let l = &self.disk.layers[self.layer];
        let cluster = l.cluster_size();
        // Skip to the first data cluster.
        let start = loop {
            if self.next >= self.end {
                return Ok(false);
            }
            let c = self.next - self.next % cluster;
            match l.map(c)? {
                Mapping::Data(_) => break c,
                Mapping::Compressed => return Err(l.compressed_error()),
                Mapping::Zero | Mapping::Unallocated => self.next = c + cluster,
            }
        };
        // Extend the run over following data clusters.
        let mut stop = start + cluster;
        while stop < self.end
            && stop - start < (1 << 20)
            && matches!(l.map(stop)?, Mapping::Data(_))
        {
            stop += cluster;
        }
        self.next = stop;
        // Whole blocks covering the run, read from this file down.
        let first = start - start % BLOCK;
        let last = stop.min(self.end).div_ceil(BLOCK) * BLOCK;
        let last = last.min(self.disk.len());
        self.buf.resize((last - first) as usize, 0);
        self.disk.read_from(self.layer, first, &mut self.buf)?;
        self.buf_at = first;
        self.pos = 0;
        // A block may straddle two runs (clusters under 4 KiB): do not
        // yield it twice.
        self.next = self.next.max(last);
        Ok(true)
    }
}

impl Iterator for AllocatedBlocks<'_> {
    type Item = Result<(u64, Vec<u8>), DiskError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.done {
                return None;
            }
            while self.buf.len() - self.pos >= BLOCK as usize {
                let block = &self.buf[self.pos..self.pos + BLOCK as usize];
                let at = self.buf_at;
                self.buf_at += BLOCK;
                self.pos += BLOCK as usize;
                if block.iter().any(|&b| b != 0) {
                    return Some(Ok((at / BLOCK, block.to_vec())));
                }
            }
            match self.fill() {
                Ok(true) => {}
                Ok(false) => {
                    self.done = true;
                    return None;
                }
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
    }
}
