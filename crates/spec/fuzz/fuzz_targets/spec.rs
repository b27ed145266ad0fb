//! Feeds arbitrary text as a cluster spec to
//! `vmcsnap_spec::testing::exercise_spec` (`ClusterSpec::from_toml_str`
//! and its validation, then every accessor): it must return an error, or a
//! spec whose numbers are usable (a boot deadline that does not overflow,
//! guest RAM in bytes), whose workloads expand, and that survives the JSON
//! round trip; never panic, hang or allocate more than the input justifies.
//!
//! Input: `[mode, payload...]`, `mode % 3`: 0 = payload is the spec (as
//! UTF-8, lossily); 1 = payload is a list of 6-byte edits `[op, offset u32
//! le, value]` applied to a valid spec (ops `op % 4`: set byte, xor byte,
//! truncate at offset, insert byte); 2 = payload is a list of 3-byte
//! structural edits (`vmcsnap_spec::testing::edit_toml`: a TOML value of
//! the valid spec replaced by an interesting one, e.g. `boot_timeout_s =
//! 9223372036854775807`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmcsnap_spec::testing::{edit_toml, exercise_spec, sample_spec};
use vmcsnap_testkit::apply_edits;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, payload)) = data.split_first() else {
        return;
    };
    let text = match mode % 3 {
        0 => String::from_utf8_lossy(payload).into_owned(),
        1 => {
            let v = apply_edits(sample_spec().as_bytes(), payload);
            String::from_utf8_lossy(&v).into_owned()
        }
        _ => edit_toml(sample_spec(), payload),
    };
    let _ = exercise_spec(&text).map_err(|e| e.to_string());
});
