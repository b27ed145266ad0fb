//! `vmcsnap rejuvenate --mode cpr`: QEMU 10.0's own warm restart,
//! `cpr-transfer` (QEMU's docs/devel/migration/CPR.rst).
//!
//! Unlike a warm restart, the new QEMU starts *beside* the old one, which
//! keeps running the guest meanwhile:
//!
//! 1. the new QEMU starts with `-incoming defer` and a second `-incoming`,
//!    the cpr channel (a unix socket in the VM's directory);
//! 2. the old QEMU is told to `migrate` in mode `cpr-transfer` with a main
//!    and a cpr channel: it hands the new one its RAM file descriptors over
//!    the cpr channel; the new one builds its devices and opens its monitor
//!    (on the VM's usual socket paths: QEMU unlinks a path before binding);
//! 3. `migrate-incoming` on the new QEMU: it listens on the main channel,
//!    the old one stops the guest, sends the device state (RAM stays in
//!    place: `x-ignore-shared`), and the new one resumes the guest itself.
//!
//! The downtime is then only stop, device state, resume: the new QEMU's
//! start-up is not in it. Both QEMUs have bound the same socket paths, and
//! the old one unlinks "its" paths when it quits, which by then name the
//! new QEMU's sockets: they are hard-linked aside before the old QEMU quits
//! and renamed back after.
//!
//! It needs QEMU 10.0 on both sides and a VM started with
//! `aux-ram-share=on` ([`crate::qemu::QemuConfig::cpr_ready`]; a warm or
//! saved restart onto 10.0 makes it so). There is no kept-copy fallback:
//! until the switchover the old QEMU runs the guest, and a failure leaves
//! it running.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::member::Member;
use crate::qemu_crossing::Crossing;
use crate::qemu_restart::{caps, event_ts, installed, wait_migration_every, Timings};
use crate::vm::Vm;
use crate::{log, AgentError};

/// How long the new QEMU may take to listen on the cpr channel and to
/// open its monitor.
const START_BOUND: Duration = Duration::from_secs(30);
/// How often the new QEMU is asked whether it has loaded the state.
const LOAD_POLL: Duration = Duration::from_millis(20);

