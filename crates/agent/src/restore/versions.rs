//! Which QEMU a snapshot can restore into, checked before anything starts.
//!
//! A snapshot records the QEMU that took it (`qemu.version` in its
//! manifest). QEMU loads the migration stream of its own release and of
//! older ones (same machine type version), never of a newer one: a
//! snapshot taken under 10.0 restored into 7.2 would fail half-way, on
//! device sections 7.2 does not know. So the restore compares the two
//! releases ([`Dialect`]) first and refuses, naming both, what cannot work;
//! a snapshot of a QEMU vmcsnap does not know is refused as well.

use std::path::Path;
use std::process::Command;

use vmcsnap_migstream::Dialect;

/// Why a snapshot cannot restore into a QEMU.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VersionError {
    /// The snapshot was taken under a newer QEMU than the one that would
    /// restore it.
    #[error("snapshot {snapshot:?} was taken under QEMU {taken} and cannot be restored into QEMU {into} ({bin}): QEMU loads only the streams of its own release and older ones. Restore it with a QEMU {taken_release} or newer (VMCSNAP_QEMU=$(scripts/install-qemu.sh {taken_release}))")]
    Downgrade {
        /// The snapshot's name.
        snapshot: String,
        /// The version the manifest records.
        taken: String,
        /// Its release, e.g. `10.0`.
        taken_release: &'static str,
        /// The restoring QEMU's version.
        into: String,
        /// The restoring QEMU's binary.
        bin: String,
    },
    /// The manifest names a QEMU vmcsnap does not speak (or no version).
    #[error("snapshot {snapshot:?} was taken under QEMU {taken:?}, a version vmcsnap does not know: it restores snapshots of QEMU 7.2 and 10.0 only")]
    UnknownSnapshotQemu {
        /// The snapshot's name.
        snapshot: String,
        /// The version the manifest records.
        taken: String,
    },
    /// The restoring QEMU's version could not be learned or is unknown.
    #[error("the QEMU that would restore snapshot {snapshot:?} ({bin}) {why}")]
    Destination {
        /// The snapshot's name.
        snapshot: String,
        /// The binary.
        bin: String,
        /// What went wrong.
        why: String,
    },
}

/// The release of a version string such as `"7.2.22"`.
pub fn release_of(version: &str) -> Option<Dialect> {
    Dialect::parse_version(version).and_then(Result::ok)
}

/// The releases a snapshot taken under `taken` can restore into, oldest
/// first (empty for a version vmcsnap does not know).
pub fn restores_into(taken: &str) -> Vec<Dialect> {
    match release_of(taken) {
        Some(t) => Dialect::ALL.into_iter().filter(|d| *d >= t).collect(),
        None => Vec::new(),
    }
}

/// Whether a snapshot taken under `taken` can restore into a QEMU of
/// version `into` (both `major.minor.micro`).
pub fn check(snapshot: &str, taken: &str, into: &str, bin: &Path) -> Result<Dialect, VersionError> {
    let taken_d = release_of(taken).ok_or_else(|| VersionError::UnknownSnapshotQemu {
        snapshot: snapshot.into(),
        taken: taken.into(),
    })?;
    let into_d = match Dialect::parse_version(into) {
        Some(Ok(d)) => d,
        Some(Err(e)) => {
            return Err(VersionError::Destination {
                snapshot: snapshot.into(),
                bin: bin.display().to_string(),
                why: format!("cannot be used: {e}"),
            })
        }
        None => {
            return Err(VersionError::Destination {
                snapshot: snapshot.into(),
                bin: bin.display().to_string(),
                why: format!("reports no version vmcsnap can read ({into:?})"),
            })
        }
    };
    if into_d < taken_d {
        return Err(VersionError::Downgrade {
            snapshot: snapshot.into(),
            taken: taken.into(),
            taken_release: taken_d.release(),
            into: into.into(),
            bin: bin.display().to_string(),
        });
    }
    Ok(into_d)
}

/// The version of the QEMU binary `bin` (`major.minor.micro`), from
/// `bin --version` ("QEMU emulator version 10.0.2 (Debian ...)").
pub fn binary_version(snapshot: &str, bin: &Path) -> Result<String, VersionError> {
    let dest = |why: String| VersionError::Destination {
        snapshot: snapshot.into(),
        bin: bin.display().to_string(),
        why,
    };
    let out = Command::new(bin)
        .arg("--version")
        .output()
        .map_err(|e| dest(format!("could not be run: {e}")))?;
    let text = String::from_utf8_lossy(&out.stdout);
    parse_version_output(&text)
        .ok_or_else(|| dest(format!("printed no version: {:?}", text.trim())))
}

fn parse_version_output(text: &str) -> Option<String> {
    let rest = text.split("version ").nth(1)?;
    let v: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    (!v.is_empty()).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BIN: &str = "/q";

    #[test]
    fn same_release_and_upgrades_restore() {
        assert_eq!(
            check("s", "7.2.22", "7.2.0", Path::new(BIN)),
            Ok(Dialect::Qemu7_2)
        );
        assert_eq!(
            check("s", "7.2.22", "10.0.2", Path::new(BIN)),
            Ok(Dialect::Qemu10_0)
        );
        assert_eq!(
            check("s", "10.0.2", "10.0.13", Path::new(BIN)),
            Ok(Dialect::Qemu10_0)
        );
    }

    #[test]
    fn a_downgrade_names_both_versions_and_what_to_do() {
        let e = check("s10", "10.0.2", "7.2.22", Path::new(BIN)).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, VersionError::Downgrade { .. }), "{msg}");
        for want in [
            "QEMU 10.0.2",
            "QEMU 7.2.22",
            "s10",
            "install-qemu.sh 10.0",
            BIN,
        ] {
            assert!(msg.contains(want), "{want:?} missing from: {msg}");
        }
    }

    #[test]
    fn unknown_versions_are_refused() {
        let e = check("s", "9.1.0", "10.0.2", Path::new(BIN)).unwrap_err();
        assert!(matches!(e, VersionError::UnknownSnapshotQemu { .. }), "{e}");
        assert!(e.to_string().contains("\"9.1.0\""), "{e}");
        let e = check("s", "", "10.0.2", Path::new(BIN)).unwrap_err();
        assert!(matches!(e, VersionError::UnknownSnapshotQemu { .. }), "{e}");
        let e = check("s", "7.2.22", "8.2.2", Path::new(BIN)).unwrap_err();
        assert!(e.to_string().contains("QEMU 8.2.2 is not supported"), "{e}");
    }

    #[test]
    fn restore_targets_per_snapshot_version() {
        assert_eq!(
            restores_into("7.2.22"),
            vec![Dialect::Qemu7_2, Dialect::Qemu10_0]
        );
        assert_eq!(restores_into("10.0.2"), vec![Dialect::Qemu10_0]);
        assert!(restores_into("6.2.0").is_empty());
    }

    #[test]
    fn version_output_parses() {
        assert_eq!(
            parse_version_output(
                "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)\nCopyright"
            )
            .as_deref(),
            Some("10.0.2")
        );
        assert_eq!(
            parse_version_output("QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18)")
                .as_deref(),
            Some("7.2.22")
        );
        assert_eq!(parse_version_output("nothing"), None);
    }
}
