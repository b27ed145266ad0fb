//! [`probe`]: can vmcsnap run its own vaddr monitoring on this host, and if
//! not, why.
//!
//! Only reads, plus an open-for-write (no data written) of
//! `kdamonds/nr_kdamonds` to learn whether it could be written. It never
//! changes anything: a kdamond someone else configured is left as it is.

use std::fmt;
use std::fs::{self, OpenOptions};
use std::io;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Whether DAMON virtual-address monitoring is usable under a sysfs root,
/// and if not why. It serializes (`{"status": "slot-in-use", ...}`) for a
/// snapshot's metadata and a restore report; [`fmt::Display`] gives one
/// line for logs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "kebab-case")]
pub enum Availability {
    /// No admin directory: the kernel has no DAMON sysfs interface
    /// (`CONFIG_DAMON_SYSFS` off, or a kernel older than 5.18).
    Absent,
    /// The interface exists but this process cannot read or write it
    /// (not root, or sysfs mounted read-only).
    PermissionDenied,
    /// `avail_operations` is present and does not list `vaddr`
    /// (`CONFIG_DAMON_VADDR` off).
    NoVaddr,
    /// A kdamond is not `off`: someone else (the host itself, `damo`, ...)
    /// uses DAMON. vmcsnap never takes over a kdamond it did not create.
    SlotInUse {
        /// Index of the first kdamond found (someone else's).
        kdamond: u32,
        /// What its `state` file says (normally `on`).
        state: String,
    },
    /// A file of the tree could not be read or parsed: an unknown layout.
    Unreadable {
        /// The file, relative to the root.
        file: String,
        /// What went wrong.
        reason: String,
    },
    /// vmcsnap may create its own kdamond (see [`crate::plan_setup`]).
    Usable,
}

impl Availability {
    /// True only for [`Availability::Usable`].
    pub fn is_usable(&self) -> bool {
        matches!(self, Availability::Usable)
    }
}

impl fmt::Display for Availability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Availability::Absent => f.write_str("absent: the kernel has no DAMON sysfs interface"),
            Availability::PermissionDenied => {
                f.write_str("permission denied: DAMON sysfs needs root (and a writable sysfs)")
            }
            Availability::NoVaddr => {
                f.write_str("no vaddr: the kernel's DAMON lacks virtual-address monitoring")
            }
            Availability::SlotInUse { kdamond, state } => write!(
                f,
                "slot in use: kdamond {kdamond} is {state:?}, DAMON is used by someone else"
            ),
            Availability::Unreadable { file, reason } => {
                write!(f, "unreadable: {file}: {reason}")
            }
            Availability::Usable => f.write_str("usable"),
        }
    }
}

/// What the running kernel's build configuration (the text of
/// `/proc/config.gz` or `/boot/config-RELEASE`) already says, so that a
/// host whose kernel cannot do vaddr monitoring is never probed through
/// sysfs at all (its DAMON may be in use by the host itself): `Absent`
/// without `CONFIG_DAMON` or `CONFIG_DAMON_SYSFS`, `NoVaddr` without
/// `CONFIG_DAMON_VADDR`, `None` when the configuration allows it (the
/// sysfs probe decides).
pub fn from_kernel_config(config: &str) -> Option<Availability> {
    let set = |name: &str| {
        config
            .lines()
            .any(|l| l.trim() == format!("{name}=y") || l.trim() == format!("{name}=m"))
    };
    if !set("CONFIG_DAMON") || !set("CONFIG_DAMON_SYSFS") {
        Some(Availability::Absent)
    } else if !set("CONFIG_DAMON_VADDR") {
        Some(Availability::NoVaddr)
    } else {
        None
    }
}

/// Can this process write the file at `path`? Opens it for writing without
/// writing anything (on sysfs an open calls no store handler). Passed to
/// [`probe_with`] so tests running as root can still cover the denial path.
pub fn can_open_for_write(path: &Path) -> io::Result<()> {
    OpenOptions::new().write(true).open(path).map(drop)
}

/// Probes the DAMON admin directory `root` (in production
/// [`crate::DEFAULT_ROOT`]) with the real write check.
pub fn probe(root: &Path) -> Availability {
    probe_with(root, can_open_for_write)
}

/// [`probe`] with the write check injected.
///
/// Order: no root → `Absent`; `kdamonds/nr_kdamonds` unreadable for lack of
/// permission or not writable → `PermissionDenied`; a context's
/// `avail_operations` (only present once some kdamond has a context)
/// without `vaddr` → `NoVaddr`; any kdamond at all, running or stopped
/// (someone else's configuration) → `SlotInUse`; else `Usable`.
pub fn probe_with(root: &Path, can_write: impl Fn(&Path) -> io::Result<()>) -> Availability {
    match fs::metadata(root) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return unreadable("", "the DAMON admin path is not a directory"),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Availability::Absent,
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            return Availability::PermissionDenied
        }
        Err(e) => return unreadable("", &e.to_string()),
    }
    let nr_file = "kdamonds/nr_kdamonds";
    let nr_kdamonds = match read_count(root, nr_file) {
        Ok(n) => n,
        Err(a) => return a,
    };
    match can_write(&root.join(nr_file)) {
        Ok(()) => {}
        Err(e) if is_denied(&e) => return Availability::PermissionDenied,
        Err(e) => return unreadable(nr_file, &e.to_string()),
    }
    if let Some(a) = check_vaddr(root, nr_kdamonds) {
        return a;
    }
    // Any kdamond, stopped ones included, is someone else's configuration:
    // writing `nr_kdamonds` would erase it, and vmcsnap never takes over a
    // kdamond it did not create.
    if nr_kdamonds > 0 {
        let file = "kdamonds/0/state";
        return match read_text(root, file) {
            Ok(state) => Availability::SlotInUse { kdamond: 0, state },
            Err(a) => a,
        };
    }
    Availability::Usable
}

/// `NoVaddr` if some existing context lists its available operations and
/// `vaddr` is not among them. Absent files say nothing (assume it may
/// exist: `operations` refuses it at setup time otherwise).
fn check_vaddr(root: &Path, nr_kdamonds: u32) -> Option<Availability> {
    for k in 0..nr_kdamonds {
        let file = format!("kdamonds/{k}/contexts/0/avail_operations");
        match fs::read_to_string(root.join(&file)) {
            Ok(text) => {
                return (!text.lines().any(|l| l.trim() == "vaddr"))
                    .then_some(Availability::NoVaddr)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) if is_denied(&e) => return Some(Availability::PermissionDenied),
            Err(e) => return Some(unreadable(&file, &e.to_string())),
        }
    }
    None
}

fn is_denied(e: &io::Error) -> bool {
    // EROFS: sysfs mounted read-only (e.g. in a container).
    e.kind() == io::ErrorKind::PermissionDenied || e.raw_os_error() == Some(30)
}

fn unreadable(file: &str, reason: &str) -> Availability {
    Availability::Unreadable {
        file: file.to_string(),
        reason: reason.to_string(),
    }
}

fn read_text(root: &Path, file: &str) -> Result<String, Availability> {
    match fs::read_to_string(root.join(file)) {
        Ok(s) => Ok(s.trim().to_string()),
        Err(e) if is_denied(&e) => Err(Availability::PermissionDenied),
        Err(e) => Err(unreadable(file, &e.to_string())),
    }
}

fn read_count(root: &Path, file: &str) -> Result<u32, Availability> {
    let text = read_text(root, file)?;
    text.parse()
        .map_err(|_| unreadable(file, &format!("{text:?} is not a count")))
}
