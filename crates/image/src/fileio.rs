//! Small file helpers shared by the writer and the reader: positioned
//! reads with error mapping, writing a header + CRC'd body, vectored
//! appends, fsync of directories, image ids.

use std::fs::File;
use std::io::{self, BufWriter, IoSlice, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::ReadError;
use crate::format::{FileHeader, FileKind, FILE_HEADER_LEN};

/// Reads exactly `buf.len()` bytes at `offset` (one `pread` loop).
pub(crate) fn read_at(
    file: &File,
    path: &Path,
    buf: &mut [u8],
    offset: u64,
) -> Result<(), ReadError> {
    file.read_exact_at(buf, offset)
        .map_err(|e| ReadError::io(path, e))
}

/// Reads `len` bytes at `offset` into a new buffer. The caller has
/// checked `offset + len` against the file size, so `len` is bounded.
pub(crate) fn read_vec_at(
    file: &File,
    path: &Path,
    len: u64,
    offset: u64,
) -> Result<Vec<u8>, ReadError> {
    let len = usize::try_from(len)
        .map_err(|_| ReadError::corrupt(path, "length does not fit in memory"))?;
    let mut v = vec![0u8; len];
    read_at(file, path, &mut v, offset)?;
    Ok(v)
}

/// A writer that counts bytes and computes their CRC32C on the way.
pub(crate) struct CrcWriter<W: Write> {
    inner: W,
    crc: u32,
    len: u64,
}

impl<W: Write> CrcWriter<W> {
    pub(crate) fn new(inner: W) -> Self {
        CrcWriter {
            inner,
            crc: 0,
            len: 0,
        }
    }
}

impl<W: Write> Write for CrcWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, &buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Creates `path` holding a `kind` header and the body `write_body`
/// produces; fills in the header's body length and CRC, fsyncs, and
/// returns the file size.
pub(crate) fn write_body_file(
    path: &Path,
    kind: FileKind,
    mut header: FileHeader,
    write_body: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> io::Result<u64> {
    let file = File::options().write(true).create_new(true).open(path)?;
    let mut w = CrcWriter::new(BufWriter::with_capacity(1 << 20, &file));
    w.inner.write_all(&[0u8; FILE_HEADER_LEN])?;
    write_body(&mut w)?;
    w.flush()?;
    header.body_len = w.len;
    header.body_crc = w.crc;
    let CrcWriter { inner, .. } = w;
    inner.into_inner().map_err(|e| e.into_error())?;
    file.write_all_at(&header.encode(kind), 0)?;
    file.sync_all()?;
    Ok(FILE_HEADER_LEN as u64 + header.body_len)
}

/// fsyncs a directory (makes its entries durable).
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Opens `path` for reading; returns it and its size.
pub(crate) fn open_file(path: &Path) -> Result<(File, u64), ReadError> {
    let f = File::open(path).map_err(|e| ReadError::io(path, e))?;
    let meta = f.metadata().map_err(|e| ReadError::io(path, e))?;
    if !meta.is_file() {
        return Err(ReadError::corrupt(path, "not a regular file"));
    }
    Ok((f, meta.len()))
}

/// Reads and checks the header of a binary file of `kind` whose size is
/// `file_len`: magic, version, header CRC, and that the body length the
/// header claims is what the file holds.
pub(crate) fn read_header(
    file: &File,
    path: &Path,
    kind: FileKind,
    file_len: u64,
) -> Result<FileHeader, ReadError> {
    let mut pre = [0u8; 16];
    let n = file_len.min(16) as usize;
    read_at(file, path, &mut pre[..n], 0)?;
    let (_, header_len) = FileHeader::preamble(path, kind, &pre[..n], file_len)?;
    let mut buf = vec![0u8; header_len as usize];
    read_at(file, path, &mut buf, 0)?;
    let h = FileHeader::decode(path, kind, &buf, file_len)?;
    let expected = u64::from(h.header_len).saturating_add(h.body_len);
    if file_len < expected {
        return Err(ReadError::Truncated {
            file: path.into(),
            expected,
            found: file_len,
        });
    }
    if file_len > expected {
        return Err(ReadError::corrupt(
            path,
            format!(
                "{} bytes after the end the header declares",
                file_len - expected
            ),
        ));
    }
    Ok(h)
}

/// Reads the body of a binary file whose header was checked by
/// [`read_header`] and checks its CRC.
pub(crate) fn read_body(file: &File, path: &Path, h: &FileHeader) -> Result<Vec<u8>, ReadError> {
    let body = read_vec_at(file, path, h.body_len, u64::from(h.header_len))?;
    if crc32c::crc32c(&body) != h.body_crc {
        return Err(ReadError::BadCrc {
            file: path.into(),
            what: "body".into(),
            block: None,
            offset: u64::from(h.header_len),
        });
    }
    Ok(body)
}

/// Writes every byte of `parts`, in order, with as few `writev` calls as
/// the kernel allows.
pub(crate) fn write_all_vectored(f: &mut File, parts: &[&[u8]]) -> io::Result<()> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let slices: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
    let n = loop {
        match f.write_vectored(&slices) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => break r?,
        }
    };
    if n == total {
        return Ok(());
    }
    // A short write: finish piece by piece.
    let mut skip = n;
    for p in parts {
        if skip >= p.len() {
            skip -= p.len();
            continue;
        }
        f.write_all(&p[skip..])?;
        skip = 0;
    }
    Ok(())
}

static ID_SEQ: AtomicU64 = AtomicU64::new(0);

/// 16 random bytes from the kernel, or a time/pid/counter mix if
/// `/dev/urandom` is unavailable (the id only has to differ between
/// snapshots, it protects against mixing files, not against attackers).
pub(crate) fn new_image_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    if File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut id))
        .is_ok()
    {
        return id;
    }
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0) as u64;
    let mut x =
        nanos ^ (u64::from(std::process::id()) << 32) ^ ID_SEQ.fetch_add(1, Ordering::Relaxed);
    for chunk in id.chunks_mut(8) {
        // splitmix64
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        chunk.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    id
}
