//! The agent's durable record of its VMs, and how a new agent adopts them.
//!
//! A VM is a handle: its identity (name, address), its QEMU endpoint (the
//! QMP socket), its files (RAM file, disks, logs) and, once launched, the
//! pid of its QEMU. The agent keeps these handles in
//! `<run-dir>/vms.json`, rewritten atomically (temporary file, `fsync`,
//! `rename`, `fsync` of the directory) whenever a VM is added, replaced or
//! removed. A VM is written there *before* its QEMU is started, so no QEMU
//! of ours ever runs unrecorded.
//!
//! ```text
//!  vms.json = { version, agent_pid, spec, accel, vms: [ VmRecord ] }
//!  VmRecord = { config (the QEMU command line's inputs), pid?, started_unix_ms,
//!               boot_ms?, qemu_log, address, disk }
//! ```
//!
//! An agent that starts and finds the file adopts the cluster
//! ([`adopt`]): every QEMU still running is found (by pid, checked against
//! its command line, or else by scanning `/proc` for a QEMU whose command
//! line names the VM's QMP socket: a QEMU started just before a crash whose
//! pid was never written is found too) and becomes a member again; its
//! NIC is plugged into the new switch (QEMU listens on its NIC socket, the
//! switch dials it); work a killed agent left half-done on it is finished
//! ([`crate::intent`]), and priorities it raised are put back
//! ([`crate::thread_priority`]). A VM whose QEMU is gone is kept in the cluster as
//! `exited` (its disk overlay is the user's data; `down` removes it), and
//! its runtime files (RAM file, sockets) are removed.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use vmcsnap_spec::{ClusterSpec, VmAddress};

use crate::accel::Resolved;
use crate::cluster::{Cluster, Member};
use crate::qemu::QemuConfig;
use crate::vm::Vm;
use crate::{log, AgentError, RunDir};

/// The record's file name in the run directory.
pub const RECORD_FILE: &str = "vms.json";
/// Bumped whenever the layout changes incompatibly.
pub const RECORD_VERSION: u32 = 1;

/// One VM as recorded.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmRecord {
    /// Everything its QEMU command line is made of.
    pub config: QemuConfig,
    /// QEMU's pid; `None` while it is being started.
    pub pid: Option<u32>,
    /// When its QEMU was started (ms since the epoch).
    pub started_unix_ms: u64,
    /// QEMU start to ready, once seen.
    pub boot_ms: Option<u64>,
    /// QEMU's own output.
    pub qemu_log: PathBuf,
    /// Its place on the cluster network.
    pub address: VmAddress,
    /// The disk it writes (top of its chain).
    pub disk: PathBuf,
}

/// `<run-dir>/vms.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterRecord {
    /// [`RECORD_VERSION`].
    pub version: u32,
    /// The agent that wrote it (for the log of the one that adopts).
    pub agent_pid: u32,
    /// The spec the cluster was booted from.
    pub spec: ClusterSpec,
    /// The accelerator in use.
    pub accel: Resolved,
    /// The VMs, in spec order (restored VMs after them).
    pub vms: Vec<VmRecord>,
}

impl VmRecord {
    /// The record of a member.
    pub fn of(m: &Member) -> VmRecord {
        VmRecord {
            config: m.vm.config.clone(),
            pid: Some(m.vm.pid).filter(|&p| p != 0),
            started_unix_ms: unix_ms(m.vm.started_at),
            boot_ms: m.vm.boot_ms,
            qemu_log: m.vm.qemu_log.clone(),
            address: m.address,
            disk: m.disk.clone(),
        }
    }

    /// A VM about to be started (no pid yet).
    pub fn pending(
        config: &QemuConfig,
        qemu_log: &Path,
        address: VmAddress,
        disk: &Path,
    ) -> VmRecord {
        VmRecord {
            config: config.clone(),
            pid: None,
            started_unix_ms: unix_ms(SystemTime::now()),
            boot_ms: None,
            qemu_log: qemu_log.to_path_buf(),
            address,
            disk: disk.to_path_buf(),
        }
    }
}

