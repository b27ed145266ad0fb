//! Running a cluster snapshot's protocol: the initiator, and per VM a peer
//! and a snapshot thread, on the in-process transport (see the docs of
//! `super`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::{Scope, ScopedJoinHandle};
use std::time::{Duration, Instant};

use vmcsnap_coord::snapshot::{
    run_initiator, run_peer, Initiator, InitiatorEvent, InitiatorEventKind, InitiatorOutcome, Msg,
    Peer, PeerInput, PeerOutcome, Timeouts,
};
use vmcsnap_coord::transport::{Envelope, InProcessEndpoint, InProcessNetwork};
use vmcsnap_switch::PortId;

use super::peer::{self, Job, VmOutcome, Worker};
use super::{barrier, ProtocolStats, INITIATOR};
use crate::cluster::Cluster;
use crate::snapshot::{self, Mode};
use crate::stored_config::StoredVmConfig;
use crate::{log, RunDir};

/// What the protocol's threads share of the cluster snapshot.
pub(super) struct ProtocolCtx<'a> {
    pub run: &'a RunDir,
    pub epoch: u64,
    pub mode: Mode,
    pub tmp: &'a Path,
    pub disks: &'a Path,
    pub cut_probes: u32,
}

/// A peer's ends: its inbox (sender and receiver) and its endpoint.
type PeerLink = (
    Sender<PeerInput>,
    Receiver<PeerInput>,
    InProcessEndpoint<Msg>,
);
/// Where the initiator's messages go; emptied once every peer has
/// finished, so that the initiator stops lingering for retransmitted FINs
/// (nothing is lost in-process).
type InitiatorInbox = Arc<Mutex<Option<Sender<Envelope<Msg>>>>>;
type InitiatorThread<'scope> = ScopedJoinHandle<'scope, (InitiatorOutcome, Vec<String>)>;
type PeerThread<'scope> = ScopedJoinHandle<'scope, (String, PeerOutcome)>;

/// Runs the initiator, and per VM a peer and a snapshot thread, until the
/// protocol ends; forwards progress lines meanwhile.
pub(super) fn run_protocol(
    c: &mut Cluster,
    ctx: &ProtocolCtx<'_>,
    configs: Vec<StoredVmConfig>,
    triggers: mpsc::Receiver<PortId>,
    progress: &mut dyn FnMut(&str),
) -> (InitiatorOutcome, Vec<VmOutcome>, ProtocolStats) {
    let timeouts = timeouts_for(ctx.mode);
    let net = InProcessNetwork::<Msg>::new();
    let (init_tx, init_rx) = mpsc::channel();
    let init_inbox: InitiatorInbox = Arc::new(Mutex::new(Some(init_tx)));
    let deliver = init_inbox.clone();
    let init_ep = net.join(INITIATOR, move |env| {
        if let Some(tx) = deliver.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = tx.send(env);
        }
    });
    let (progress_tx, progress_rx) = mpsc::channel::<String>();
    let names: Vec<String> = c.members.iter().map(|m| m.vm.name.clone()).collect();
    let (inboxes, peers) = join_peers(&net, c);
    let t0 = Instant::now();
    let finished = AtomicBool::new(false);
    let (outcome, events, vms) = std::thread::scope(|s| {
        let (finished, inboxes) = (&finished, &inboxes);
        s.spawn(move || forward_triggers(&triggers, inboxes, finished));
        let (snaps, workers, prep_errors) =
            prepare_snapshots(s, c, ctx, configs, &peers, &progress_tx);
        let mut peer_threads = Vec::new();
        let init = if prep_errors.is_empty() {
            let _ = progress_tx.send(format!(
                "every VM is prepared after {:.1} ms; starting the protocol",
                t0.elapsed().as_secs_f64() * 1000.0
            ));
            peer_threads = start_peers(s, ctx.epoch, &timeouts, workers, peers);
            let ptx = progress_tx.clone();
            let (epoch, t) = (ctx.epoch, timeouts.clone());
            Some(s.spawn(move || initiator(epoch, names, t, &init_ep, &init_rx, &ptx)))
        } else {
            for w in &workers {
                let _ = w.start.send(peer::WorkerCmd::Abandon);
            }
            drop(workers);
            None
        };
        drop(progress_tx);
        let threads = Threads {
            init,
            peers: peer_threads,
            snaps,
        };
        forward_progress(&progress_rx, &threads, &init_inbox, inboxes, progress);
        finished.store(true, Ordering::SeqCst);
        join_all(threads, &prep_errors)
    });
    (outcome, vms, protocol_stats(&net, events, t0))
}

