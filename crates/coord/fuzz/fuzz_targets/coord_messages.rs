//! Feeds arbitrary text as lines of coordination messages from other hosts
//! to `vmcsnap_coord::testing::exercise_lines`: each line is decoded as a
//! cluster-snapshot and as a cluster-restore message; one that decodes must
//! re-encode to one line that decodes to itself, and is delivered to an
//! initiator, a peer, a restore coordinator and a cohort (epoch 7), with
//! the clock advancing and timers ticking. Nothing may panic or hang, and
//! every envelope a state machine sends must come from it.
//!
//! Input: `[mode, payload...]`, `mode % 2`: 0 = payload is the text
//! (lossily UTF-8); 1 = payload is a list of 6-byte edits `[op, offset u32
//! le, value]` applied to every message of both protocols, one per line
//! (ops `op % 4`: set byte, xor byte, truncate at offset, insert byte).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vmcsnap_coord::testing::{exercise_lines, sample_lines};
use vmcsnap_testkit::apply_edits;

fn base() -> &'static [u8] {
    static BASE: OnceLock<Vec<u8>> = OnceLock::new();
    BASE.get_or_init(|| sample_lines().into_bytes())
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, payload)) = data.split_first() else {
        return;
    };
    let text = if mode % 2 == 0 {
        String::from_utf8_lossy(payload).into_owned()
    } else {
        let v = apply_edits(base(), payload);
        String::from_utf8_lossy(&v).into_owned()
    };
    let _ = exercise_lines(&text);
});
