//! Packet capture: every frame a port passes, written to a pcapng file
//! that tcpdump, Wireshark and tshark read (see
//! [`SwitchConfig::capture_dir`](crate::SwitchConfig::capture_dir)).
//!
//! One file per port, `<capture_dir>/<port name>.pcapng` (or, if that
//! exists, from an earlier port of that name or an earlier switch,
//! `<port name>.1.pcapng`, `.2`, ...: a capture is never overwritten),
//! holding both directions as a tap on the VM's NIC would, each frame
//! marked with its direction: *outbound*, sent by the VM (time: when the
//! switch read it), or *inbound*, handed to the VM (time: when the switch
//! wrote it to its QEMU, so a held port's frames appear at their release,
//! and a replayed channel state at its replay).
//!
//! ```text
//! Section Header Block (28 bytes, little endian)
//! +----------+--------+----------+-------+-------+----------------+--------+
//! | 0A0D0D0A | len 28 | 1A2B3C4D | major | minor | section length | len 28 |
//! |          |        | (order)  | 1     | 0     | -1 (unknown)   |        |
//! +----------+--------+----------+-------+-------+----------------+--------+
//! Interface Description Block (20 bytes): one interface, the port
//! +----------+--------+--------------+----------+---------+--------+
//! | 00000001 | len 20 | linktype 1   | reserved | snaplen | len 20 |
//! |          |        | (Ethernet)   | 0        | 262144  |        |
//! +----------+--------+--------------+----------+---------+--------+
//! then per frame, an Enhanced Packet Block (44 + frame padded to 4 bytes)
//! +----------+-----+-----------+---------+---------+----------+----------+
//! | 00000006 | len | interface | ts high | ts low  | captured | original |
//! |          |     | 0         | (unix µs, 64 bits)  | length   | length   |
//! +----------+-----+-----------+---------+---------+----------+----------+
//! | frame, zero-padded to 4 | epb_flags: code 2, len 4, | end of    | len |
//! |                         | 1 inbound / 2 outbound    | options 0 |     |
//! +-------------------------+---------------------------+-----------+-----+
//! ```
//!
//! Time stamps are in microseconds (the interface's default resolution).
//! Frames longer than the snap length are cut to it (the original length
//! is kept). The file is buffered and flushed at the first frame 100 ms
//! or more after the last flush, when the port is removed and when the
//! switch stops; a capture that fails to write is closed with a warning and
//! the switch goes on.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::core::PortId;

/// Frames are cut to this many bytes.
pub const SNAPLEN: u32 = 262_144;
/// LINKTYPE_ETHERNET.
pub const LINKTYPE_ETHERNET: u16 = 1;
/// Flush when this much time has passed since the last flush.
const FLUSH_EVERY_US: u64 = 100_000;
const SHB: u32 = 0x0A0D_0D0A;
const IDB: u32 = 1;
const EPB: u32 = 6;
const BYTE_ORDER_MAGIC: u32 = 0x1A2B_3C4D;
const EPB_FLAGS: u16 = 2;

/// Which way a frame went, seen from the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Handed to the VM.
    Inbound,
    /// Sent by the VM.
    Outbound,
}

impl Direction {
    /// The epb_flags value (bits 0-1).
    pub fn flags(self) -> u32 {
        match self {
            Direction::Inbound => 1,
            Direction::Outbound => 2,
        }
    }
}

/// `<dir>/<name>.pcapng`, or the first `<dir>/<name>.<n>.pcapng` that does
/// not exist. Characters of `name` other than ASCII letters, digits, `-` and
/// `_` become `_`, so a port name cannot leave `dir`.
pub fn free_path(dir: &Path, name: &str) -> PathBuf {
    let name: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let first = dir.join(format!("{name}.pcapng"));
    if !first.exists() {
        return first;
    }
    (1u32..)
        .map(|n| dir.join(format!("{name}.{n}.pcapng")))
        .find(|p| !p.exists())
        .expect("a free name")
}

/// An open capture file.
pub struct PcapFile {
    out: BufWriter<File>,
    last_flush_us: u64,
}

impl PcapFile {
    /// Creates (or truncates) `path` and writes the section header and the
    /// interface description.
    pub fn create(path: &Path) -> io::Result<PcapFile> {
        let mut out = BufWriter::with_capacity(256 << 10, File::create(path)?);
        let mut h = Vec::with_capacity(48);
        for v in [SHB, 28, BYTE_ORDER_MAGIC] {
            h.extend_from_slice(&v.to_le_bytes());
        }
        h.extend_from_slice(&1u16.to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes());
        h.extend_from_slice(&(-1i64).to_le_bytes());
        h.extend_from_slice(&28u32.to_le_bytes());
        for v in [IDB, 20] {
            h.extend_from_slice(&v.to_le_bytes());
        }
        h.extend_from_slice(&LINKTYPE_ETHERNET.to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes());
        for v in [SNAPLEN, 20] {
            h.extend_from_slice(&v.to_le_bytes());
        }
        out.write_all(&h)?;
        out.flush()?;
        Ok(PcapFile {
            out,
            last_flush_us: 0,
        })
    }

