//! Feeds arbitrary bytes as a snapshot's `access/accessed.json` to what a
//! restore does with it (`vmcsnap_workingset::access::exercise`: parse
//! against a VM of two RAM blocks, list the pages, encode and parse back):
//! it must return an error or pages the VM has, each once; never panic,
//! hang or allocate more than the VM's page count justifies.
//!
//! Input: `[b0, b1, payload...]`: the first RAM block has
//! `1 + u16(b0, b1) % 4096` pages, the second 4; the payload is the file.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [b0, b1, payload @ ..] = data else {
        return;
    };
    let first = 1 + u32::from(u16::from_le_bytes([*b0, *b1])) % 4096;
    let _ = vmcsnap_workingset::access::exercise(payload, &[first, 4]);
});
