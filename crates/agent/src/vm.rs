//! One VM: its QEMU process, QMP session and console.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;
use vmcsnap_qmp::QmpClient;

use crate::qemu::QemuConfig;
use crate::AgentError;

/// How long a QEMU gets to quit on request before it is killed.
const QUIT_GRACE: Duration = Duration::from_secs(5);
/// How long a new QEMU may take to accept the switch's connection.
const NIC_ACCEPT_BOUND: Duration = Duration::from_secs(10);

/// What an error says of the console when this QEMU printed nothing on it.
pub const CONSOLE_EMPTY: &str = "(the console is empty since this QEMU started)";

/// A QMP command's result and the Unix µs its reply was read.
pub type Timed = (Result<Value, AgentError>, u64);

/// A running (or exited) QEMU process of the cluster.
pub struct Vm {
    /// VM name.
    pub name: String,
    /// The configuration it was started with.
    pub config: QemuConfig,
    /// QEMU's pid.
    pub pid: u32,
    /// When QEMU was started.
    pub started: Instant,
    /// Wall-clock start time.
    pub started_at: SystemTime,
    /// QEMU start to ready marker, once seen.
    pub boot_ms: Option<u64>,
    /// QEMU's own output.
    pub qemu_log: PathBuf,
    /// Whether this QEMU process has read every page of guest RAM (page
    /// tables populated), so that a hot snapshot's write-protect setup is
    /// quick; see `snapshot::populate_ram`.
    pub ram_populated: bool,
    /// `None` for a QEMU adopted from a previous agent image (after an
    /// agent restart by exec it is still our child, known by pid only).
    child: Option<Child>,
    qmp: Option<QmpClient>,
    /// The events of QMP sessions closed since (a broken session is
    /// reopened), newest last, at most [`vmcsnap_qmp::HISTORY`].
    past_events: Vec<vmcsnap_qmp::QmpEvent>,
    scan_offset: u64,
    /// The console log's length when this QEMU started (or was adopted):
    /// the log is appended across incarnations of the VM (boot, restores,
    /// restarts), and an error quotes only what this QEMU printed.
    console_start: u64,
    exit_status: Option<String>,
}

impl Vm {
    /// Starts QEMU with `config`. QEMU runs in its own process group so a
    /// signal to the agent's group (Ctrl-C) never reaches the guests.
    pub fn spawn(qemu: &Path, config: QemuConfig, qemu_log: PathBuf) -> Result<Vm, AgentError> {
        let log = File::create(&qemu_log).map_err(AgentError::io("creating", &qemu_log))?;
        let log2 = log
            .try_clone()
            .map_err(AgentError::io("opening", &qemu_log))?;
        if !config.incoming {
            // A fresh boot starts a fresh console log (and events log: the
            // ready marker of an earlier boot must not count); a restarted
            // QEMU (warm/saved restart) appends to the ones it continues.
            let _ = std::fs::remove_file(&config.console_log);
            if let Some(i) = &config.image {
                let _ = std::fs::remove_file(&i.events_log);
            }
        }
        let console_start = file_len(&config.console_log);
        let mut cmd = Command::new(qemu);
        if let Some(d) = &config.module_dir {
            cmd.env("QEMU_MODULE_DIR", d);
        }
        let child = cmd
            .args(config.args())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .process_group(0)
            .spawn()
            .map_err(AgentError::io("starting", qemu))?;
        Ok(Vm {
            name: config.name.clone(),
            pid: child.id(),
            started: Instant::now(),
            started_at: SystemTime::now(),
            boot_ms: None,
            qemu_log,
            ram_populated: false,
            child: Some(child),
            qmp: None,
            past_events: Vec::new(),
            scan_offset: 0,
            console_start,
            exit_status: None,
            config,
        })
    }

    /// A QEMU started by a previous image of this agent process (see
    /// `handover`): same pid, still our child; its QMP session is reopened
    /// on first use. Its errors quote the console from here on (where its
    /// own output began is not recorded; this is never earlier).
    pub fn adopt(
        config: QemuConfig,
        pid: u32,
        started_at: SystemTime,
        boot_ms: Option<u64>,
        qemu_log: PathBuf,
    ) -> Vm {
        let age = SystemTime::now()
            .duration_since(started_at)
            .unwrap_or_default();
        Vm {
            name: config.name.clone(),
            pid,
            started: Instant::now().checked_sub(age).unwrap_or_else(Instant::now),
            started_at,
            boot_ms,
            qemu_log,
            ram_populated: false,
            child: None,
            qmp: None,
            past_events: Vec::new(),
            scan_offset: 0,
            console_start: file_len(&config.console_log),
            exit_status: None,
            config,
        }
    }

