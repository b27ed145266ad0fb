//! Completing a cluster snapshot: the switch session's log becomes the
//! channel-state file, the per-VM timelines and the W(i,j) edges go into
//! cluster.json, backoff and the guests' view are measured, and the
//! temporary directory is renamed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vmcsnap_image::channel_log::{write_channel_log, ChannelFrame, FrameReason};
use vmcsnap_image::cluster::{
    commit_cluster_dir, ChannelStateRef, ClusterManifest, ClusterVm, Edge, Timeline, CHANNEL_LOG,
};
use vmcsnap_switch::{LogReason, SessionLog, SessionStats};

use super::peer::VmOutcome;
use super::ProtocolStats;
use crate::cluster::Cluster;
use crate::guest_console::GuestView;
use crate::guest_counters;
use crate::qemu::QemuConfig;
use crate::snapshot::Mode;
use crate::AgentError;
pub use vmcsnap_control::{ClusterSnapshotReport as ClusterReport, VmSnapshotReport as VmReport};
use vmcsnap_orchestrator::cluster_snapshot::metrics::{self, Moments, TcpCounters};

/// How long the switch may still hold pre-snapshot frames for post-snapshot
/// VMs (their sockets full) after the protocol completed.
const PENDING_PRE_BOUND: Duration = Duration::from_secs(2);
/// How long to wait for every guest's next `vmcsnap-stat` line (one per
/// second) after the snapshot, for its retransmission count.
const GUEST_STAT_WAIT: Duration = Duration::from_millis(2500);

/// A guest's console before the snapshot.
pub struct GuestBefore {
    path: PathBuf,
    offset: u64,
    tcp: TcpCounters,
    /// An image VM: its counters come from its guest agent, not from
    /// console stat lines (see [`crate::guest_counters`]).
    agent: Option<QemuConfig>,
}

impl GuestBefore {
    /// Reads where each VM's console is and its guest's TCP counters (all
    /// VMs at once: guest agents may take a while).
    pub fn read_all(configs: Vec<&QemuConfig>) -> Vec<GuestBefore> {
        let counters = guest_counters::guest_counters_all(&configs);
        configs
            .into_iter()
            .zip(counters)
            .map(|(c, tcp)| GuestBefore {
                path: c.console_log.clone(),
                offset: crate::guest_console::console_offset(&c.console_log),
                tcp: tcp.unwrap_or_default(),
                agent: guest_counters::from_agent(c).then(|| c.clone()),
            })
            .collect()
    }

    /// The counters after the snapshot: the view's (the lab guest's last
    /// stat line, or else the ones before: no line, no retransmission seen);
    /// an image VM's guest agent reading, unknown if it did not answer.
    fn tcp_after(&self, view: &GuestView) -> TcpCounters {
        if self.agent.is_some() || view.stat_lines > 0 {
            view.tcp
        } else {
            self.tcp
        }
    }
}

/// Inputs of [`finish`].
pub struct Finish<'a> {
    pub name: &'a str,
    pub mode: Mode,
    pub tmp: &'a Path,
    pub final_dir: &'a Path,
    pub start_unix_us: u64,
    pub t0: Instant,
    pub vms: Vec<VmOutcome>,
    pub before: Vec<GuestBefore>,
    pub protocol: ProtocolStats,
}

