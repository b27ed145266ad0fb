//! Write and read a 256 MiB image and print MB/s (not a benchmark
//! harness, just numbers to look at).
//!
//! ```sh
//! cargo run --release -p vmcsnap-image --example throughput [-- --mib 256 --dir /var/tmp --cold]
//! ```
//!
//! `--cold` drops the page cache before reading (needs root); otherwise the
//! read numbers are from the page cache and measure CPU cost (CRC, copies).

use std::path::PathBuf;
use std::time::Instant;

use vmcsnap_image::{Image, ImageMeta, ImageWriter, PageKey, RamBlock};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let mib: u64 = arg("--mib").map(|s| s.parse()).transpose()?.unwrap_or(256);
    let cold = args.iter().any(|a| a == "--cold");
    let root = arg("--dir")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let tmp = tempfile::tempdir_in(&root)?;
    let dir = tmp.path().join("snap");
    let ps = 4096usize;
    let pages = (mib << 20) / ps as u64;
    let meta = ImageMeta {
        page_size: ps as u32,
        ram_blocks: vec![RamBlock {
            name: "pc.ram".into(),
            used_length: mib << 20,
        }],
        ..Default::default()
    };

    // Non-zero, non-repeating-looking pages; the page number in the first bytes.
    let mut page = vec![0u8; ps];
    for (i, b) in page.iter_mut().enumerate() {
        *b = (i * 131 % 251) as u8 | 1;
    }
    let t = Instant::now();
    let mut w = ImageWriter::create(&dir, meta)?;
    for p in 0..pages as u32 {
        page[..4].copy_from_slice(&p.to_le_bytes());
        w.add_page(0, p, &page)?;
    }
    w.set_device_state(&[1u8; 64 << 10])?;
    let c = w.commit()?;
    let secs = t.elapsed().as_secs_f64();
    let bytes = c.manifest.metrics.bytes_written.unwrap_or(0) as f64;
    println!(
        "write+commit (fsync): {mib} MiB of pages in {secs:.3} s = {:.0} MB/s",
        bytes / secs / 1e6
    );

    let drop_caches = || {
        if cold {
            if let Err(e) = std::fs::write("/proc/sys/vm/drop_caches", "1") {
                eprintln!("cannot drop caches ({e}); read numbers are warm");
            }
        }
    };
    let label = if cold { "cold" } else { "warm (page cache)" };

    drop_caches();
    let t = Instant::now();
    let img = Image::open(&dir)?;
    let mut n = 0u64;
    for b in img.iter_blocks() {
        n += b?.data.len() as u64;
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "open + read_block all, {label}: {:.3} s = {:.0} MB/s",
        secs,
        n as f64 / secs / 1e6
    );

    drop_caches();
    let t = Instant::now();
    let report = img.verify();
    let secs = t.elapsed().as_secs_f64();
    assert!(report.is_ok(), "{report}");
    println!(
        "verify, {label}: {:.3} s = {:.0} MB/s",
        secs,
        report.bytes_read as f64 / secs / 1e6
    );

    drop_caches();
    let t = Instant::now();
    let keys: Vec<PageKey> = (0..pages as u32).map(|p| PageKey::new(0, p)).collect();
    let plan = img.plan_reads(&keys, 4096, 8 << 20)?;
    let mut buf = Vec::new();
    for e in &plan.extents {
        img.read_extent(e, &mut buf)?;
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "plan_reads + read_extent (all pages, {} extents), {label}: {:.3} s = {:.0} MB/s",
        plan.extents.len(),
        secs,
        plan.bytes() as f64 / secs / 1e6
    );

    drop_caches();
    let t = Instant::now();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut out = vec![0u8; ps];
    let reads = 20_000u32;
    for _ in 0..reads {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        img.read_page(PageKey::new(0, (x % pages) as u32), &mut out)?;
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "random read_page, {label}: {reads} pages in {secs:.3} s = {:.0} pages/s",
        f64::from(reads) / secs
    );
    Ok(())
}