    /// A VM whose QEMU was found gone when an agent adopted it: shown as
    /// exited until `down` or `stop` removes it.
    pub fn dead(
        config: QemuConfig,
        pid: u32,
        started_at: SystemTime,
        boot_ms: Option<u64>,
        qemu_log: PathBuf,
    ) -> Vm {
        let mut vm = Vm::adopt(config, pid, started_at, boot_ms, qemu_log);
        vm.exit_status = Some("exited while no agent watched it".into());
        vm
    }

    /// Has QEMU exited? Returns its status text if so.
    pub fn exited(&mut self) -> Option<String> {
        if self.exit_status.is_none() {
            match self.child.as_mut() {
                Some(child) => {
                    if let Ok(Some(st)) = child.try_wait() {
                        self.exit_status = Some(st.to_string());
                    }
                }
                None => {
                    // Our child after an exec handover (reap it), or a QEMU
                    // adopted after a crash (init reaps it; its command line
                    // tells it from a process that reused the pid).
                    self.exit_status = crate::process::reap(self.pid).or_else(|| {
                        (!crate::qemu_find::is_qemu_of(self.pid, &self.config.qmp_socket))
                            .then(|| "exited".to_string())
                    });
                }
            }
        }
        self.exit_status.clone()
    }

    /// Scans new console output for `marker`; records `boot_ms` when seen.
    /// Fails if QEMU has exited.
    pub fn poll_ready(&mut self, marker: &str) -> Result<bool, AgentError> {
        if self.boot_ms.is_some() {
            return Ok(true);
        }
        let start = self.scan_offset.saturating_sub(marker.len() as u64);
        // The lab guest prints the marker on its console; an image VM
        // writes it to its events port (a serial getty may reset the
        // console line while the marker is written).
        let file = self
            .config
            .image
            .as_ref()
            .map_or(&self.config.console_log, |i| &i.events_log);
        let text = read_from(file, start).unwrap_or_default();
        if text.contains(marker) {
            self.boot_ms = Some(self.started.elapsed().as_millis() as u64);
            return Ok(true);
        }
        self.scan_offset = start + text.len() as u64;
        if let Some(status) = self.exited() {
            return Err(AgentError::QemuExited {
                vm: self.name.clone(),
                status,
                output: [
                    tail(&self.qemu_log, 2000).trim_end().to_string(),
                    self.console_for_error(2000),
                ]
                .into_iter()
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join("\n"),
            });
        }
        Ok(false)
    }

    /// The QMP session, connected on first use.
    pub fn qmp(&mut self) -> Result<&mut QmpClient, AgentError> {
        if self.qmp.is_none() {
            // Retry while QEMU starts up, but give up at once if it exits
            // (a broken binary must not cost the whole timeout).
            let deadline = Instant::now() + Duration::from_secs(10);
            let c = loop {
                match QmpClient::connect(&self.config.qmp_socket, Duration::from_millis(200)) {
                    Ok(mut c) => {
                        c.set_timeout(Duration::from_secs(10));
                        break c;
                    }
                    Err(source) => {
                        if let Some(status) = self.exited() {
                            return Err(AgentError::QemuExited {
                                vm: self.name.clone(),
                                status,
                                output: tail(&self.qemu_log, 2000),
                            });
                        }
                        if Instant::now() > deadline {
                            return Err(AgentError::Qmp {
                                vm: self.name.clone(),
                                source,
                            });
                        }
                    }
                }
            };
            self.qmp = Some(c);
        }
        Ok(self.qmp.as_mut().expect("just connected"))
    }

    /// The dialect of this VM's QEMU, from the version in its QMP greeting:
    /// the one key for what differs between QEMU versions (migration
    /// stream, QMP). A version vmcsnap does not speak is an error naming it.
    pub fn dialect(&mut self) -> Result<vmcsnap_migstream::Dialect, AgentError> {
        let v = self.qmp()?.version();
        vmcsnap_migstream::Dialect::for_qemu(v.major, v.minor, v.micro).map_err(|source| {
            AgentError::UnsupportedQemu {
                vm: self.name.clone(),
                source,
            }
        })
    }

