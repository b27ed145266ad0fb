//! Where the agent keeps its files.
//!
//! ```text
//! <run-dir>/                       mode 0700 (on disk: /var/lib/vmcsnap for root)
//!   agent.sock                     control socket, mode 0600
//!   agent.log                      the agent's log (when started by the CLI)
//!   agent.pid
//!   vms.json                       the durable record of the VMs (crate::record)
//!   restoring.json                 a restore in progress (crate::restore_journal)
//!   cluster/<vm>/qmp.sock          QMP of the VM's QEMU
//!   cluster/<vm>/port.sock         the VM's NIC (QEMU listens, the switch dials)
//!   cluster/<vm>/intent.json       work in progress on the VM (crate::intent)
//!   cluster/<vm>/events.log, qga.sock, root.qcow2, seed.iso   an image VM's (crate::image_vm)
//!   cluster/host.sock              the host interface's relay (crate::host_port)
//!   cluster/<vm>/console.log       serial console
//!   cluster/<vm>/qemu.log          QEMU's own stdout/stderr
//!   cluster/<vm>/data.qcow2        the VM's data disk
//!   cluster/<vm>/restart.state     device (and for `saved`, RAM) state of a restart
//!   snapshots/<name>/              a committed snapshot image (docs/image-format.md)
//!   snapshots/.disks/<name>/       the disk images frozen by it (hard links)
//!   rejuvenations.jsonl            every rejuvenation's measured downtime
//! /dev/shm/vmcsnap-<tag>-<cluster>-<vm>   guest RAM (tag: hash of run-dir)
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::AgentError;

/// The run directory of one agent.
#[derive(Debug, Clone)]
pub struct RunDir {
    root: PathBuf,
}

impl RunDir {
    /// Wraps `root` (made absolute if it is not).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        let root = root.into();
        let root = if root.is_absolute() {
            root
        } else {
            std::env::current_dir()
                .map(|d| d.join(&root))
                .unwrap_or(root)
        };
        RunDir { root }
    }

    /// The default: `$VMCSNAP_RUN_DIR`, else `/var/lib/vmcsnap` for root,
    /// else `$XDG_STATE_HOME/vmcsnap`, else `~/.local/state/vmcsnap`. It is
    /// on disk, not tmpfs, because saved VM state and snapshots live in it.
    pub fn default_root() -> PathBuf {
        if let Some(d) = std::env::var_os("VMCSNAP_RUN_DIR") {
            return PathBuf::from(d);
        }
        // SAFETY: getuid has no preconditions and cannot fail.
        let uid = unsafe { libc::getuid() };
        if uid == 0 {
            return PathBuf::from("/var/lib/vmcsnap");
        }
        if let Some(d) = std::env::var_os("XDG_STATE_HOME") {
            return PathBuf::from(d).join("vmcsnap");
        }
        match std::env::var_os("HOME") {
            Some(h) => PathBuf::from(h).join(".local/state/vmcsnap"),
            None => PathBuf::from(format!("/tmp/vmcsnap-{uid}")),
        }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }
    /// The control socket.
    pub fn agent_socket(&self) -> PathBuf {
        self.root.join("agent.sock")
    }
    /// The agent's log file.
    pub fn agent_log(&self) -> PathBuf {
        self.root.join("agent.log")
    }
    /// The agent's pid file.
    pub fn agent_pid(&self) -> PathBuf {
        self.root.join("agent.pid")
    }
    /// The directory of the running cluster.
    pub fn cluster_dir(&self) -> PathBuf {
        self.root.join("cluster")
    }
    /// The directory of one VM.
    pub fn vm_dir(&self, vm: &str) -> PathBuf {
        self.cluster_dir().join(vm)
    }
    /// Where measured rejuvenation downtimes are appended (JSON lines).
    pub fn rejuvenation_log(&self) -> PathBuf {
        self.root.join("rejuvenations.jsonl")
    }
    /// Where committed snapshots live (`<run-dir>/snapshots/<name>`), and
    /// the disk images they froze (`.disks/<name>/`, hidden from listing).
    pub fn snapshots_dir(&self) -> PathBuf {
        self.root.join("snapshots")
    }
    /// The shared-memory file of a VM's RAM.
    pub fn shm_path(&self, cluster: &str, vm: &str) -> PathBuf {
        PathBuf::from(format!("/dev/shm/vmcsnap-{}-{cluster}-{vm}", self.tag()))
    }
    /// A short hash of the run directory, so agents in different run
    /// directories (parallel tests) never share a file name in /dev/shm.
    pub fn tag(&self) -> String {
        let h = Sha256::digest(self.root.as_os_str().as_encoded_bytes());
        h[..4].iter().map(|b| format!("{b:02x}")).collect()
    }
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

#[cfg(test)]
mod tests {
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

    use super::*;

    #[test]
    fn shm_names_differ_between_run_dirs() {
        let a = RunDir::new("/tmp/a");
        let b = RunDir::new("/tmp/b");
        assert_ne!(a.shm_path("c", "v"), b.shm_path("c", "v"));
        assert!(a.shm_path("c", "v").starts_with("/dev/shm"));
        assert_eq!(a.vm_dir("v"), PathBuf::from("/tmp/a/cluster/v"));
    }

    #[test]
    fn relative_roots_become_absolute() {
        assert!(RunDir::new("rel").root().is_absolute());
    }
}
