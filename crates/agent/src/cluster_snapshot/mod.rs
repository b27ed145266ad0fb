//! Consistent snapshot of a whole cluster (HotSnap): the coordinated
//! non-blocking protocol between an initiator and one peer per VM
//! (`vmcsnap_coord::snapshot`, in-process transport), each peer snapshotting
//! its VM (`crate::snapshot`) while the switch's packet mediator keeps the
//! cut consistent and logs the frames in flight (`vmcsnap_switch::mediator`).
//! See docs/cluster-protocol.md and docs/cluster-snapshot.md.
//!
//! ```text
//!  agent thread         initiator thread      per VM: peer thread + snapshot thread
//!  begin_cut_session ──► SNAPSHOT ──────────► StartSnapshot ─► prepare_cut, stop, cut,
//!                                                              disk, migrate, RESUME,
//!                        ◄── TRANSIENT_SNAP_FIN ◄──────────── release (TransientDone)
//!                        ALL_TRANSIENT_SNAP_FIN ─►             … pages stream …
//!                        ◄── FULL_SNAP_FIN ◄──────────────── image committed (FullDone)
//!                        ALL_FULL_SNAP_FIN ─────► Complete
//!  end_cut_session, channel-state.bin, cluster.json, rename .tmp → <name>
//! ```
//!
//! The whole cluster snapshot is built in `<snapshots>/<name>.tmp-<pid>-0`
//! and renamed only when every VM's image is committed and the channel
//! state written: a failed or abandoned cluster snapshot leaves nothing
//! that is listed, and every VM keeps running.

mod barrier;
mod peer;
mod report;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmcsnap_coord::snapshot::{
    run_initiator, run_peer, Initiator, InitiatorEvent, InitiatorEventKind, InitiatorOutcome, Msg,
    Peer, PeerInput, PeerOutcome, Timeouts,
};
use vmcsnap_coord::transport::InProcessNetwork;
use vmcsnap_switch::PortId;

pub use crate::guest_console::{console_text, parse_console, tcp_now, GuestView};
pub use report::{ClusterReport, VmReport};
pub use vmcsnap_control::ProtocolStats;
pub use vmcsnap_orchestrator::cluster_snapshot::metrics::{
    Backoff, PairBackoff, TcpCounters, TcpGrowth,
};

use crate::cluster::Cluster;
use crate::snapshot::{self, Mode};
use crate::stored_config::StoredVmConfig;
use crate::{log, AgentError, RunDir};
use peer::{Job, VmOutcome, Worker};

/// The initiator's node name on the protocol's transport.
pub const INITIATOR: &str = "initiator";

/// What `vmcsnap snapshot --cluster` asks for.
#[derive(Debug, Clone)]
pub struct Options {
    /// How each VM is snapshotted.
    pub mode: Mode,
    /// The cluster snapshot's name (default `<cluster>-<unix time>`).
    pub name: Option<String>,
    /// Cut probes the switch has each VM's QEMU read before the pause
    /// (`vmcsnap_switch::mediator::probe`): 2 by default; 0 cuts after the
    /// socket drain only, as vmcsnap did before (kept to measure the
    /// difference: a restore may then lack frames QEMU had not handed to
    /// the guest).
    pub cut_probes: u32,
}

/// Everything a restore needs to rebuild one VM: its spec entry, the
/// cluster section, its QEMU configuration and address.
pub fn vm_config(c: &mut Cluster, vm: &str) -> Result<StoredVmConfig, AgentError> {
    let spec = c.spec.vm.iter().find(|v| v.name == vm).cloned();
    let cluster = c.spec.cluster.clone();
    let m = c.member_mut(vm)?;
    Ok(StoredVmConfig::new(
        spec,
        cluster,
        m.vm.config.clone(),
        &m.address,
    ))
}