    /// Closes the QMP session (the next use opens another), keeping its
    /// events for [`Vm::recent_events`].
    fn close_qmp(&mut self) {
        if let Some(q) = self.qmp.take() {
            self.past_events.extend(q.recent_events());
            let drop = self.past_events.len().saturating_sub(vmcsnap_qmp::HISTORY);
            self.past_events.drain(..drop);
        }
    }

    /// The newest QMP events this agent received from this QEMU (at most
    /// [`vmcsnap_qmp::HISTORY`] per session), oldest first: what explains
    /// a failure. Reads those already waiting on the socket first, and
    /// empties the queue of events not yet taken.
    pub fn recent_events(&mut self) -> Vec<vmcsnap_qmp::QmpEvent> {
        if let Some(q) = self.qmp.as_mut() {
            if q.take_events().is_err() {
                self.close_qmp();
            }
        }
        let mut all = self.past_events.clone();
        if let Some(q) = self.qmp.as_ref() {
            all.extend(q.recent_events());
        }
        all
    }

    /// Runs one QMP command on the session already open, waiting at most
    /// `timeout` for its reply; opens none (a post-mortem must not wait
    /// for a QEMU that does not answer).
    pub fn execute_if_open(
        &mut self,
        command: &str,
        timeout: Duration,
    ) -> Result<Value, AgentError> {
        match self.qmp.as_mut() {
            Some(q) => q.set_timeout(timeout),
            None => {
                return Err(AgentError::Qmp {
                    vm: self.name.clone(),
                    source: vmcsnap_qmp::QmpError::Closed,
                })
            }
        }
        self.execute(command, Value::Null)
    }

    /// Runs one QMP command.
    pub fn execute(&mut self, command: &str, args: Value) -> Result<Value, AgentError> {
        let name = self.name.clone();
        let r = self.qmp()?.execute(command, args);
        if r.is_err() {
            // A broken session is reconnected on next use.
            self.close_qmp();
        }
        r.map_err(|source| AgentError::Qmp { vm: name, source })
    }

    /// Runs `commands` without waiting for a reply between them
    /// ([`QmpClient::execute_pipelined`]): each result, with the Unix µs its
    /// reply was read.
    pub fn execute_pipelined(
        &mut self,
        commands: Vec<(&str, Value)>,
    ) -> Result<Vec<Timed>, AgentError> {
        let name = self.name.clone();
        let out = self.qmp()?.execute_pipelined(commands);
        if out.iter().any(
            |(r, _)| matches!(r, Err(e) if !matches!(e, vmcsnap_qmp::QmpError::Command { .. })),
        ) {
            // A broken session is reconnected on next use.
            self.close_qmp();
        }
        Ok(out
            .into_iter()
            .map(|(r, t)| {
                (
                    r.map_err(|source| AgentError::Qmp {
                        vm: name.clone(),
                        source,
                    }),
                    t,
                )
            })
            .collect())
    }

