//! Which `-cpu` a new VM gets: the accelerator's model (`max` under TCG,
//! `host` under KVM) unless the QEMU version and the guest kernel need
//! another one.
//!
//! The one case known: QEMU 7.2's TCG and Linux 6.12 guests (Debian 13's
//! kernel). With `-cpu max` such a guest dies of a double fault right after
//! `cmpxchg16b` early in boot (4 of 4 boots, also with `EPYC` and `qemu64`);
//! without the `cx16` flag the kernel does not use the instruction and runs.
//! (That was the bookworm-backports 6.12 in a nested lab; trixie's own
//! 6.12.117 booted with plain `max` on 7.2 in 7 of 7 tries, docs/images.md:
//! `-cx16` on 7.2 is a precaution for 6.12 kernels that costs nothing
//! measurable.) QEMU 10.0's TCG boots trixie's kernel with plain `max` (9 of
//! 9), so there the accelerator's model stays.
//!
//! The choice is made once, when a VM is created (`up`), and recorded in
//! its [`crate::qemu::QemuConfig::cpu`]: every restart, restore and
//! rejuvenation of the VM reuses the recorded model, whatever QEMU runs it
//! then, since a guest's CPU features must not change under it.

use std::path::{Path, PathBuf};
use std::process::Command;

use vmcsnap_migstream::{Dialect, UnsupportedQemu};

use crate::accel::Resolved;

/// The TCG model of a guest whose kernel may use `cmpxchg16b` under QEMU
/// 7.2 (see the module documentation).
pub const TCG_NO_CX16: &str = "max,-cx16";

