//! Block compression (format v2): which codec, and compressing and
//! decompressing one block payload.
//!
//! A block's payload (its pages, in slot order) is compressed as one unit:
//! LZ4's block format ([`Codec::Lz4`], no frame, no checksum: the block CRC
//! covers the stored bytes, and each page's CRC the bytes decompressed) or
//! one Zstandard frame ([`Codec::Zstd`]). A payload that does not shrink is
//! stored as is ([`Codec::None`] for that block). Decompression never
//! allocates more than the block's declared raw length, which the reader
//! bounds by `pages_per_block × page_size`.

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

use crate::format::{COMPRESSION_LZ4, COMPRESSION_NONE, COMPRESSION_ZSTD};

/// Why a payload could not be decompressed (the reader turns it into a
/// [`crate::ReadError`] naming the block).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CodecError {
    /// The codec number is not one this build knows.
    #[error("compression codec {0} is unknown to this build")]
    Unknown(u8),
    /// The stored bytes do not decompress.
    #[error("{codec} data does not decompress: {reason}")]
    Corrupt {
        /// The codec.
        codec: Codec,
        /// What the decoder said.
        reason: String,
    },
    /// The bytes decompressed to another length than declared.
    #[error("{codec} data decompressed to {found} bytes, the block declares {expected}")]
    Length {
        /// The codec.
        codec: Codec,
        /// Declared raw length.
        expected: usize,
        /// Decompressed length.
        found: usize,
    },
    /// A codec name that is not `none`, `lz4` or `zstd`.
    #[error("unknown compression {0:?}: use none, lz4 or zstd")]
    BadName(String),
}

/// A block compression codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Codec {
    /// Stored as is.
    None,
    /// LZ4 block format: the fastest on both ends.
    Lz4,
    /// Zstandard level 1 (the default): 30% smaller than LZ4 on a real
    /// VM's memory, and no slower end to end on the machines measured
    /// (`bench/storage_redis.py`, `bench/storage.py`).
    #[default]
    Zstd,
}

impl Codec {
    /// The number stored in block headers.
    pub fn id(self) -> u8 {
        match self {
            Codec::None => COMPRESSION_NONE,
            Codec::Lz4 => COMPRESSION_LZ4,
            Codec::Zstd => COMPRESSION_ZSTD,
        }
    }

    /// The codec of a stored number.
    pub fn from_id(id: u8) -> Result<Codec, CodecError> {
        match id {
            COMPRESSION_NONE => Ok(Codec::None),
            COMPRESSION_LZ4 => Ok(Codec::Lz4),
            COMPRESSION_ZSTD => Ok(Codec::Zstd),
            other => Err(CodecError::Unknown(other)),
        }
    }

    /// Its name (`none`, `lz4`, `zstd`).
    pub fn name(self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Lz4 => "lz4",
            Codec::Zstd => "zstd",
        }
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Codec {
    type Err = CodecError;
    fn from_str(s: &str) -> Result<Codec, CodecError> {
        match s {
            "none" => Ok(Codec::None),
            "lz4" => Ok(Codec::Lz4),
            "zstd" => Ok(Codec::Zstd),
            other => Err(CodecError::BadName(other.into())),
        }
    }
}

/// Zstandard level: 1 is the fastest "real" level, and memory pages gain
/// little from higher ones (bench/storage.py measures it).
pub const ZSTD_LEVEL: i32 = 1;

/// Compresses `raw` with `codec` into `out` (cleared first). Returns the
/// codec actually used: [`Codec::None`] (and `out` left empty) if the
/// result would not be smaller than `raw`.
pub fn compress(codec: Codec, raw: &[u8], out: &mut Vec<u8>) -> Codec {
    out.clear();
    match codec {
        Codec::None => return Codec::None,
        Codec::Lz4 => {
            out.resize(lz4_flex::block::get_maximum_output_size(raw.len()), 0);
            match lz4_flex::block::compress_into(raw, out) {
                Ok(n) => out.truncate(n),
                Err(_) => out.clear(),
            }
        }
        Codec::Zstd => {
            out.resize(zstd::zstd_safe::compress_bound(raw.len()), 0);
            match zstd::bulk::compress_to_buffer(raw, out, ZSTD_LEVEL) {
                Ok(n) => out.truncate(n),
                Err(_) => out.clear(),
            }
        }
    }
    if out.is_empty() || out.len() >= raw.len() {
        out.clear();
        return Codec::None;
    }
    codec
}

/// Decompresses `stored` into `out`, which must be exactly the declared raw
/// length (the decoder never writes past it).
pub fn decompress(codec: Codec, stored: &[u8], out: &mut [u8]) -> Result<(), CodecError> {
    let n = match codec {
        Codec::None => {
            if stored.len() != out.len() {
                return Err(CodecError::Length {
                    codec,
                    expected: out.len(),
                    found: stored.len(),
                });
            }
            out.copy_from_slice(stored);
            stored.len()
        }
        Codec::Lz4 => {
            lz4_flex::block::decompress_into(stored, out).map_err(|e| CodecError::Corrupt {
                codec,
                reason: e.to_string(),
            })?
        }
        Codec::Zstd => {
            zstd::bulk::decompress_to_buffer(stored, out).map_err(|e| CodecError::Corrupt {
                codec,
                reason: e.to_string(),
            })?
        }
    };
    if n != out.len() {
        return Err(CodecError::Length {
            codec,
            expected: out.len(),
            found: n,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        (0..64 * 1024u32)
            .map(|i| if i % 4096 < 1000 { (i / 7) as u8 } else { 0 })
            .collect()
    }

    #[test]
    fn round_trip_every_codec() {
        let raw = sample();
        for codec in [Codec::Lz4, Codec::Zstd] {
            let mut c = Vec::new();
            assert_eq!(compress(codec, &raw, &mut c), codec);
            assert!(c.len() < raw.len() / 2, "{codec}: {}", c.len());
            let mut back = vec![0u8; raw.len()];
            decompress(codec, &c, &mut back).unwrap();
            assert_eq!(back, raw);
            assert_eq!(Codec::from_id(codec.id()).unwrap(), codec);
            assert_eq!(codec.name().parse::<Codec>().unwrap(), codec);
        }
    }

    #[test]
    fn incompressible_is_stored_raw() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let raw: Vec<u8> = (0..8192)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let mut c = Vec::new();
        assert_eq!(compress(Codec::Lz4, &raw, &mut c), Codec::None);
        assert!(c.is_empty());
    }

    #[test]
    fn bad_data_and_wrong_lengths_are_errors() {
        let raw = sample();
        for codec in [Codec::Lz4, Codec::Zstd] {
            let mut c = Vec::new();
            compress(codec, &raw, &mut c);
            // Declared too short or too long.
            let mut short = vec![0u8; raw.len() - 1];
            assert!(decompress(codec, &c, &mut short).is_err());
            let mut long = vec![0u8; raw.len() + 4096];
            assert!(matches!(
                decompress(codec, &c, &mut long),
                Err(CodecError::Length { .. }) | Err(CodecError::Corrupt { .. })
            ));
            // Truncated and garbage input.
            let mut out = vec![0u8; raw.len()];
            assert!(decompress(codec, &c[..c.len() / 2], &mut out).is_err());
            assert!(decompress(codec, &[0xff; 64], &mut out).is_err());
        }
        assert_eq!(Codec::from_id(9), Err(CodecError::Unknown(9)));
        assert!("gzip".parse::<Codec>().is_err());
    }
}
