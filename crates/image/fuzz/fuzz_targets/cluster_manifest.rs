//! Feeds arbitrary bytes as `cluster.json` to the cluster manifest's
//! decoder and validation (`vmcsnap_image::testing::exercise_cluster_manifest`,
//! what `ClusterManifest::load` runs on the file's bytes): it must return an
//! error, or a valid manifest that encodes and decodes back to itself and
//! whose paths stay inside the snapshot directory; never panic, hang or
//! allocate more than the input justifies.
//!
//! Input: `[mode, payload...]`, `mode % 3`: 0 = payload is the file; 1 =
//! payload is a list of 6-byte edits `[op, offset u32 le, value]` applied
//! to a valid manifest (ops `op % 4`: set byte, xor byte, truncate at
//! offset, insert byte); 2 = payload is a list of 3-byte structural edits
//! (`vmcsnap_image::testing::edit_json`: a JSON value of the valid
//! manifest replaced by an interesting one).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vmcsnap_image::testing::{edit_json, exercise_cluster_manifest, sample_cluster_manifest};
use vmcsnap_testkit::apply_edits;

fn base() -> &'static [u8] {
    static BASE: OnceLock<Vec<u8>> = OnceLock::new();
    BASE.get_or_init(sample_cluster_manifest)
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, payload)) = data.split_first() else {
        return;
    };
    let content = match mode % 3 {
        0 => payload.to_vec(),
        1 => apply_edits(base(), payload),
        _ => edit_json(base(), payload),
    };
    let _ = exercise_cluster_manifest(&content).map_err(|e| e.to_string());
});
