//! Feeds arbitrary datagrams to a tunnel's receiving end
//! (`vmcsnap_switch::tunnel::decode`, then `SeqWindow::observe`): nothing
//! may panic, a datagram that decodes encodes back to the same bytes, and
//! no (incarnation, seq) is ever delivered twice; `missing_below` stays
//! below the number it is asked about.
//!
//! Input: datagrams, each `[len, bytes...]` (`len` bytes follow, fewer at
//! the end of the input).
#![no_main]

use std::collections::HashSet;

use libfuzzer_sys::fuzz_target;
use vmcsnap_switch::tunnel::{decode, encode, SeqVerdict, SeqWindow};

fuzz_target!(|data: &[u8]| {
    let mut window = SeqWindow::new();
    let mut delivered = HashSet::new();
    let mut rest = data;
    while let Some((&len, tail)) = rest.split_first() {
        let n = (len as usize).min(tail.len());
        let (datagram, next) = tail.split_at(n);
        rest = next;
        let Ok((header, payload)) = decode(datagram) else {
            continue;
        };
        let mut again = Vec::new();
        encode(&header, payload, &mut again);
        assert_eq!(again, datagram);
        match window.observe(header.incarnation, header.seq) {
            SeqVerdict::New { .. } | SeqVerdict::Late => {
                assert!(
                    delivered.insert((header.incarnation, header.seq)),
                    "delivered twice"
                );
            }
            SeqVerdict::Duplicate | SeqVerdict::Stale => {}
        }
        // What a post keepalive's receiver waits for: bounded, and never
        // more than the numbers below it.
        if let Some(missing) = window.missing_below(header.incarnation, header.seq) {
            assert!(
                missing <= header.seq.saturating_sub(1),
                "{missing} missing below {}",
                header.seq
            );
        }
    }
});