/// Whether `run` holds VMs or work that an agent must take over (its agent
/// died): recorded VMs, or a restore that did not finish.
pub fn needs_agent(run: &RunDir) -> bool {
    run.root().join(RECORD_FILE).exists()
        || run
            .root()
            .join(crate::restore_journal::JOURNAL_FILE)
            .exists()
}

/// Writes the record of `cluster` plus `pending` VMs about to start.
pub fn save(run: &RunDir, cluster: &Cluster, pending: &[VmRecord]) -> Result<(), AgentError> {
    let mut vms: Vec<VmRecord> = cluster.members.iter().map(VmRecord::of).collect();
    vms.extend(pending.iter().cloned());
    let rec = ClusterRecord {
        version: RECORD_VERSION,
        agent_pid: std::process::id(),
        spec: cluster.spec.clone(),
        accel: cluster.accel,
        vms,
    };
    write_atomic(
        &run.root().join(RECORD_FILE),
        &serde_json::to_vec_pretty(&rec).expect("record serialises"),
    )
}

/// Removes the record (the cluster is down).
pub fn clear(run: &RunDir) {
    let path = run.root().join(RECORD_FILE);
    if let Err(e) = std::fs::remove_file(&path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            log(format!("cannot remove {}: {e}", path.display()));
        }
    }
}

/// Reads the record, if there is one.
pub fn load(run: &RunDir) -> Result<Option<ClusterRecord>, AgentError> {
    let path = run.root().join(RECORD_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(AgentError::io("reading the VM record", &path)(e)),
    };
    let rec: ClusterRecord = serde_json::from_slice(&bytes).map_err(|e| AgentError::BadRecord {
        path: path.clone(),
        detail: e.to_string(),
    })?;
    if rec.version != RECORD_VERSION {
        return Err(AgentError::BadRecord {
            path,
            detail: format!(
                "version {} but this agent reads {RECORD_VERSION}; use the vmcsnap that wrote it",
                rec.version
            ),
        });
    }
    Ok(Some(rec))
}

/// `path` replaced by `bytes` all at once: a crash leaves the old file or
/// the new one, never a mix.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), AgentError> {
    let dir = path.parent().expect("a file in a directory");
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().expect("a file name").to_string_lossy(),
        std::process::id()
    ));
    let res = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res.map_err(AgentError::io("writing", path))
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Whether `pid` is a live process whose command line names `qmp_socket`
/// (i.e. the QEMU of that VM, not a process that reused its pid).
pub fn is_qemu_of(pid: u32, qmp_socket: &Path) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let needle = qmp_socket.as_os_str().as_encoded_bytes();
    cmdline
        .split(|&b| b == 0)
        .any(|arg| arg.windows(needle.len()).any(|w| w == needle))
        // A zombie (ours, not reaped yet) is not running, nor is a QEMU
        // that quit and is exiting (the old QEMU of a warm restart, whose
        // exit goes on in the background while the new one runs the VM).
        && !crate::qemu_exit::exiting(pid)
}

/// The live QEMU of the VM whose QMP socket is `qmp_socket`: `pid` if it
/// still is that, else any process whose command line names the socket
/// (the newest, should two be found while one quits).
pub fn find_qemu(pid: Option<u32>, qmp_socket: &Path) -> Option<u32> {
    if let Some(p) = pid.filter(|&p| is_qemu_of(p, qmp_socket)) {
        return Some(p);
    }
    let mut found: Vec<u32> = std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| p != std::process::id() && is_qemu_of(p, qmp_socket))
        .collect();
    found.sort_unstable();
    found.pop()
}

/// Live QEMU processes whose command line mentions `dir` (a cluster
/// directory about to be removed): they must not lose their files.
pub fn qemus_using(dir: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    let needle = dir.as_os_str().as_encoded_bytes().to_vec();
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| p != std::process::id())
        .filter(|p| {
            let exe = std::fs::read_link(format!("/proc/{p}/exe")).unwrap_or_default();
            let is_qemu = exe
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("qemu"));
            is_qemu
                && std::fs::read(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle.as_slice()))
        })
        .collect()
}