    /// Appends `frame`, which went `dir` at `unix_us`.
    pub fn write(&mut self, unix_us: u64, dir: Direction, frame: &[u8]) -> io::Result<()> {
        let incl = frame.len().min(SNAPLEN as usize);
        let padded = incl.div_ceil(4) * 4;
        let total = (44 + padded) as u32;
        let mut head = [0u8; 28];
        for (i, v) in [
            EPB,
            total,
            0,
            (unix_us >> 32) as u32,
            unix_us as u32,
            incl as u32,
            frame.len() as u32,
        ]
        .into_iter()
        .enumerate()
        {
            head[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
        self.out.write_all(&head)?;
        self.out.write_all(&frame[..incl])?;
        self.out.write_all(&[0u8; 3][..padded - incl])?;
        let mut tail = [0u8; 16];
        tail[0..2].copy_from_slice(&EPB_FLAGS.to_le_bytes());
        tail[2..4].copy_from_slice(&4u16.to_le_bytes());
        tail[4..8].copy_from_slice(&dir.flags().to_le_bytes());
        // tail[8..12]: end of options (code 0, length 0).
        tail[12..16].copy_from_slice(&total.to_le_bytes());
        self.out.write_all(&tail)?;
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

/// The capture files of a switch, one per port, opened at the port's first
/// frame.
pub(crate) struct Captures {
    dir: PathBuf,
    /// Per port its file, or `None` once it failed (warned once, not
    /// retried).
    files: HashMap<PortId, Option<PcapFile>>,
}

impl Captures {
    pub(crate) fn new(dir: PathBuf) -> Captures {
        Captures {
            dir,
            files: HashMap::new(),
        }
    }

    /// Records `frame`, which went `dir` through `port` at `unix_us`;
    /// `name` gives the port's name the first time.
    pub(crate) fn record(
        &mut self,
        port: PortId,
        name: impl FnOnce() -> Option<String>,
        unix_us: u64,
        dir: Direction,
        frame: &[u8],
    ) {
        let slot = self.files.entry(port).or_insert_with(|| {
            let name = name().unwrap_or_else(|| format!("port{}", port.as_u32()));
            let path = free_path(&self.dir, &name);
            PcapFile::create(&path)
                .map_err(|e| {
                    log::warn!(
                        "{port}: capture to {} failed, not capturing this port: {e}",
                        path.display()
                    )
                })
                .ok()
        });
        if let Some(f) = slot {
            if let Err(e) = f.write(unix_us, dir, frame) {
                log::warn!("{port}: writing its capture failed, closing it: {e}");
                *slot = None;
            }
        }
    }

    /// Flushes and closes `port`'s file.
    pub(crate) fn close(&mut self, port: PortId) {
        if let Some(Some(mut f)) = self.files.remove(&port) {
            let _ = f.flush();
        }
    }

    /// Writes out every file's buffer.
    pub(crate) fn flush_all(&mut self) {
        for f in self.files.values_mut().flatten() {
            let _ = f.flush();
        }
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
        assert_eq!(
            names.iter().map(file).collect::<Vec<_>>(),
            ["vm1.pcapng", "vm1.1.pcapng", "vm1.2.pcapng"]
        );
        assert_eq!(
            free_path(dir.path(), "../x/.y"),
            dir.path().join("___x__y.pcapng"),
            "a port name stays in the directory"
        );
    }

    #[test]
    fn writes_a_pcapng_that_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vm1.pcapng");
        let mut p = PcapFile::create(&path).unwrap();
        let t = 1_700_000_000_123_456u64;
        p.write(t, Direction::Outbound, &[0xaa; 61]).unwrap();
        let big = vec![0x55; SNAPLEN as usize + 10];
        p.write(t + 1, Direction::Inbound, &big).unwrap();
        drop(p);
        let b = std::fs::read(&path).unwrap();
        // Section header and interface description.
        assert_eq!(
            (u32_at(&b, 0), u32_at(&b, 4), u32_at(&b, 8), u32_at(&b, 24)),
            (SHB, 28, BYTE_ORDER_MAGIC, 28)
        );
        assert_eq!(
            (
                u32_at(&b, 28),
                u32_at(&b, 32),
                u32_at(&b, 36),
                u32_at(&b, 40),
                u32_at(&b, 44)
            ),
            (IDB, 20, 1, SNAPLEN, 20)
        );
        // First frame: 61 bytes padded to 64, outbound.
        let e = 48;
        assert_eq!((u32_at(&b, e), u32_at(&b, e + 4)), (EPB, 44 + 64));
        let ts = ((u32_at(&b, e + 12) as u64) << 32) | u32_at(&b, e + 16) as u64;
        assert_eq!(ts, t);
        assert_eq!((u32_at(&b, e + 20), u32_at(&b, e + 24)), (61, 61));
        assert_eq!(&b[e + 28..e + 89], &[0xaa; 61][..]);
        assert_eq!(&b[e + 89..e + 92], &[0, 0, 0], "zero padding");
        assert_eq!(
            (u32_at(&b, e + 92), u32_at(&b, e + 96), u32_at(&b, e + 100)),
            (2 | 4 << 16, 2, 0)
        );
        assert_eq!(u32_at(&b, e + 104), 44 + 64, "trailing length");
        // Second: cut to the snap length, inbound.
        let e = e + 108;
        assert_eq!(
            (u32_at(&b, e + 20), u32_at(&b, e + 24)),
            (SNAPLEN, SNAPLEN + 10),
            "cut to the snap length"
        );
        let o = e + 28 + SNAPLEN as usize;
        assert_eq!(u32_at(&b, o + 4), 1, "inbound");
        assert_eq!(b.len(), o + 16);
    }
}
