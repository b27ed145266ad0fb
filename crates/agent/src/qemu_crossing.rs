//! Restarting a VM's QEMU on another QEMU version: an upgrade 7.2 → 10.0
//! (the warm-VM reboot's use case: a hypervisor upgrade under a running
//! guest), or back. Which moves QEMU can make is decided here, from the
//! [`Dialect`] of the running QEMU (its QMP greeting) and of the new binary
//! (`--version`), *before* the VM is paused; the new QEMU's own greeting is
//! checked again once it runs, in case the binary lied or changed.
//!
//! What crosses (checked on QEMU 7.2.x of Debian 12 and 10.0.2 of
//! bookworm-backports, see docs/rejuvenation.md "Upgrades"):
//!
//! - the same release: everything, any machine;
//! - a cold restart: any pair (the guest boots again, no state crosses);
//! - q35, warm and saved, both ways: every q35 VM runs the versioned
//!   [`crate::qemu::Q35_MACHINE`], whose compatibility properties make
//!   10.0 write and read the stream 7.2 does;
//! - microvm, warm and saved, 7.2 → 10.0: the devices load unchanged once
//!   the new QEMU runs the firmware the VM booted with
//!   ([`Crossing::adapt`]);
//! - microvm, 10.0 → 7.2: refused. microvm has no versions, so 10.0 writes
//!   its newest stream, with a command 7.2 does not know (`MIG_CMD 0xb
//!   unknown`, the switchover-start of 10.0): the load would fail with the
//!   VM stopped and its old QEMU gone.

use std::path::Path;
use std::process::Command;

use vmcsnap_control::RejuvenateMode as Mode;
use vmcsnap_migstream::{Dialect, UnsupportedQemu};

use crate::qemu::{Machine, QemuConfig};
use crate::vm::Vm;
use crate::{log, AgentError};

/// Why a restart onto another QEMU is refused.
#[derive(Debug, thiserror::Error)]
pub enum CrossingError {
    /// The new binary's version could not be read.
    #[error("{}: cannot tell its QEMU version ({why}); check that it is a qemu-system-x86_64 (`{} --version`)", bin.display(), bin.display())]
    NoVersion {
        /// The binary.
        bin: std::path::PathBuf,
        /// What went wrong.
        why: String,
    },
    /// A release vmcsnap does not speak.
    #[error("VM {vm:?}: {source}")]
    Unsupported {
        /// The VM.
        vm: String,
        /// Which version.
        source: UnsupportedQemu,
    },
    /// A move QEMU cannot make; the VM was not touched.
    #[error("VM {vm:?}: a {mode} restart from {from} to {to} is not possible: {why}. The VM was not touched and runs on {from}; restart it on a {from} binary, or with --mode cold (the guest boots again)")]
    Refused {
        /// The VM.
        vm: String,
        /// The mode asked for.
        mode: &'static str,
        /// The running QEMU's release.
        from: Dialect,
        /// The new binary's release.
        to: Dialect,
        /// Why.
        why: &'static str,
    },
}

/// A restart's move between QEMU releases, checked before the VM is
/// touched ([`preflight`]).
#[derive(Debug, Clone, Copy)]
pub struct Crossing {
    /// The running QEMU's release (its QMP greeting).
    pub from: Dialect,
    /// The new binary's (`--version`); `None` if it could not be read: its
    /// QMP greeting is checked once it runs ([`Crossing::check_greeting`]).
    pub to: Option<Dialect>,
    machine: Machine,
    mode: Mode,
}

/// Reads the releases of `vm`'s running QEMU and of `bin`, and refuses a
/// `mode` restart between them that cannot work, before anything is done
/// to the VM.
pub fn preflight(vm: &mut Vm, bin: &Path, mode: Mode) -> Result<Crossing, AgentError> {
    let name = vm.name.clone();
    let from = dialect_of(&name, vm.qmp()?.version())?;
    let to = match binary_version(bin) {
        Ok(v) => Some(dialect_of(&name, v)?),
        Err(e) if mode == Mode::Cpr => return Err(e.into()),
        Err(e) => {
            log(format!(
                "VM {name}: {e}; the new QEMU's QMP greeting is checked once it runs"
            ));
            None
        }
    };
    if let Some(to) = to {
        check(&name, vm.config.machine, mode, from, to)?;
        if to != from {
            log(format!("VM {name}: {mode:?} restart from {from} to {to}"));
        }
    }
    Ok(Crossing {
        from,
        to,
        machine: vm.config.machine,
        mode,
    })
}

