//! The option enums of requests, defined once: the agent runs them, the CLI
//! parses them (with the `clap` feature, as `clap::ValueEnum`), reports
//! carry them. Each spells its values in kebab-case, on the command line,
//! on the wire and in reports alike.

use serde::{Deserialize, Serialize};

/// Implements `FromStr` (with an error naming every value) and `Display`
/// (the value's name) from the one list of names.
macro_rules! named_enum {
    ($ty:ident, $what:literal, { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// Every value, in the order `--help` lists them.
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];

            /// The value's name (command line, wire, reports).
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }
        }

        impl std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                $ty::ALL.iter().copied().find(|m| m.name() == s).ok_or_else(|| {
                    let names: Vec<&str> = $ty::ALL.iter().map(|m| m.name()).collect();
                    let (last, rest) = names.split_last().expect("an enum has values");
                    format!("unknown {} {s:?}: use {} or {last}", $what, rest.join(", "))
                })
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

/// How a snapshot is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum SnapshotMode {
    /// Background snapshot: a pause of milliseconds, copy-on-write after.
    Hot,
    /// The VM stays paused while all of its memory is copied.
    StopCopy,
    /// Live pre-copy; the VM pauses for the last round and the disk.
    Precopy,
}
named_enum!(SnapshotMode, "snapshot mode", { Hot => "hot", StopCopy => "stop-copy", Precopy => "precopy" });

/// How a VM's QEMU is restarted (`vmcsnap rejuvenate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum RejuvenateMode {
    /// Device state only; RAM stays in place.
    Warm,
    /// RAM and device state to disk and back.
    Saved,
    /// Shut down and boot again.
    Cold,
    /// QEMU 10.0's own warm restart, `cpr-transfer`: the new QEMU starts
    /// beside the old one, which stops only once the new one is ready.
    Cpr,
}
named_enum!(RejuvenateMode, "rejuvenation mode", { Warm => "warm", Saved => "saved", Cold => "cold", Cpr => "cpr" });

/// How a cluster is restored (`vmcsnap restore --cluster`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum ClusterRestoreMode {
    /// Every VM independently, all of its memory loaded before it starts
    /// (the eager baseline).
    Eager,
    /// All of every VM's memory loaded first, starts in restore-line order
    /// (no demand paging after the start: slower, but no guest stalls).
    EagerRl,
    /// Every VM independently, sampled working set (the baseline).
    WorkingsetRestore,
    /// Elastic working set, no restore line.
    Hotrestore,
    /// Elastic working set, LP-revised sizes, restore line.
    HotrestoreRl,
}
named_enum!(ClusterRestoreMode, "cluster restore mode", {
    Eager => "eager", EagerRl => "eager-rl", WorkingsetRestore => "workingset-restore",
    Hotrestore => "hotrestore", HotrestoreRl => "hotrestore-rl",
});

/// How one VM is restored (`vmcsnap restore`): which pages load before
/// its guest starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum RestoreMode {
    /// Every page before the guest starts.
    Eager,
    /// No page before the guest starts.
    Lazy,
    /// HotRestore's elastic working set.
    Workingset,
    /// Working set sized by sampling alone, no FAFL order.
    SamplingWs,
}
named_enum!(RestoreMode, "restore mode", {
    Eager => "eager", Lazy => "lazy", Workingset => "workingset", SamplingWs => "sampling-ws",
});

#[cfg(test)]
mod tests {
    use super::*;

    /// The names of `FromStr`/`Display` are those serde writes: one
    /// spelling everywhere.
    #[test]
    fn names_parse_back_and_match_serde() {
        fn check<T>(all: &[T])
        where
            T: Copy
                + PartialEq
                + std::fmt::Debug
                + std::fmt::Display
                + std::str::FromStr<Err = String>
                + Serialize,
        {
            for m in all {
                let name = m.to_string();
                assert_eq!(name.parse::<T>().unwrap(), *m);
                assert_eq!(serde_json::to_value(m).unwrap(), serde_json::json!(name));
            }
        }
        check(SnapshotMode::ALL);
        check(RejuvenateMode::ALL);
        check(ClusterRestoreMode::ALL);
        check(RestoreMode::ALL);
        let e = "fast".parse::<SnapshotMode>().unwrap_err();
        assert_eq!(
            e,
            "unknown snapshot mode \"fast\": use hot, stop-copy or precopy"
        );
    }
}