/// Moves `m` to a new QEMU `bin` by cpr-transfer.
pub(crate) fn transfer(
    m: &mut Member,
    bin: &Path,
    crossing: &Crossing,
) -> Result<Timings, AgentError> {
    let vm = &mut m.vm;
    if !vm.config.cpr_ready {
        return Err(AgentError::BadRequest(format!(
            "VM {:?} runs without aux-ram-share=on, which cpr-transfer needs (QEMU refuses to transfer its ROMs); one warm restart onto QEMU 10.0 makes it ready: `vmcsnap rejuvenate --vm {} --mode warm`, then --mode cpr",
            vm.name, vm.name
        )));
    }
    let dir = vm
        .config
        .console_log
        .parent()
        .expect("console log is in the VM dir")
        .to_path_buf();
    let (cpr_sock, main_sock) = (dir.join("cpr.sock"), dir.join("cpr-main.sock"));
    let _ = std::fs::remove_file(&cpr_sock);
    let _ = std::fs::remove_file(&main_sock);
    let old_qmp = inode(&vm.config.qmp_socket);
    let mut config = installed(&vm.config, bin);
    config.incoming = true;
    config.cpr_channel = Some(cpr_sock.clone());
    let was_running = vm.run_state() == "running";
    vm.execute("migrate-set-capabilities", caps(true))?;
    vm.execute("migrate-set-parameters", json!({ "mode": "cpr-transfer" }))?;
    vm.qmp()?.take_events().map_err(|source| AgentError::Qmp {
        vm: vm.name.clone(),
        source,
    })?;

    let t_start = Instant::now();
    let mut new = Vm::spawn(bin, config, vm.qemu_log.clone())?;
    let started =
        wait_for(&mut new, "listen on its cpr channel", || cpr_sock.exists()).and_then(|()| {
            if was_running {
                crate::intent::set(&vm.config, &crate::intent::Intent::Resume)?;
            }
            let main = json!({ "transport": "socket", "type": "unix", "path": main_sock });
            let cpr = json!({ "transport": "socket", "type": "unix", "path": cpr_sock });
            let channels = json!({ "channels": [
                { "channel-type": "main", "addr": main },
                { "channel-type": "cpr", "addr": cpr },
            ] });
            // The socket file exists from its bind(), a moment before the
            // new QEMU listens: "Connection refused" then (the bench met
            // it). The old QEMU fails that migration before it stops the
            // guest; ask again.
            let deadline = Instant::now() + START_BOUND;
            loop {
                match vm.execute("migrate", channels.clone()) {
                    Err(e) if e.to_string().contains("Connection refused") => {
                        if Instant::now() > deadline {
                            return Err(e);
                        }
                        vm.wait_migration_end("a refused cpr-transfer", Duration::from_secs(10));
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    r => {
                        r?;
                        break;
                    }
                };
            }
            // Its monitor opens once it has read the cpr channel: on a new
            // socket at the same path.
            let qmp = new.config.qmp_socket.clone();
            wait_for(&mut new, "open its monitor", || {
                inode(&qmp).is_some_and(|i| Some(i) != old_qmp)
            })?;
            new.qmp()?;
            crossing.check_greeting(&mut new)?;
            let start_ms = t_start.elapsed().as_secs_f64() * 1000.0;
            new.execute("migrate-set-capabilities", caps(true))?;
            new.execute("migrate-set-parameters", json!({ "mode": "cpr-transfer" }))?;
            let t_load = Instant::now();
            new.execute(
                "migrate-incoming",
                json!({ "channels": [ { "channel-type": "main", "addr": main } ] }),
            )?;
            // The new QEMU resumes the guest by itself: polling it no faster
            // than this keeps its main loop (which loads the state) free; the
            // downtime is QEMU's own STOP to RESUME either way.
            wait_migration_every(&mut new, "loading state (cpr-transfer)", LOAD_POLL)?;
            Ok((start_ms, t_load.elapsed().as_secs_f64() * 1000.0))
        });
    let (start_ms, load_ms) = match started {
        Ok(v) => v,
        Err(e) => {
            new.discard("the cpr-transfer failed");
            give_back(vm, was_running);
            let _ = std::fs::remove_file(&cpr_sock);
            let _ = std::fs::remove_file(&main_sock);
            return Err(e);
        }
    };
    let stop_us = event_ts(vm, "STOP")?;
    let resume_us = if was_running {
        Some(event_ts(&mut new, "RESUME")?)
    } else {
        None
    };
    // The old QEMU quits; its clean-up unlinks the socket paths, which
    // name the new QEMU's sockets now: keep them aside meanwhile.
    let t_quit = Instant::now();
    let kept = keep_aside(&socket_paths(&new.config));
    vm.quit_detached();
    put_back(kept);
    let quit_ms = t_quit.elapsed().as_secs_f64() * 1000.0;
    let _ = std::fs::remove_file(&cpr_sock);
    let _ = std::fs::remove_file(&main_sock);
    // A later warm restart migrates in QEMU's normal mode.
    new.execute("migrate-set-parameters", json!({ "mode": "normal" }))?;
    new.config.cpr_channel = None;
    new.config.incoming = false;
    new.boot_ms = vm.boot_ms;
    *vm = new;
    crate::intent::clear(&vm.config);
    let downtime_ms = resume_us
        .map(|r| r.saturating_sub(stop_us) as f64 / 1000.0)
        .unwrap_or(0.0);
    log(format!("VM {}: cpr-transfer done, pid {}", vm.name, vm.pid));
    Ok(Timings {
        downtime_ms,
        save_ms: 0.0,
        restart_ms: start_ms,
        load_ms,
        quit_ms,
        start_ms,
        resume_ms: 0.0,
        fallback_reason: None,
    })
}

/// The old QEMU after a failed transfer: cancel what is left of its
/// migration and let the guest run on.
fn give_back(vm: &mut Vm, was_running: bool) {
    let _ = vm.execute("migrate_cancel", Value::Null);
    vm.wait_migration_end("the cancelled cpr-transfer", Duration::from_secs(60));
    let _ = vm.execute("migrate-set-parameters", json!({ "mode": "normal" }));
    if was_running && vm.run_state() != "running" {
        let _ = vm.execute("cont", Value::Null);
    }
    crate::intent::clear(&vm.config);
}

/// Polls `ready` until it holds; fails if `new` exits or takes too long.
fn wait_for(new: &mut Vm, what: &str, ready: impl Fn() -> bool) -> Result<(), AgentError> {
    let deadline = Instant::now() + START_BOUND;
    while !ready() {
        if let Some(status) = new.exited() {
            return Err(AgentError::QemuExited {
                vm: new.name.clone(),
                status,
                output: crate::vm::tail(&new.qemu_log, 2000),
            });
        }
        if Instant::now() > deadline {
            return Err(AgentError::Migration {
                vm: new.name.clone(),
                what: "cpr-transfer".into(),
                detail: format!("the new QEMU did not {what} within {START_BOUND:?}"),
            });
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

fn inode(p: &Path) -> Option<u64> {
    std::fs::symlink_metadata(p).ok().map(|m| m.ino())
}

/// The unix sockets a QEMU of `config` listens on.
fn socket_paths(config: &crate::qemu::QemuConfig) -> Vec<PathBuf> {
    let mut v = vec![
        config.qmp_socket.clone(),
        config.sample_socket(),
        config.port_socket.clone(),
    ];
    if let Some(i) = &config.image {
        v.push(i.qga_socket.clone());
    }
    v
}

/// Hard-links each socket path aside (`<path>.cpr`); returns the pairs.
fn keep_aside(paths: &[PathBuf]) -> Vec<(PathBuf, PathBuf)> {
    paths
        .iter()
        .filter_map(|p| {
            let mut aside = p.clone().into_os_string();
            aside.push(".cpr");
            let aside = PathBuf::from(aside);
            let _ = std::fs::remove_file(&aside);
            match std::fs::hard_link(p, &aside) {
                Ok(()) => Some((aside, p.clone())),
                Err(e) => {
                    log(format!("cpr-transfer: keeping {} aside: {e}", p.display()));
                    None
                }
            }
        })
        .collect()
}

/// Renames the kept links back over the paths.
fn put_back(kept: Vec<(PathBuf, PathBuf)>) {
    for (aside, p) in kept {
        if let Err(e) = std::fs::rename(&aside, &p) {
            log(format!("cpr-transfer: restoring {}: {e}", p.display()));
        }
    }
}
