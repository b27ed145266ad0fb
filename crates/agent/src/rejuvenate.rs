//! Rejuvenating the hypervisor layer of a VM: restart its QEMU process.
//!
//! Three ways, after the warm-VM reboot paper (Kourai & Chiba):
//!
//! - **warm** (on-memory suspend/resume): guest RAM already lives in a shared
//!   file under /dev/shm. Pause, save only device state (QEMU's
//!   `x-ignore-shared`: RAM is not in the stream), quit the old QEMU, start a
//!   new one (the binary may have changed on disk) on the same RAM file with
//!   `-incoming defer`, load the device state, resume. Guest memory is never
//!   copied, and the old QEMU's exit is not waited for (only until it runs
//!   no code of its own: the kernel unmapping the guest RAM it mapped goes
//!   on in the background, see [`crate::qemu_exit`]), so the downtime does
//!   not grow with memory size; page cache and TCP sessions survive.
//! - **saved** (suspend to disk, the paper's "saved-VM reboot"): the same, but
//!   all of RAM goes into the state file on disk and the RAM file is deleted
//!   before the new QEMU loads it back.
//! - **cold**: quit and boot the guest again; its memory and sessions are lost.
//!
//! While the VM is away its switch port is held: frames for it queue in the
//! switch and are delivered to the new QEMU. Before the pause the agent waits
//! until the old QEMU has read everything already sent to it (SIOCOUTQ), so
//! no frame is stranded in the old socket.
//!
//! If the new QEMU fails to start or load, it is retried with the kept copy
//! of the old QEMU ([`crate::qemu_kept`]: taken from `/proc/PID/exe` before
//! the restart, so it works even when the package was upgraded meanwhile,
//! and kept while the VM runs on it, so that any number of restarts in a row
//! can fall back). If that fails too, the state file and the copy are kept,
//! the intent says a restart is unfinished, and `vmcsnap rejuvenate --resume`
//! or `--rollback` ([`crate::restart_recovery`]) starts the VM again.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vmcsnap_switch::mediator::probe::PROBES_BEFORE_PAUSE;
use vmcsnap_switch::SwitchHandle;

use crate::fault::RejuvenateFault;
use crate::intent::Intent;
use crate::member::Member;
use crate::qemu_kept::Kept;
use crate::qemu_restart::{
    caps, event_ts, installed, load_state, shell_quote, start_checked_and_load, try_start_and_load,
    wait_migration, Started, Timings,
};
use crate::vm::Vm;
use crate::{log, AgentError};

/// How long the agent waits for a paused-to-be VM to read what the switch
/// already sent it; hitting the bound is logged, not fatal.
const DRAIN_BOUND: Duration = Duration::from_millis(200);
/// How long the switch may take to connect to a restarted VM's new QEMU
/// before its held frames are released anyway.
const RECONNECT_BOUND: Duration = Duration::from_secs(5);

/// Which kind of restart.
pub use vmcsnap_control::RejuvenateMode as Mode;
pub use vmcsnap_control::RejuvenateReport as Report;

