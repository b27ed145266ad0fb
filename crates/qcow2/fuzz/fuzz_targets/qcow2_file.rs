//! Feeds arbitrary bytes as a qcow2 file (the top of a frozen disk chain)
//! and reads it: open, every layer's allocated blocks, and reads at a few
//! offsets. Nothing may panic, hang or allocate without bound. The first
//! input byte picks a small backing file (none, a raw file, or a valid
//! qcow2) that the fuzzed header may name as `base.img`.
#![no_main]

use std::fs;
use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vmcsnap_qcow2::Disk;

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("vmcsnap-qcow2-fuzz-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    })
}

fuzz_target!(|data: &[u8]| {
    if data.is_empty() {
        return;
    }
    let d = dir();
    let base = d.join("base.img");
    match data[0] % 2 {
        0 => {
            let _ = fs::remove_file(&base);
        }
        _ => fs::write(&base, vec![0x5au8; 64 << 10]).unwrap(),
    }
    let top = d.join("top.qcow2");
    fs::write(&top, &data[1..]).unwrap();
    let Ok(disk) = Disk::open(&top) else {
        return;
    };
    let len = disk.len();
    let mut buf = vec![0u8; 4096];
    for off in [0, len / 2, len.saturating_sub(4096), len, u64::MAX - 4095] {
        let _ = disk.read_at(off, &mut buf);
    }
    for layer in 0..disk.layers().len() {
        if let Ok(blocks) = disk.allocated_blocks(layer) {
            for b in blocks.take(4096) {
                let _ = b;
            }
        }
    }
});
