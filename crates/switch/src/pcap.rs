//! Packet capture: every frame a port passes, written to a classic pcap
//! file that tcpdump, Wireshark and tshark read (see
//! [`SwitchConfig::capture_dir`](crate::SwitchConfig::capture_dir)).
//!
//! One file per port, `<capture_dir>/<port name>.pcap` (or, if that
//! exists, from an earlier port of that name or an earlier switch,
//! `<port name>.1.pcap`, `.2`, ...: a capture is never overwritten), holding both
//! directions as a tap on the VM's NIC would: the frames the VM sent (when
//! the switch read them) and the frames handed to it (when the switch
//! wrote them to its QEMU, so a held port's frames appear at their
//! release, and a replayed channel state at its replay).
//!
//! ```text
//! file header (24 bytes, little endian)
//! +------------+-------+-------+----------+----------+----------+----------+
//! | a1b2c3d4   | 2     | 4     | 0        | 0        | snaplen  | 1        |
//! | magic (µs) | major | minor | thiszone | sigfigs  | 262144   | Ethernet |
//! +------------+-------+-------+----------+----------+----------+----------+
//! then per frame
//! +----------+----------+----------+----------+-----------------------+
//! | ts_sec   | ts_usec  | incl_len | orig_len | frame (incl_len bytes)|
//! +----------+----------+----------+----------+-----------------------+
//! ```
//!
//! Frames longer than the snap length are cut to it (`orig_len` keeps the
//! real length). The file is buffered and flushed about every 100 ms of
//! traffic, when the port is removed and when the switch stops; a capture
//! that fails to write is closed with a warning and the switch goes on.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

/// The classic pcap magic for microsecond timestamps.
pub const MAGIC_US: u32 = 0xa1b2_c3d4;
/// Frames are cut to this many bytes.
pub const SNAPLEN: u32 = 262_144;
/// LINKTYPE_ETHERNET.
pub const LINKTYPE_ETHERNET: u32 = 1;
/// Flush when this much time has passed since the last flush.
const FLUSH_EVERY_US: u64 = 100_000;

/// `<dir>/<name>.pcap`, or the first `<dir>/<name>.<n>.pcap` that does not
/// exist. Characters of `name` other than ASCII letters, digits, `-` and `_`
/// become `_`, so a port name cannot leave `dir`.
pub fn free_path(dir: &Path, name: &str) -> PathBuf {
    let name: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' })
        .collect();
    let first = dir.join(format!("{name}.pcap"));
    if !first.exists() {
        return first;
    }
    (1u32..)
        .map(|n| dir.join(format!("{name}.{n}.pcap")))
        .find(|p| !p.exists())
        .expect("a free name")
}

/// An open capture file.
pub struct PcapFile {
    out: BufWriter<File>,
    last_flush_us: u64,
}

impl PcapFile {
    /// Creates (or truncates) `path` and writes the file header.
    pub fn create(path: &Path) -> io::Result<PcapFile> {
        let mut out = BufWriter::with_capacity(256 << 10, File::create(path)?);
        let mut h = Vec::with_capacity(24);
        h.extend_from_slice(&MAGIC_US.to_le_bytes());
        h.extend_from_slice(&2u16.to_le_bytes());
        h.extend_from_slice(&4u16.to_le_bytes());
        h.extend_from_slice(&0i32.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&SNAPLEN.to_le_bytes());
        h.extend_from_slice(&LINKTYPE_ETHERNET.to_le_bytes());
        out.write_all(&h)?;
        out.flush()?;
        Ok(PcapFile { out, last_flush_us: 0 })
    }

    /// Appends `frame`, seen at `unix_us`.
    pub fn write(&mut self, unix_us: u64, frame: &[u8]) -> io::Result<()> {
        let incl = frame.len().min(SNAPLEN as usize);
        let mut rec = [0u8; 16];
        rec[0..4].copy_from_slice(&((unix_us / 1_000_000) as u32).to_le_bytes());
        rec[4..8].copy_from_slice(&((unix_us % 1_000_000) as u32).to_le_bytes());
        rec[8..12].copy_from_slice(&(incl as u32).to_le_bytes());
        rec[12..16].copy_from_slice(&(frame.len() as u32).to_le_bytes());
        self.out.write_all(&rec)?;
        self.out.write_all(&frame[..incl])?;
        if unix_us.saturating_sub(self.last_flush_us) >= FLUSH_EVERY_US {
            self.last_flush_us = unix_us;
            self.out.flush()?;
        }
        Ok(())
    }

    /// Writes out what is buffered.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    #[test]
    fn a_capture_is_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let names: Vec<PathBuf> = (0..3)
            .map(|_| {
                let p = free_path(dir.path(), "vm1");
                PcapFile::create(&p).unwrap();
                p
            })
            .collect();
        let file = |p: &PathBuf| p.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(names.iter().map(file).collect::<Vec<_>>(), ["vm1.pcap", "vm1.1.pcap", "vm1.2.pcap"]);
        assert_eq!(free_path(dir.path(), "../x/.y"), dir.path().join("___x__y.pcap"), "a port name stays in the directory");
    }

    #[test]
    fn writes_a_pcap_that_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vm1.pcap");
        let mut p = PcapFile::create(&path).unwrap();
        p.write(1_700_000_000_123_456, &[0xaa; 60]).unwrap();
        let big = vec![0x55; SNAPLEN as usize + 10];
        p.write(1_700_000_001_000_001, &big).unwrap();
        drop(p);
        let b = std::fs::read(&path).unwrap();
        assert_eq!(u32_at(&b, 0), MAGIC_US);
        assert_eq!(u32_at(&b, 16), SNAPLEN);
        assert_eq!(u32_at(&b, 20), LINKTYPE_ETHERNET);
        assert_eq!((u32_at(&b, 24), u32_at(&b, 28)), (1_700_000_000, 123_456));
        assert_eq!((u32_at(&b, 32), u32_at(&b, 36)), (60, 60));
        assert_eq!(&b[40..100], &[0xaa; 60][..]);
        assert_eq!((u32_at(&b, 100), u32_at(&b, 104)), (1_700_000_001, 1));
        assert_eq!((u32_at(&b, 108), u32_at(&b, 112)), (SNAPLEN, SNAPLEN + 10), "cut to the snap length");
        assert_eq!(b.len(), 116 + SNAPLEN as usize);
    }
}
