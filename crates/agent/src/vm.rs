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
    scan_offset: u64,
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
            scan_offset: 0,
            exit_status: None,
            config,
        })
    }

    /// A QEMU started by a previous image of this agent process (see
    /// `handover`): same pid, still our child; its QMP session is reopened
    /// on first use.
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
            scan_offset: 0,
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
                    self.exit_status = crate::handover::reap(self.pid).or_else(|| {
                        (!crate::record::is_qemu_of(self.pid, &self.config.qmp_socket))
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
                output: format!("{}{}", tail(&self.qemu_log, 2000), self.console_tail(2000)),
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

    /// Runs one QMP command.
    pub fn execute(&mut self, command: &str, args: Value) -> Result<Value, AgentError> {
        let name = self.name.clone();
        let r = self.qmp()?.execute(command, args);
        if r.is_err() {
            // A broken session is reconnected on next use.
            self.qmp = None;
        }
        r.map_err(|source| AgentError::Qmp { vm: name, source })
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

    /// The last `bytes` bytes of the console (everything if 0).
    pub fn console_tail(&self, bytes: u64) -> String {
        tail(&self.config.console_log, bytes)
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
        self.qmp = None;
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
        self.qmp = None;
    }

    /// SIGKILL and reap.
    fn kill(&mut self) {
        match self.child.as_mut() {
            Some(child) => {
                let _ = child.kill();
                let _ = child.wait();
            }
            None => crate::handover::kill_and_reap(self.pid),
        }
        self.exit_status = Some("killed".into());
    }
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
    let len = path.metadata().map(|m| m.len()).unwrap_or(0);
    let start = if bytes == 0 {
        0
    } else {
        len.saturating_sub(bytes)
    };
    let text = read_from(path, start).unwrap_or_default();
    if start > 0 {
        if let Some(nl) = text.find('\n') {
            return text[nl + 1..].to_string();
        }
    }
    text
}
