//! Helpers shared by the deterministic mutation tests (unit tests, so CI
//! runs them without nightly) and the cargo-fuzz targets
//! (`crates/*/fuzz`), so that each exists once.
//!
//! - [`Rng`]: xorshift64*, seeded; a seed always gives the same sequence,
//!   so a failing iteration can be replayed.
//! - [`apply_edits`]: the fuzz targets' "6-byte edits applied to a valid
//!   input" mode.

/// xorshift64*: deterministic, no dependencies. `Rng(seed)`; the seed must
/// not be 0 (the sequence would be all zeros).
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 pseudo-random bits.
    // Not `Iterator::next`: the sequence never ends, so callers get a
    // `u64`, not an `Option`.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (`n > 0`; modulo, so very slightly biased).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// `base` with `edits` applied in order: each 6-byte chunk is `[op, offset
/// u32 le, value]` (a shorter tail is ignored). The offset is taken modulo
/// the current length + 1; `op % 4`: 0 = set the byte at the offset to
/// `value`, 1 = xor it with `value` (both do nothing at the end), 2 =
/// truncate at the offset, 3 = insert `value` at the offset.
pub fn apply_edits(base: &[u8], edits: &[u8]) -> Vec<u8> {
    let mut v = base.to_vec();
    for e in edits.chunks_exact(6) {
        let off = u32::from_le_bytes([e[1], e[2], e[3], e[4]]) as usize;
        let at = off % (v.len() + 1);
        match e[0] % 4 {
            0 if at < v.len() => v[at] = e[5],
            1 if at < v.len() => v[at] ^= e[5],
            2 => v.truncate(at),
            3 => v.insert(at, e[5]),
            _ => {}
        }
    }
    v
}

/// Runs `cmd ARGS` (a test's `qemu-img`/`qemu-io`) and panics with its
/// stderr unless it succeeds.
pub fn run_ok(cmd: &str, args: &[&str]) {
    let out = std::process::Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e} (install qemu-utils)"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sequence of one seed, as computed by the copies this crate
    /// replaced: tests that pin a seed keep exercising the same inputs.
    #[test]
    fn a_seed_gives_the_same_sequence_as_before() {
        let mut r = Rng(0x5eed_d4c9);
        let got: Vec<u64> = (0..4).map(|_| r.next()).collect();
        assert_eq!(
            got,
            [
                0xb6cb_1556_b4b0_e772,
                0x9e2f_50fc_77f5_376f,
                0xb81f_528b_b9b9_db31,
                0x388a_d0bd_9dec_15e0,
            ]
        );
        assert_eq!(r.0, 0x114b_f417_4fa4_e760);
        let mut r = Rng(0x5eed_d4c9);
        let below: Vec<usize> = (0..8).map(|_| r.below(10)).collect();
        assert_eq!(below, [8, 7, 9, 4, 4, 3, 1, 8]);
    }

    fn edit(op: u8, off: u32, value: u8) -> [u8; 6] {
        let o = off.to_le_bytes();
        [op, o[0], o[1], o[2], o[3], value]
    }

    #[test]
    fn edits_set_xor_truncate_insert() {
        let base = b"abcdef";
        assert_eq!(apply_edits(base, &[]), base);
        assert_eq!(apply_edits(base, &edit(0, 1, b'X')), b"aXcdef");
        assert_eq!(apply_edits(base, &edit(4, 1, b'X')), b"aXcdef");
        assert_eq!(apply_edits(base, &edit(1, 0, 0x20)), b"Abcdef");
        assert_eq!(apply_edits(base, &edit(2, 3, 0)), b"abc");
        assert_eq!(apply_edits(base, &edit(3, 6, b'!')), b"abcdef!");
        // Offsets wrap modulo len + 1: 13 % 7 = 6, the end; set and xor
        // there do nothing.
        assert_eq!(apply_edits(base, &edit(0, 13, b'X')), base);
        assert_eq!(apply_edits(base, &edit(1, 6, 0xff)), base);
        assert_eq!(apply_edits(base, &edit(3, 13, b'!')), b"abcdef!");
        // In order, each on the result of the previous; a short tail is
        // ignored.
        let mut edits = [edit(2, 2, 0), edit(3, 0, b'>')].concat();
        edits.extend_from_slice(&[0, 0, 0]);
        assert_eq!(apply_edits(base, &edits), b">ab");
        assert_eq!(apply_edits(b"", &edit(0, 5, 1)), b"");
        assert_eq!(apply_edits(b"", &edit(3, 5, 1)), [1]);
    }
}