/// Takes a consistent snapshot of every VM of the cluster.
pub fn snapshot_cluster(
    c: &mut Cluster,
    run: &RunDir,
    opts: Options,
    progress: &mut dyn FnMut(&str),
) -> Result<ClusterReport, AgentError> {
    let t0 = Instant::now();
    let start_unix_us = snapshot::unix_us();
    if c.members.is_empty() {
        return Err(AgentError::BadRequest(
            "the cluster has no VM to snapshot".into(),
        ));
    }
    for m in c.members.iter_mut() {
        let state = m.vm.run_state();
        if state != "running" {
            return Err(AgentError::BadRequest(format!(
                "VM {:?} is {state}, not running: a cluster snapshot needs every VM running (stop it with `vmcsnap stop {}` or restore it first)",
                m.vm.name, m.vm.name
            )));
        }
    }
    let root = run.snapshots_dir();
    let (name, final_dir) =
        snapshot::new_snapshot_dir(&root, opts.name.clone(), &c.spec.cluster.name)?;
    let tmp = root.join(format!(
        "{name}{}{}-0",
        vmcsnap_image::list::TEMP_MARKER,
        std::process::id()
    ));
    let disks = root.join(".disks").join(&name);
    let _ = std::fs::remove_dir_all(&tmp);
    let _ = std::fs::remove_dir_all(&disks);
    for d in [tmp.join("vms"), disks.clone()] {
        std::fs::create_dir_all(&d).map_err(AgentError::io("creating", &d))?;
    }
    let names: Vec<String> = c.members.iter().map(|m| m.vm.name.clone()).collect();
    let mut configs = Vec::new();
    for n in &names {
        configs.push(vm_config(c, n)?);
    }
    let before = report::GuestBefore::read_all(c.members.iter().map(|m| &m.vm.config).collect());

    let epoch = start_unix_us / 1000;
    let (trig_tx, trig_rx) = mpsc::channel();
    let ports: Vec<PortId> = c.members.iter().map(|m| m.port).collect();
    c.switch.begin_cut_session(epoch, &ports, trig_tx)?;
    progress(&format!(
        "cluster snapshot {name}: {} VMs, mode {}",
        names.len(),
        mode_name(opts.mode)
    ));
    let ctx = ProtocolCtx {
        run,
        epoch,
        mode: opts.mode,
        tmp: &tmp,
        disks: &disks,
        cut_probes: opts.cut_probes,
    };
    let (outcome, vms, protocol) = run_protocol(c, &ctx, configs, trig_rx, progress);

    let done = match outcome {
        InitiatorOutcome::Completed => report::finish(
            c,
            &report::Finish {
                name: &name,
                mode: opts.mode,
                tmp: &tmp,
                final_dir: &final_dir,
                start_unix_us,
                t0,
                vms,
                before,
                protocol,
            },
        ),
        InitiatorOutcome::Aborted { reason } => {
            Err(AgentError::ClusterSnapshot(abort_detail(&reason, &vms)))
        }
    };
    match done {
        Ok(r) => {
            progress(&format!(
                "cluster snapshot {name} committed: backoff avg {:.1} ms, max {:.1} ms; {} frames logged",
                r.backoff.avg_ms, r.backoff.max_ms, r.channel_state_frames
            ));
            Ok(r)
        }
        Err(e) => {
            if let Err(se) = c.switch.abort_cut_session() {
                log(format!(
                    "cluster snapshot {name}: ending the switch session: {se}"
                ));
            }
            let _ = std::fs::remove_dir_all(&tmp);
            let _ = std::fs::remove_dir_all(&disks);
            log(format!("cluster snapshot {name} failed: {e}"));
            Err(e)
        }
    }
}

struct ProtocolCtx<'a> {
    run: &'a RunDir,
    epoch: u64,
    mode: Mode,
    tmp: &'a Path,
    disks: &'a Path,
    cut_probes: u32,
}

