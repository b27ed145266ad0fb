//! What a cluster restore measured: per VM its restore latency, start
//! time, HotRestore's backoff approximation and disruption; for the
//! cluster their average, median and maximum.

use std::time::{Duration, Instant};

use vmcsnap_image::cluster::ClusterManifest;

use super::{ClusterRestoreReport, ClusterRunning, Plan, VmRestoreReport, VmRunning};
use crate::cluster_snapshot::{GuestView, TcpCounters};
use crate::guest_counters;
use crate::member::Member;
use crate::restore;

/// How long to wait for the restored guests' console stat lines (one per
/// second) to read their TCP retransmission counters.
const GUEST_STAT_WAIT: Duration = Duration::from_millis(3500);
/// How much longer to wait for a guest that has not printed a single stat
/// line yet (a guest starved of CPU right after its start; seen in CI: no
/// line from one of four guests within 3.5 s), so that every guest's
/// counters are measured.
const GUEST_FIRST_STAT_WAIT: Duration = Duration::from_secs(20);
/// How long after its first reading an image VM's guest agent is read
/// again (the time three stat lines of a lab guest take).
const GUEST_AGENT_LATER: Duration = Duration::from_secs(3);

/// The answer once every guest runs, from their start times (unix µs).
pub fn running(
    m: &ClusterManifest,
    plan: &Plan,
    opts: &super::Options,
    starts: &std::collections::BTreeMap<String, u64>,
    start_unix_us: u64,
) -> ClusterRunning {
    let mut vms: Vec<VmRunning> = starts
        .iter()
        .map(|(vm, &us)| VmRunning {
            vm: vm.clone(),
            latency_ms: us.saturating_sub(start_unix_us) as f64 / 1000.0,
            started_unix_us: us,
        })
        .collect();
    vms.sort_by(|a, b| a.latency_ms.total_cmp(&b.latency_ms));
    let n = vms.len().max(1) as f64;
    ClusterRunning {
        snapshot: m.name.clone(),
        cluster: m.cluster.clone(),
        mode: opts.mode,
        start_quiet_ms: opts.start_quiet.as_millis() as u64,
        start_order: vms.iter().map(|v| v.vm.clone()).collect(),
        restore_line: plan.line.clone(),
        latency_avg_ms: vms.iter().map(|v| v.latency_ms).sum::<f64>() / n,
        running_ms: vms.iter().map(|v| v.latency_ms).fold(0.0, f64::max),
        full_load_ms: None,
        loading: true,
        guest_clocks: vec![],
        vms,
    }
}

