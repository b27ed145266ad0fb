//! Human and JSON output.

use anyhow::{Context, Result};
use vmcsnap_agent::image::PauseBreakdown;
use vmcsnap_control::{
    ClockOutcome, ClockSync, RecoverResult, RejuvenateResult, Response, RestoreReport,
    RestoreRunning, SnapshotMetrics, SnapshotReport, StatusResult, UpResult,
};

/// An optional figure as a table cell: `-` for none. (A
/// `serde_json::Value`'s `Display` ignores width and alignment: `{:>8}`
/// printed 383 unpadded and broke the columns of the restore table; cells
/// go through a `String`.)
pub fn cell<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

/// Prints `v` as JSON if `json`, else runs `human`.
pub fn json_or<T: serde::Serialize>(json: bool, v: &T, human: impl FnOnce()) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(v)?);
    } else {
        human();
    }
    Ok(())
}

/// The table printed by `up`.
pub fn up(r: &UpResult) {
    println!("cluster {} is up", r.cluster);
    println!(
        "{:<12} {:>8} {:>8} {:<5} {:<16} MAC",
        "VM", "PID", "BOOT_MS", "ACCEL", "IP"
    );
    for v in &r.vms {
        println!(
            "{:<12} {:>8} {:>8} {:<5} {:<16} {}",
            v.name, v.pid, v.boot_ms, v.accel, v.ip, v.mac
        );
    }
}

/// The table printed by `status`.
pub fn status(s: &StatusResult, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
        return Ok(());
    }
    let Some(name) = &s.cluster else {
        println!("no cluster is up");
        return Ok(());
    };
    println!(
        "cluster {name} ({}), agent pid {}",
        s.accel.as_deref().unwrap_or("?"),
        s.agent_pid
    );
    let loading = s.vms.iter().any(|v| v.load.is_some());
    if let Some(b) = &s.busy {
        if loading {
            println!(
                "busy: {} for {:.1} s: the restored guests run, the rest of their pages loads (other commands wait for it)",
                b.request, b.for_s
            );
        } else {
            println!(
                "busy: {} for {:.1} s (VM states below are from before it began)",
                b.request, b.for_s
            );
        }
    }
    println!(
        "{:<12} {:>8} {:<10} {:<16} {:>7} {:>9} {:>21}",
        "VM", "PID", "STATE", "IP", "MEM_MIB", "UPTIME_S", "PAGES_LOADED"
    );
    for v in &s.vms {
        let load = v.load.map_or("-".to_string(), |l| {
            format!(
                "{}/{} ({} left)",
                l.pages_loaded,
                l.pages_total,
                l.pages_total - l.pages_loaded
            )
        });
        println!(
            "{:<12} {:>8} {:<10} {:<16} {:>7} {:>9.1} {:>21}",
            v.name, v.pid, v.state, v.ip, v.memory_mib, v.uptime_s, load
        );
    }
    if let Some(sw) = &s.switch {
        println!();
        println!(
            "{:<12} {:>10} {:>12} {:>10} {:>12} {:>6}",
            "PORT", "RX_FRAMES", "RX_BYTES", "TX_FRAMES", "TX_BYTES", "DROPS"
        );
        for p in &sw.ports {
            let c = &p.counters;
            println!(
                "{:<12} {:>10} {:>12} {:>10} {:>12} {:>6}",
                p.name, c.rx_frames, c.rx_bytes, c.tx_frames, c.tx_bytes, c.drops
            );
        }
    }
    Ok(())
}

/// The table printed by `rejuvenate`.
pub fn rejuvenate(v: &RejuvenateResult) {
    println!(
        "{:<12} {:<6} {:>8} {:>12} {:>9} {:>11} {:>9} {:>12} {:>7}",
        "VM",
        "MODE",
        "MEM_MIB",
        "DOWNTIME_MS",
        "SAVE_MS",
        "RESTART_MS",
        "LOAD_MS",
        "STATE_BYTES",
        "HELD"
    );
    for r in &v.reports {
        println!(
            "{:<12} {:<6} {:>8} {:>12.1} {:>9.1} {:>11.1} {:>9.1} {:>12} {:>7}",
            r.vm,
            r.mode.name(),
            r.memory_mib,
            r.downtime_ms,
            r.save_ms,
            r.restart_ms,
            r.load_ms,
            r.state_bytes,
            r.frames_held
        );
    }
    for r in v.reports.iter().filter(|r| r.fell_back_to_old_binary) {
        println!(
            "{}: the new QEMU could not take over ({}); the VM runs on the kept copy of its previous QEMU{}",
            r.vm,
            r.fallback_reason.as_deref().unwrap_or("no reason given"),
            r.qemu
                .as_ref()
                .map(|q| format!(" ({})", q.display()))
                .unwrap_or_default()
        );
    }
    println!("total {:.1} ms", v.total_ms);
}

