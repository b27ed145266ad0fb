//! The `spec` fuzz target's property (see `crates/spec/fuzz`) on a few
//! thousand deterministic mutations of a valid spec, so that CI runs it
//! without nightly.

use vmcsnap_testkit::Rng;

use crate::testing::{edit_toml, exercise_spec, sample_spec};

#[test]
fn the_sample_spec_is_valid() {
    let s = exercise_spec(sample_spec()).unwrap();
    assert_eq!(s.vm.len(), 4);
}

#[test]
fn mutated_specs_parse_consistently_or_fail_cleanly() {
    let base = sample_spec();
    let mut rng = Rng(0x5bec_f00d_0000_0001);
    let (mut ok, mut err) = (0, 0);
    for i in 0..4000 {
        let text = match i % 3 {
            // Byte edits (kept UTF-8: the agent reads the spec as a string).
            0 => {
                const BYTES: &[u8] = b"=[]{}\"'#.,\n 0123456789-_az";
                let mut b = base.as_bytes().to_vec();
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
                String::from_utf8_lossy(&b).into_owned()
            }
            // Structural edits: values replaced by interesting ones.
            _ => {
                let edits: Vec<u8> = (0..3 * (1 + rng.below(3)))
                    .map(|_| rng.next() as u8)
                    .collect();
                edit_toml(base, &edits)
            }
        };
        match exercise_spec(&text) {
            Ok(_) => ok += 1,
            Err(e) => {
                assert!(!e.to_string().is_empty());
                err += 1;
            }
        }
    }
    assert!(ok > 50 && err > 1000, "ok {ok}, err {err}");
}