/// Builds the report from the restored VMs (member, restore report, guest
/// start in unix µs, frames replayed).
pub fn build(
    m: &ClusterManifest,
    plan: &Plan,
    opts: &super::Options,
    restored: &[(Member, restore::Report, Option<u64>, u64)],
    _start_order: &[(String, u64)],
    t0: Instant,
    start_unix_us: u64,
) -> ClusterRestoreReport {
    let start_of = |vm: &str| {
        restored
            .iter()
            .find(|r| r.0.vm.name == vm)
            .and_then(|r| r.2)
    };
    let rel = |us: u64| us.saturating_sub(start_unix_us) as f64 / 1000.0;
    let views = guest_views(restored);
    let mut vms: Vec<VmRestoreReport> = Vec::new();
    let mut full_load_ms = 0.0f64;
    for ((member, rep, started, replayed), view) in restored.iter().zip(views) {
        let name = member.vm.name.clone();
        let tcp_at_cut = m
            .vms
            .iter()
            .find(|v| v.name == name)
            .map_or(view.tcp_first, |v| counters_at_cut(&v.metrics, &view));
        let first = tcp_at_cut.retrans;
        let growth = view.tcp.growth_since(&tcp_at_cut);
        let start = started.map(rel).unwrap_or(rep.restore_latency_ms);
        let mut backoff = 0.0f64;
        for e in plan.rdg.edges().iter().filter(|e| e.from == name) {
            if let (Some(si), Some(sj)) = (*started, start_of(&e.to)) {
                backoff = backoff.max(sj.saturating_sub(si) as f64 / 1000.0);
            }
        }
        let pv = plan.vms.iter().find(|v| v.name == name);
        // The VM's own clock (its restore request) put on the cluster's.
        let offset = rep.request_unix_us.saturating_sub(start_unix_us) as f64 / 1000.0;
        full_load_ms = full_load_ms.max(rep.full_load_ms + offset);
        vms.push(VmRestoreReport {
            vm: name,
            latency_ms: start,
            started_unix_us: *started,
            start_received_ms: rep.start_received_ms.map(|t| t + offset),
            run_sent_ms: rep.run_sent_ms + offset,
            loaded_ms: rep.loaded_ms.map(|t| t + offset),
            qemu_ready_ms: rep.qemu_ready_ms.map(|t| t + offset),
            begun_ms: offset,
            background_before_start: rep.background_before_start,
            pages_before_run: rep.pages_before_run,
            backoff_ms: backoff,
            disruption_ms: start + backoff,
            wss_hybrid: pv.map_or(0, |v| v.hybrid),
            wss: pv.map_or(0, |v| v.size),
            pages_before_start: rep.ws_pages,
            demand_faults: rep.demand_faults,
            demand_faults_before_start: rep.demand_faults_before_start,
            full_load_ms: rep.full_load_ms,
            frames_replayed: *replayed,
            retrans_first: first,
            retrans_later: view.tcp.retrans,
            tlp_later: view.tcp.tlp,
            rto_later: view.tcp.rto,
            tcp_at_cut,
            tcp_later: view.tcp,
            tcp_growth: growth,
            lost_segments: growth.lost(),
            guest_max_gap_ms: view.pingpong_max_gap_ms,
            record: rep.record.clone(),
        });
    }
    vms.sort_by(|a, b| a.latency_ms.total_cmp(&b.latency_ms));
    let start_order: Vec<String> = vms.iter().map(|v| v.vm.clone()).collect();
    let mut follows = true;
    for e in plan.rdg.edges() {
        let same_ring = plan.rdg.ring_of(&e.from).is_some_and(|r| r.contains(&e.to));
        if let (Some(si), Some(sj)) = (start_of(&e.from), start_of(&e.to)) {
            if !same_ring && sj > si {
                follows = false;
            }
        }
    }
    let n = vms.len().max(1) as f64;
    let mut backoffs: Vec<f64> = vms.iter().map(|v| v.backoff_ms).collect();
    backoffs.sort_by(f64::total_cmp);
    let median = match backoffs.len() {
        0 => 0.0,
        k if k % 2 == 1 => backoffs[k / 2],
        k => (backoffs[k / 2 - 1] + backoffs[k / 2]) / 2.0,
    };
    ClusterRestoreReport {
        snapshot: m.name.clone(),
        cluster: m.cluster.clone(),
        mode: opts.mode,
        start_quiet_ms: opts.start_quiet.as_millis() as u64,
        backoff_avg_ms: backoffs.iter().sum::<f64>() / n,
        backoff_median_ms: median,
        backoff_max_ms: backoffs.last().copied().unwrap_or(0.0),
        latency_avg_ms: vms.iter().map(|v| v.latency_ms).sum::<f64>() / n,
        disruption_avg_ms: vms.iter().map(|v| v.disruption_ms).sum::<f64>() / n,
        running_ms: vms.iter().map(|v| v.latency_ms).fold(0.0, f64::max),
        full_load_ms: Some(full_load_ms),
        loading: false,
        vms,
        start_order,
        restore_line: plan.line.clone(),
        starts_follow_dependencies: follows,
        rings: plan.rdg.rings(),
        edges: plan
            .rdg
            .edges()
            .iter()
            .map(|e| (e.from.clone(), e.to.clone(), e.weight))
            .collect(),
        lp_objective: plan.lp_objective,
        duration_ms: t0.elapsed().as_secs_f64() * 1000.0,
        planned_ms: 0.0,
        load_sent_ms: 0.0,
        guest_clocks: Vec::new(),
    }
}

