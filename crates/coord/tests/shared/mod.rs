//! Helpers of both protocols' threaded test clusters (`common`,
//! `restore_common`): a seeded random generator and an ordered log.
#![allow(dead_code)]

use std::sync::Mutex;

/// xorshift64*: enough randomness for tests, reproducible per seed.
#[derive(Debug, Clone)]
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// `true` with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// What the nodes did, in one global order.
pub struct Log<A> {
    entries: Mutex<Vec<(String, A)>>,
}

impl<A> Default for Log<A> {
    fn default() -> Self {
        Log {
            entries: Mutex::new(Vec::new()),
        }
    }
}

impl<A: Clone> Log<A> {
    pub fn push(&self, node: &str, act: A) {
        self.entries.lock().unwrap().push((node.to_string(), act));
    }
    pub fn entries(&self) -> Vec<(String, A)> {
        self.entries.lock().unwrap().clone()
    }
}