/// `rejuvenate --resume|--rollback`: which VMs started again, on what.
pub fn recovered(v: &RecoverResult) {
    for r in &v.recovered {
        let how = match r.how {
            vmcsnap_control::Recover::Resume => "resume",
            vmcsnap_control::Recover::Rollback => "rollback",
        };
        println!(
            "{}: started again ({how} of a failed {}) on {}{}, pid {}",
            r.vm,
            r.intent,
            r.qemu.display(),
            if r.on_kept_copy {
                " (the kept copy of its previous QEMU)"
            } else {
                ""
            },
            r.pid
        );
    }
}

/// The line printed by `snapshot`.
pub fn snapshot(v: &SnapshotReport) {
    println!(
        "snapshot {} of {} ({}): downtime {:.1} ms, disk snapshot {:.1} ms, total {:.1} ms, {} MiB stream at {:.0} MB/s, {} pages written by the guest",
        v.name,
        v.vm,
        v.mode,
        v.downtime_ms,
        v.disk_snapshot_ms,
        v.duration_ms,
        v.stream_bytes >> 20,
        v.stream_mb_per_s,
        v.pages_guest_written
    );
    if let Some(p) = &v.pause {
        println!("  pause: {}", pause_parts(p));
    }
    match v.incremental_to() {
        Err(why) => println!("  full: {why}"),
        Ok(p) => println!("  incremental to {p}"),
    }
    println!("  {}", v.path.display());
}

/// A pause breakdown on one line: `stop 0.4 + disk_snapshot 5.1 + ... =
/// 12.3 ms`.
pub fn pause_parts(b: &PauseBreakdown) -> String {
    let parts: Vec<String> = b
        .parts
        .iter()
        .map(|p| format!("{} {:.1}", p.name, p.us as f64 / 1000.0))
        .collect();
    format!(
        "{} = {:.1} ms",
        parts.join(" + "),
        b.total_us as f64 / 1000.0
    )
}

/// `snapshots`: the committed snapshots under `root`.
pub fn snapshots(root: &std::path::Path, json: bool) -> Result<()> {
    use crate::views::{ClusterSnapshotRow, SnapshotRow, SnapshotsView};
    let entries = if root.exists() {
        vmcsnap_agent::image::list_snapshots(root)?
    } else {
        vec![]
    };
    let clusters = crate::output_cluster::entries(root)?;
    let view = SnapshotsView {
        cluster_snapshots: clusters.iter().map(ClusterSnapshotRow::of).collect(),
        root,
        snapshots: entries.iter().map(SnapshotRow::of).collect(),
    };
    if json {
        println!("{}", serde_json::to_string(&view)?);
        return Ok(());
    }
    let (rows, clusters) = (&view.snapshots, &view.cluster_snapshots);
    if rows.is_empty() && clusters.is_empty() {
        println!("no snapshots in {}", root.display());
        return Ok(());
    }
    for c in clusters {
        match c {
            ClusterSnapshotRow::Valid(c) => println!(
                "{:<32} cluster {} ({}), VMs {}, {} frames of channel state",
                c.name,
                c.cluster,
                c.mode,
                c.vms.join(","),
                c.channel_state_frames
            ),
            ClusterSnapshotRow::Invalid(c) => {
                println!("{:<32} INVALID cluster snapshot: {}", c.name, c.error)
            }
        }
    }
    if rows.is_empty() {
        return Ok(());
    }
    println!(
        "{:<32} {:<10} {:<10} {:>11} {:>11} {:>12}",
        "NAME", "VM", "MODE", "DOWNTIME_MS", "DURATION_MS", "BYTES"
    );
    for r in rows {
        match r {
            SnapshotRow::Valid(r) => println!(
                "{:<32} {:<10} {:<10} {:>11} {:>11} {:>12}",
                r.name,
                r.vm,
                r.mode.unwrap_or("?"),
                cell(r.downtime_ms),
                cell(r.duration_ms),
                cell(r.bytes_written)
            ),
            SnapshotRow::Invalid(r) => println!("{:<32} INVALID: {}", r.name, r.error),
        }
    }
    Ok(())
}

