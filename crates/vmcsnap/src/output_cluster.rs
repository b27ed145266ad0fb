//! Human and JSON output of cluster snapshots.

use crate::views::{ClusterInspectView, ClusterVerifyView, VmChecked};
use anyhow::{Context, Result};
use vmcsnap_agent::image::cluster::{
    check_cluster_committed, list_cluster_snapshots, ClusterSnapshotEntry,
};
use vmcsnap_control::{
    ClockSync, ClusterRestoreMode, ClusterRestoreReport, ClusterRunning, ClusterSnapshotMetrics,
    ClusterSnapshotReport, Response,
};

/// `snapshot --cluster`: the report as JSON, or a table per VM and the
/// cluster's backoff and switch accounting.
pub fn json_or_snapshot(json: bool, v: &ClusterSnapshotReport) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(v)?);
        return Ok(());
    }
    println!(
        "cluster snapshot {} ({}) of {}: {}",
        v.name,
        v.mode,
        v.cluster,
        v.path.display()
    );
    println!(
        "{:<10} {:>9} {:>9} {:>9} {:>10} {:>10} {:>9} {:>8} {:>9} {:>9}",
        "VM",
        "PAUSE_MS",
        "PAUSED@",
        "RESUMED@",
        "TRANSIENT@",
        "COMPLETE@",
        "SETTLE_MS",
        "DRAINED",
        "RETRANS",
        "PP_GAP_MS"
    );
    for r in &v.vms {
        let retrans = match (r.retrans_before, r.retrans_after) {
            (Some(b), Some(a)) => format!("+{}", a.saturating_sub(b)),
            _ => "?".into(),
        };
        println!(
            "{:<10} {:>9.1} {:>9.1} {:>9.1} {:>10.1} {:>10.1} {:>9} {:>8} {:>9} {:>9}",
            r.vm,
            r.downtime_ms,
            r.pause_start_ms,
            r.pause_end_ms,
            r.transient_done_ms,
            r.complete_ms,
            // The wait for QEMU to hand the guest everything (cut probes);
            // "!" when it did not within the bound.
            format!(
                "{:.1}{}",
                r.settle_us as f64 / 1000.0,
                if r.unsettled { "!" } else { "" }
            ),
            r.frames_drained_at_cut,
            retrans,
            r.pingpong_max_gap_ms.map_or("-".into(), |g| g.to_string()),
        );
    }
    println!("(times in ms since the request)");
    for r in &v.vms {
        if let Some(p) = &r.pause {
            println!("  {} pause: {}", r.vm, crate::output::pause_parts(p));
        }
    }
    let b = &v.backoff;
    println!(
        "TCP backoff: {:.1} ms average over {} communicating pairs, {:.1} ms max",
        b.avg_ms,
        b.pairs.len(),
        b.max_ms
    );
    let s = &v.switch;
    println!(
        "switch: {} forwarded, {} held, {} logged ({} bytes), {} dropped, {} violations, {} drain-bound hits, {} unsettled cuts",
        s.forwarded,
        s.held,
        s.logged,
        s.logged_bytes,
        s.dropped,
        s.violations,
        s.bound_hits,
        s.unsettled_cuts
    );
    for e in &v.edges {
        println!("  W({}, {}) = {} frames", e.from, e.to, e.frames);
    }
    println!("took {:.0} ms", v.duration_ms);
    Ok(())
}

