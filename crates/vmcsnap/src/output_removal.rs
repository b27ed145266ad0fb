//! Output of `snapshots delete` and `snapshots prune`.

use anyhow::Result;
use vmcsnap_control::{RemovedSnapshot, SnapshotKind, SnapshotsDeleteResult};

/// Bytes as MiB with one decimal.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
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
        println!("{verb} {} ({}), {}", s.name, of(s), mib(s.bytes_freed));
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
        println!("would free {} (nothing was removed)", mib(r.bytes_freed));
    } else {
        println!("freed {}", mib(r.bytes_freed));
    }
    Ok(())
}
