//! Named network namespaces, made and removed the way iproute2 does it, so
//! `ip netns exec NAME ...` and `ip -n NAME ...` work on them.
//!
//! A named netns is a bind mount of a network namespace file
//! (`/proc/thread-self/ns/net` of a thread that `unshare`d `CLONE_NEWNET`)
//! onto an empty file `/run/netns/NAME`; `/run/netns` itself is made a
//! shared mount first (iproute2 does the same, so namespace mounts
//! propagate to other mount namespaces). The namespace lives as long as the
//! mount, or any process, socket or device in it.
//!
//! Crash safety: if a process dies between creating the file and mounting
//! onto it, an empty plain file is left. [`netns_exists`] checks the file
//! system type (nsfs), so such an entry counts as absent, and
//! [`ensure_netns`] removes it and starts over.
//!
//! Entering a namespace is per thread (`setns`): [`in_netns`] runs a closure
//! in a fresh thread that joined the namespace, so the caller's threads
//! never change namespace; [`exec_in_netns`] joins it in the child between
//! fork and exec.

use std::ffi::{CString, OsString};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

use crate::error::{HostNetError, Result};

/// Where iproute2 keeps named network namespaces.
pub const NETNS_RUN_DIR: &str = "/run/netns";

/// Longest netns name accepted: a file name (`NAME_MAX`).
pub const MAX_NETNS_NAME_LEN: usize = 255;

/// Prefix of the namespaces vmcsnap names.
pub const NETNS_PREFIX: &str = "vmcsnap-";

/// The network namespace of the cluster of the run directory with tag
/// `run_tag` (`RunDir::tag()`, 8 hex digits): `vmcsnap-<tag>`, e.g.
/// `vmcsnap-1a2b3c4d` (16 bytes; iproute2 accepts up to 255, without `/`).
///
/// The name depends on the run directory only, not on the cluster's name:
/// a run directory holds one cluster at a time, and `vmcsnap exec` finds the
/// namespace without asking the agent. Characters other than ASCII
/// alphanumerics, `-` and `_` in `run_tag` are replaced by `_`.
pub fn netns_name(run_tag: &str) -> String {
    let tag: String = run_tag
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{NETNS_PREFIX}{tag}")
}

/// Checks `name` as iproute2 does (a file name under /run/netns).
pub fn validate_netns_name(name: &str) -> Result<()> {
    let bad = name.is_empty()
        || name.len() > MAX_NETNS_NAME_LEN
        || name == "."
        || name == ".."
        || name.contains('/')
        || name.contains('\0');
    if bad {
        return Err(HostNetError::InvalidNetnsName {
            name: name.into(),
            max: MAX_NETNS_NAME_LEN,
        });
    }
    Ok(())
}

/// The bind-mount target of the named namespace.
pub fn netns_path(name: &str) -> PathBuf {
    Path::new(NETNS_RUN_DIR).join(name)
}

/// Whether `/run/netns/NAME` is a mounted network namespace (an empty file
/// left by a crash half-way through [`ensure_netns`] does not count).
pub fn netns_exists(name: &str) -> bool {
    validate_netns_name(name).is_ok() && is_nsfs(&netns_path(name))
}

fn is_nsfs(path: &Path) -> bool {
    let Ok(c) = cstring(path) else { return false };
    // SAFETY: statfs is plain old data; all-zero is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid out-pointer.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    // The types of f_type and NSFS_MAGIC differ between architectures.
    #[allow(clippy::unnecessary_cast)]
    let nsfs = st.f_type as i64 == libc::NSFS_MAGIC as i64;
    rc == 0 && nsfs
}

pub(crate) fn cstring(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| HostNetError::Io {
        what: format!("path {path:?}"),
        source: io::Error::new(io::ErrorKind::InvalidInput, "contains a NUL byte"),
    })
}

/// Makes the named namespace unless it exists. Returns whether it made it.
pub fn ensure_netns(name: &str) -> Result<bool> {
    validate_netns_name(name)?;
    // One creation at a time in this process: two threads that both find
    // /run/netns not yet a mount point would otherwise stack two bind
    // mounts on it. (Across processes the race is iproute2's too.)
    static CREATE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _serial = CREATE.lock().unwrap_or_else(|p| p.into_inner());
    let path = netns_path(name);
    if is_nsfs(&path) {
        return Ok(false);
    }
    make_run_dir_shared()?;
    // A half-made entry (plain file, no mount) of a crashed creator.
    match std::fs::remove_file(&path) {
        Ok(()) => log::warn!("removed the half-made network namespace entry {path:?}"),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(HostNetError::io(format!("cannot remove stale {path:?}"), e)),
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| HostNetError::io(format!("cannot create {path:?}"), e))?;
    let target = cstring(&path)?;
    let mounted = run_in_thread("netns-create", move || {
        // SAFETY: unshare affects only this (short-lived) thread's network namespace.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(HostNetError::last_os(
                "cannot create a network namespace (unshare)",
            ));
        }
        let src = c"/proc/thread-self/ns/net";
        // SAFETY: both paths are NUL-terminated; a bind mount takes no fstype or data.
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            return Err(HostNetError::last_os(format!(
                "cannot bind-mount the new network namespace on {target:?}"
            )));
        }
        Ok(())
    })
    .and_then(|r| r);
    if let Err(e) = mounted {
        let _ = std::fs::remove_file(&path);
        return Err(e);
    }
    log::info!("created network namespace {name}");
    Ok(true)
}

