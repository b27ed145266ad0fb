//! The `guest_frames` fuzz target's property (see `crates/switch/fuzz`) on
//! a few thousand deterministic mutations of a program that reaches every
//! rule, so that CI runs it without nightly.

use vmcsnap_testkit::Rng;

use crate::testing::{exercise_guest_bytes, sample_program};

#[test]
fn the_sample_program_reaches_every_rule() {
    let run = exercise_guest_bytes(&sample_program());
    assert!(run.frames >= 8, "{run:?}");
    assert!(run.logged >= 1, "{run:?}");
    assert!(run.delivered >= 8, "{run:?}");
    assert_eq!(run.protocol_errors, 1, "{run:?}");
}

#[test]
fn mutated_programs_keep_the_invariants() {
    let base = sample_program();
    let mut rng = Rng(0x5717_c400_5eed_0003);
    let mut totals = (0, 0, 0);
    for i in 0..3000 {
        let mut b = if i % 5 == 0 {
            // Noise: random stream bytes and operations.
            (0..rng.below(600)).map(|_| rng.next() as u8).collect()
        } else {
            base.clone()
        };
        for _ in 0..=rng.below(6) {
            if b.is_empty() {
                break;
            }
            let at = rng.below(b.len());
            match rng.below(4) {
                0 => b[at] = rng.next() as u8,
                1 => b[at] ^= 1 << rng.below(8),
                2 => {
                    b.remove(at);
                }
                _ => {
                    // Splice a copy of another part of the program.
                    let from = rng.below(b.len());
                    let len = rng.below(24).min(b.len() - from);
                    let piece: Vec<u8> = b[from..from + len].to_vec();
                    b.splice(at..at, piece);
                }
            }
        }
        let run = exercise_guest_bytes(&b);
        totals.0 += run.frames;
        totals.1 += run.logged;
        totals.2 += run.protocol_errors;
    }
    assert!(
        totals.0 > 10_000 && totals.1 > 100 && totals.2 > 100,
        "{totals:?}"
    );
}
