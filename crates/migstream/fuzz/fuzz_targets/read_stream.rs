//! Feeds arbitrary bytes to the stream reader. The first byte selects
//! reader options (bit 0: pages may be missing; bits 1-2: vmdesc policy;
//! bit 3: QEMU 10.0's dialect, else 7.2) and the source's read size
//! (bits 6-7), the rest is the stream.
//! Every input must end in an error or a clean end: no panic, no hang, no
//! huge allocation.
#![no_main]

use std::io::Read;

use libfuzzer_sys::fuzz_target;
use vmcsnap_migstream::{Dialect, Event, ReaderOptions, StreamReader, VmDescPolicy};

/// A source that returns at most `chunk` bytes per read, like a socket.
struct Chunked<'a> {
    data: &'a [u8],
    chunk: usize,
}

impl Read for Chunked<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.data.len().min(buf.len()).min(self.chunk);
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Ok(n)
    }
}

fuzz_target!(|input: &[u8]| {
    let Some((&sel, stream)) = input.split_first() else {
        return;
    };
    let opts = ReaderOptions {
        require_all_pages: sel & 1 == 0,
        vmdesc: match (sel >> 1) & 3 {
            0 | 3 => VmDescPolicy::Auto,
            1 => VmDescPolicy::Required,
            _ => VmDescPolicy::Optional,
        },
        max_device_state_bytes: 1 << 20,
        dialect: if sel & 8 != 0 {
            Dialect::Qemu10_0
        } else {
            Dialect::Qemu7_2
        },
        ..ReaderOptions::default()
    };
    let chunk = [1usize, 7, 4096, usize::MAX][usize::from(sel >> 6)];
    let mut reader = StreamReader::with_options(
        Chunked {
            data: stream,
            chunk,
        },
        opts,
    );
    let mut events = 0u64;
    loop {
        match reader.next_event() {
            Ok(Some(ev)) => {
                events += 1;
                if let Event::Page { data, .. } = ev {
                    assert!(!data.is_empty());
                }
            }
            Ok(None) => break,
            Err(_) => {
                assert!(reader.next_event().is_err());
                break;
            }
        }
        // Every event consumes at least one byte, or is one of the two
        // final events.
        assert!(events <= stream.len() as u64 + 3);
    }
    let _ = reader.stats();
});
