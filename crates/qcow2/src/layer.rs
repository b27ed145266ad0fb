//! One file of a backing chain: a raw file, or a qcow2 file with its L1
//! table in memory and a small cache of L2 tables.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error::DiskError;
use crate::header::{Header, MAGIC};

/// L2 tables kept in memory per file (each maps cluster_size / 8 clusters:
/// 512 MiB of disk with the default 64 KiB clusters).
const L2_CACHE_TABLES: usize = 32;
/// Bits 9..=55 of an L1 or standard L2 entry: a host offset.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// L2 entry: the cluster is compressed.
const L2_COMPRESSED: u64 = 1 << 62;
/// L2 entry (v3): the cluster reads as zeros.
const L2_ZERO: u64 = 1;

/// A file's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A raw disk: byte `n` of the file is byte `n` of the disk.
    Raw,
    /// qcow2 (version 2 or 3).
    Qcow2,
}

impl Format {
    /// `raw` or `qcow2`.
    pub fn name(self) -> &'static str {
        match self {
            Format::Raw => "raw",
            Format::Qcow2 => "qcow2",
        }
    }
}

/// Where the bytes of one cluster of a qcow2 file are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mapping {
    /// At this offset of the file.
    Data(u64),
    /// Zeros (a zero cluster).
    Zero,
    /// Not in this file: the backing file has them.
    Unallocated,
    /// A compressed cluster.
    Compressed,
}

#[derive(Debug)]
struct Qcow2 {
    cluster_bits: u32,
    l1: Vec<u64>,
    l2_cache: Mutex<HashMap<u64, Arc<[u64]>>>,
    compression_type: u8,
}

/// One file of the chain.
#[derive(Debug)]
pub(crate) struct Layer {
    pub path: PathBuf,
    file: File,
    file_len: u64,
    /// Virtual size.
    pub size: u64,
    pub format: Format,
    qcow2: Option<Qcow2>,
    /// The backing file's name as the header gives it, and its format.
    pub backing: Option<(String, Option<String>)>,
}

impl Layer {
    /// Opens `path`; `format` None: by its magic.
    pub fn open(path: &Path, format: Option<Format>) -> Result<Layer, DiskError> {
        let file = File::open(path).map_err(DiskError::io(path))?;
        let file_len = file.metadata().map_err(DiskError::io(path))?.len();
        let mut magic = [0u8; 4];
        let n = read_full(&file, 0, &mut magic).map_err(DiskError::io(path))?;
        let format = format.unwrap_or(if n == 4 && magic == MAGIC {
            Format::Qcow2
        } else {
            Format::Raw
        });
        if format == Format::Raw {
            return Ok(Layer {
                path: path.into(),
                file,
                file_len,
                size: file_len,
                format,
                qcow2: None,
                backing: None,
            });
        }
        // Cluster 0 holds the header, its extensions and the backing name.
        let mut first = [0u8; 24];
        let n = read_full(&file, 0, &mut first).map_err(DiskError::io(path))?;
        let cluster_bits = if n >= 24 {
            u32::from_be_bytes([first[20], first[21], first[22], first[23]])
        } else {
            0
        };
        let head_len = if (9..=21).contains(&cluster_bits) {
            (1u64 << cluster_bits).min(file_len)
        } else {
            n as u64
        };
        let mut head = vec![0u8; head_len as usize];
        let n = read_full(&file, 0, &mut head).map_err(DiskError::io(path))?;
        head.truncate(n);
        let h = Header::parse(path, &head, file_len)?;
        let mut raw = vec![0u8; h.l1_entries as usize * 8];
        let n = read_full(&file, h.l1_offset, &mut raw).map_err(DiskError::io(path))?;
        if n != raw.len() {
            return Err(DiskError::corrupt(path, "the L1 table is cut short"));
        }
        let l1 = raw
            .chunks_exact(8)
            .map(|c| u64::from_be_bytes(c.try_into().unwrap_or([0; 8])))
            .collect();
        Ok(Layer {
            path: path.into(),
            file,
            file_len,
            size: h.size,
            format,
            qcow2: Some(Qcow2 {
                cluster_bits: h.cluster_bits,
                l1,
                l2_cache: Mutex::new(HashMap::new()),
                compression_type: h.compression_type,
            }),
            backing: h.backing_file.map(|b| (b, h.backing_format)),
        })
    }