/// `inspect`: manifest, page statistics, FAFL length; with `verify`, every
/// CRC (fails naming each bad block).
pub fn inspect(dir: &std::path::Path, verify: bool, json: bool) -> Result<()> {
    use crate::views::{BlockBytes, InspectView, ParentView, StatsView, VerifyView};
    let img = vmcsnap_agent::frozen_disks::open_image(dir)
        .with_context(|| format!("snapshot {}", dir.display()))?;
    let st = img.stats();
    let mut sizes: Vec<u32> = img.blocks().iter().map(|b| b.stored_len).collect();
    sizes.sort_unstable();
    let size_at = |q: f64| {
        sizes
            .get(((sizes.len().max(1) - 1) as f64 * q) as usize)
            .copied()
            .unwrap_or(0)
    };
    let stream_bytes = SnapshotMetrics::read(&img.manifest().metrics.other).stream_bytes;
    // Everything a restore checks: every block, every page through the
    // chain of parents and the frozen disks, the page hashes.
    let report = verify.then(|| img.verify());
    // Every disk of the VM frozen, each a file of this snapshot.
    let own_disks: Vec<String> = if verify {
        vmcsnap_agent::disk_set::own_disk_problems(dir, img.manifest())
            .iter()
            .map(ToString::to_string)
            .collect()
    } else {
        vec![]
    };
    let into = restores_into(&img.manifest().qemu.version);
    let block_bytes = BlockBytes {
        max: size_at(1.0),
        median: size_at(0.5),
        min: size_at(0.0),
    };
    let v = InspectView {
        fafl_len: img.fafl().len(),
        format: img.version().to_string(),
        manifest: img.manifest(),
        parent: img.manifest().parent.as_ref().map(|p| ParentView {
            depth: p.depth,
            name: &p.name,
        }),
        path: dir,
        restores_into: &into,
        stats: StatsView::new(&st, block_bytes, stream_bytes),
        verify: report.as_ref().map(|r| VerifyView::new(r, &own_disks)),
    };
    let ratio = v.stats.compression_ratio;
    if json {
        println!("{}", serde_json::to_string(&v)?);
    } else {
        let m = img.manifest();
        println!("snapshot {}", dir.display());
        println!("  image id   {}", m.image_id);
        println!(
            "  vm         {} (qemu {}, machine {})",
            m.vm.name, m.qemu.version, m.qemu.machine
        );
        println!("  created    {} (unix ms)", m.created_unix_ms);
        for b in &m.ram_blocks {
            println!("  ram block  {} ({} MiB)", b.name, b.used_length >> 20);
        }
        for d in &m.disks {
            println!("  disk       {} {} {}", d.node, d.format, d.path);
        }
        for (k, l) in &m.labels {
            println!("  label      {k}={l}");
        }
        println!("  metrics    {}", serde_json::to_string(&m.metrics)?);
        if let Some(b) = &m.metrics.pause {
            println!("  pause      {}", pause_parts(b));
        }
        println!(
            "  pages      {} total: {} stored, {} duplicate, {} in parent, {} on disk, {} zero, {} absent",
            st.pages_total, st.pages_stored, st.pages_duplicate, st.pages_in_parent, st.pages_on_disk, st.pages_zero, st.pages_absent
        );
        if let Some(p) = &m.parent {
            println!(
                "  parent     {} (chain depth {}): incremental, restores through it",
                p.name, p.depth
            );
        }
        let codec = m.storage.as_ref().map_or("none", |s| s.codec.as_str());
        println!(
            "  storage    format {}, {codec}: {} blocks ({} hot, {} compressed; {}/{}/{} bytes min/median/max), ratio {ratio:.2}",
            img.version(), st.blocks, st.blocks_hot, st.blocks_compressed, size_at(0.0), size_at(0.5), size_at(1.0)
        );
        let stream = stream_bytes.map_or(String::new(), |b| {
            format!(
                " ({:.2}x of QEMU's {b} stream bytes)",
                st.total_bytes as f64 / b.max(1) as f64
            )
        });
        println!(
            "  bytes      {} memory image, {} total{stream}",
            st.memory_bytes, st.total_bytes
        );
        println!(
            "  device     {} bytes ({})",
            st.device_state_bytes, m.device_state_format
        );
        println!("  fafl       {} pages", img.fafl().len());
        println!(
            "  qemu       {}",
            restores_into_line(&m.qemu.version, &into)
        );
        if let Some(r) = &report {
            println!("  verify     {r}");
        }
    }
    if let Some(first) = own_disks.first() {
        anyhow::bail!(
            "snapshot {} failed verification: its disks are not all its own: {first}",
            dir.display()
        );
    }
    if let Some(r) = report {
        if !r.is_ok() {
            let first = r.first_problem().unwrap_or_default();
            anyhow::bail!(
                "snapshot {} failed verification: {} bad blocks, {} bad pages, {} other problems; first: {first}",
                dir.display(),
                r.bad_blocks.len(),
                r.bad_pages_total,
                r.other.len()
            );
        }
    }
    Ok(())
}

