//! Feeds arbitrary bytes to the postcopy source's return-path parser, as
//! a stream of messages: parse, consume, repeat until an error or a prefix
//! that needs more bytes. No panic, every consumed length within the
//! buffer and the message bound, and a buffer of `MAX_MESSAGE_LEN` bytes
//! always decides.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmcsnap_migstream::postcopy::return_path::{encode_message, parse_message, MAX_MESSAGE_LEN};

fuzz_target!(|input: &[u8]| {
    let mut rest = input;
    loop {
        match parse_message(rest) {
            Ok(Some((msg, n))) => {
                assert!(n >= 4 && n <= rest.len() && n <= MAX_MESSAGE_LEN);
                // Re-encoding gives back the bytes consumed.
                let mut again = Vec::new();
                encode_message(&msg, &mut again);
                assert_eq!(&again[..], &rest[..n]);
                rest = &rest[n..];
            }
            Ok(None) => {
                assert!(rest.len() < MAX_MESSAGE_LEN);
                break;
            }
            Err(e) => {
                let _ = e.to_string();
                break;
            }
        }
    }
});