/// Why the version of a QEMU binary could not be had.
#[derive(Debug, thiserror::Error)]
pub enum CpuModelError {
    /// `QEMU --version` did not run.
    #[error("cannot run {bin} --version to learn its version: {source}; check VMCSNAP_QEMU names a QEMU binary")]
    Run {
        /// The binary.
        bin: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// Its output has no version where QEMU prints it.
    #[error("{bin} --version printed no \"QEMU emulator version X.Y.Z\" line ({status}; it said {output:?}): is VMCSNAP_QEMU a working qemu-system-x86_64?")]
    NoVersion {
        /// The binary.
        bin: PathBuf,
        /// How it exited.
        status: String,
        /// The first lines of what it printed (stdout, then stderr).
        output: String,
    },
    /// A version vmcsnap does not speak.
    #[error(transparent)]
    Unsupported(#[from] UnsupportedQemu),
}

/// The dialect of the QEMU binary `bin`, from its `--version` (the VM is
/// not started yet, so there is no QMP greeting to ask).
pub fn binary_dialect(bin: &Path) -> Result<Dialect, CpuModelError> {
    let out = Command::new(bin)
        .arg("--version")
        .output()
        .map_err(|source| CpuModelError::Run {
            bin: bin.to_path_buf(),
            source,
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    version_dialect(&text).unwrap_or_else(|| {
        let said = format!("{text}{}", String::from_utf8_lossy(&out.stderr));
        Err(CpuModelError::NoVersion {
            bin: bin.to_path_buf(),
            status: out.status.to_string(),
            output: said.lines().take(3).collect::<Vec<_>>().join(" / "),
        })
    })
}

/// The dialect named by QEMU's `--version` text (`QEMU emulator version
/// 10.0.2 (Debian ...)`); `None` if there is no such line.
pub fn version_dialect(text: &str) -> Option<Result<Dialect, CpuModelError>> {
    let line = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("QEMU emulator version "))?;
    let version = line.split_whitespace().next()?;
    Dialect::parse_version(version).map(|r| r.map_err(CpuModelError::from))
}

/// Whether a guest kernel release (`uname -r`, e.g. `6.1.0-50-cloud-amd64`
/// or `6.12.57+deb13-cloud-amd64`) is known to boot with `-cpu max` under
/// QEMU 7.2's TCG: Linux up to 6.1 is (bookworm's kernel, vmcsnap's lab
/// guest). A newer or unknown kernel (a user's image may be Debian 13) is
/// treated as 6.12.
pub fn kernel_boots_with_cx16(release: Option<&str>) -> bool {
    let Some(release) = release else {
        return false;
    };
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next().and_then(|p| p.parse::<u32>().ok());
    let minor = parts.next().and_then(|p| p.parse::<u32>().ok());
    matches!((major, minor), (Some(ma), Some(mi)) if (ma, mi) <= (6, 1))
}

/// The kernel release of the lab guest's assets in `dir`, from the
/// `kernel-package` file `guest/build.sh` writes (`linux-image-RELEASE
/// VERSION`); `None` if it is missing or says something else.
pub fn lab_kernel_release(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("kernel-package")).ok()?;
    let package = text.split_whitespace().next()?;
    package
        .strip_prefix("linux-image-")
        .filter(|r| r.starts_with(|c: char| c.is_ascii_digit()))
        .map(str::to_string)
}

/// The `-cpu` for a new VM under `accel` on a QEMU of `dialect` booting
/// a kernel of `kernel_release` (if known): `None` keeps the accelerator's
/// model.
pub fn choose(accel: Resolved, dialect: Dialect, kernel_release: Option<&str>) -> Option<String> {
    match (accel, dialect) {
        (Resolved::Tcg, Dialect::Qemu7_2) if !kernel_boots_with_cx16(kernel_release) => {
            Some(TCG_NO_CX16.to_string())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_of_debians_qemus_are_read_and_others_refused() {
        let d = |t: &str| version_dialect(t).map(|r| r.map_err(|e| e.to_string()));
        assert_eq!(
            d("QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\nCopyright"),
            Some(Ok(Dialect::Qemu7_2))
        );
        assert_eq!(
            d("QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)\n"),
            Some(Ok(Dialect::Qemu10_0))
        );
        let e = d("QEMU emulator version 8.2.2\n").unwrap().unwrap_err();
        assert!(e.contains("8.2.2") && e.contains("not supported"), "{e}");
        for bad in ["", "qemu-img version 7.2.22\n", "QEMU emulator version x\n"] {
            assert_eq!(d(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn only_kernels_up_to_6_1_count_as_safe_with_cx16() {
        for safe in [
            "6.1.0-50-cloud-amd64",
            "6.1.153",
            "5.10.0-35-cloud-amd64",
            "4.19.0",
        ] {
            assert!(kernel_boots_with_cx16(Some(safe)), "{safe}");
        }
        for new in ["6.12.57+deb13-cloud-amd64", "6.2.0", "7.0.1", "garbage", ""] {
            assert!(!kernel_boots_with_cx16(Some(new)), "{new}");
        }
        assert!(!kernel_boots_with_cx16(None));
    }

    #[test]
    fn only_tcg_on_7_2_with_a_new_or_unknown_kernel_drops_cx16() {
        let trixie = Some("6.12.57+deb13-cloud-amd64");
        let bookworm = Some("6.1.0-50-cloud-amd64");
        assert_eq!(
            choose(Resolved::Tcg, Dialect::Qemu7_2, trixie).as_deref(),
            Some(TCG_NO_CX16)
        );
        assert_eq!(
            choose(Resolved::Tcg, Dialect::Qemu7_2, None).as_deref(),
            Some(TCG_NO_CX16)
        );
        assert_eq!(choose(Resolved::Tcg, Dialect::Qemu7_2, bookworm), None);
        for k in [trixie, bookworm, None] {
            assert_eq!(choose(Resolved::Tcg, Dialect::Qemu10_0, k), None);
            for d in Dialect::ALL {
                assert_eq!(choose(Resolved::Kvm, d, k), None);
            }
        }
    }

    #[test]
    fn the_lab_kernel_release_comes_from_its_package_name() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(lab_kernel_release(d.path()), None);
        let write = |t: &str| std::fs::write(d.path().join("kernel-package"), t).unwrap();
        write("linux-image-6.1.0-56-cloud-amd64 6.1.192-2\n");
        assert_eq!(
            lab_kernel_release(d.path()).as_deref(),
            Some("6.1.0-56-cloud-amd64")
        );
        for bad in ["", "linux-image-cloud-amd64 1", "vmlinuz 6.1"] {
            write(bad);
            assert_eq!(lab_kernel_release(d.path()), None, "{bad:?}");
        }
    }

    #[test]
    fn the_system_qemu_reports_a_supported_version() {
        let bin = crate::qemu::find_qemu().unwrap();
        binary_dialect(&bin).unwrap_or_else(|e| panic!("{e}"));
        let e = binary_dialect(Path::new("/nonexistent/qemu")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/qemu"), "{e}");
    }
}
