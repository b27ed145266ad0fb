//! Randomized damage to valid images: open, verify and every read must
//! return errors, never panic. Deterministic (fixed seeds), a few seconds.

mod common;

use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use common::*;
use vmcsnap_image::testing::{exercise, reseal};
use vmcsnap_image::FileKind;

const FILES: [FileKind; 6] = [
    FileKind::Manifest,
    FileKind::Memory,
    FileKind::Index,
    FileKind::Zero,
    FileKind::Device,
    FileKind::Trace,
];

/// Changes a random JSON leaf of the manifest body to an awkward value.
fn mutate_json(data: &mut Vec<u8>, rng: &mut Rng) {
    let Some(nl) = data.iter().position(|&c| c == b'\n') else {
        return;
    };
    let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(&data[nl + 1..]) else {
        return;
    };
    let mut leaves = Vec::new();
    collect(&v, String::new(), &mut leaves);
    let path = &leaves[rng.below(leaves.len() as u64) as usize];
    let awkward = [
        serde_json::json!(0),
        serde_json::json!(1),
        serde_json::json!(u64::MAX),
        serde_json::json!(u32::MAX as u64 + 1),
        serde_json::json!(4095),
        serde_json::json!(-1),
        serde_json::json!("../../etc/passwd"),
        serde_json::json!("manifest"),
        serde_json::json!(""),
        serde_json::json!(null),
        serde_json::json!([]),
        serde_json::json!(rng.next() % 100_000),
    ];
    *v.pointer_mut(path).unwrap() = awkward[rng.below(awkward.len() as u64) as usize].clone();
    data.truncate(nl + 1);
    data.extend(serde_json::to_vec(&v).unwrap());
}

fn collect(v: &serde_json::Value, path: String, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => m
            .iter()
            .for_each(|(k, x)| collect(x, format!("{path}/{k}"), out)),
        serde_json::Value::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, x)| collect(x, format!("{path}/{i}"), out)),
        _ => out.push(path),
    }
}

fn mutate(kind: FileKind, data: &mut Vec<u8>, rng: &mut Rng) -> String {
    let len = data.len() as u64;
    let op = rng.below(7);
    let desc = match op {
        0 | 1 => {
            let n = 1 + rng.below(4);
            for _ in 0..n {
                let i = rng.below(len) as usize;
                data[i] ^= 1 << rng.below(8);
            }
            format!("flip {n} bits")
        }
        2 => {
            // Overwrite a field-sized run, biased towards headers and tables.
            let at = if rng.below(2) == 0 {
                rng.below(len.min(256))
            } else {
                rng.below(len)
            } as usize;
            let w = [1usize, 2, 4, 8][rng.below(4) as usize].min(data.len() - at);
            let val =
                [0u64, u64::MAX, rng.next(), 1, 0x8000_0000][rng.below(5) as usize].to_le_bytes();
            data[at..at + w].copy_from_slice(&val[..w]);
            format!("write {w} bytes at {at}")
        }
        3 => {
            let at = rng.below(len) as usize;
            data.truncate(at);
            format!("truncate at {at}")
        }
        4 => {
            let n = 1 + rng.below(64) as usize;
            data.extend((0..n).map(|_| rng.next() as u8));
            format!("append {n}")
        }
        5 if kind == FileKind::Manifest => {
            mutate_json(data, rng);
            "json leaf".into()
        }
        _ => {
            let at = rng.below(len) as usize;
            let n = (1 + rng.below(16) as usize).min(data.len() - at);
            data.drain(at..at + n);
            format!("delete {n} at {at}")
        }
    };
    // Mostly reseal, so the damage gets past the CRCs to the structure checks.
    if rng.below(4) != 0 {
        reseal(kind, data);
        format!("{desc}, resealed")
    } else {
        desc
    }
}

#[test]
fn mutated_images_never_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    build_with(
        &good,
        &[("pc.ram", 30 * PS as u64), ("vga", 9 * PS as u64 - 1)],
        4,
    );
    let originals: Vec<Vec<u8>> = FILES
        .iter()
        .map(|k| fs::read(good.join(k.default_name())).unwrap())
        .collect();
    let work = tmp.path().join("work");
    copy_dir(&good, &work);
    let deadline = Instant::now() + Duration::from_secs(4);
    // VMCSNAP_MUTATE_SEED explores other sequences; the default keeps CI deterministic.
    let seed = std::env::var("VMCSNAP_MUTATE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x9E37_79B9_7F4A_7C15u64);
    let mut rng = Rng(seed.max(1));
    let (mut runs, mut opened) = (0u32, 0u32);
    while Instant::now() < deadline && runs < 20_000 {
        let f = rng.below(FILES.len() as u64) as usize;
        let kind = FILES[f];
        let mut data = originals[f].clone();
        let mut what = Vec::new();
        for _ in 0..1 + rng.below(3) {
            if data.is_empty() {
                break;
            }
            what.push(mutate(kind, &mut data, &mut rng));
        }
        let path = work.join(kind.default_name());
        fs::write(&path, &data).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| exercise(&work)));
        match r {
            Ok(Ok(())) => opened += 1,
            Ok(Err(e)) => {
                let _ = e.to_string();
            }
            Err(_) => panic!(
                "panic on {} after {:?} (seed {seed}, run {runs})",
                kind.default_name(),
                what
            ),
        }
        fs::write(&path, &originals[f]).unwrap();
        runs += 1;
    }
    assert!(runs > 200, "only {runs} runs");
    eprintln!("{runs} mutated images, {opened} still read cleanly");
    exercise(&work).unwrap();
}
