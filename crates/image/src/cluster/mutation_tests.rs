//! The `cluster_manifest` fuzz target's property (see
//! `crates/image/fuzz`) on a few thousand deterministic mutations of a
//! valid `cluster.json`, so that CI runs it without nightly.

use vmcsnap_testkit::Rng;

use crate::testing::{edit_json, exercise_cluster_manifest, sample_cluster_manifest};

#[test]
fn the_sample_manifest_is_valid() {
    let m = exercise_cluster_manifest(&sample_cluster_manifest()).unwrap();
    assert_eq!(m.vms.len(), 3);
}

#[test]
fn mutated_manifests_decode_consistently_or_fail_cleanly() {
    let base = sample_cluster_manifest();
    let mut rng = Rng(0xc105_7e55_0000_0001);
    let (mut ok, mut err) = (0, 0);
    for i in 0..4000 {
        let doc = match i % 3 {
            // Byte edits: set, xor, delete or insert a few bytes.
            0 => {
                let mut b = base.clone();
                for _ in 0..=rng.below(3) {
                    let at = rng.below(b.len());
                    match rng.below(4) {
                        0 => b[at] = rng.next() as u8,
                        1 => b[at] ^= 1 << rng.below(8),
                        2 => {
                            b.remove(at);
                        }
                        _ => b.insert(at, b"{}[]\",:0123456789.-e\\"[rng.below(21)]),
                    }
                }
                b
            }
            // Structural edits: values replaced by interesting ones.
            _ => {
                let edits: Vec<u8> = (0..3 * (1 + rng.below(3)))
                    .map(|_| rng.next() as u8)
                    .collect();
                edit_json(&base, &edits)
            }
        };
        match exercise_cluster_manifest(&doc) {
            Ok(_) => ok += 1,
            Err(e) => {
                assert!(!e.to_string().is_empty());
                err += 1;
            }
        }
    }
    assert!(ok > 50 && err > 1000, "ok {ok}, err {err}");
}
