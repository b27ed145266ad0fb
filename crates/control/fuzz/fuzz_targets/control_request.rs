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

fn requests() -> &'static [Vec<u8>] {
    static R: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    R.get_or_init(sample_requests)
}

fn replies() -> &'static [u8] {
    static R: OnceLock<Vec<u8>> = OnceLock::new();
    R.get_or_init(|| sample_replies().concat())
}

fn edit(mut v: Vec<u8>, edits: &[u8]) -> Vec<u8> {
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
            drop(exercise_request(&edit(r.clone(), edits)).map_err(|e| e.to_string()));
        }
        _ => drop(exercise_replies(&edit(replies().to_vec(), payload)).map_err(|e| e.to_string())),
    }
});