/// `inspect` of a cluster snapshot; `verify` checks every VM's image and
/// the channel-state file.
pub fn inspect(dir: &std::path::Path, verify: bool, json: bool) -> Result<()> {
    let m = check_cluster_committed(dir)
        .with_context(|| format!("cluster snapshot {}", dir.display()))?;
    let mut problems = Vec::new();
    let mut checked = Vec::new();
    let mut qemu_lines = Vec::new();
    if verify {
        for vm in &m.vms {
            let vdir = dir.join(&vm.snapshot);
            match vmcsnap_agent::frozen_disks::open_image(&vdir) {
                Ok(img) => {
                    let r = img.verify();
                    if !r.is_ok() {
                        problems.push(format!("VM {}: {r}", vm.name));
                    }
                    for e in vmcsnap_agent::disk_set::own_disk_problems(&vdir, img.manifest()) {
                        problems.push(format!("VM {}: {e}", vm.name));
                    }
                    let version = &img.manifest().qemu.version;
                    let into = crate::output::restores_into(version);
                    qemu_lines.push(format!(
                        "  qemu       {}: {}",
                        vm.name,
                        crate::output::restores_into_line(version, &into)
                    ));
                    checked.push(VmChecked {
                        ok: r.is_ok(),
                        pages_checked: r.pages_checked,
                        restores_into: into,
                        vm: vm.name.clone(),
                    });
                }
                Err(e) => problems.push(format!("VM {}: {e}", vm.name)),
            }
        }
        let log = dir.join(&m.channel_state.file);
        match vmcsnap_agent::image::channel_log::read_channel_log(&log) {
            Ok(frames) if frames.len() as u64 == m.channel_state.frames => {}
            Ok(frames) => problems.push(format!(
                "channel state holds {} frames, cluster.json says {}",
                frames.len(),
                m.channel_state.frames
            )),
            Err(e) => problems.push(format!("channel state: {e}")),
        }
    }
    if json {
        let v = ClusterInspectView {
            manifest: &m,
            path: dir,
            verify: verify.then(|| ClusterVerifyView {
                ok: problems.is_empty(),
                problems: problems.clone(),
                vms: checked,
            }),
        };
        println!("{}", serde_json::to_string(&v)?);
    } else {
        println!(
            "cluster snapshot {} ({}) of cluster {}",
            m.name, m.mode, m.cluster
        );
        println!("  created    {} (unix ms)", m.created_unix_ms);
        let t0 = m.vms.iter().map(|v| v.timeline.start_us).min().unwrap_or(0);
        let ms = |us: u64| us.saturating_sub(t0) as f64 / 1000.0;
        for v in &m.vms {
            let t = &v.timeline;
            println!(
                "  vm         {:<10} {} MiB {:<18} paused {:.1}-{:.1} ms, transient {:.1} ms, complete {:.1} ms",
                v.name,
                v.memory_mib,
                v.ip,
                ms(t.pause_start_us),
                ms(t.pause_end_us),
                ms(t.transient_done_us),
                ms(t.complete_us)
            );
        }
        println!(
            "  channel    {} frames, {} bytes in {}",
            m.channel_state.frames, m.channel_state.bytes, m.channel_state.file
        );
        for e in &m.edges {
            println!(
                "  W({}, {}) = {} frames, {} bytes",
                e.from, e.to, e.frames, e.bytes
            );
        }
        if let Some(b) = ClusterSnapshotMetrics::read(&m.metrics).backoff {
            // As JSON writes them (80.0 stays "80.0").
            let ms = |v: f64| serde_json::to_string(&v).unwrap_or_default();
            println!(
                "  backoff    avg {} ms, max {} ms",
                ms(b.avg_ms),
                ms(b.max_ms)
            );
        }
        for l in &qemu_lines {
            println!("{l}");
        }
        if verify {
            println!(
                "  verify     {}",
                if problems.is_empty() {
                    "ok".to_string()
                } else {
                    problems.join("; ")
                }
            );
        }
    }
    if !problems.is_empty() {
        anyhow::bail!(
            "cluster snapshot {} failed verification: {}",
            dir.display(),
            problems.join("; ")
        );
    }
    Ok(())
}

/// The cluster snapshots under `root`, for `snapshots`.
pub fn entries(root: &std::path::Path) -> Result<Vec<ClusterSnapshotEntry>> {
    if !root.exists() {
        return Ok(vec![]);
    }
    list_cluster_snapshots(root).with_context(|| format!("listing {}", root.display()))
}

/// `restore --cluster`: the report as JSON, or per VM its latency, backoff
/// and disruption in start order.
pub fn json_or_restore(json: bool, r: Response) -> Result<()> {
    match r {
        Response::ClusterRunning(v) => crate::output::json_or(json, &v, || running(&v)),
        other => {
            let v = vmcsnap_control::expect_response!(other, Response::ClusterRestore)?;
            crate::output::json_or(json, &v, || restored(&v))
        }
    }
}

/// The heading of both answers.
fn heading(
    cluster: &str,
    snapshot: &str,
    mode: ClusterRestoreMode,
    quiet_ms: u64,
    line: &[String],
) {
    println!(
        "cluster {cluster} restored from {snapshot} ({mode}; after each start only demand faults for {quiet_ms} ms)"
    );
    println!("restore line (planned): {}", line.join(" < "));
}

/// Every guest runs, pages still load.
fn running(v: &ClusterRunning) {
    heading(
        &v.cluster,
        &v.snapshot,
        v.mode,
        v.start_quiet_ms,
        &v.restore_line,
    );
    println!("{:<10} {:>10}", "VM", "LATENCY_MS");
    for r in &v.vms {
        println!("{:<10} {:>10.1}", r.vm, r.latency_ms);
    }
    println!(
        "every guest runs after {:.1} ms; the rest of the pages loads in the background (`vmcsnap status` shows how far; --wait returns once every page is in, with the full report)",
        v.running_ms
    );
    print_guest_clocks(&v.guest_clocks);
}