/// The QEMU releases (`"7.2"`, `"10.0"`) a snapshot taken under QEMU
/// `version` restores into (docs/qemu-upgrade-restore.md).
pub(crate) fn restores_into(version: &str) -> Vec<&'static str> {
    vmcsnap_agent::restore::versions::restores_into(version)
        .into_iter()
        .map(|d| d.release())
        .collect()
}

pub(crate) fn restores_into_line(version: &str, into: &[&str]) -> String {
    match into {
        [] => {
            format!("taken under QEMU {version:?}, which vmcsnap does not know: restores nowhere")
        }
        [one] => format!("taken under {version}: restores into QEMU {one} only"),
        many => format!(
            "taken under {version}: restores into QEMU {}",
            many.join(" and ")
        ),
    }
}

/// `restore`: the report as JSON, or in words: once the guest runs
/// (pages still loading), or the full report.
pub fn restore(json: bool, r: Response) -> Result<()> {
    match r {
        Response::RestoreRunning(v) => json_or(json, &v, || restore_running(&v)),
        other => {
            let v = vmcsnap_control::expect_response!(other, Response::Restore)?;
            json_or(json, &v, || restore_report(&v))
        }
    }
}

fn restore_running(v: &RestoreRunning) {
    println!(
        "restored {} from {} ({}{}): guest running after {:.1} ms",
        v.vm,
        v.snapshot,
        v.mode,
        if v.paused { ", paused" } else { "" },
        v.restore_latency_ms,
    );
    println!(
        "  {} of {} pages loaded at the start; the rest loads in the background (`vmcsnap status` shows how far; --wait returns once every page is in)",
        v.pages_loaded, v.pages_total
    );
    if let Some(c) = &v.clock {
        println!("  guest clock: {}", clock_line(c));
    }
}

fn restore_report(v: &RestoreReport) {
    println!(
        "restored {} from {} ({}{}): guest running after {:.1} ms",
        v.vm,
        v.snapshot,
        v.mode,
        if v.paused { ", paused" } else { "" },
        v.restore_latency_ms,
    );
    let first_10s: u64 = v.demand_faults_per_100ms.iter().sum();
    println!(
        "  {:>18} {:>12} {:>14} {:>14} {:>12}",
        "pages before start", "MiB read", "demand faults", "in first 10 s", "full load"
    );
    println!(
        "  {:>18} {:>12.1} {:>14} {:>14} {:>9.0} ms",
        v.ws_pages,
        v.bytes_read_before_start as f64 / 1048576.0,
        v.demand_faults,
        first_10s,
        v.full_load_ms
    );
    println!(
        "  working set: wss {} (sample {}, snapshot {}){}",
        v.wss,
        v.wss_sample.map_or("-".to_string(), |n| n.to_string()),
        v.wss_snapshot,
        if v.learned {
            ", learned from an earlier restore"
        } else {
            ""
        }
    );
    println!("  access data: {}", v.access_data);
    if let Some(q) = &v.quality {
        println!(
            "  hit rate {:.2}, accuracy {:.2}: {} of {} loaded pages used, {} missed, in the {:.0} ms to the full load",
            q.hit_rate, q.accuracy, q.used, q.loaded, q.missed, q.window_ms
        );
    }
    if let Some(n) = v.next_wss {
        println!("  next workingset restore loads {n} pages first (learned, bounded)");
    }
    if let Some(c) = &v.clock {
        println!("  guest clock: {}", clock_line(c));
    }
}