/// Runs the initiator, and per VM a peer and a snapshot thread, until the
/// protocol ends; forwards progress lines meanwhile.
fn run_protocol(
    c: &mut Cluster,
    ctx: &ProtocolCtx<'_>,
    configs: Vec<StoredVmConfig>,
    triggers: mpsc::Receiver<PortId>,
    progress: &mut dyn FnMut(&str),
) -> (InitiatorOutcome, Vec<VmOutcome>, ProtocolStats) {
    // Stop-copy and pre-copy finish their "transient" pause only once all
    // of memory is copied.
    let transient_deadline = if ctx.mode == Mode::Hot {
        Duration::from_secs(120)
    } else {
        Duration::from_secs(900)
    };
    let timeouts = Timeouts {
        retry: Duration::from_millis(200),
        transient_deadline,
        full_deadline: Duration::from_secs(1800),
    };
    let net = InProcessNetwork::<Msg>::new();
    let (init_tx, init_rx) = mpsc::channel();
    // Dropped once every peer has finished: the initiator then stops
    // lingering for retransmitted FINs (nothing is lost in-process).
    let init_inbox = Arc::new(Mutex::new(Some(init_tx)));
    let deliver = init_inbox.clone();
    let init_ep = net.join(INITIATOR, move |env| {
        if let Some(tx) = deliver.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = tx.send(env);
        }
    });
    let (progress_tx, progress_rx) = mpsc::channel::<String>();
    let switch = c.switch.clone();
    let names: Vec<String> = c.members.iter().map(|m| m.vm.name.clone()).collect();
    let mut inboxes: HashMap<PortId, mpsc::Sender<PeerInput>> = HashMap::new();
    let mut peers = Vec::new();
    for m in c.members.iter() {
        let (tx, rx) = mpsc::channel();
        let deliver = tx.clone();
        let ep = net.join(m.vm.name.clone(), move |env| {
            let _ = deliver.send(PeerInput::Message(env));
        });
        inboxes.insert(m.port, tx.clone());
        peers.push((tx, rx, ep));
    }
    let t0 = Instant::now();
    let finished = AtomicBool::new(false);
    let (outcome, events, vms) = std::thread::scope(|s| {
        let finished = &finished;
        let inboxes = &inboxes;
        s.spawn(move || loop {
            match triggers.recv_timeout(Duration::from_millis(20)) {
                Ok(port) => {
                    if let Some(tx) = inboxes.get(&port) {
                        let _ = tx.send(PeerInput::Trigger);
                    }
                }
                Err(RecvTimeoutError::Timeout) if !finished.load(Ordering::SeqCst) => {}
                Err(_) => return,
            }
        });
        // Every VM prepares its snapshot first (disk overlay, capture,
        // migration settings) and waits; the protocol starts once all are
        // ready, so that the pauses start together.
        let (ready_tx, ready_rx) = mpsc::channel();
        // And once started, every VM prepares its network cut (the guest
        // reads the cut probes, which takes each VM its own time) before
        // any VM stops (pre-copy: QEMU pauses each VM by itself).
        let barrier = (ctx.mode != Mode::Precopy)
            .then(|| Arc::new(barrier::StopBarrier::new(c.members.len())));
        let mut snaps = Vec::new();
        let mut workers = Vec::new();
        for ((m, (tx, _, _)), config) in c.members.iter_mut().zip(&peers).zip(configs) {
            let (start_tx, start_rx) = mpsc::channel();
            let cancel: peer::Cancel = Arc::new(Mutex::new(None));
            let vm = m.vm.name.clone();
            let opts = snapshot::Options {
                mode: ctx.mode,
                name: Some(vm.clone()),
                reference: None,
                fault: None,
                vm_config: config,
                target: Some(snapshot::Target {
                    root: ctx.tmp.join("vms"),
                    disks_dir: ctx.disks.join(&vm),
                }),
                writer: Default::default(),
                full: true,
                disk_layer: true,
                // One DAMON kdamond for all VMs' pauses at once: none.
                access_window: std::time::Duration::ZERO,
            };
            let job = Job {
                opts,
                switch: switch.clone(),
                commands: start_rx,
                inbox: tx.clone(),
                cancel: cancel.clone(),
                progress: progress_tx.clone(),
                ready: ready_tx.clone(),
                cut_probes: ctx.cut_probes,
                barrier: barrier.clone(),
            };
            let run = ctx.run;
            snaps.push(s.spawn(move || peer::snapshot_thread(m, run, job)));
            workers.push(Worker {
                start: start_tx,
                cancel,
                progress: progress_tx.clone(),
                vm,
            });
        }
        drop(ready_tx);
        let mut prep_errors = Vec::new();
        for _ in 0..workers.len() {
            match ready_rx.recv() {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => prep_errors.push(e),
                Err(_) => break,
            }
        }
        let mut peer_threads = Vec::new();
        let init = if prep_errors.is_empty() {
            let _ = progress_tx.send(format!(
                "every VM is prepared after {:.1} ms; starting the protocol",
                t0.elapsed().as_secs_f64() * 1000.0
            ));
            for (mut worker, (_, rx, ep)) in workers.into_iter().zip(peers) {
                let (epoch, timeouts, vm) = (ctx.epoch, timeouts.clone(), worker.vm.clone());
                peer_threads.push(s.spawn(move || {
                    let p = Peer::new(epoch, vm.clone(), INITIATOR.to_string(), timeouts);
                    let outcome = run_peer(p, &ep, &rx, &mut worker);
                    drop(worker); // a snapshot thread still waiting for Start ends
                    (vm, outcome)
                }));
            }
            let ptx = progress_tx.clone();
            Some(s.spawn(move || {
                let mut i = Initiator::new(ctx.epoch, INITIATOR.to_string(), names, timeouts);
                let t_start = Instant::now();
                let outcome = run_initiator(&mut i, &init_ep, &init_rx, &mut |ev| {
                    if let Some(line) = describe(ev, t_start) {
                        let _ = ptx.send(format!("protocol: {line}"));
                    }
                });
                let events: Vec<String> = i
                    .events()
                    .iter()
                    .filter_map(|e| describe(e, t_start))
                    .collect();
                (outcome, events)
            }))
        } else {
            for w in &workers {
                let _ = w.start.send(peer::WorkerCmd::Abandon);
            }
            drop(workers);
            None
        };
        drop(progress_tx);
        let mut init_done_at: Option<Instant> = None;
        let mut peers_told = false;
        loop {
            match progress_rx.recv_timeout(Duration::from_millis(50)) {
                Ok(line) => progress(&line),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            let peers_done = peer_threads.iter().all(|h| h.is_finished())
                && snaps.iter().all(|h| h.is_finished());
            if peers_done {
                init_inbox.lock().unwrap_or_else(|p| p.into_inner()).take();
                if init.as_ref().is_none_or(|h| h.is_finished()) {
                    break;
                }
            }
            // A peer that never heard SNAPSHOT waits by design; once the
            // initiator is over, tell it the snapshot is gone.
            if init.as_ref().is_some_and(|h| h.is_finished()) && !peers_done {
                let since = *init_done_at.get_or_insert_with(Instant::now);
                if !peers_told && since.elapsed() > Duration::from_secs(5) {
                    peers_told = true;
                    for tx in inboxes.values() {
                        let _ = tx.send(PeerInput::Failed("the initiator has finished".into()));
                    }
                }
            }
        }
        for line in progress_rx.try_iter() {
            progress(&line);
        }
        finished.store(true, Ordering::SeqCst);
        let (outcome, events) = match init {
            Some(h) => h.join().expect("initiator thread panicked"),
            None => (
                InitiatorOutcome::Aborted {
                    reason: format!("preparing failed: {}", prep_errors.join("; ")),
                },
                vec![],
            ),
        };
        for h in peer_threads {
            let (vm, o) = h.join().expect("peer thread panicked");
            if let PeerOutcome::Abandoned { reason } = o {
                log(format!("cluster snapshot: peer {vm} abandoned: {reason}"));
            }
        }
        let vms: Vec<VmOutcome> = snaps
            .into_iter()
            .map(|h| h.join().expect("snapshot thread panicked"))
            .collect();
        (outcome, events, vms)
    });
    let ns = net.stats();
    let elapsed = t0.elapsed();
    let protocol = ProtocolStats {
        messages_sent: ns.sent,
        messages_dropped: ns.dropped,
        events: events
            .into_iter()
            .chain(std::iter::once(format!(
                "protocol ended after {:.1} ms",
                elapsed.as_secs_f64() * 1000.0
            )))
            .collect(),
    };
    (outcome, vms, protocol)
}