/// Restarts `member`'s QEMU in `mode`.
pub fn rejuvenate(
    member: &mut Member,
    switch: &SwitchHandle,
    qemu_bin: &Path,
    mode: Mode,
    fault: Option<RejuvenateFault>,
) -> Result<Report, AgentError> {
    let vm_dir = member
        .vm
        .config
        .console_log
        .parent()
        .expect("console log is in the VM dir")
        .to_path_buf();
    let state = vm_dir.join("restart.state");
    // Another QEMU release: refused here, before the VM is touched, if
    // the move cannot work (`crate::qemu_crossing`).
    let crossing = crate::qemu_crossing::preflight(&mut member.vm, qemu_bin, mode)?;
    // Keep the running QEMU, in case the new one cannot start.
    let kept_dir = vm_dir.join(crate::qemu_kept::KEPT_DIR);
    let prev = crate::qemu_kept::keep(&kept_dir, member.vm.pid)?;
    let held_before = port_held(switch, member)?;
    let old_pid = member.vm.pid;
    let name = member.vm.name.clone();

    // The switch dials each new QEMU: count connections to know when it
    // has reached the new one.
    let connections = switch.connection_state(member.port)?.connections;
    switch.hold(member.port)?;
    let settle = switch.settle(member.port, DRAIN_BOUND, PROBES_BEFORE_PAUSE)?;
    if !settle.state.is_drained() || settle.unsettled {
        log(format!(
            "VM {}: its QEMU had not taken everything sent to it after {:?} ({} bytes unread, {} of {PROBES_BEFORE_PAUSE} probes read)",
            name, settle.waited, settle.state.unread_bytes, settle.probes_read
        ));
    }
    let t0 = Instant::now();
    let result = match mode {
        Mode::Cold => cold(member, qemu_bin, &prev, &crossing, fault),
        Mode::Cpr => crate::rejuvenate_cpr::transfer(member, qemu_bin, &crossing),
        Mode::Warm | Mode::Saved => {
            suspend_resume(member, qemu_bin, &prev, &crossing, &state, mode, fault)
        }
    };
    // Whatever happened, let frames flow again to whichever QEMU is there,
    // once the switch has connected to it (a release before that would
    // drop what was held).
    if member.vm.pid != old_pid {
        match switch.wait_connected(member.port, connections + 1, RECONNECT_BOUND) {
            Ok(st) if !st.connected_since(connections + 1) => {
                log(format!("VM {name}: the switch has not reached the new QEMU after {RECONNECT_BOUND:?}; releasing its port anyway"));
            }
            Ok(_) => {}
            Err(e) => log(format!(
                "VM {name}: waiting for the switch to reach the new QEMU: {e}"
            )),
        }
    }
    let released = switch.release(member.port);
    let mut t = result?;
    released?;
    let frames_held = port_held(switch, member)? - held_before;
    if t.downtime_ms == 0.0 {
        t.downtime_ms = t0.elapsed().as_secs_f64() * 1000.0;
    }
    let state_bytes = std::fs::metadata(&state).map(|m| m.len()).unwrap_or(0);
    let _ = std::fs::remove_file(&state);
    crate::qemu_kept::drop_unless_used(&kept_dir, member.vm.pid);
    let qemu = std::fs::read_link(format!("/proc/{}/exe", member.vm.pid)).ok();
    if let Some(reason) = &t.fallback_reason {
        log(format!(
            "VM {name}: the new QEMU could not take over ({reason}); it runs on the kept copy of its previous QEMU, {}",
            prev.bin.display()
        ));
    }
    let report = Report {
        vm: name,
        mode,
        memory_mib: member.vm.config.memory_mib,
        downtime_ms: t.downtime_ms,
        save_ms: t.save_ms,
        restart_ms: t.restart_ms,
        load_ms: t.load_ms,
        quit_ms: t.quit_ms,
        start_ms: t.start_ms,
        resume_ms: t.resume_ms,
        state_bytes,
        drain_ms: settle.waited.as_secs_f64() * 1000.0,
        drain_bound_hit: !settle.state.is_drained(),
        unsettled: settle.unsettled,
        frames_held,
        old_pid,
        new_pid: member.vm.pid,
        fell_back_to_old_binary: t.fallback_reason.is_some(),
        fallback_reason: t.fallback_reason,
        qemu,
    };
    log(format!(
        "rejuvenate {} {:?}: downtime {:.1} ms (save {:.1}, restart {:.1} of which quit {:.1} and start {:.1}, load {:.1}, resume {:.1}), pid {} -> {}",
        report.vm, mode, report.downtime_ms, report.save_ms, report.restart_ms, report.quit_ms, report.start_ms, report.load_ms, report.resume_ms, old_pid, report.new_pid
    ));
    Ok(report)
}

fn port_held(switch: &SwitchHandle, m: &Member) -> Result<u64, AgentError> {
    Ok(switch
        .stats()?
        .port(m.port)
        .map(|p| p.counters.held)
        .unwrap_or(0))
}