/// Ends the switch session, writes the channel state and the manifest,
/// measures, and commits the cluster snapshot.
pub fn finish(c: &mut Cluster, f: &Finish<'_>) -> Result<ClusterReport, AgentError> {
    let log = end_session(c)?;
    let st = log.stats.clone();
    let frames = channel_frames(&log);
    let summary = write_channel_log(&f.tmp.join(CHANNEL_LOG), &frames)
        .map_err(|e| fail(format!("writing the channel state: {e}")))?;
    let edges = edges(&frames);
    let backoff = backoff(f, &st)?;
    let views = guest_views(f);
    let (vms, manifest_vms) = vm_reports(c, f, &views);
    let n = vms.len().max(1) as f64;
    let downtime_avg_ms = vms.iter().map(|v| v.downtime_ms).sum::<f64>() / n;
    let downtime_max_ms = vms.iter().map(|v| v.downtime_ms).fold(0.0, f64::max);
    let duration_ms = f.t0.elapsed().as_secs_f64() * 1000.0;
    let manifest = ClusterManifest {
        format: vmcsnap_image::cluster::FORMAT.to_string(),
        version: 1,
        name: f.name.to_string(),
        cluster: c.spec.cluster.name.clone(),
        mode: super::mode_name(f.mode),
        created_unix_ms: f.start_unix_us / 1000,
        network: serde_json::to_value(&c.spec.cluster).unwrap_or_default(),
        vms: manifest_vms,
        channel_state: ChannelStateRef {
            file: CHANNEL_LOG.to_string(),
            frames: summary.frames,
            bytes: summary.bytes,
            file_size: summary.file_size,
        },
        edges: edges.clone(),
        metrics: vmcsnap_control::ClusterSnapshotMetrics {
            backoff: Some(backoff.clone()),
            downtime_avg_ms: Some(downtime_avg_ms),
            downtime_max_ms: Some(downtime_max_ms),
            duration_ms: Some(duration_ms),
            protocol: Some(f.protocol.clone()),
            switch: Some(st.clone()),
        }
        .to_value(),
    };
    manifest
        .save(f.tmp)
        .map_err(|e| fail(format!("writing cluster.json: {e}")))?;
    commit_cluster_dir(f.tmp, f.final_dir)
        .map_err(|e| fail(format!("committing {}: {e}", f.final_dir.display())))?;
    crate::log(format!(
        "cluster snapshot {} ({:?}) committed: {} VMs, backoff avg {:.1} ms max {:.1} ms, {} frames logged",
        f.name, f.mode, vms.len(), backoff.avg_ms, backoff.max_ms, summary.frames
    ));
    Ok(ClusterReport {
        name: f.name.to_string(),
        path: f.final_dir.to_path_buf(),
        cluster: c.spec.cluster.name.clone(),
        mode: f.mode,
        duration_ms,
        vms,
        backoff,
        downtime_avg_ms,
        downtime_max_ms,
        channel_state_frames: summary.frames,
        channel_state_bytes: summary.bytes,
        edges,
        switch: st,
        protocol: f.protocol.clone(),
    })
}

fn fail(m: String) -> AgentError {
    AgentError::ClusterSnapshot(m)
}

