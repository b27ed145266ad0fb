//! A restore of one VM that answers once its guest runs, while the rest of
//! its pages load in the background (see [`crate::loading`]).

use std::path::Path;
use std::sync::mpsc;
use std::time::SystemTime;

use vmcsnap_control::VmStatus;
use vmcsnap_spec::VmAddress;

use super::job::{unix_us, Options, RestoreEvent, Saved};
use crate::cluster::Cluster;
use crate::guest_clock::ClockSync;
use crate::loading::Ctx;
use crate::qemu::QemuConfig;
use crate::{AgentError, RunDir};

/// What `status` and the early answer say of the VM being restored.
pub(super) struct Shown {
    cluster: String,
    accel: String,
    vm: String,
    address: VmAddress,
    memory_mib: u64,
    qmp_socket: std::path::PathBuf,
    request_us: u64,
    /// The restored VM's config as far as its guest clock goes (its guest
    /// agent's socket in the VM's directory).
    clock_config: QemuConfig,
}

impl Shown {
    /// The VM of `saved`, restored into `c` by a request that came at
    /// `request_us`.
    pub(super) fn of(c: &Cluster, run: &RunDir, saved: &Saved, request_us: u64) -> Shown {
        let vm = saved.qemu.name.clone();
        Shown {
            clock_config: crate::guest_clock::restored_in(&saved.qemu, &run.vm_dir(&vm)),
            cluster: c.spec.cluster.name.clone(),
            accel: c.accel.name().to_string(),
            qmp_socket: run.vm_dir(&vm).join("qmp.sock"),
            vm,
            address: saved.address,
            memory_mib: saved.qemu.memory_mib,
            request_us,
        }
    }
}

/// A restored VM whose guest runs since `started_us`, as `status` lists it
/// before it joins the cluster.
pub fn vm_status(
    name: &str,
    address: &VmAddress,
    memory_mib: u64,
    qmp_socket: &Path,
    started_us: u64,
) -> VmStatus {
    let now = unix_us(SystemTime::now());
    VmStatus {
        name: name.to_string(),
        pid: crate::qemu_find::find_qemu(None, qmp_socket).unwrap_or(0),
        state: "running".into(),
        ip: address.cidr(),
        mac: address.mac_string(),
        memory_mib,
        uptime_s: now.saturating_sub(started_us) as f64 / 1e6,
        port: name.to_string(),
        load: None,
    }
}

/// Runs `restore` (a restore of one VM with `opts`) and answers the
/// request as soon as its guest runs, its clock set first; returns what
/// `restore` returns, at the full load, and that clock's setting.
pub(super) fn answering<T>(
    ctx: &Ctx<'_>,
    shown: Shown,
    mut opts: Options,
    restore: impl FnOnce(&Options) -> Result<T, AgentError>,
) -> (Result<T, AgentError>, Option<ClockSync>) {
    let (tx, rx) = mpsc::channel();
    opts.observer = Some(tx);
    let mode = opts.mode;
    let snapshot = opts.snapshot.clone();
    std::thread::scope(|s| {
        let watcher = s.spawn(|| watch(ctx, &shown, &snapshot, mode, rx));
        let r = restore(&opts);
        drop(opts); // the last sender: the watcher ends
        let clock = watcher.join().ok().flatten();
        ctx.loads.done(&shown.vm);
        (r, clock)
    })
}

/// Follows the restore's events: loads to the board, the guest's clock and
/// the answer at the start.
fn watch(
    ctx: &Ctx<'_>,
    shown: &Shown,
    snapshot: &str,
    mode: vmcsnap_control::RestoreMode,
    events: mpsc::Receiver<RestoreEvent>,
) -> Option<ClockSync> {
    let (mut loaded, mut total, mut all) = (0, 0, false);
    let mut clock = None;
    for ev in events {
        match ev {
            RestoreEvent::Loading { sent, total: t } if !all => {
                (loaded, total) = (sent, t);
                ctx.loads.set(&shown.vm, sent, t);
            }
            RestoreEvent::AllLoaded => {
                all = true;
                loaded = total;
                ctx.loads.done(&shown.vm);
            }
            RestoreEvent::Started(us) => {
                let st = vm_status(
                    &shown.vm,
                    &shown.address,
                    shown.memory_mib,
                    &shown.qmp_socket,
                    us,
                );
                ctx.early.show(&shown.cluster, &shown.accel, vec![st]);
                let set = crate::guest_clock::sync(&shown.clock_config, false);
                let running = vmcsnap_control::RestoreRunning {
                    vm: shown.vm.clone(),
                    snapshot: snapshot.to_string(),
                    mode,
                    paused: false,
                    restore_latency_ms: us.saturating_sub(shown.request_us) as f64 / 1000.0,
                    started_unix_us: us,
                    pages_loaded: loaded,
                    pages_total: total,
                    full_load_ms: None,
                    loading: !all,
                    clock: Some(set.clone()),
                };
                ctx.early
                    .reply(vmcsnap_control::Response::RestoreRunning(running));
                clock = Some(set);
            }
            _ => {}
        }
    }
    clock
}
