//! Feeds arbitrary bytes from the agent's control socket to the control
//! protocol's readers: as the one request of a connection, read by the
//! agent (`vmcsnap_control::testing::exercise_request`, i.e.
//! `read_request`), or as the reply lines the CLI reads
//! (`testing::exercise_replies`). A request or reply that reads must
//! encode to one line that reads back the same; nothing may panic, hang or
//! allocate more than the input justifies.
//!
//! Input: `[mode, payload...]`, `mode % 4`: 0 = payload is a request; 1 =
//! payload is reply lines; 2 = payload is `[which, edits...]`, 6-byte
//! edits `[op, offset u32 le, value]` (ops `op % 4`: set, xor, truncate,
//! insert) applied to sample request `which`; 3 = the same edits applied
//! to the sample replies, all lines.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vmcsnap_control::testing::{
    exercise_replies, exercise_request, sample_replies, sample_requests,
};
use vmcsnap_testkit::apply_edits;

fn requests() -> &'static [Vec<u8>] {
    static R: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    R.get_or_init(sample_requests)
}

fn replies() -> &'static [u8] {
    static R: OnceLock<Vec<u8>> = OnceLock::new();
    R.get_or_init(|| sample_replies().concat())
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, payload)) = data.split_first() else {
        return;
    };
    match mode % 4 {
        0 => drop(exercise_request(payload).map_err(|e| e.to_string())),
        1 => drop(exercise_replies(payload).map_err(|e| e.to_string())),
        2 => {
            let Some((&which, edits)) = payload.split_first() else {
                return;
            };
            let r = &requests()[usize::from(which) % requests().len()];
            drop(exercise_request(&apply_edits(r, edits)).map_err(|e| e.to_string()));
        }
        _ => drop(exercise_replies(&apply_edits(replies(), payload)).map_err(|e| e.to_string())),
    }
});