impl Crossing {
    /// Checks the release the new QEMU greeted with (the binary may not be
    /// what `--version` said, or that could not be read): an error makes
    /// the restart fall back to the kept copy of the old QEMU.
    pub fn check_greeting(&self, new: &mut Vm) -> Result<(), AgentError> {
        let name = new.name.clone();
        let to = dialect_of(&name, new.qmp()?.version())?;
        check(&name, self.machine, self.mode, self.from, to)?;
        Ok(())
    }

    /// `config` for the new binary: cpr-ready (`aux-ram-share=on`, which
    /// only 10.0 knows) when it is 10.0, not when it is 7.2, as the old
    /// QEMU's if its release is unknown.
    pub fn for_new(&self, mut config: QemuConfig) -> QemuConfig {
        if let Some(to) = self.to {
            config.cpr_ready = to >= Dialect::Qemu10_0;
        }
        config
    }

    /// `config` for the kept copy of the old QEMU: cpr-ready as it was.
    pub fn for_old(&self, mut config: QemuConfig) -> QemuConfig {
        config.cpr_ready &= self.from >= Dialect::Qemu10_0;
        config
    }

    /// `config` for the new QEMU: a microvm VM keeps the firmware file it
    /// booted with unless the release is known to stay the same. Its size
    /// is part of the migrated state, and the firmware differs between the
    /// installations (Debian 12's 7.2 boots microvm with qboot, 64 KiB; the
    /// 10.0 of `install-qemu.sh` with SeaBIOS's, 128 KiB: a load fails on
    /// "Size mismatch: pc.bios"). q35's SeaBIOS and option ROMs are the
    /// same files for both (`install-qemu.sh` links the system's).
    pub fn adapt(&self, config: &mut QemuConfig, old_data_dir: Option<&Path>) {
        if self.machine != Machine::Microvm
            || self.mode == Mode::Cold
            || self.to == Some(self.from)
            || config.bios.is_some()
        {
            return;
        }
        let dir = old_data_dir.unwrap_or(Path::new(SYSTEM_DATA_DIR));
        let fw = dir.join(MICROVM_FIRMWARE);
        config.bios = Some(std::fs::canonicalize(&fw).unwrap_or(fw));
    }
}

/// Where a QEMU installed under /usr finds its firmware.
const SYSTEM_DATA_DIR: &str = "/usr/share/qemu";
/// microvm's default firmware file.
const MICROVM_FIRMWARE: &str = "bios-microvm.bin";

/// The release of the QEMU that greeted with `major.minor.micro`.
pub fn dialect_of(vm: &str, v: vmcsnap_qmp::QemuVersion) -> Result<Dialect, CrossingError> {
    Dialect::for_qemu(v.major, v.minor, v.micro).map_err(|source| CrossingError::Unsupported {
        vm: vm.to_string(),
        source,
    })
}