/// The full report.
fn restored(v: &ClusterRestoreReport) {
    heading(
        &v.cluster,
        &v.snapshot,
        v.mode,
        v.start_quiet_ms,
        &v.restore_line,
    );
    println!(
        "{:<10} {:>10} {:>10} {:>13} {:>8} {:>11} {:>7} {:>8} {:>8} {:>5} {:>11}",
        "VM",
        "LATENCY_MS",
        "BACKOFF_MS",
        "DISRUPTION_MS",
        "WSS",
        "PAGES_FIRST",
        "FAULTS",
        "REPLAYED",
        "RETRANS",
        "LOST",
        "GUEST_GAP_MS"
    );
    for r in &v.vms {
        let retrans = match (r.retrans_first, r.retrans_later) {
            (Some(a), Some(b)) => format!("+{}", b.saturating_sub(a)),
            _ => "?".into(),
        };
        let gap = r
            .guest_max_gap_ms
            .map_or("-".to_string(), |g| g.to_string());
        // At most this many segments lost across the restore: the
        // retransmissions no duplicate SACK answered (the others were a slow
        // peer). Guests without `dsack=`: the tail loss probes that repaired one.
        let lost = r
            .lost_segments
            .or(r.tcp_growth.tlp_recovered)
            .map_or("?".to_string(), |n| n.to_string());
        println!(
            "{:<10} {:>10.1} {:>10.1} {:>13.1} {:>8} {:>11} {:>7} {:>8} {:>8} {:>5} {:>11}",
            r.vm,
            r.latency_ms,
            r.backoff_ms,
            r.disruption_ms,
            r.wss,
            r.pages_before_start,
            r.demand_faults,
            r.frames_replayed,
            retrans,
            lost,
            gap
        );
    }
    println!(
        "backoff avg {:.1} ms, median {:.1} ms, max {:.1} ms; disruption avg {:.1} ms; starts follow dependencies: {}",
        v.backoff_avg_ms,
        v.backoff_median_ms,
        v.backoff_max_ms,
        v.disruption_avg_ms,
        v.starts_follow_dependencies
    );
    println!(
        "every guest running after {:.1} ms, every page loaded after {:.1} ms",
        v.running_ms,
        v.full_load_ms.unwrap_or(0.0)
    );
    print_guest_clocks(&v.guest_clocks);
}

/// One line per VM: its guest clock after the restore.
fn print_guest_clocks(clocks: &[ClockSync]) {
    for c in clocks {
        println!("  {} guest clock: {}", c.vm, crate::output::clock_line(c));
    }
}

/// `inspect --rdg`: the restore dependency graph and what `hotrestore-rl`
/// makes of it; `dot` gets the Graphviz picture.
pub fn rdg(dir: &std::path::Path, dot: Option<&std::path::Path>, json: bool) -> Result<()> {
    let r = vmcsnap_agent::cluster_restore::dependency_report(dir)?;
    if let Some(path) = dot {
        std::fs::write(path, &r.dot).with_context(|| format!("writing {}", path.display()))?;
        let png = path.with_extension("png");
        match std::process::Command::new("dot")
            .arg("-Tpng")
            .arg("-o")
            .arg(&png)
            .arg(path)
            .status()
        {
            Ok(s) if s.success() => eprintln!("wrote {} and {}", path.display(), png.display()),
            _ => eprintln!(
                "wrote {} (install graphviz for a PNG: dot -Tpng)",
                path.display()
            ),
        }
    }
    if json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!(
        "restore dependency graph of {} ({} VMs)",
        r.snapshot,
        r.vms.len()
    );
    if r.edges.is_empty() {
        println!("  no edges: no frame was in flight between two VMs at the cut");
    }
    for (from, to, w) in &r.edges {
        println!("  {from} -> {to}  W = {w} frames ({to} must run before {from} starts)");
    }
    for ring in &r.rings {
        println!("  ring:    {} (start together)", ring.join(", "));
    }
    if !r.orphans.is_empty() {
        println!("  orphans: {}", r.orphans.join(", "));
    }
    let order: Vec<String> = r.causal_order.iter().map(|g| g.join("+")).collect();
    println!("  causal order (rules 1-6): {}", order.join(" < "));
    println!("{:<12} {:>10} {:>10}", "VM", "WSS_PAGES", "REVISED");
    for v in &r.vms {
        println!(
            "{:<12} {:>10} {:>10}",
            v,
            r.sizes.get(v).copied().unwrap_or(0),
            r.revised.get(v).copied().unwrap_or(0)
        );
    }
    println!(
        "  LP objective sum|S*-S| = {} pages; restore line: {}",
        r.lp_objective,
        r.restore_line.join(" < ")
    );
    Ok(())
}
