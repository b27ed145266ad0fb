//! Frozen disks that stay usable after the VM's directory is gone.
//!
//! A snapshot freezes the qcow2 the VM runs on and puts a new overlay on
//! top. From the second snapshot on, the frozen file is itself an overlay,
//! so the frozen disk is a *chain* of files. vmcsnap keeps every link of
//! the chain as a hard link in `snapshots/.disks/<name>/`, under its own
//! file name, and creates overlays whose backing file is named
//! **relative** to the overlay (just the backing file's name; QEMU resolves
//! it in the overlay's directory). So the chain resolves inside the VM's
//! directory while the VM runs, and inside `.disks/<name>/` once `down` or
//! the next `up` has removed the VM's directory.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::AgentError;

/// The files of a disk chain, top first, and its virtual size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    /// Virtual size in bytes.
    pub virtual_size: u64,
    /// The files, from the top (the one the VM writes) to the base.
    pub files: Vec<PathBuf>,
}

/// Runs `qemu-img ARGS`; its stdout, or an error with its stderr.
pub(crate) fn qemu_img(qemu_img: &Path, args: &[&std::ffi::OsStr]) -> Result<Vec<u8>, AgentError> {
    let out = Command::new(qemu_img)
        .args(args)
        .output()
        .map_err(AgentError::io("running", qemu_img))?;
    if !out.status.success() {
        return Err(AgentError::BadRequest(format!(
            "qemu-img {}: {}",
            args.iter()
                .map(|a| a.to_string_lossy())
                .collect::<Vec<_>>()
                .join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(out.stdout)
}

/// The chain under `top` (`-U`: QEMU may have it open).
pub fn chain(qemu_img_bin: &Path, top: &Path) -> Result<Chain, AgentError> {
    let out = qemu_img(
        qemu_img_bin,
        &[
            "info".as_ref(),
            "-U".as_ref(),
            "--backing-chain".as_ref(),
            "--output=json".as_ref(),
            top.as_os_str(),
        ],
    )?;
    let v: serde_json::Value = serde_json::from_slice(&out)
        .map_err(|e| AgentError::BadRequest(format!("qemu-img info {}: {e}", top.display())))?;
    let items = v.as_array().cloned().unwrap_or_default();
    let files: Vec<PathBuf> = items
        .iter()
        .filter_map(|i| i["filename"].as_str().map(PathBuf::from))
        .collect();
    let virtual_size = items
        .first()
        .and_then(|i| i["virtual-size"].as_u64())
        .unwrap_or(0);
    if files.is_empty() || virtual_size == 0 {
        return Err(AgentError::BadRequest(format!(
            "qemu-img info {}: no disk chain in {v}",
            top.display()
        )));
    }
    Ok(Chain {
        virtual_size,
        files,
    })
}

/// Hard-links every file of `chain` into `dir` under its own name; returns
/// the path of the top file there.
pub fn freeze(chain: &Chain, dir: &Path) -> Result<PathBuf, AgentError> {
    let mut top = None;
    for f in &chain.files {
        let name = f.file_name().ok_or_else(|| {
            AgentError::BadRequest(format!("disk {} has no file name", f.display()))
        })?;
        let link = dir.join(name);
        if !link.exists() {
            match std::fs::hard_link(f, &link) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
                    return Err(AgentError::BadRequest(format!(
                        "cannot keep the disk {} in the snapshot: {} is on another file system,                          and a snapshot keeps its frozen disk as hard links (no copy, no pause);                          keep the snapshot directory on the file system of the run directory                          (do not mount another one on it)",
                        f.display(),
                        dir.display()
                    )))
                }
                Err(e) => return Err(AgentError::io("hard-linking the disk to", &link)(e)),
            }
        }
        top.get_or_insert(link);
    }
    Ok(top.expect("a chain has a file"))
}

/// Creates `overlay` (qcow2, `size` bytes) on top of `backing`, which must
/// be in the same directory, naming it by file name only.
pub fn create_overlay(
    qemu_img_bin: &Path,
    backing: &Path,
    size: u64,
    overlay: &Path,
) -> Result<(), AgentError> {
    let name = backing.file_name().ok_or_else(|| {
        AgentError::BadRequest(format!("disk {} has no file name", backing.display()))
    })?;
    let size = size.to_string();
    qemu_img(
        qemu_img_bin,
        &[
            "create".as_ref(),
            "-q".as_ref(),
            "-f".as_ref(),
            "qcow2".as_ref(),
            "-F".as_ref(),
            "qcow2".as_ref(),
            "-u".as_ref(),
            "-b".as_ref(),
            name,
            overlay.as_os_str(),
            size.as_ref(),
        ],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// Regression (fault matrix): a snapshot directory on another file
    /// system failed with a bare "Invalid cross-device link"; the error now
    /// says what to change.
    #[test]
    fn a_snapshot_directory_on_another_file_system_is_a_clear_error() {
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        let other = tempfile::tempdir_in("/var/tmp").unwrap();
        assert_ne!(
            std::fs::metadata(shm.path()).unwrap().dev(),
            std::fs::metadata(other.path()).unwrap().dev(),
            "the test needs /dev/shm and the target directory on different file systems"
        );
        let disk = shm.path().join("data.qcow2");
        std::fs::write(&disk, b"qcow2").unwrap();
        let chain = Chain {
            virtual_size: 1 << 20,
            files: vec![disk],
        };
        let e = freeze(&chain, other.path()).unwrap_err().to_string();
        assert!(
            e.contains("another file system") && e.contains("snapshot directory"),
            "{e}"
        );
        // On the same file system it links.
        let same = shm.path().join("frozen");
        std::fs::create_dir(&same).unwrap();
        let top = freeze(&chain, &same).unwrap();
        assert_eq!(std::fs::read(top).unwrap(), b"qcow2");
    }
}
