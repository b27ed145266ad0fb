//! Truncation at every offset, garbage, and randomized mutations of real
//! streams: always an error or a clean end, never a panic or a hang.

mod common;

use std::time::{Duration, Instant};

use common::encoder::small_stream;
use common::{collect, drain, fixture, Rng};
use vmcsnap_migstream::{ReaderOptions, StreamError, VmDescPolicy};

/// Offset where the device state starts in `stream` (from a clean read).
fn device_offset(stream: &[u8]) -> usize {
    collect(stream).unwrap().device_offset as usize
}

/// Every proper prefix of `stream` must fail with an error naming the cut
/// as the end: `Truncated` up to the device state (and inside the header of
/// its first section), `BadStreamEnd` inside it.
fn check_prefix(stream: &[u8], cut: usize, dev: usize) {
    let err = drain(&stream[..cut], ReaderOptions::default())
        .unwrap_or_else(|| panic!("prefix of {cut} of {} bytes was accepted", stream.len()));
    match err {
        StreamError::Truncated { end, offset, .. } if cut < dev + 64 => {
            assert_eq!(end, cut as u64, "cut {cut}: {err}");
            assert!(offset <= end);
        }
        StreamError::BadStreamEnd { end, .. } if cut > dev => assert_eq!(end, cut as u64),
        e => panic!("cut {cut} (device state at {dev}): unexpected {e}"),
    }
}

#[test]
fn truncation_at_every_offset_of_a_small_stream() {
    let (stream, _) = small_stream();
    let dev = device_offset(&stream);
    for cut in 0..stream.len() {
        check_prefix(&stream, cut, dev);
    }
}

#[test]
fn truncation_of_a_real_stream() {
    let stream = fixture("precopy-paused");
    let dev = device_offset(&stream);
    let n = stream.len();
    // Every offset of the header, setup and first records, around the
    // device state start and the end; a stride elsewhere.
    let cuts = (0..300)
        .chain((dev - 40)..(dev + 40))
        .chain((n - 120)..n)
        .chain((0..n).step_by(499));
    for cut in cuts {
        check_prefix(&stream, cut, dev);
    }
}

#[test]
fn truncation_without_vmdesc_never_panics() {
    // Without a VM description a cut inside the device state just after a
    // 0x00 byte looks like a complete stream (see VmDescPolicy); the rest
    // must still fail cleanly.
    let stream = fixture("precopy-bare");
    let dev = device_offset(&stream);
    let opts = ReaderOptions {
        vmdesc: VmDescPolicy::Optional,
        ..ReaderOptions::default()
    };
    for cut in (0..stream.len())
        .step_by(307)
        .chain((dev - 50..stream.len()).step_by(13))
    {
        let r = drain(&stream[..cut], opts.clone());
        if cut < dev {
            assert!(r.is_some(), "cut {cut} accepted");
        }
    }
}

#[test]
fn garbage_is_an_error() {
    let mut rng = Rng(0x9e3779b97f4a7c15);
    for len in [0usize, 1, 3, 8, 9, 100, 5000] {
        for _ in 0..50 {
            let junk: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            assert!(drain(&junk, ReaderOptions::default()).is_some());
            // Valid header and config, then junk.
            let mut s = b"QEVM\0\0\0\x03\x07\0\0\0\x07microvm".to_vec();
            s.extend_from_slice(&junk);
            assert!(drain(&s, ReaderOptions::default()).is_some());
        }
    }
}

/// One random mutation of `s`.
fn mutate(rng: &mut Rng, s: &mut Vec<u8>) {
    match rng.below(6) {
        0 => {
            // flip a few bytes
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(s.len());
                s[i] ^= 1 << rng.below(8);
            }
        }
        1 => {
            let i = rng.below(s.len());
            s[i] = rng.next() as u8;
        }
        2 => {
            // overwrite a be32/be64 with an extreme value
            let i = rng.below(s.len().saturating_sub(8).max(1));
            let v = [0u64, 1, 0xff, 0xffff_ffff, u64::MAX, 1 << 40][rng.below(6)];
            let n = if rng.below(2) == 0 { 4 } else { 8 };
            let bytes = v.to_be_bytes();
            for k in 0..n.min(s.len() - i) {
                s[i + k] = bytes[8 - n + k];
            }
        }
        3 => {
            // delete a range
            let i = rng.below(s.len());
            let n = 1 + rng.below(64.min(s.len() - i));
            s.drain(i..i + n);
        }
        4 => {
            // duplicate a range
            let i = rng.below(s.len());
            let n = 1 + rng.below(4200.min(s.len() - i));
            let chunk = s[i..i + n].to_vec();
            let at = rng.below(s.len());
            s.splice(at..at, chunk);
        }
        _ => {
            let cut = rng.below(s.len());
            s.truncate(cut);
        }
    }
}

#[test]
fn mutated_real_streams() {
    let sources = [
        fixture("precopy-paused"),
        fixture("bgsnap-ignore-shared"),
        fixture("precopy-bare"),
        small_stream().0,
    ];
    let mut rng = Rng(0x2545f4914f6cdd1d);
    let start = Instant::now();
    let (mut runs, mut ok) = (0, 0);
    // Bounded in count and in time.
    while runs < 1500 && start.elapsed() < Duration::from_secs(5) {
        let mut s = sources[runs % sources.len()].clone();
        for _ in 0..1 + rng.below(3) {
            if s.is_empty() {
                break;
            }
            mutate(&mut rng, &mut s);
        }
        if drain(&s, ReaderOptions::default()).is_none() {
            ok += 1;
        }
        runs += 1;
    }
    assert!(runs >= 100, "only {runs} runs");
    eprintln!("{runs} mutated streams, {ok} still read to the end");
}