/// The version `bin --version` reports (`QEMU emulator version 10.0.2 (…)`).
pub fn binary_version(bin: &Path) -> Result<vmcsnap_qmp::QemuVersion, CrossingError> {
    let no = |why: String| CrossingError::NoVersion {
        bin: bin.to_path_buf(),
        why,
    };
    let out = Command::new(bin)
        .arg("--version")
        .output()
        .map_err(|e| no(e.to_string()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(no(format!("{}: {}", out.status, err.trim())));
    }
    parse_version(&String::from_utf8_lossy(&out.stdout))
        .ok_or_else(|| no("no \"QEMU emulator version X.Y.Z\" in its output".into()))
}

fn parse_version(text: &str) -> Option<vmcsnap_qmp::QemuVersion> {
    let rest = text.split("version ").nth(1)?;
    let word = rest.split_whitespace().next()?;
    let mut it = word.split('.').map(|p| p.parse::<u64>().ok());
    Some(vmcsnap_qmp::QemuVersion {
        major: it.next()??,
        minor: it.next()??,
        micro: it.next().flatten().unwrap_or(0),
    })
}

/// Whether a `mode` restart of a `machine` VM from `from` to `to` can work.
pub fn check(
    vm: &str,
    machine: Machine,
    mode: Mode,
    from: Dialect,
    to: Dialect,
) -> Result<(), CrossingError> {
    if mode == Mode::Cpr && (from, to) != (Dialect::Qemu10_0, Dialect::Qemu10_0) {
        return Err(CrossingError::Refused {
            vm: vm.to_string(),
            mode: mode_name(mode),
            from,
            to,
            why: "cpr-transfer is QEMU 10.0's: both the running QEMU and the new one must be 10.0; use --mode warm",
        });
    }
    if from == to || mode == Mode::Cold || machine == Machine::Q35 {
        return Ok(());
    }
    if to < from {
        return Err(CrossingError::Refused {
            vm: vm.to_string(),
            mode: mode_name(mode),
            from,
            to,
            why: "microvm has no versioned machine type, so the newer QEMU writes a stream the older one cannot load (QEMU 7.2 rejects 10.0's switchover-start command); only q35 VMs (machine pc-q35-7.2) move back",
        });
    }
    Ok(())
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Warm => "warm",
        Mode::Saved => "saved",
        Mode::Cold => "cold",
        Mode::Cpr => "cpr",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_from_qemu_version_output() {
        let v = parse_version("QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)\nCopyright (c) 2003-2025 Fabrice Bellard and the QEMU Project developers\n").unwrap();
        assert_eq!((v.major, v.minor, v.micro), (10, 0, 2));
        let v =
            parse_version("QEMU emulator version 7.2.19 (Debian 1:7.2+dfsg-7+deb12u16)\n").unwrap();
        assert_eq!((v.major, v.minor, v.micro), (7, 2, 19));
        assert!(parse_version("broken qemu").is_none());
    }

    #[test]
    fn upgrades_pass_and_microvm_downgrades_are_refused_naming_both_versions() {
        use Dialect::*;
        for machine in [Machine::Microvm, Machine::Q35] {
            for mode in [Mode::Warm, Mode::Saved, Mode::Cold] {
                check("v", machine, mode, Qemu7_2, Qemu7_2).unwrap();
                check("v", machine, mode, Qemu10_0, Qemu10_0).unwrap();
                check("v", machine, mode, Qemu7_2, Qemu10_0).unwrap();
            }
            check("v", machine, Mode::Cold, Qemu10_0, Qemu7_2).unwrap();
        }
        for mode in [Mode::Warm, Mode::Saved] {
            check("v", Machine::Q35, mode, Qemu10_0, Qemu7_2).unwrap();
            let e = check("v", Machine::Microvm, mode, Qemu10_0, Qemu7_2)
                .unwrap_err()
                .to_string();
            assert!(e.contains("from QEMU 10.0 to QEMU 7.2"), "{e}");
            assert!(e.contains("not touched"), "{e}");
            assert!(e.contains("--mode cold"), "{e}");
        }
    }

    #[test]
    fn cpr_needs_10_0_on_both_sides() {
        use Dialect::*;
        check("v", Machine::Microvm, Mode::Cpr, Qemu10_0, Qemu10_0).unwrap();
        for (from, to) in [(Qemu7_2, Qemu10_0), (Qemu7_2, Qemu7_2), (Qemu10_0, Qemu7_2)] {
            let e = check("v", Machine::Q35, Mode::Cpr, from, to)
                .unwrap_err()
                .to_string();
            assert!(e.contains("cpr-transfer is QEMU 10.0's"), "{e}");
            assert!(e.contains(&format!("from {from} to {to}")), "{e}");
        }
    }

    #[test]
    fn an_unknown_release_is_an_error_naming_it() {
        let v = vmcsnap_qmp::QemuVersion {
            major: 9,
            minor: 2,
            micro: 1,
        };
        let e = dialect_of("v", v).unwrap_err().to_string();
        assert!(e.contains("QEMU 9.2.1 is not supported"), "{e}");
    }
}