/// One line for the progress stream and the report, or `None` for routine
/// retransmissions (counted by the transport).
fn describe(ev: &InitiatorEvent, t0: Instant) -> Option<String> {
    let at = ev.at.saturating_duration_since(t0).as_secs_f64() * 1000.0;
    let what = match &ev.kind {
        InitiatorEventKind::Started { peers } => format!("SNAPSHOT sent to {peers} peers"),
        InitiatorEventKind::TransientFin { peer } => format!("TRANSIENT_SNAP_FIN from {peer}"),
        InitiatorEventKind::AllTransient => "ALL_TRANSIENT_SNAP_FIN sent".to_string(),
        InitiatorEventKind::FullFin { peer } => format!("FULL_SNAP_FIN from {peer}"),
        InitiatorEventKind::Done => "ALL_FULL_SNAP_FIN sent: complete".to_string(),
        InitiatorEventKind::Aborted { reason } => format!("ABORT sent: {reason}"),
        InitiatorEventKind::Retransmit { .. } => return None,
        other => format!("{other:?}"),
    };
    Some(format!("{at:.1} ms: {what}"))
}

/// The abort reason, with the VMs' own errors.
fn abort_detail(reason: &str, vms: &[VmOutcome]) -> String {
    let errors: Vec<String> = vms
        .iter()
        .filter_map(|v| v.error.as_ref().map(|e| format!("{}: {e}", v.vm)))
        .collect();
    if errors.is_empty() {
        format!("abandoned: {reason}")
    } else {
        format!("abandoned: {reason} ({})", errors.join("; "))
    }
}

fn mode_name(mode: Mode) -> String {
    snapshot::serde_name(mode)
}

/// The directory of a committed cluster snapshot, by name or path.
pub fn resolve(run: &RunDir, name_or_path: &Path) -> PathBuf {
    if name_or_path.components().count() == 1 && !name_or_path.exists() {
        run.snapshots_dir().join(name_or_path)
    } else {
        name_or_path.to_path_buf()
    }
}