fn suspend_resume(
    m: &mut Member,
    qemu_bin: &Path,
    prev: &Kept,
    crossing: &crate::qemu_crossing::Crossing,
    state: &Path,
    mode: Mode,
    fault: Option<RejuvenateFault>,
) -> Result<Timings, AgentError> {
    let warm = mode == Mode::Warm;
    let vm = &mut m.vm;
    // The firmware the old QEMU runs, pinned for whichever QEMU loads its
    // state (the new one, the kept copy, or a later `--resume`).
    crossing.adapt(&mut vm.config, prev.data_dir.as_deref());
    vm.execute("migrate-set-capabilities", caps(warm))?;
    vm.qmp()?.take_events().map_err(|source| AgentError::Qmp {
        vm: vm.name.clone(),
        source,
    })?;
    // A VM the operator paused is not resumed by a later agent.
    let was_running = vm.run_state() == "running";
    if was_running {
        crate::intent::set(&vm.config, &Intent::Resume)?;
    }
    let t_pause = Instant::now();
    if let Err(e) = vm.execute("stop", Value::Null) {
        crate::intent::clear(&vm.config);
        return Err(e);
    }
    let stop_us = match event_ts(vm, "STOP") {
        Ok(t) => t,
        Err(e) => {
            let _ = vm.execute("cont", Value::Null);
            crate::intent::clear(&vm.config);
            return Err(e);
        }
    };
    let _ = std::fs::remove_file(state);
    let saved = vm
        .execute(
            "migrate",
            json!({ "uri": format!("exec:cat > {}", shell_quote(state)) }),
        )
        .and_then(|_| wait_migration(vm, "saving state"));
    if let Err(e) = saved {
        // The old QEMU still has everything: let the guest run on, once
        // the cancelled migration has ended.
        let _ = vm.execute("migrate_cancel", Value::Null);
        vm.wait_migration_end("the cancelled state save", Duration::from_secs(60));
        let _ = vm.execute("cont", Value::Null);
        crate::intent::clear(&vm.config);
        let _ = std::fs::remove_file(state);
        return Err(e);
    }
    let save_ms = t_pause.elapsed().as_secs_f64() * 1000.0;
    // From here on the saved state is what the VM is: make it durable and
    // say so, so that an agent killed while no QEMU runs this VM is
    // followed by one that starts it from the state.
    let durable = std::fs::File::open(state)
        .and_then(|f| f.sync_all())
        .map_err(AgentError::io("syncing", state))
        .and_then(|()| {
            crate::intent::set(
                &vm.config,
                &Intent::Restart {
                    state: state.to_path_buf(),
                    warm,
                },
            )
        });
    if let Err(e) = durable {
        let _ = vm.execute("cont", Value::Null);
        crate::intent::clear(&vm.config);
        let _ = std::fs::remove_file(state);
        return Err(e);
    }

    let t_restart = Instant::now();
    // Not waiting for the old QEMU's exit: only until it runs no code of
    // its own anymore. The kernel unmapping its guest RAM (hundreds of ms
    // per GiB it mapped) goes on in the background while the new QEMU
    // starts (`crate::qemu_exit`).
    vm.quit_detached();
    let quit_ms = t_restart.elapsed().as_secs_f64() * 1000.0;
    if !warm {
        // Saved-VM reboot: memory must come back from disk, not from RAM.
        let _ = std::fs::remove_file(&vm.config.ram_file);
    }
    let mut config = vm.config.clone();
    config.incoming = true;
    let qemu_log = vm.qemu_log.clone();
    let (mut new, fallback_reason) = start_and_load(
        qemu_bin, prev, crossing, &config, &qemu_log, state, warm, fault,
    )?;
    let restart_ms = t_restart.elapsed().as_secs_f64() * 1000.0 - new.load_ms;
    new.vm.boot_ms = vm.boot_ms;
    let (start_ms, load_ms) = (new.start_ms, new.load_ms);
    *vm = new.vm;
    let mut timings = Timings {
        downtime_ms: 0.0,
        save_ms,
        restart_ms,
        load_ms,
        quit_ms,
        start_ms,
        resume_ms: 0.0,
        fallback_reason,
    };
    if !was_running {
        crate::intent::clear(&vm.config);
        return Ok(timings);
    }
    let t_resume = Instant::now();
    // Not before QEMU has accepted the switch's connection (QEMU 7.2
    // crashes starting a guest before: `Vm::wait_nic_accepted`).
    vm.wait_nic_accepted()?;
    vm.execute("cont", Value::Null)?;
    let resume_us = event_ts(vm, "RESUME")?;
    timings.resume_ms = t_resume.elapsed().as_secs_f64() * 1000.0;
    crate::intent::clear(&vm.config);
    timings.downtime_ms = resume_us.saturating_sub(stop_us) as f64 / 1000.0;
    Ok(timings)
}

/// Starts a new QEMU and loads `state` into it; on failure retries with the
/// kept copy of the previous one. Returns the VM, how long the load took,
/// and why the new binary failed if the kept copy took over.
#[allow(clippy::too_many_arguments)]
fn start_and_load(
    qemu_bin: &Path,
    prev: &Kept,
    crossing: &crate::qemu_crossing::Crossing,
    config: &crate::qemu::QemuConfig,
    qemu_log: &Path,
    state: &Path,
    warm: bool,
    fault: Option<RejuvenateFault>,
) -> Result<(Started, Option<String>), AgentError> {
    // Both faults kill the new QEMU; `fallback-fails` fails the kept copy too.
    let new_qemu_dies = crate::fault::new_qemu_dies(fault);
    match try_start_and_load_dying(
        qemu_bin,
        &crossing.for_new(installed(config, qemu_bin)),
        qemu_log,
        state,
        warm,
        new_qemu_dies,
        crossing,
    ) {
        Ok(v) => Ok((v, None)),
        Err(first) => {
            log(format!(
                "VM {}: new QEMU failed ({first}); retrying with the kept copy of the previous one",
                config.name
            ));
            let second = match crate::fault::fallback_failure(fault) {
                Some(injected) => Err(injected),
                None => try_start_and_load(
                    &prev.bin,
                    &crossing.for_old(prev.config(config)),
                    qemu_log,
                    state,
                    warm,
                ),
            };
            second
                .map(|v| (v, Some(first.to_string())))
                .map_err(|second| AgentError::RestartFailed {
                    vm: config.name.clone(),
                    first: first.to_string(),
                    second: second.to_string(),
                    state: state.to_path_buf(),
                })
        }
    }
}