    /// Waits, up to `limit`, until QEMU has accepted the switch's
    /// connection on its NIC's `-netdev stream` socket.
    ///
    /// QEMU 7.2 must not start a guest before: its stream backend listens
    /// from a thread, and until the main loop has processed that, the
    /// backend has no channel but is not marked down, so `vm_start`'s flush
    /// of queued packets writes to no channel (SIGSEGV in
    /// `qio_channel_writev`; 1 in 20 lazy restores). The switch's own
    /// `connect` succeeding proves nothing (the kernel queues it before
    /// QEMU accepts); QEMU's `info network` names the peer once it has.
    /// If it has not after [`NIC_ACCEPT_BOUND`], says so in the log and
    /// returns: the guest then starts anyway. Fails only if QMP does.
    pub fn wait_nic_accepted(&mut self) -> Result<(), AgentError> {
        let deadline = Instant::now() + NIC_ACCEPT_BOUND;
        loop {
            let info = self.execute(
                "human-monitor-command",
                serde_json::json!({ "command-line": "info network" }),
            )?;
            if nic_accepted(info.as_str().unwrap_or("")) {
                return Ok(());
            }
            if Instant::now() > deadline {
                crate::log(format!(
                    "VM {}: QEMU has not accepted the switch's connection after {NIC_ACCEPT_BOUND:?}; starting the guest anyway",
                    self.name
                ));
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Waits, up to `limit`, until QEMU reports that its migration (`what`,
    /// for the log) has ended: one that was cancelled or is completing on
    /// its own. Until then QEMU refuses new migration settings, a new
    /// migration, and may still stop or resume the guest by itself.
    pub fn wait_migration_end(&mut self, what: &str, limit: Duration) {
        let t = Instant::now();
        loop {
            let status = match self.execute("query-migrate", Value::Null) {
                Ok(st) => st["status"].as_str().unwrap_or("").to_string(),
                Err(e) => {
                    crate::log(format!("VM {}: waiting for {what} to end: {e}", self.name));
                    return;
                }
            };
            if !matches!(
                status.as_str(),
                "setup" | "active" | "device" | "wait-unplug" | "pre-switchover" | "cancelling"
            ) {
                let ms = t.elapsed().as_secs_f64() * 1000.0;
                crate::log(format!(
                    "VM {}: {what} ended ({status}) after {ms:.0} ms",
                    self.name
                ));
                return;
            }
            if t.elapsed() > limit {
                crate::log(format!(
                    "VM {}: {what} is still {status} after {limit:?}",
                    self.name
                ));
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// QEMU's run state (`running`, `paused`, ...) or `exited`.
    pub fn run_state(&mut self) -> String {
        if self.exited().is_some() {
            return "exited".into();
        }
        match self.execute("query-status", Value::Null) {
            Ok(v) => v["status"].as_str().unwrap_or("unknown").to_string(),
            Err(_) => "unresponsive".into(),
        }
    }

    /// The last `bytes` bytes of the console (everything if 0), of every
    /// incarnation of the VM: what `vmcsnap console` shows.
    pub fn console_tail(&self, bytes: u64) -> String {
        tail(&self.config.console_log, bytes)
    }

    /// The last `bytes` bytes (everything if 0) of what this QEMU printed
    /// on the console; `None` if nothing (but blank lines). For errors: an
    /// earlier incarnation's lines say nothing about this one.
    pub fn console_since_start(&self, bytes: u64) -> Option<String> {
        let text = tail_from(&self.config.console_log, self.console_start, bytes);
        (!text.trim().is_empty()).then_some(text)
    }

    /// [`Vm::console_since_start`] for an error's text: [`CONSOLE_EMPTY`]
    /// if this QEMU printed nothing.
    pub fn console_for_error(&self, bytes: u64) -> String {
        self.console_since_start(bytes)
            .unwrap_or_else(|| CONSOLE_EMPTY.to_string())
    }

    /// Asks QEMU to quit, kills it if it does not within a grace period, and
    /// reaps it. Never fails: a VM being torn down must go away.
    pub fn shutdown(&mut self) {
        if self.exited().is_none() {
            if let Some(q) = self.qmp.as_mut() {
                q.set_timeout(Duration::from_secs(2));
            }
            let _ = self.execute("quit", Value::Null);
            let deadline = Instant::now() + QUIT_GRACE;
            // Poll finely: a warm restart's downtime includes this wait.
            while self.exited().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if self.exited().is_none() {
                crate::log(format!(
                    "VM {}: QEMU did not quit; killing pid {}",
                    self.name, self.pid
                ));
                self.kill();
            }
        }
        self.close_qmp();
    }

    /// Asks QEMU to quit and returns as soon as it can no longer run code
    /// of its own (every thread exiting, see [`crate::qemu_exit`]): the
    /// kernel's teardown of its memory and the reaping go on in the
    /// background. Kills it if it is not exiting within a grace period.
    /// Never fails. Afterwards the VM counts as exited.
    ///
    /// For a paused QEMU whose state was saved (a warm restart): the new
    /// QEMU may start at once, even on the same socket paths.
    pub fn quit_detached(&mut self) {
        if self.exited().is_none() {
            if let Some(q) = self.qmp.as_mut() {
                q.set_timeout(Duration::from_secs(2));
            }
            let _ = self.execute("quit", Value::Null);
            if !crate::qemu_exit::wait_exiting(self.pid, QUIT_GRACE) {
                crate::log(format!(
                    "VM {}: QEMU did not quit; killing pid {}",
                    self.name, self.pid
                ));
                // SAFETY: SIGKILL to our QEMU, not reaped yet (the reap
                // below does), so the pid cannot have been reused.
                unsafe { libc::kill(self.pid as i32, libc::SIGKILL) };
                crate::qemu_exit::wait_exiting(self.pid, QUIT_GRACE);
            }
            crate::qemu_exit::reap_in_background(&self.name, self.pid, self.child.take());
            self.exit_status = Some("quit (exiting in the background)".into());
        }
        self.close_qmp();
    }

    /// Kills QEMU at once (SIGKILL) and reaps it, without asking it to
    /// quit: for a QEMU whose state is worthless (an incoming restore or
    /// state load that failed). Such a QEMU may take seconds to answer or
    /// never quit (a postcopy destination whose source is gone waits for
    /// pages that never come), which `shutdown` would wait out. Logs
    /// `why` when it kills. Never fails.
    pub fn discard(&mut self, why: &str) {
        if self.exited().is_none() {
            crate::log(format!(
                "VM {}: killing QEMU pid {} at once, without a quit: {why}",
                self.name, self.pid
            ));
            self.kill();
        }
        self.close_qmp();
    }

    /// SIGKILL and reap.
    fn kill(&mut self) {
        match self.child.as_mut() {
            Some(child) => {
                let _ = child.kill();
                let _ = child.wait();
            }
            None => crate::process::kill_and_reap(self.pid),
        }
        self.exit_status = Some("killed".into());
    }
}

/// The length of `path` (0 if it does not exist).
fn file_len(path: &Path) -> u64 {
    path.metadata().map(|m| m.len()).unwrap_or(0)
}

/// Whether `info network` shows the stream netdev with a peer (its info
/// string is the peer's address once a connection was accepted, empty
/// before).
fn nic_accepted(info: &str) -> bool {
    info.lines().any(|l| {
        l.split_once(&format!("{}: ", crate::qemu::NETDEV_ID))
            .and_then(|(_, rest)| rest.split_once("type=stream,"))
            .is_some_and(|(_, peer)| !peer.trim().is_empty())
    })
}

/// Reads `path` from byte `offset` to its end (lossy UTF-8).
fn read_from(path: &Path, offset: u64) -> std::io::Result<String> {
    let mut f = OpenOptions::new().read(true).open(path)?;
    f.seek(SeekFrom::Start(offset))?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// The last `bytes` of a file (all if 0), starting at a line boundary.
pub fn tail(path: &Path, bytes: u64) -> String {
    tail_from(path, 0, bytes)
}

/// The last `bytes` (all if 0) of what follows byte `from` of a file,
/// starting at a line boundary if cut. A file now shorter than `from` was
/// replaced since: all of it follows.
pub fn tail_from(path: &Path, from: u64, bytes: u64) -> String {
    let len = file_len(path);
    let from = if len < from { 0 } else { from };
    let start = if bytes == 0 {
        from
    } else {
        len.saturating_sub(bytes).max(from)
    };
    let text = read_from(path, start).unwrap_or_default();
    if start > from {
        if let Some(nl) = text.find('\n') {
            return text[nl + 1..].to_string();
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `info network` of QEMU 7.2 before and after it accepted the switch.
    #[test]
    fn the_nic_counts_as_accepted_once_info_network_names_its_peer() {
        let before = "virtio-net-pci.0: index=0,type=nic,model=virtio-net-pci,macaddr=52:54:00:00:00:02\r\n \\ net0: index=0,type=stream,\r\n";
        let after = "virtio-net-pci.0: index=0,type=nic,model=virtio-net-pci,macaddr=52:54:00:00:00:02\r\n \\ net0: index=0,type=stream,unix:/run/x/port.sock\r\n";
        assert!(!nic_accepted(before));
        assert!(nic_accepted(after));
        assert!(!nic_accepted(""));
    }
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    fn append(path: &Path, text: &str) {
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        f.write_all(text.as_bytes()).unwrap();
    }

    fn config(dir: &Path, incoming: bool) -> QemuConfig {
        serde_json::from_value(serde_json::json!({
            "name": "a", "accel": "tcg", "memory_mib": 64, "vcpus": 1,
            "ram_file": dir.join("ram"), "kernel": "/k",
            "console_log": dir.join("console.log"), "qmp_socket": dir.join("qmp.sock"),
            "disks": [], "port_socket": dir.join("port.sock"),
            "mac": "52:54:00:00:00:01", "incoming": incoming
        }))
        .unwrap()
    }

    #[test]
    fn tail_from_reads_only_what_follows_the_offset() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("console.log");
        append(&p, "VMCSNAP-READY a\nold line\n");
        let from = file_len(&p);
        assert_eq!(tail_from(&p, from, 0), "", "nothing new yet");
        assert_eq!(tail_from(&p, from, 100), "");
        append(&p, "new one\nnew two\n");
        assert_eq!(tail_from(&p, from, 0), "new one\nnew two\n");
        // A bound larger than what is new never reaches back before `from`
        // (and does not drop the first new line as a cut one).
        assert_eq!(tail_from(&p, from, 1000), "new one\nnew two\n");
        // A bound inside the new text starts at a line boundary.
        assert_eq!(tail_from(&p, from, 10), "new two\n");
        // The whole file is still there for `vmcsnap console`.
        assert_eq!(tail(&p, 0), "VMCSNAP-READY a\nold line\nnew one\nnew two\n");
        assert_eq!(tail(&p, 10), "new two\n");
        // A file replaced by a shorter one since: all of it is new.
        std::fs::write(&p, "fresh\n").unwrap();
        assert_eq!(tail_from(&p, from, 0), "fresh\n");
        // A missing file reads as empty.
        assert_eq!(tail_from(&d.path().join("none"), 0, 0), "");
    }

    #[test]
    fn an_adopted_vm_quotes_the_console_from_its_adoption() {
        let d = tempfile::tempdir().unwrap();
        let c = config(d.path(), false);
        append(&c.console_log, "VMCSNAP-READY a\n");
        let vm = Vm::adopt(
            c.clone(),
            0,
            SystemTime::now(),
            Some(1),
            d.path().join("q.log"),
        );
        assert_eq!(vm.console_since_start(0), None);
        assert_eq!(vm.console_for_error(2000), CONSOLE_EMPTY);
        append(&c.console_log, "\n  \n");
        assert_eq!(vm.console_since_start(0), None, "blank lines are nothing");
        append(&c.console_log, "Kernel panic\n");
        assert_eq!(vm.console_for_error(2000), "\n  \nKernel panic\n");
        assert_eq!(vm.console_tail(0), "VMCSNAP-READY a\n\n  \nKernel panic\n");
    }

    /// A stand-in for QEMU: appends `line` to the console (unless empty),
    /// then waits to be killed.
    fn fake_qemu(dir: &Path, console: &Path, line: &str) -> PathBuf {
        let bin = dir.join("fake-qemu");
        let print = if line.is_empty() {
            String::new()
        } else {
            format!("echo '{line}' >> '{}'\n", console.display())
        };
        std::fs::write(&bin, format!("#!/bin/sh\n{print}exec sleep 600\n")).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        bin
    }

    /// `Vm::spawn`, retried while another test thread's fork still holds
    /// the just-written script open ("Text file busy").
    fn spawn(bin: &Path, config: QemuConfig, log: PathBuf) -> Vm {
        for _ in 0..100 {
            match Vm::spawn(bin, config.clone(), log.clone()) {
                Ok(vm) => return vm,
                Err(e) if e.to_string().contains("busy") => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(e) => panic!("{e}"),
            }
        }
        panic!("{} stayed busy", bin.display());
    }

    #[test]
    fn a_spawned_vm_quotes_only_its_own_console_and_is_discarded_at_once() {
        let d = tempfile::tempdir().unwrap();
        // An incoming QEMU appends to the console of earlier incarnations.
        let c = config(d.path(), true);
        append(&c.console_log, "VMCSNAP-READY a\nmemtouch: t=5\n");
        let bin = fake_qemu(d.path(), &c.console_log, "this QEMU");
        let mut vm = spawn(&bin, c.clone(), d.path().join("qemu.log"));
        let t = Instant::now();
        while vm.console_since_start(0).is_none() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "the fake QEMU never printed"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(vm.console_for_error(2000), "this QEMU\n");
        assert!(vm.console_tail(0).starts_with("VMCSNAP-READY a\n"));
        assert_eq!(vm.exited(), None);
        vm.discard("a test");
        assert_eq!(vm.exited().as_deref(), Some("killed"));

        // A fresh boot starts a fresh console: nothing of the earlier one.
        let c = config(d.path(), false);
        let bin = fake_qemu(d.path(), &c.console_log, "");
        let mut vm = spawn(&bin, c.clone(), d.path().join("qemu.log"));
        assert_eq!(vm.console_for_error(0), CONSOLE_EMPTY);
        vm.discard("a test");
        assert_eq!(vm.exited().as_deref(), Some("killed"));
    }
}