/// A restored guest's clock, in words.
pub fn clock_line(c: &ClockSync) -> String {
    let ms = |v: Option<f64>| v.map_or("?".to_string(), |v| format!("{v:+.0} ms"));
    match c.outcome {
        ClockOutcome::Set => format!(
            "set to the host's by {} (it was {} off, now {})",
            c.method.as_deref().unwrap_or("?"),
            ms(c.offset_before_ms),
            ms(c.offset_after_ms)
        ),
        ClockOutcome::NoAgent => "not set: no guest agent (it keeps the snapshot's time)".into(),
        ClockOutcome::Paused => "not set: the VM is paused".into(),
        ClockOutcome::Failed => format!("not set: {}", c.error.as_deref().unwrap_or("?")),
    }
}

/// `analyze-ws`: hit rate and accuracy of the snapshot's FAFL working set
/// against its newest traced restore.
pub fn analyze_ws(dir: &std::path::Path, json: bool) -> Result<()> {
    use vmcsnap_agent::restore::traces;
    let img = vmcsnap_agent::frozen_disks::open_image(dir)
        .with_context(|| format!("snapshot {}", dir.display()))?;
    let Some(trace) = traces::newest(dir, |r| r.trace) else {
        anyhow::bail!(
            "snapshot {} has no traced restore: run `vmcsnap restore {} --mode lazy --trace --no-background` first",
            dir.display(),
            dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
        );
    };
    // The snapshot's own queue (written pages, then accessed ones where the
    // host kernel recorded them), as a first restore would use it.
    let inputs = vmcsnap_agent::restore::ws_inputs::read(&img, dir);
    let (sample, wss) = (inputs.wss_sample, inputs.hybrid());
    let factors = [0.25, 0.5, 0.7, 1.0, 1.5, 2.0];
    let accesses = trace.fault_keys();
    let queue = inputs.queue;
    let rows = vmcsnap_workingset::analyze(&queue, &accesses, wss, &factors);
    let v = crate::views::AnalyzeWsView {
        access_data: inputs.access.to_string(),
        fafl: &rows,
        snapshot: dir,
        trace_pages: accesses.len(),
        trace_unix_ms: trace.unix_ms,
        wss,
        wss_sample: sample,
        wss_snapshot: inputs.wss_snapshot,
    };
    json_or(json, &v, || {
        println!(
            "FAFL working set of {} (computed WSS {wss} pages) against a trace of {} first accesses:",
            dir.display(),
            accesses.len()
        );
        println!(
            "  {:>6} {:>8} {:>9} {:>9}",
            "x WSS", "pages", "hit rate", "accuracy"
        );
        for q in &rows {
            println!(
                "  {:>6.2} {:>8} {:>9.3} {:>9.3}{}",
                q.factor,
                q.size,
                q.hit_rate,
                q.accuracy,
                if q.trace_long_enough {
                    ""
                } else {
                    "  (trace shorter than 1.2 x size)"
                }
            );
        }
    })
}

#[cfg(test)]
mod tests {
    use super::cell;

    #[test]
    fn cells_take_width() {
        assert_eq!(format!("{:>8}", cell(Some(383))), "     383");
        assert_eq!(format!("{:<6}|", cell(Some("warm"))), "warm  |");
        assert_eq!(cell(None::<u64>), "-");
        assert_eq!(cell(Some(1.5)), "1.5");
    }
}
