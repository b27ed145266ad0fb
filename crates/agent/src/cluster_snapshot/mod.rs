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
mod protocol;
mod report;

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use vmcsnap_coord::snapshot::InitiatorOutcome;
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
use peer::VmOutcome;
use protocol::{run_protocol, ProtocolCtx};

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