/// [`try_start_and_load`], or with `dies` (injected fault) the QEMU is
/// killed right after it started, so that the load meets a dead QEMU.
fn try_start_and_load_dying(
    bin: &Path,
    config: &crate::qemu::QemuConfig,
    qemu_log: &Path,
    state: &Path,
    warm: bool,
    dies: bool,
    crossing: &crate::qemu_crossing::Crossing,
) -> Result<Started, AgentError> {
    if !dies {
        return start_checked_and_load(bin, config, qemu_log, state, warm, Some(crossing));
    }
    let mut vm = Vm::spawn(bin, config.clone(), qemu_log.to_path_buf())?;
    log(format!(
        "VM {}: injected fault: killing the new QEMU {} before it loads",
        config.name, vm.pid
    ));
    // SAFETY: SIGKILL to the QEMU just spawned, still our unreaped child
    // (shutdown below reaps it), so the pid cannot have been reused.
    unsafe { libc::kill(vm.pid as i32, libc::SIGKILL) };
    let r = load_state(&mut vm, state, warm);
    vm.shutdown();
    Err(r.err().unwrap_or_else(|| {
        AgentError::BadRequest("injected fault: the new QEMU was killed".into())
    }))
}

fn cold(
    m: &mut Member,
    qemu_bin: &Path,
    prev: &Kept,
    crossing: &crate::qemu_crossing::Crossing,
    fault: Option<RejuvenateFault>,
) -> Result<Timings, AgentError> {
    let vm = &mut m.vm;
    let t = Instant::now();
    crate::intent::set(&vm.config, &Intent::Boot)?;
    vm.shutdown();
    let _ = std::fs::remove_file(&vm.config.ram_file);
    let mut config = vm.config.clone();
    config.incoming = false;
    // A boot, not a restore: the guest must run (a VM restored with
    // --paused and resumed since still says -S).
    config.paused = false;
    // A boot: on the new QEMU's own firmware, whatever an earlier move
    // between releases pinned (`crate::qemu_crossing`).
    config.bios = None;
    let qemu_log = vm.qemu_log.clone();
    let boot = |bin: &Path, config: crate::qemu::QemuConfig| -> Result<Vm, AgentError> {
        let mut new = Vm::spawn(bin, config, qemu_log.clone())?;
        let deadline = Instant::now() + Duration::from_secs(120);
        while !new.poll_ready(vmcsnap_guest::READY_MARKER)? {
            if Instant::now() > deadline {
                new.shutdown();
                return Err(AgentError::BootTimeout {
                    vm: new.name.clone(),
                    secs: 120,
                    console: new.console_for_error(2000),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        new.qmp()?;
        Ok(new)
    };
    let first = match crate::fault::fallback_failure(fault) {
        Some(injected) => Err(injected),
        None => boot(qemu_bin, crossing.for_new(installed(&config, qemu_bin))),
    };
    let (new, fallback_reason) = match first {
        Ok(v) => (v, None),
        Err(first) => {
            log(format!(
                "VM {}: cold boot failed ({first}); retrying with the kept copy of the previous QEMU",
                vm.name
            ));
            let second = match crate::fault::fallback_failure(fault) {
                Some(injected) => Err(injected),
                None => boot(&prev.bin, crossing.for_old(prev.config(&config))),
            };
            match second {
                Ok(v) => (v, Some(first.to_string())),
                Err(second) => {
                    return Err(AgentError::RestartFailed {
                        vm: vm.name.clone(),
                        first: first.to_string(),
                        second: second.to_string(),
                        state: vm_dir_of(&vm.config),
                    })
                }
            }
        }
    };
    let load_ms = new.boot_ms.unwrap_or(0) as f64;
    *vm = new;
    crate::intent::clear(&vm.config);
    let downtime_ms = t.elapsed().as_secs_f64() * 1000.0;
    Ok(Timings {
        downtime_ms,
        save_ms: 0.0,
        restart_ms: downtime_ms - load_ms,
        load_ms,
        quit_ms: 0.0,
        start_ms: 0.0,
        resume_ms: 0.0,
        fallback_reason,
    })
}

fn vm_dir_of(config: &crate::qemu::QemuConfig) -> PathBuf {
    config
        .console_log
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}