/// Stop-copy and pre-copy finish their "transient" pause only once all
/// of memory is copied.
fn timeouts_for(mode: Mode) -> Timeouts {
    let transient_deadline = if mode == Mode::Hot {
        Duration::from_secs(120)
    } else {
        Duration::from_secs(900)
    };
    Timeouts {
        retry: Duration::from_millis(200),
        transient_deadline,
        full_deadline: Duration::from_secs(1800),
    }
}

/// Every VM's peer on the network: its inbox by switch port (for the cut
/// triggers) and its ends, in the members' order.
fn join_peers(
    net: &Arc<InProcessNetwork<Msg>>,
    c: &Cluster,
) -> (HashMap<PortId, Sender<PeerInput>>, Vec<PeerLink>) {
    let mut inboxes = HashMap::new();
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
    (inboxes, peers)
}

/// Hands the switch's cut triggers to the peers of their ports, until the
/// protocol is over.
fn forward_triggers(
    triggers: &Receiver<PortId>,
    inboxes: &HashMap<PortId, Sender<PeerInput>>,
    finished: &AtomicBool,
) {
    loop {
        match triggers.recv_timeout(Duration::from_millis(20)) {
            Ok(port) => {
                if let Some(tx) = inboxes.get(&port) {
                    let _ = tx.send(PeerInput::Trigger);
                }
            }
            Err(RecvTimeoutError::Timeout) if !finished.load(Ordering::SeqCst) => {}
            Err(_) => return,
        }
    }
}

/// Starts every VM's snapshot thread, which prepares its snapshot (disk
/// overlay, capture, migration settings) and waits; the protocol starts
/// once all are ready, so that the pauses start together. Returns the
/// threads, their workers and the errors of those that failed preparing.
fn prepare_snapshots<'scope>(
    s: &'scope Scope<'scope, '_>,
    c: &'scope mut Cluster,
    ctx: &'scope ProtocolCtx<'_>,
    configs: Vec<StoredVmConfig>,
    peers: &[PeerLink],
    progress_tx: &Sender<String>,
) -> (
    Vec<ScopedJoinHandle<'scope, VmOutcome>>,
    Vec<Worker>,
    Vec<String>,
) {
    let (ready_tx, ready_rx) = mpsc::channel();
    // And once started, every VM prepares its network cut (the guest
    // reads the cut probes, which takes each VM its own time) before
    // any VM stops (pre-copy: QEMU pauses each VM by itself).
    let barrier =
        (ctx.mode != Mode::Precopy).then(|| Arc::new(barrier::StopBarrier::new(c.members.len())));
    let switch = c.switch.clone();
    let mut snaps = Vec::new();
    let mut workers = Vec::new();
    for ((m, (tx, _, _)), config) in c.members.iter_mut().zip(peers).zip(configs) {
        let (start_tx, start_rx) = mpsc::channel();
        let cancel: peer::Cancel = Arc::new(Mutex::new(None));
        let vm = m.vm.name.clone();
        let job = Job {
            opts: vm_options(ctx, &vm, config),
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
    (snaps, workers, prep_errors)
}

/// One VM's snapshot options in a cluster snapshot.
fn vm_options(ctx: &ProtocolCtx<'_>, vm: &str, config: StoredVmConfig) -> snapshot::Options {
    snapshot::Options {
        mode: ctx.mode,
        name: Some(vm.to_string()),
        reference: None,
        fault: None,
        vm_config: config,
        target: Some(snapshot::Target {
            root: ctx.tmp.join("vms"),
            disks_dir: ctx.disks.join(vm),
        }),
        writer: Default::default(),
        full: true,
        disk_layer: true,
        // One DAMON kdamond for all VMs' pauses at once: none.
        access_window: std::time::Duration::ZERO,
    }
}

/// Starts a peer thread per VM.
fn start_peers<'scope>(
    s: &'scope Scope<'scope, '_>,
    epoch: u64,
    timeouts: &Timeouts,
    workers: Vec<Worker>,
    peers: Vec<PeerLink>,
) -> Vec<PeerThread<'scope>> {
    let mut threads = Vec::new();
    for (mut worker, (_, rx, ep)) in workers.into_iter().zip(peers) {
        let (timeouts, vm) = (timeouts.clone(), worker.vm.clone());
        threads.push(s.spawn(move || {
            let p = Peer::new(epoch, vm.clone(), INITIATOR.to_string(), timeouts);
            let outcome = run_peer(p, &ep, &rx, &mut worker);
            drop(worker); // a snapshot thread still waiting for Start ends
            (vm, outcome)
        }));
    }
    threads
}