/// The guests' view of the restore, one per restored VM (in order): their
/// TCP counters from the first stat line after the restore and one a few
/// seconds later (or, for image VMs, from their guest agents).
fn guest_views(restored: &[(Member, restore::Report, Option<u64>, u64)]) -> Vec<GuestView> {
    // The guests' retransmission counters: first stat line after the
    // restore vs one a few seconds later.
    // Image VMs print no stat lines: their guest agents are read now and
    // again once the lab guests' wait is over (and at least
    // GUEST_AGENT_LATER after the first reading).
    let configs: Vec<&crate::qemu::QemuConfig> = restored.iter().map(|r| &r.0.vm.config).collect();
    let agents: Vec<&crate::qemu::QemuConfig> = configs
        .iter()
        .copied()
        .filter(|c| guest_counters::from_agent(c))
        .collect();
    let agents_first = guest_counters::guest_counters_all(&agents);
    let t = Instant::now();
    let mut views: Vec<GuestView> = loop {
        let v: Vec<GuestView> = restored
            .iter()
            .map(|r| {
                crate::cluster_snapshot::parse_console(&crate::cluster_snapshot::console_text(
                    &r.0.vm.config.console_log,
                ))
            })
            .collect();
        let lab = || {
            v.iter()
                .zip(&configs)
                .filter(|(_, c)| !guest_counters::from_agent(c))
                .map(|(g, _)| g)
        };
        let waited = t.elapsed();
        let enough =
            lab().all(|g| g.stat_lines >= 3) && (agents.is_empty() || waited >= GUEST_AGENT_LATER);
        let some = lab().all(|g| g.stat_lines >= 1);
        if enough || (some && waited > GUEST_STAT_WAIT) || waited > GUEST_FIRST_STAT_WAIT {
            break v;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let agents_later = guest_counters::guest_counters_all(&agents);
    let mut readings = agents_first.into_iter().zip(agents_later);
    for (view, c) in views.iter_mut().zip(&configs) {
        if guest_counters::from_agent(c) {
            let (first, later) = readings.next().expect("one reading per image VM");
            *view = guest_counters::agent_view(first, later);
        }
    }
    views
}

/// A restored guest's TCP counters at the cut: exact when its cluster
/// snapshot saw none of them grow (the stat lines before and after the
/// snapshot agree); otherwise the first line after the restore, which may
/// miss what happened in the restore's first second. Snapshots taken
/// before the counters were recorded have only `retrans_before/after`.
fn counters_at_cut(metrics: &serde_json::Value, view: &GuestView) -> TcpCounters {
    let c = vmcsnap_control::VmCutCounters::read(metrics);
    match (c.tcp_before, c.tcp_after) {
        (Some(b), Some(a)) if b == a && b.retrans.is_some() => b,
        (Some(_), Some(_)) => view.tcp_first,
        _ => {
            let (b, a) = (c.retrans_before, c.retrans_after);
            let retrans = if b.is_some() && b == a {
                b
            } else {
                view.tcp_first.retrans
            };
            TcpCounters {
                retrans,
                ..view.tcp_first
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(first: &str) -> GuestView {
        crate::cluster_snapshot::parse_console(first)
    }

    #[test]
    fn counters_at_the_cut_come_from_the_snapshot_when_steady() {
        let v = view("vmcsnap-stat name=a uptime=9 retrans=12 tlp=5 tlprec=1 rto=0\n");
        let steady = serde_json::json!({
            "tcp_before": {"retrans": 10, "tlp": 4, "tlp_recovered": 0, "rto": 0},
            "tcp_after": {"retrans": 10, "tlp": 4, "tlp_recovered": 0, "rto": 0},
        });
        let c = counters_at_cut(&steady, &v);
        assert_eq!(
            (c.retrans, c.tlp, c.tlp_recovered),
            (Some(10), Some(4), Some(0))
        );
        let g = v.tcp.growth_since(&c);
        assert_eq!(
            (g.retrans, g.tlp, g.tlp_recovered, g.rto),
            (Some(2), Some(1), Some(1), Some(0))
        );
        // Grew during the snapshot: the value at the cut is unknown; the
        // first line after the restore stands in.
        let moving = serde_json::json!({
            "tcp_before": {"retrans": 10, "tlp": 4, "tlp_recovered": 0, "rto": 0},
            "tcp_after": {"retrans": 11, "tlp": 5, "tlp_recovered": 0, "rto": 0},
        });
        assert_eq!(counters_at_cut(&moving, &v), v.tcp_first);
        // An older snapshot: only RetransSegs.
        let old = serde_json::json!({"retrans_before": 7, "retrans_after": 7});
        let c = counters_at_cut(&old, &v);
        assert_eq!((c.retrans, c.tlp), (Some(7), Some(5)));
    }
}
