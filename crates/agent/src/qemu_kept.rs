//! The kept copy of the last QEMU that ran a VM: what a restart falls back
//! to when the new QEMU cannot take over.
//!
//! A package upgrade replaces `/usr/bin/qemu-system-x86_64` and its modules
//! in place, so "the previous binary" must be copied before a restart, not
//! looked up. The copy lives in the VM's directory:
//!
//! ```text
//! <vm-dir>/qemu-kept/
//!   qemu-system-x86_64   copy of /proc/<pid>/exe of the QEMU being replaced
//!   modules/             copy of its installation's module directory (Debian
//!                        builds the TCG accelerator as a module)
//!   kept.json            where it came from: the installed binary and its
//!                        firmware directory (-L), which is not copied
//! ```
//!
//! A VM that fell back runs on the kept copy, so the copy stays as long as
//! it does: the next restart finds the VM running on it and keeps using it
//! as the fallback instead of copying a copy (whose installation could not
//! be found). A restart that moved the VM to another binary removes it, and
//! so does `down`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::qemu::QemuConfig;
use crate::AgentError;

/// The directory in a VM's directory.
pub const KEPT_DIR: &str = "qemu-kept";
const BIN: &str = "qemu-system-x86_64";
const MODULES: &str = "modules";
const ORIGIN: &str = "kept.json";

/// Where a kept copy came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    /// The binary as installed (what `/proc/<pid>/exe` named).
    pub installed: PathBuf,
    /// Its firmware directory, if one was found.
    pub data_dir: Option<PathBuf>,
}

/// A runnable copy of a QEMU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    /// The copied binary.
    pub bin: PathBuf,
    /// `-L` for it.
    pub data_dir: Option<PathBuf>,
    /// `QEMU_MODULE_DIR` for it.
    pub module_dir: Option<PathBuf>,
    /// Where it came from.
    pub origin: Origin,
}

impl Kept {
    /// `config` with this copy's firmware and module directories.
    pub fn config(&self, config: &QemuConfig) -> QemuConfig {
        let mut c = config.clone();
        c.data_dir = self.data_dir.clone();
        c.module_dir = self.module_dir.clone();
        c
    }
}

/// The kept-copy directory of the VM whose files are next to `config`'s
/// console log.
pub fn dir_of(config: &QemuConfig) -> PathBuf {
    config.console_log.with_file_name(KEPT_DIR)
}

/// Makes sure `dir` holds a runnable copy of the QEMU running as `pid`:
/// copies it, unless that QEMU already runs from `dir` (it fell back in an
/// earlier restart), in which case the copy is reused as it is.
pub fn keep(dir: &Path, pid: u32) -> Result<Kept, AgentError> {
    let exe = PathBuf::from(format!("/proc/{pid}/exe"));
    let installed = std::fs::read_link(&exe).map_err(AgentError::io("reading", &exe))?;
    if installed == dir.join(BIN) {
        if let Some(k) = load(dir) {
            return Ok(k);
        }
    }
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).map_err(AgentError::io("creating", dir))?;
    let bin = dir.join(BIN);
    std::fs::copy(&exe, &bin)
        .map_err(AgentError::io("copying the running QEMU binary from", &exe))?;
    // A relocated QEMU does not find its firmware by itself: remember where
    // the running one is installed (<prefix>/bin/qemu → <prefix>/share/qemu).
    let prefix = installed.parent().and_then(Path::parent);
    let data_dir = prefix.map(|p| p.join("share/qemu")).filter(|d| d.is_dir());
    if let Some(from) = prefix.and_then(crate::qemu::module_dir) {
        copy_files(&from, &dir.join(MODULES))
            .map_err(AgentError::io("copying QEMU's modules from", &from))?;
    }
    let origin = Origin {
        installed,
        data_dir,
    };
    crate::paths::write_atomic(
        &dir.join(ORIGIN),
        &serde_json::to_vec_pretty(&origin).expect("origin serialises"),
    )?;
    load(dir).ok_or_else(|| AgentError::BadRequest(format!("{} is incomplete", dir.display())))
}

/// The copy kept in `dir`, if there is a complete one.
pub fn load(dir: &Path) -> Option<Kept> {
    let origin: Origin = serde_json::from_slice(&std::fs::read(dir.join(ORIGIN)).ok()?).ok()?;
    let bin = dir.join(BIN);
    if !bin.is_file() {
        return None;
    }
    let modules = dir.join(MODULES);
    Some(Kept {
        bin,
        data_dir: origin.data_dir.clone(),
        module_dir: modules.is_dir().then_some(modules),
        origin,
    })
}

/// Whether QEMU process `pid` runs the binary kept in `dir`.
pub fn runs_on(dir: &Path, pid: u32) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == dir.join(BIN))
}

/// Removes the copy unless QEMU process `pid` runs on it.
pub fn drop_unless_used(dir: &Path, pid: u32) {
    if !runs_on(dir, pid) {
        let _ = std::fs::remove_dir_all(dir);
    }
}

fn copy_files(from: &Path, to: &Path) -> std::io::Result<()> {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        if e.file_type()?.is_file() || e.file_type()?.is_symlink() {
            std::fs::copy(e.path(), to.join(e.file_name()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process of ours stands in for QEMU: its binary is copied, the copy
    /// loads back, and a process running from the copy reuses it.
    #[test]
    fn keeps_a_copy_and_reuses_it_when_running_from_it() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(KEPT_DIR);
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let k = keep(&dir, child.id()).unwrap();
        assert!(k.bin.is_file());
        assert!(k.origin.installed.ends_with("sleep"), "{:?}", k.origin);
        assert_eq!(load(&dir), Some(k.clone()));
        assert!(!runs_on(&dir, child.id()));
        child.kill().unwrap();
        child.wait().unwrap();

        // A process started from the copy: keeping again reuses it as is.
        let mut from_copy = std::process::Command::new(&k.bin)
            .arg("30")
            .spawn()
            .unwrap();
        assert!(runs_on(&dir, from_copy.id()));
        let again = keep(&dir, from_copy.id()).unwrap();
        assert_eq!(again, k, "the copy was replaced");
        drop_unless_used(&dir, from_copy.id());
        assert!(dir.exists(), "removed while in use");
        from_copy.kill().unwrap();
        from_copy.wait().unwrap();
        drop_unless_used(&dir, std::process::id());
        assert!(!dir.exists());
        assert_eq!(load(&dir), None);
    }
}
