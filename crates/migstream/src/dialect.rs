//! Which QEMU's stream this is: the one place where the versions differ.
//!
//! vmcsnap supports the QEMU releases that Debian ships: 7.2 (Debian 12)
//! and 10.0 (Debian 13, and bookworm-backports). Every difference between
//! their migration streams, and between their QMP commands, is keyed by a
//! [`Dialect`], chosen from the version QEMU reports in its QMP greeting.
//! A version vmcsnap does not know is one clear error, before any VM is
//! touched: [`Dialect::for_qemu`].

use std::fmt;

/// A QEMU release whose migration stream and QMP vmcsnap speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dialect {
    /// QEMU 7.2.x (Debian 12's system QEMU).
    Qemu7_2,
    /// QEMU 10.0.x (Debian 13; bookworm-backports).
    Qemu10_0,
}

/// A QEMU version vmcsnap does not speak.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("QEMU {major}.{minor}.{micro} is not supported: vmcsnap speaks the migration streams of QEMU 7.2 (Debian 12) and 10.0 (Debian 13, bookworm-backports); install one (scripts/install-qemu.sh 10.0) and name it with VMCSNAP_QEMU")]
pub struct UnsupportedQemu {
    /// Major version as QEMU reported it.
    pub major: u64,
    /// Minor version.
    pub minor: u64,
    /// Micro version.
    pub micro: u64,
}

impl Dialect {
    /// Every supported release, oldest first.
    pub const ALL: [Dialect; 2] = [Dialect::Qemu7_2, Dialect::Qemu10_0];

    /// The dialect of the QEMU that reported `major.minor.micro` (QMP
    /// greeting or `query-version`). Any micro release of a supported
    /// major.minor is accepted.
    pub fn for_qemu(major: u64, minor: u64, micro: u64) -> Result<Dialect, UnsupportedQemu> {
        match (major, minor) {
            (7, 2) => Ok(Dialect::Qemu7_2),
            (10, 0) => Ok(Dialect::Qemu10_0),
            _ => Err(UnsupportedQemu {
                major,
                minor,
                micro,
            }),
        }
    }

    /// The dialect named by a version string such as `"10.0.2"` (as image
    /// manifests record it). `None` if it does not parse.
    pub fn parse_version(version: &str) -> Option<Result<Dialect, UnsupportedQemu>> {
        let mut it = version.split('.').map(|p| p.parse::<u64>().ok());
        let major = it.next()??;
        let minor = it.next()??;
        let micro = it.next().flatten().unwrap_or(0);
        Some(Dialect::for_qemu(major, minor, micro))
    }

    /// `major.minor` of the release, e.g. `"10.0"`.
    pub fn release(self) -> &'static str {
        match self {
            Dialect::Qemu7_2 => "7.2",
            Dialect::Qemu10_0 => "10.0",
        }
    }
}

/// Who resumes the guest after a background snapshot (`migrate` with the
/// `background-snapshot` capability) of a VM the caller paused before
/// starting it (vmcsnap pauses first, to freeze the disk in the same pause).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackgroundResume {
    /// QEMU 7.2 starts the vCPUs itself once guest RAM is write-protected
    /// (`vm_start` in `bg_migration_vm_start_bh`), whatever the run state
    /// was; the caller waits for the `RESUME` event.
    Qemu,
    /// QEMU 10.0 puts back the run state from before the snapshot
    /// (`vm_resume(vm_old_state)`): a guest the caller paused stays paused
    /// and no `RESUME` comes. The caller sends `cont` once write protection
    /// is on, which QMP shows as the first pages counted by `query-migrate`
    /// (`ram.normal` + `ram.duplicate`: pages are saved only after the
    /// protection is on) or the migration `completed`.
    Caller,
}

impl Dialect {
    /// Who resumes a guest paused before its background snapshot started.
    pub fn background_resume(self) -> BackgroundResume {
        match self {
            Dialect::Qemu7_2 => BackgroundResume::Qemu,
            Dialect::Qemu10_0 => BackgroundResume::Caller,
        }
    }

    /// Whether a postcopy source may use this release's postcopy-preempt
    /// channel ([`crate::postcopy::run_source_preempt`]). 10.0's
    /// destination takes the second connection at any time before RUN and
    /// ends its preempt thread on its own at the end. 7.2 has the
    /// capability too, but its destination starts loading only once both
    /// connections exist, and its preempt thread can only end on an EOS;
    /// vmcsnap has neither tested nor measured it, so it is refused there
    /// (docs/qemu-10.0-wire-format.md, "postcopy-preempt").
    pub fn postcopy_preempt(self) -> bool {
        match self {
            Dialect::Qemu7_2 => false,
            Dialect::Qemu10_0 => true,
        }
    }
}

impl fmt::Display for Dialect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "QEMU {}", self.release())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn supported_releases_map_to_their_dialect_whatever_the_micro() {
        assert_eq!(Dialect::for_qemu(7, 2, 0), Ok(Dialect::Qemu7_2));
        assert_eq!(Dialect::for_qemu(7, 2, 22), Ok(Dialect::Qemu7_2));
        assert_eq!(Dialect::for_qemu(10, 0, 2), Ok(Dialect::Qemu10_0));
        assert_eq!(Dialect::for_qemu(10, 0, 13), Ok(Dialect::Qemu10_0));
    }

    #[test]
    fn an_unknown_release_is_an_error_naming_it_and_what_to_do() {
        let e = Dialect::for_qemu(9, 2, 1).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("QEMU 9.2.1 is not supported"), "{msg}");
        assert!(msg.contains("install-qemu.sh"), "{msg}");
        assert!(Dialect::for_qemu(10, 1, 0).is_err());
        assert!(Dialect::for_qemu(8, 2, 0).is_err());
    }

    #[test]
    fn only_qemu_7_2_resumes_a_guest_paused_before_its_background_snapshot() {
        assert_eq!(Dialect::Qemu7_2.background_resume(), BackgroundResume::Qemu);
        assert_eq!(
            Dialect::Qemu10_0.background_resume(),
            BackgroundResume::Caller
        );
    }

    #[test]
    fn version_strings_parse() {
        assert_eq!(
            Dialect::parse_version("10.0.2"),
            Some(Ok(Dialect::Qemu10_0))
        );
        assert_eq!(Dialect::parse_version("7.2"), Some(Ok(Dialect::Qemu7_2)));
        assert!(matches!(Dialect::parse_version("9.1.0"), Some(Err(_))));
        assert_eq!(Dialect::parse_version("x"), None);
        assert_eq!(Dialect::parse_version(""), None);
    }
}