/// The initiator's thread: runs it to its outcome, sends its events as
/// progress lines, and returns them for the report.
fn initiator(
    epoch: u64,
    names: Vec<String>,
    timeouts: Timeouts,
    ep: &InProcessEndpoint<Msg>,
    inbox: &Receiver<Envelope<Msg>>,
    progress: &Sender<String>,
) -> (InitiatorOutcome, Vec<String>) {
    let mut i = Initiator::new(epoch, INITIATOR.to_string(), names, timeouts);
    let t_start = Instant::now();
    let outcome = run_initiator(&mut i, ep, inbox, &mut |ev| {
        if let Some(line) = describe(ev, t_start) {
            let _ = progress.send(format!("protocol: {line}"));
        }
    });
    let events: Vec<String> = i
        .events()
        .iter()
        .filter_map(|e| describe(e, t_start))
        .collect();
    (outcome, events)
}

/// The protocol's threads (no initiator if preparing failed).
struct Threads<'scope> {
    init: Option<InitiatorThread<'scope>>,
    peers: Vec<PeerThread<'scope>>,
    snaps: Vec<ScopedJoinHandle<'scope, VmOutcome>>,
}

/// Forwards progress lines until every thread has finished.
fn forward_progress(
    progress_rx: &Receiver<String>,
    threads: &Threads<'_>,
    init_inbox: &InitiatorInbox,
    inboxes: &HashMap<PortId, Sender<PeerInput>>,
    progress: &mut dyn FnMut(&str),
) {
    let init = threads.init.as_ref();
    let mut init_done_at: Option<Instant> = None;
    let mut peers_told = false;
    loop {
        match progress_rx.recv_timeout(Duration::from_millis(50)) {
            Ok(line) => progress(&line),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        let peers_done = threads.peers.iter().all(|h| h.is_finished())
            && threads.snaps.iter().all(|h| h.is_finished());
        if peers_done {
            init_inbox.lock().unwrap_or_else(|p| p.into_inner()).take();
            if init.is_none_or(|h| h.is_finished()) {
                break;
            }
        }
        // A peer that never heard SNAPSHOT waits by design; once the
        // initiator is over, tell it the snapshot is gone.
        if init.is_some_and(|h| h.is_finished()) && !peers_done {
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
}

/// Joins every thread: the protocol's outcome and events, the VMs'
/// outcomes.
fn join_all(
    threads: Threads<'_>,
    prep_errors: &[String],
) -> (InitiatorOutcome, Vec<String>, Vec<VmOutcome>) {
    let (outcome, events) = match threads.init {
        Some(h) => h.join().expect("initiator thread panicked"),
        None => (
            InitiatorOutcome::Aborted {
                reason: format!("preparing failed: {}", prep_errors.join("; ")),
            },
            vec![],
        ),
    };
    for h in threads.peers {
        let (vm, o) = h.join().expect("peer thread panicked");
        if let PeerOutcome::Abandoned { reason } = o {
            log(format!("cluster snapshot: peer {vm} abandoned: {reason}"));
        }
    }
    let vms: Vec<VmOutcome> = threads
        .snaps
        .into_iter()
        .map(|h| h.join().expect("snapshot thread panicked"))
        .collect();
    (outcome, events, vms)
}

/// The transport's counts and the protocol's events, with its duration.
fn protocol_stats(net: &InProcessNetwork<Msg>, events: Vec<String>, t0: Instant) -> ProtocolStats {
    let ns = net.stats();
    let elapsed = t0.elapsed();
    ProtocolStats {
        messages_sent: ns.sent,
        messages_dropped: ns.dropped,
        events: events
            .into_iter()
            .chain(std::iter::once(format!(
                "protocol ended after {:.1} ms",
                elapsed.as_secs_f64() * 1000.0
            )))
            .collect(),
    }
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
