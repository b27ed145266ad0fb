//! Output of `snapshots delete` and `snapshots prune`.

use anyhow::Result;
use vmcsnap_control::{RemovedSnapshot, SnapshotKind, SnapshotsDeleteResult};

/// Bytes in the largest binary unit below them, one decimal.
fn size(bytes: u64) -> String {
    let units = [(30, "GiB"), (20, "MiB"), (10, "KiB")];
    match units.iter().find(|(shift, _)| bytes >= 1u64 << shift) {
        Some((shift, unit)) => format!("{:.1} {unit}", bytes as f64 / (1u64 << shift) as f64),
        None => format!("{bytes} bytes"),
    }
}

/// What a removed snapshot was of.
fn of(r: &RemovedSnapshot) -> String {
    match (r.kind, &r.of) {
        (SnapshotKind::Vm, Some(vm)) => format!("VM {vm}"),
        (SnapshotKind::Cluster, Some(c)) => format!("cluster snapshot of {c}"),
        (SnapshotKind::Vm, None) => "invalid snapshot".into(),
        (SnapshotKind::Cluster, None) => "invalid cluster snapshot".into(),
    }
}

/// Prints `r` as JSON, or one line per snapshot removed (or, dry run, to
/// remove), the frozen disks kept and the space freed.
pub fn removal(r: &SnapshotsDeleteResult, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(r)?);
        return Ok(());
    }
    let verb = if r.dry_run { "would remove" } else { "removed" };
    for s in &r.removed {
        println!("{verb} {} ({}), {}", s.name, of(s), size(s.bytes_freed));
    }
    for c in &r.merged {
        println!("rewrote {c} without its removed parent (it restores as before)");
    }
    for d in &r.kept_in_use {
        println!(
            "kept {}: a running VM's disk or another snapshot's frozen disk reads from it (`vmcsnap gc` removes it once unused)",
            d.display()
        );
    }
    if !r.kept.is_empty() {
        println!("kept {}", r.kept.join(", "));
    }
    if r.removed.is_empty() {
        println!("nothing to remove");
    } else if r.dry_run {
        println!("would free {} (nothing was removed)", size(r.bytes_freed));
    } else {
        println!("freed {}", size(r.bytes_freed));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_read_in_their_unit() {
        assert_eq!(super::size(0), "0 bytes");
        assert_eq!(super::size(1536), "1.5 KiB");
        assert_eq!(super::size(100 << 20), "100.0 MiB");
        assert_eq!(super::size(3 << 30), "3.0 GiB");
    }
}
