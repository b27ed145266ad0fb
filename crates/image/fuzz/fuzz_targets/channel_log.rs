//! Feeds arbitrary bytes to the channel-state parser
//! (`vmcsnap_image::testing::exercise_channel_log`): it must return an
//! error or frames that encode back to the same records, never panic, hang
//! or allocate more than the input justifies.
//!
//! Input: `[mode, payload...]`, `mode % 4`:
//! 0 = payload is the file; 1 = payload with its CRCs recomputed; 2 =
//! payload is a list of 6-byte edits `[op, offset u32 le, value]` applied
//! to a valid log of a few frames; 3 = edits, then CRCs recomputed. Edit
//! ops (`op % 4`): set byte, xor byte, truncate at offset, insert byte.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vmcsnap_image::testing::{exercise_channel_log, reseal_channel_log};
use vmcsnap_image::{encode_channel_log, ChannelFrame, FrameReason};
use vmcsnap_testkit::apply_edits;

fn base() -> &'static [u8] {
    static BASE: OnceLock<Vec<u8>> = OnceLock::new();
    BASE.get_or_init(|| {
        let vms = ["alpha", "beta", "gamma"];
        let frames: Vec<ChannelFrame> = (0..5usize)
            .map(|i| ChannelFrame {
                sender: vms[i % 3].into(),
                receiver: vms[(i + 1) % 3].into(),
                received_unix_us: 1_000 + i as u64,
                delivered_unix_us: 2_000 + i as u64,
                reason: if i % 2 == 0 { FrameReason::HeldAtCut } else { FrameReason::InFlight },
                data: vec![i as u8; 14 + i * 9],
            })
            .collect();
        encode_channel_log(&frames).unwrap()
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, payload)) = data.split_first() else {
        return;
    };
    let content = match mode % 4 {
        0 => payload.to_vec(),
        1 => {
            let mut v = payload.to_vec();
            reseal_channel_log(&mut v);
            v
        }
        mode => {
            let mut v = apply_edits(base(), payload);
            if mode == 3 {
                reseal_channel_log(&mut v);
            }
            v
        }
    };
    let _ = exercise_channel_log(&content).map_err(|e| e.to_string());
});
