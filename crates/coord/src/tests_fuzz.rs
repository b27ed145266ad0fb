//! The `coord_messages` fuzz target's property (see `crates/coord/fuzz`)
//! on a few thousand deterministic mutations of valid message lines, so
//! that CI runs it without nightly.

use vmcsnap_testkit::Rng;

use crate::testing::{exercise_lines, sample_lines};

#[test]
fn every_sample_line_decodes() {
    let seen = exercise_lines(&sample_lines());
    // 7 + 9 lines; FAILED and ABORT have the same shape in both protocols.
    assert_eq!((seen.snapshot_msgs, seen.restore_msgs), (7 + 2, 9 + 2));
}

#[test]
fn mutated_message_lines_decode_consistently_or_are_rejected() {
    const BYTES: &[u8] = b"{}[]\":,0123456789-e.\\u \nabAZ_";
    const EPOCHS: [&str; 5] = [
        "0",
        "8",
        "18446744073709551615",
        "18446744073709551616",
        "-1",
    ];
    let lines: Vec<String> = sample_lines().lines().map(str::to_owned).collect();
    let mut rng = Rng(0xc00d_0000_5eed_0001);
    let (mut decoded, mut total) = (0, 0);
    for _ in 0..3000 {
        // A few sample lines in a random order, repeated, some edited.
        let mut text = String::new();
        for _ in 0..=rng.below(12) {
            let mut line = lines[rng.below(lines.len())].clone();
            match rng.below(4) {
                0 => {
                    let mut b = line.into_bytes();
                    for _ in 0..=rng.below(3) {
                        let at = rng.below(b.len());
                        match rng.below(3) {
                            0 => b[at] = BYTES[rng.below(BYTES.len())],
                            1 => {
                                b.remove(at);
                            }
                            _ => b.insert(at, BYTES[rng.below(BYTES.len())]),
                        }
                    }
                    line = String::from_utf8_lossy(&b).into_owned();
                }
                1 => line = line.replace("7", EPOCHS[rng.below(EPOCHS.len())]),
                _ => {}
            }
            text.push_str(&line);
            text.push('\n');
        }
        let seen = exercise_lines(&text);
        decoded += seen.snapshot_msgs + seen.restore_msgs;
        total += text.lines().count();
    }
    assert!(
        decoded > total / 3 && decoded < total,
        "{decoded} of {total}"
    );
}