    /// The unit in which this file maps the disk (the cluster size; 1 MiB
    /// for raw files, which map everything).
    pub fn cluster_size(&self) -> u64 {
        self.qcow2.as_ref().map_or(1 << 20, |q| 1 << q.cluster_bits)
    }

    /// Where the cluster holding virtual offset `off` (< size) is.
    pub fn map(&self, off: u64) -> Result<Mapping, DiskError> {
        let Some(q) = &self.qcow2 else {
            return Ok(Mapping::Data(off - off % self.cluster_size()));
        };
        let cb = q.cluster_bits;
        let l2_bits = cb - 3;
        let l1_index = (off >> (cb + l2_bits)) as usize;
        let Some(&l1e) = q.l1.get(l1_index) else {
            return Ok(Mapping::Unallocated);
        };
        let l2_off = l1e & OFFSET_MASK;
        if l2_off == 0 {
            return Ok(Mapping::Unallocated);
        }
        let table = self.l2_table(q, l2_off)?;
        let e = table[((off >> cb) & ((1 << l2_bits) - 1)) as usize];
        if e & L2_COMPRESSED != 0 {
            return Ok(Mapping::Compressed);
        }
        if e & L2_ZERO != 0 {
            return Ok(Mapping::Zero);
        }
        let host = e & OFFSET_MASK;
        if host == 0 {
            return Ok(Mapping::Unallocated);
        }
        if host % (1 << cb) != 0 {
            return Err(DiskError::corrupt(
                &self.path,
                format!("data cluster offset {host:#x} is not cluster-aligned"),
            ));
        }
        Ok(Mapping::Data(host))
    }

    fn l2_table(&self, q: &Qcow2, at: u64) -> Result<Arc<[u64]>, DiskError> {
        let cluster = 1u64 << q.cluster_bits;
        {
            let cache = q.l2_cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(t) = cache.get(&at) {
                return Ok(t.clone());
            }
        }
        if at % cluster != 0 || at.checked_add(cluster).is_none_or(|e| e > self.file_len) {
            return Err(DiskError::corrupt(
                &self.path,
                format!("L2 table at {at:#x} is misaligned or past the end of the file"),
            ));
        }
        let mut raw = vec![0u8; cluster as usize];
        let n = read_full(&self.file, at, &mut raw).map_err(DiskError::io(&self.path))?;
        if n != raw.len() {
            return Err(DiskError::corrupt(&self.path, "an L2 table is cut short"));
        }
        let t: Arc<[u64]> = raw
            .chunks_exact(8)
            .map(|c| u64::from_be_bytes(c.try_into().unwrap_or([0; 8])))
            .collect();
        let mut cache = q.l2_cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= L2_CACHE_TABLES {
            cache.clear();
        }
        cache.insert(at, t.clone());
        Ok(t)
    }

    /// Reads file bytes at `host`; past the end of the file reads zeros
    /// (as QEMU's file driver does).
    pub fn read_host(&self, host: u64, out: &mut [u8]) -> Result<(), DiskError> {
        let n = if host >= self.file_len {
            0
        } else {
            read_full(&self.file, host, out).map_err(DiskError::io(&self.path))?
        };
        out[n..].fill(0);
        Ok(())
    }

    /// The error for a compressed cluster.
    pub fn compressed_error(&self) -> DiskError {
        let codec = match self.qcow2.as_ref().map_or(0, |q| q.compression_type) {
            0 => "zlib",
            1 => "zstd",
            _ => "unknown",
        };
        DiskError::unsupported(&self.path, format!("compressed clusters ({codec})"))
    }

    /// The file's identity: (device, inode, length, mtime in ns).
    pub fn identity(&self) -> Result<(u64, u64, u64, i128), DiskError> {
        use std::os::unix::fs::MetadataExt;
        let m = self.file.metadata().map_err(DiskError::io(&self.path))?;
        let mtime = i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec());
        Ok((m.dev(), m.ino(), m.len(), mtime))
    }
}

/// `pread` until `out` is full or the end of the file; bytes read.
fn read_full(file: &File, mut at: u64, out: &mut [u8]) -> std::io::Result<usize> {
    let mut done = 0;
    while done < out.len() {
        match file.read_at(&mut out[done..], at) {
            Ok(0) => break,
            Ok(n) => {
                done += n;
                at += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}
