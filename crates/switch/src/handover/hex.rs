//! Serde helpers for the byte fields of a frozen state: a lowercase hex
//! string in human-readable formats (JSON stays compact and greppable), raw
//! bytes in binary formats. Use with `#[serde(with = "hex")]` on `Vec<u8>`
//! and `#[serde(with = "hex::seq")]` on `Vec<Vec<u8>>`.

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

const DIGITS: &[u8; 16] = b"0123456789abcdef";

fn encode(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

fn decode(s: &str) -> Result<Vec<u8>, String> {
    fn nibble(c: u8) -> Option<u8> {
        (c as char).to_digit(16).map(|d| d as u8)
    }
    if s.len() % 2 != 0 {
        return Err(format!("hex string of odd length {}", s.len()));
    }
    s.as_bytes()
        .chunks(2)
        .map(|pair| match (nibble(pair[0]), nibble(pair[1])) {
            (Some(hi), Some(lo)) => Ok(hi << 4 | lo),
            _ => Err(format!(
                "invalid hex digits {:?}",
                String::from_utf8_lossy(pair)
            )),
        })
        .collect()
}

/// Serializes `bytes` (see the module docs).
pub(crate) fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
    if s.is_human_readable() {
        s.serialize_str(&encode(bytes))
    } else {
        s.serialize_bytes(bytes)
    }
}

struct BytesVisitor;

impl<'de> Visitor<'de> for BytesVisitor {
    type Value = Vec<u8>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a hex string or bytes")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Vec<u8>, E> {
        decode(v).map_err(E::custom)
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
        Ok(v.to_vec())
    }

    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
        Ok(v)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(b) = seq.next_element()? {
            out.push(b);
        }
        Ok(out)
    }
}

/// Deserializes what [`serialize`] wrote (also accepts a sequence of bytes).
pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    if d.is_human_readable() {
        d.deserialize_str(BytesVisitor)
    } else {
        d.deserialize_byte_buf(BytesVisitor)
    }
}

/// The same for a sequence of byte strings.
pub(crate) mod seq {
    use super::*;

    #[derive(Serialize)]
    struct Ser<'a>(#[serde(with = "super")] &'a [u8]);

    #[derive(Deserialize)]
    struct De(#[serde(with = "super")] Vec<u8>);

    /// Serializes each element like [`super::serialize`].
    pub(crate) fn serialize<S: Serializer>(items: &[Vec<u8>], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(items.iter().map(|b| Ser(b)))
    }

    /// Deserializes what [`serialize`] wrote.
    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<u8>>, D::Error> {
        Ok(Vec::<De>::deserialize(d)?
            .into_iter()
            .map(|b| b.0)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct T {
        #[serde(with = "super")]
        one: Vec<u8>,
        #[serde(with = "super::seq")]
        many: Vec<Vec<u8>>,
    }

    #[test]
    fn json_is_hex_and_round_trips() {
        let t = T {
            one: vec![0x00, 0xab, 0xff],
            many: vec![vec![], vec![1, 0x10]],
        };
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(json, r#"{"one":"00abff","many":["","0110"]}"#);
        assert_eq!(serde_json::from_str::<T>(&json).unwrap(), t);
        assert_eq!(decode("ABcd").unwrap(), vec![0xab, 0xcd]);
    }

    #[test]
    fn bad_hex_is_rejected() {
        for bad in [
            r#"{"one":"abc","many":[]}"#,
            r#"{"one":"zz","many":[]}"#,
            r#"{"one":"+1","many":[]}"#,
        ] {
            assert!(serde_json::from_str::<T>(bad).is_err(), "{bad}");
        }
    }
}
