//! Feeds arbitrary bytes from guests, interleaved with switch operations,
//! to `vmcsnap_switch::testing::exercise_guest_bytes`: the stream framing
//! of `-netdev stream` (`framing::Decoder`, partial and bad length
//! prefixes, reconnects), then the core (`SwitchCore::receive`: MAC
//! learning, forwarding, DHCP interception, bounded queues) and the cut
//! session rules of the mediator (coloring, auto holds, channel-state
//! log). Nothing may panic or hang; the decoder must return exactly the
//! records fed and buffer less than one; no queue may pass its bound; no
//! post frame may reach a pre port; a session's log stays within its bound.
//!
//! Input: `[mode, payload...]`, `mode % 2`: 0 = payload is the program
//! (see `vmcsnap_switch::testing::op`); 1 = payload is a list of 6-byte
//! edits `[op, offset u32 le, value]` applied to `testing::sample_program`
//! (ops `op % 4`: set byte, xor byte, truncate at offset, insert byte).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vmcsnap_switch::testing::{exercise_guest_bytes, sample_program};
use vmcsnap_testkit::apply_edits;

fn base() -> &'static [u8] {
    static BASE: OnceLock<Vec<u8>> = OnceLock::new();
    BASE.get_or_init(sample_program)
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, payload)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        exercise_guest_bytes(payload);
        return;
    }
    let v = apply_edits(base(), payload);
    exercise_guest_bytes(&v);
});