/// Ends the switch's cut session once it holds no pre-snapshot frame (or
/// after a bound), and checks that the cut was consistent and fully logged.
fn end_session(c: &mut Cluster) -> Result<SessionLog, AgentError> {
    let deadline = Instant::now() + PENDING_PRE_BOUND;
    while let Some(st) = c.switch.session_stats()? {
        if st.pending_pre_frames == 0 || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let log = c.switch.end_cut_session()?;
    let st = &log.stats;
    if st.violations > 0 {
        return Err(fail(format!("the switch delivered {} post-snapshot frames to pre-snapshot VMs; the cut is not consistent", st.violations)));
    }
    if st.log_overflow > 0 {
        return Err(fail(format!(
            "{} in-flight frames did not fit the switch's channel-state log",
            st.log_overflow
        )));
    }
    Ok(log)
}

/// The switch's logged frames as the channel-state file holds them.
fn channel_frames(log: &SessionLog) -> Vec<ChannelFrame> {
    log.frames
        .iter()
        .map(|l| ChannelFrame {
            sender: l.sender.clone(),
            receiver: l.receiver.clone(),
            received_unix_us: l.received_unix_us,
            delivered_unix_us: l.delivered_unix_us,
            reason: match l.reason {
                LogReason::HeldAtCut => FrameReason::HeldAtCut,
                LogReason::InFlight => FrameReason::InFlight,
            },
            data: l.data.clone(),
        })
        .collect()
}

/// The W(i,j) edges: frames and bytes in flight per sender and receiver.
fn edges(frames: &[ChannelFrame]) -> Vec<Edge> {
    let mut w: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
    for fr in frames {
        let e = w
            .entry((fr.sender.clone(), fr.receiver.clone()))
            .or_default();
        e.0 += 1;
        e.1 += fr.data.len() as u64;
    }
    w.into_iter()
        .map(|((from, to), (frames, bytes))| Edge {
            from,
            to,
            frames,
            bytes,
        })
        .collect()
}

/// The backoff between the communicating VMs, from every VM's pause and
/// completion; an error if a VM has no snapshot.
fn backoff(f: &Finish<'_>, st: &SessionStats) -> Result<metrics::Backoff, AgentError> {
    let mut moments = BTreeMap::new();
    for v in &f.vms {
        let r = v
            .report
            .as_ref()
            .ok_or_else(|| fail(format!("VM {} has no snapshot", v.vm)))?;
        moments.insert(
            v.vm.clone(),
            Moments {
                pause_start_us: r.pause_start_unix_us,
                pause_end_us: r.pause_end_unix_us,
                complete_us: r.complete_unix_us,
            },
        );
    }
    let pairs = metrics::communicating_pairs(
        st.pairs
            .iter()
            .map(|p| (p.from.as_str(), p.to.as_str(), p.unicast_frames)),
    );
    Ok(metrics::backoff(f.mode, &moments, &pairs))
}

/// The guests' own view after the snapshot: a lab guest's console stat
/// lines written after completion, an image VM's guest agent's reading.
fn guest_views(f: &Finish<'_>) -> Vec<GuestView> {
    let after_us = crate::snapshot::unix_us();
    let wait_until = Instant::now() + GUEST_STAT_WAIT;
    // The console has no host timestamps: count its stat lines (one per
    // second since the snapshot started), and want one more than elapsed.
    let min_lines = after_us.saturating_sub(f.start_unix_us) / 1_000_000 + 2;
    let mut views = loop {
        let views: Vec<GuestView> = f
            .before
            .iter()
            .map(|b| {
                crate::guest_console::parse_console(&crate::guest_console::console_since(
                    &b.path, b.offset,
                ))
            })
            .collect();
        let waiting = views
            .iter()
            .zip(&f.before)
            .any(|(v, b)| b.agent.is_none() && v.stat_lines < min_lines);
        if !waiting || Instant::now() > wait_until {
            break views;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // Image VMs: their guest agents' reading now, after completion.
    let agents: Vec<&QemuConfig> = f.before.iter().filter_map(|b| b.agent.as_ref()).collect();
    let mut after = guest_counters::guest_counters_all(&agents).into_iter();
    for (view, b) in views.iter_mut().zip(&f.before) {
        if b.agent.is_some() {
            let tcp = after.next().flatten();
            *view = guest_counters::agent_view(tcp, tcp);
        }
    }
    views
}

/// Every VM's report and its entry in cluster.json (`backoff` checked
/// that each has a snapshot).
fn vm_reports(c: &Cluster, f: &Finish<'_>, views: &[GuestView]) -> (Vec<VmReport>, Vec<ClusterVm>) {
    let mut vms = Vec::new();
    let mut manifest_vms = Vec::new();
    for ((v, b), view) in f.vms.iter().zip(&f.before).zip(views) {
        let r = v.report.as_ref().expect("checked above");
        let member = c.members.iter().find(|m| m.vm.name == v.vm);
        let report = vm_report(f, v, r, b, view);
        manifest_vms.push(ClusterVm {
            name: v.vm.clone(),
            snapshot: format!("vms/{}", v.vm),
            memory_mib: r.memory_mib,
            ip: member.map(|m| m.address.cidr()).unwrap_or_default(),
            mac: member.map(|m| m.address.mac_string()).unwrap_or_default(),
            timeline: Timeline {
                start_us: r.start_unix_us,
                pause_start_us: r.pause_start_unix_us,
                pause_end_us: r.pause_end_unix_us,
                transient_done_us: r.transient_done_unix_us,
                complete_us: r.complete_unix_us,
            },
            metrics: serde_json::to_value(&report).unwrap_or_default(),
        });
        vms.push(report);
    }
    (vms, manifest_vms)
}

/// One VM's report: its snapshot's moments relative to the cluster
/// snapshot's start, its cut, and its guest's view.
fn vm_report(
    f: &Finish<'_>,
    v: &VmOutcome,
    r: &crate::snapshot::Report,
    b: &GuestBefore,
    view: &GuestView,
) -> VmReport {
    let rel = |us: u64| us.saturating_sub(f.start_unix_us) as f64 / 1000.0;
    let prep = v.prepare.unwrap_or_default();
    let cut = v.cut.unwrap_or_default();
    VmReport {
        vm: v.vm.clone(),
        downtime_ms: r.downtime_ms,
        pause: r.pause.clone(),
        start_ms: rel(r.start_unix_us),
        pause_start_ms: rel(r.pause_start_unix_us),
        pause_end_ms: rel(r.pause_end_unix_us),
        transient_done_ms: rel(r.transient_done_unix_us),
        complete_ms: rel(r.complete_unix_us),
        drain_wait_us: prep.waited_us,
        drain_bound_hit: prep.bound_hit,
        unread_bytes_at_cut: prep.unread_bytes as u64,
        settle_us: prep.settle_us,
        unsettled: prep.unsettled,
        frames_drained_at_cut: cut.frames_drained,
        cut_prepared_ms: v.barrier.map(|w| rel(w.arrived_unix_us)),
        stop_barrier_wait_us: v.barrier.map(|w| w.waited_us),
        stop_barrier_complete: v.barrier.map(|w| w.complete),
        ram: r.ram,
        retrans_before: b.tcp.retrans,
        retrans_after: b.tcp_after(view).retrans,
        tcp_before: b.tcp,
        tcp_after: b.tcp_after(view),
        pingpong_max_gap_ms: view.pingpong_max_gap_ms,
        pages_stored: r.pages_stored,
        path: f.final_dir.join("vms").join(&v.vm),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn before(agent: bool) -> GuestBefore {
        let tcp = TcpCounters {
            retrans: Some(5),
            ..TcpCounters::default()
        };
        let config: Option<QemuConfig> = agent.then(|| {
            serde_json::from_value(serde_json::json!({
                "name": "a", "accel": "tcg", "memory_mib": 64, "vcpus": 1, "ram_file": "/r", "kernel": "/k",
                "console_log": "/c.log", "qmp_socket": "/q", "disks": [], "port_socket": "/p",
                "mac": "52:54:00:00:00:01", "incoming": false,
                "image": {"qga_socket": "/qga.sock", "events_log": "/e.log"}
            }))
            .unwrap()
        });
        GuestBefore {
            path: "/c.log".into(),
            offset: 0,
            tcp,
            agent: config,
        }
    }

    #[test]
    fn counters_after_are_unknown_when_an_image_vms_agent_did_not_answer() {
        let silent = crate::guest_counters::agent_view(None, None);
        // The lab guest without a new stat line: nothing retransmitted seen.
        assert_eq!(before(false).tcp_after(&silent).retrans, Some(5));
        // An image VM whose agent did not answer: unknown, not "unchanged".
        assert_eq!(before(true).tcp_after(&silent).retrans, None);
        let read = TcpCounters {
            retrans: Some(8),
            ..TcpCounters::default()
        };
        assert_eq!(
            before(true)
                .tcp_after(&crate::guest_counters::agent_view(Some(read), Some(read)))
                .retrans,
            Some(8)
        );
    }
}
