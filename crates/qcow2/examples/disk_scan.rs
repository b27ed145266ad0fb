//! Reads every allocated 4 KiB block of each file of a disk's chain and
//! reports how long it took (the work the detection layer's index does,
//! without the hashing): `cargo run --release --example disk_scan DISK`.
//! `disk_scan DISK --raw` writes the whole disk to stdout instead (to
//! compare with `qemu-img convert -O raw`).

use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: disk_scan DISK");
        std::process::exit(2);
    };
    let disk = vmcsnap_qcow2::Disk::open(path.as_ref())?;
    if std::env::args().nth(2).as_deref() == Some("--raw") {
        use std::io::Write;
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        let mut buf = vec![0u8; 1 << 20];
        let mut at = 0;
        while at < disk.len() {
            let n = (disk.len() - at).min(buf.len() as u64) as usize;
            disk.read_at(at, &mut buf[..n])?;
            out.write_all(&buf[..n])?;
            at += n as u64;
        }
        return Ok(());
    }
    for (i, l) in disk.layers().iter().enumerate() {
        let t = Instant::now();
        let mut n = 0u64;
        let mut sum = 0u64;
        for r in disk.allocated_blocks(i)? {
            let (_, data) = r?;
            n += 1;
            sum = sum.wrapping_add(u64::from(data[0]));
        }
        println!(
            "{{\"file\": {:?}, \"format\": {:?}, \"blocks\": {n}, \"ms\": {:.1}, \"check\": {sum}}}",
            l.path.display().to_string(),
            l.format.name(),
            t.elapsed().as_secs_f64() * 1000.0
        );
    }
    Ok(())
}