/// Adopts the cluster recorded in `run`, if any: a fresh switch, every
/// live QEMU a member again (with its half-done work finished), every dead
/// one a member marked exited. Never stops or pauses a live VM.
pub fn adopt(run: &RunDir) -> Result<Option<Cluster>, AgentError> {
    let Some(rec) = load(run)? else {
        return Ok(None);
    };
    log(format!(
        "adopting cluster {} ({} VMs) recorded by agent {}",
        rec.spec.cluster.name,
        rec.vms.len(),
        rec.agent_pid
    ));
    let mut cluster = Cluster::adopted(run, rec.spec.clone(), rec.accel)?;
    for v in rec.vms {
        let name = v.config.name.clone();
        let started_at = UNIX_EPOCH + Duration::from_millis(v.started_unix_ms);
        let port = crate::cluster::plug(&cluster.switch, &name, &v.config.port_socket, &v.address)?;
        let qemu = find_qemu(v.pid, &v.config.qmp_socket);
        // A snapshot's raised priorities, if its agent died in the pause
        // (see `thread_priority`).
        crate::thread_priority::undo_left(&crate::thread_priority::record_path(&v.config), qemu);
        let vm = match qemu {
            Some(pid) => {
                log(format!("VM {name}: adopting QEMU pid {pid}"));
                let mut vm = Vm::adopt(v.config, pid, started_at, v.boot_ms, v.qemu_log);
                // Nothing is done to a VM whose QEMU version vmcsnap does
                // not speak; every operation on it says why.
                match vm.dialect() {
                    Ok(_) => crate::intent::finish(&mut vm),
                    Err(e) => log(format!("VM {name}: {e}; adopted, left as it is")),
                }
                vm
            }
            None => match crate::intent::recover_dead(&v.config, &v.qemu_log) {
                Some(vm) => vm,
                None => {
                    log(format!(
                        "VM {name}: its QEMU (pid {:?}) is gone; keeping it as exited",
                        v.pid
                    ));
                    let _ = std::fs::remove_file(&v.config.ram_file);
                    let _ = std::fs::remove_file(&v.config.qmp_socket);
                    let _ = std::fs::remove_file(v.config.sample_socket());
                    Vm::dead(
                        v.config,
                        v.pid.unwrap_or(0),
                        started_at,
                        v.boot_ms,
                        v.qemu_log,
                    )
                }
            },
        };
        let mut member = Member {
            vm,
            address: v.address,
            port,
            disk: v.disk,
        };
        member.refresh_disk();
        cluster.members.push(member);
    }
    save(run, &cluster, &[])?;
    Ok(Some(cluster))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_writes_replace_whole_files() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("vms.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temporary file is left: {names:?}");
    }

    #[test]
    fn a_bad_record_is_an_error_naming_the_file() {
        let d = tempfile::tempdir().unwrap();
        let run = RunDir::new(d.path());
        std::fs::write(d.path().join(RECORD_FILE), b"{ not json").unwrap();
        let e = load(&run).unwrap_err().to_string();
        assert!(e.contains(RECORD_FILE), "{e}");
        std::fs::remove_file(d.path().join(RECORD_FILE)).unwrap();
        assert!(load(&run).unwrap().is_none());
    }

    #[test]
    fn processes_are_recognised_by_their_command_line() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("qmp.sock");
        // `read` is a builtin: the shell never forks a child that would
        // carry the same command line for a moment (a `sleep` did, and the
        // scan found that child: a flaky test).
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg("read x; : \"$0\"")
            .arg(&sock)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        // The child may still be between fork and exec for a moment.
        let t = std::time::Instant::now();
        while !is_qemu_of(pid, &sock) && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(is_qemu_of(pid, &sock));
        assert!(!is_qemu_of(pid, &d.path().join("other.sock")));
        assert_eq!(
            find_qemu(Some(999_999_999), &sock),
            Some(pid),
            "found by scanning when the pid is wrong"
        );
        assert_eq!(find_qemu(None, &sock), Some(pid));
        child.kill().unwrap();
        child.wait().unwrap();
        let left = find_qemu(Some(pid), &sock);
        let cmd = left.map(|p| std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default());
        assert_eq!(
            left,
            None,
            "{:?}",
            cmd.map(|c| String::from_utf8_lossy(&c).into_owned())
        );
    }
}