/// Makes /run/netns a shared mount point, as `ip netns add` does: mark it
/// shared; if it is not a mount point yet (EINVAL), bind it onto itself once
/// and mark it again.
fn make_run_dir_shared() -> Result<()> {
    std::fs::create_dir_all(NETNS_RUN_DIR)
        .map_err(|e| HostNetError::io(format!("cannot create {NETNS_RUN_DIR}"), e))?;
    let dir = c"/run/netns";
    let none = c"none";
    let mut bound = false;
    loop {
        // SAFETY: NUL-terminated strings; changing propagation takes no source or data.
        let rc = unsafe {
            libc::mount(
                c"".as_ptr(),
                dir.as_ptr(),
                none.as_ptr(),
                libc::MS_SHARED | libc::MS_REC,
                std::ptr::null(),
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINVAL) || bound {
            return Err(HostNetError::io(
                format!("cannot make {NETNS_RUN_DIR} a shared mount"),
                err,
            ));
        }
        // SAFETY: NUL-terminated strings; a bind mount takes no data.
        let rc = unsafe {
            libc::mount(
                dir.as_ptr(),
                dir.as_ptr(),
                none.as_ptr(),
                libc::MS_BIND | libc::MS_REC,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            return Err(HostNetError::last_os(format!(
                "cannot bind-mount {NETNS_RUN_DIR} onto itself"
            )));
        }
        bound = true;
    }
}

/// Removes the named namespace (unmount and unlink, like `ip netns del`).
/// Processes, sockets and devices still in it keep it alive, unnamed, until
/// they are gone. Removing an absent namespace is not an error.
pub fn destroy_netns(name: &str) -> Result<()> {
    validate_netns_name(name)?;
    let path = netns_path(name);
    let c = cstring(&path)?;
    // SAFETY: NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
        let err = io::Error::last_os_error();
        // EINVAL: not a mount point (half-made entry); ENOENT: absent.
        if !matches!(err.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOENT)) {
            return Err(HostNetError::io(format!("cannot unmount {path:?}"), err));
        }
    }
    match std::fs::remove_file(&path) {
        Ok(()) => {
            log::info!("removed network namespace {name}");
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(HostNetError::io(format!("cannot remove {path:?}"), e)),
    }
}

/// Opens the namespace file of an existing named namespace.
fn open_netns(name: &str) -> Result<File> {
    if !netns_exists(name) {
        return Err(HostNetError::NetnsMissing { name: name.into() });
    }
    let path = netns_path(name);
    File::open(&path).map_err(|e| HostNetError::io(format!("cannot open {path:?}"), e))
}

/// Runs `f` on a new thread and returns its result (a panic is re-raised).
pub(crate) fn run_in_thread<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T> {
    let h = std::thread::Builder::new()
        .name(what.into())
        .spawn(f)
        .map_err(|source| HostNetError::Thread { what, source })?;
    match h.join() {
        Ok(v) => Ok(v),
        Err(p) => std::panic::resume_unwind(p),
    }
}

/// Runs `f` on a new thread that joined the named network namespace (or,
/// for `None`, stays in the caller's). Sockets and devices `f` creates
/// belong to that namespace and keep working from any thread.
pub fn in_netns<T: Send + 'static>(
    name: Option<&str>,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let ns = name
        .map(|n| open_netns(n).map(|f| (n.to_string(), f)))
        .transpose()?;
    run_in_thread("netns-worker", move || {
        if let Some((name, file)) = ns {
            // SAFETY: `file` is an open nsfs file; setns changes only this thread.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(HostNetError::last_os(format!(
                    "cannot enter network namespace {name} (setns)"
                )));
            }
        }
        f()
    })?
}

/// Runs `argv` inside the named namespace with the caller's stdio, and
/// waits for it. Only the network namespace changes: unlike `ip netns
/// exec`, /sys and /etc are the host's (`/etc/netns/NAME` is not applied).
pub fn exec_in_netns(name: &str, argv: &[OsString]) -> Result<ExitStatus> {
    let (program, args) = argv.split_first().ok_or(HostNetError::NoCommand)?;
    let file = open_netns(name)?;
    let fd = file.as_raw_fd();
    let mut cmd = Command::new(program);
    cmd.args(args);
    // SAFETY: the closure only calls setns(2), which is async-signal-safe,
    // and reads errno; `fd` stays open in the parent until spawn returns.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let status = cmd.status().map_err(|source| match source.raw_os_error() {
        Some(libc::EPERM) => HostNetError::NotRoot {
            what: format!("cannot enter network namespace {name}"),
        },
        _ => HostNetError::Spawn {
            program: program.to_string_lossy().into_owned(),
            source,
        },
    });
    drop(file);
    status
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_run_dir_tag() {
        assert_eq!(netns_name("1a2b3c4d"), "vmcsnap-1a2b3c4d");
        assert_eq!(netns_name("a/b c"), "vmcsnap-a_b_c");
        validate_netns_name(&netns_name("1a2b3c4d")).unwrap();
    }

    #[test]
    fn invalid_names_are_rejected() {
        for bad in ["", ".", "..", "a/b", "a\0b"] {
            assert!(validate_netns_name(bad).is_err(), "{bad:?}");
        }
        assert!(validate_netns_name(&"x".repeat(256)).is_err());
        validate_netns_name(&"x".repeat(255)).unwrap();
        assert!(!netns_exists("../etc"));
    }

    #[test]
    fn exec_without_a_command_is_an_error() {
        assert!(matches!(
            exec_in_netns("whatever", &[]),
            Err(HostNetError::NoCommand)
        ));
    }
}
