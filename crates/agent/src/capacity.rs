//! The capacity check that `up` and restores run before they create
//! anything: will the VMs they are about to start fit on this host?
//!
//! Three rules (docs/cluster-spec.md, "Will it fit?"; docs/restore.md):
//! - **memory**: the guest RAM of the VMs to start, plus an estimated
//!   [`QEMU_OVERHEAD_MIB`] per VM for QEMU itself, must not exceed the
//!   host's `MemAvailable` (/proc/meminfo);
//! - **/dev/shm**: the RAM files to create (one per VM, the size of its
//!   guest RAM) must fit in the free space of /dev/shm, where guest RAM
//!   lives ([`crate::RunDir::shm_path`]);
//! - **disk**: the run directory, where overlays and logs go, must have at
//!   least [`DISK_HEADROOM_MIB`] free. A qcow2 overlay starts at a few
//!   hundred KiB and a restore reads its snapshot without writing to it, so
//!   only headroom is asked, not the disks' sizes.
//!
//! A RAM file that already exists at the path of a VM to start (left by a
//! VM that is not running any more) is removed before the new one is
//! created, so the space it holds counts as free for memory and /dev/shm:
//! it is never counted twice. Running VMs are not counted: their RAM is
//! already taken out of what the host reports (though a guest may still
//! grow into RAM it has not touched yet).
//!
//! The arithmetic is pure ([`check`]) and saturating: a sum that would
//! overflow is `u64::MAX` bytes, which never fits. Reading the host
//! ([`host`]) only reads; the check never changes a host setting. A figure
//! the host does not give (no /proc/meminfo, no /dev/shm) skips its rule.

use std::path::Path;

use crate::{log, AgentError, RunDir};

const MIB: u64 = 1 << 20;

/// Memory QEMU itself needs per VM beyond guest RAM: an estimate. A lab VM
/// under TCG measured about 70 MiB of anonymous memory after boot (mostly
/// the translation cache, which grows with the guest's code); the rest is
/// room for that growth and for devices. QEMU's binary and libraries are
/// shared page cache and not counted.
pub const QEMU_OVERHEAD_MIB: u64 = 128;

/// Free space the run directory must have before VMs start there: their
/// qcow2 overlays (which start small and grow with what guests write),
/// seeds, sockets and logs.
pub const DISK_HEADROOM_MIB: u64 = 64;

/// What is short.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    /// The host's available memory.
    Memory,
    /// Free space in /dev/shm.
    Shm,
    /// Free space where the run directory is.
    Disk,
}

impl std::fmt::Display for Resource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Resource::Memory => "memory",
            Resource::Shm => "space in /dev/shm",
            Resource::Disk => "disk space",
        })
    }
}

impl Resource {
    /// What to do about it (`restore`: the VMs come from a snapshot, whose
    /// memory size cannot change).
    pub fn advice(&self, restore: bool) -> &'static str {
        match (self, restore) {
            (Resource::Memory, false) => "lower memory_mib or stop other VMs",
            (Resource::Memory, true) => {
                "stop other VMs, or restore on a host with more memory \
                 (a snapshot's memory size cannot change)"
            }
            (Resource::Shm, false) => {
                "lower memory_mib or stop other VMs (guest RAM lives in /dev/shm; \
                 `df -h /dev/shm` shows what uses it)"
            }
            (Resource::Shm, true) => {
                "stop other VMs (guest RAM lives in /dev/shm; \
                 `df -h /dev/shm` shows what uses it)"
            }
            (Resource::Disk, _) => {
                "free some space there (`vmcsnap gc` removes leftovers) or use another --run-dir"
            }
        }
    }
}

/// The operation that is about to start VMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start<'a> {
    /// `up`.
    Up,
    /// A restore of the VM of this name.
    Restore(&'a str),
    /// A restore of the cluster snapshot of this name.
    ClusterRestore(&'a str),
}

impl Start<'_> {
    /// What it does, for the error ("start 2 VMs").
    fn to(&self, vms: usize) -> String {
        let vms = if vms == 1 {
            "1 VM".to_string()
        } else {
            format!("{vms} VMs")
        };
        match self {
            Start::Up => format!("start {vms}"),
            Start::Restore(vm) => format!("restore VM {vm:?}"),
            Start::ClusterRestore(snap) => format!("restore {vms} of cluster snapshot {snap:?}"),
        }
    }
}

/// What an operation is about to start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Demand {
    /// The size of each new VM's RAM file (its guest RAM), bytes.
    pub ram_bytes: Vec<u64>,
    /// Bytes held by existing RAM files that the operation removes before
    /// it creates its own at the same paths.
    pub replaced_bytes: u64,
}

/// What the host has, bytes; `None` where it could not be read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Host {
    /// `MemAvailable` of /proc/meminfo.
    pub mem_available: Option<u64>,
    /// Free bytes of /dev/shm.
    pub shm_free: Option<u64>,
    /// Free bytes of the run directory's file system.
    pub disk_free: Option<u64>,
}

/// A rule the host does not meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shortfall {
    /// What is short.
    pub resource: Resource,
    /// What the operation needs, bytes.
    pub need: u64,
    /// What there is (with the replaced files' bytes), bytes.
    pub have: u64,
}

/// The bytes of a VM's guest RAM, and so of its RAM file (saturating).
/// (VMs launched padded under TCG have 8 KiB more,
/// [`crate::qemu::TCG_DIRTY_TRACKING_PAD_KIB`]; that is left out so the
/// numbers in the error are the spec's.)
pub fn ram_bytes(memory_mib: u64) -> u64 {
    memory_mib.saturating_mul(MIB)
}

/// The guest RAM of every VM to start, bytes (saturating).
pub fn guest_ram(d: &Demand) -> u64 {
    d.ram_bytes.iter().fold(0, |a, &b| a.saturating_add(b))
}

/// Guest RAM plus QEMU's estimated overhead for every VM, bytes.
pub fn memory_need(d: &Demand) -> u64 {
    let vms = u64::try_from(d.ram_bytes.len()).unwrap_or(u64::MAX);
    guest_ram(d).saturating_add(vms.saturating_mul(QEMU_OVERHEAD_MIB * MIB))
}

/// Checks memory, then /dev/shm, then disk; the first rule not met.
pub fn check(d: &Demand, host: &Host) -> Result<(), Shortfall> {
    let rules = [
        (Resource::Memory, memory_need(d), host.mem_available, true),
        (Resource::Shm, guest_ram(d), host.shm_free, true),
        (
            Resource::Disk,
            DISK_HEADROOM_MIB * MIB,
            host.disk_free,
            false,
        ),
    ];
    for (resource, need, have, replaced_count) in rules {
        let Some(have) = have else { continue };
        let have = if replaced_count {
            have.saturating_add(d.replaced_bytes)
        } else {
            have
        };
        if need > have {
            return Err(Shortfall {
                resource,
                need,
                have,
            });
        }
    }
    Ok(())
}

/// `MemAvailable` of a /proc/meminfo text, bytes.
pub fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let v = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let kib: u64 = v.trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// Bytes an unprivileged user may still write on the file system of `path`.
fn free_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is a valid NUL-terminated path and `st` a properly sized,
    // writable statvfs that the call only fills in.
    let st = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        (libc::statvfs(c.as_ptr(), &mut st) == 0).then_some(st)
    }?;
    #[allow(clippy::useless_conversion)] // the field types differ by target
    let (avail, frsize) = (u64::from(st.f_bavail), u64::from(st.f_frsize));
    Some(avail.saturating_mul(frsize))
}

/// What the host has now. `run_root` is the run directory (or, before it
/// exists, the nearest parent that does).
pub fn host(run_root: &Path) -> Host {
    let disk_dir = run_root
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(run_root);
    Host {
        mem_available: std::fs::read_to_string("/proc/meminfo")
            .ok()
            .as_deref()
            .and_then(parse_mem_available),
        shm_free: free_bytes(Path::new("/dev/shm")),
        disk_free: free_bytes(disk_dir),
    }
}

/// The bytes an existing file holds (its allocated blocks), 0 if there is
/// none: what removing it frees.
pub fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .filter(|m| m.is_file())
        .map_or(0, |m| m.blocks().saturating_mul(512))
}

/// What starting `vms` (name, memory_mib) in the cluster
/// named `cluster` of `run` takes: their RAM files, less the old files at
/// the same paths (every start removes those first).
pub fn demand<'a>(
    run: &RunDir,
    cluster: &str,
    vms: impl IntoIterator<Item = (&'a str, u64)>,
) -> Demand {
    let mut d = Demand::default();
    for (name, memory_mib) in vms {
        d.ram_bytes.push(ram_bytes(memory_mib));
        d.replaced_bytes = d
            .replaced_bytes
            .saturating_add(allocated_bytes(&run.shm_path(cluster, name)));
    }
    d
}

fn mib_up(bytes: u64) -> u64 {
    bytes.div_ceil(MIB)
}

/// Runs the check against this host for `start`, which will start the VMs
/// of `demand` in `run`.
pub fn ensure(start: Start<'_>, demand: &Demand, run: &RunDir) -> Result<(), AgentError> {
    let run_root = run.root();
    let host = host(run_root);
    for (what, v) in [
        ("MemAvailable", host.mem_available),
        ("/dev/shm", host.shm_free),
        ("the run directory's free space", host.disk_free),
    ] {
        if v.is_none() {
            log(format!(
                "capacity check: {what} cannot be read, not checked"
            ));
        }
    }
    let Err(s) = check(demand, &host) else {
        return Ok(());
    };
    Err(shortfall_error(start, demand, &s, run_root))
}

/// The error for a shortfall (numbers in MiB: need rounded up, what there
/// is rounded down).
fn shortfall_error(start: Start<'_>, d: &Demand, s: &Shortfall, run_root: &Path) -> AgentError {
    let vms = d.ram_bytes.len();
    let replaced = if d.replaced_bytes > 0 {
        format!(
            ", counting {} MiB of old RAM files this replaces",
            mib_up(d.replaced_bytes)
        )
    } else {
        String::new()
    };
    let (need_detail, have_detail) = match s.resource {
        Resource::Memory => (
            format!(
                "{} MiB of guest RAM + {vms} x {QEMU_OVERHEAD_MIB} MiB estimated QEMU overhead",
                mib_up(guest_ram(d))
            ),
            format!("available (MemAvailable in /proc/meminfo{replaced})"),
        ),
        Resource::Shm => (
            format!("the guest RAM files of {vms} VM(s)"),
            format!("free in /dev/shm{replaced}"),
        ),
        Resource::Disk => (
            "headroom for overlays and logs".to_string(),
            format!("free in {}", run_root.display()),
        ),
    };
    AgentError::Capacity {
        resource: s.resource,
        to: start.to(vms),
        advice: s.resource.advice(!matches!(start, Start::Up)),
        need_mib: mib_up(s.need),
        need_detail,
        have_mib: s.have / MIB,
        have_detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn host(mem: u64, shm: u64, disk: u64) -> Host {
        Host {
            mem_available: Some(mem),
            shm_free: Some(shm),
            disk_free: Some(disk),
        }
    }

    fn vms(mib: &[u64]) -> Demand {
        Demand {
            ram_bytes: mib.iter().map(|&m| ram_bytes(m)).collect(),
            replaced_bytes: 0,
        }
    }

    #[test]
    fn vms_that_fit_pass() {
        let d = vms(&[256, 512]);
        assert_eq!(check(&d, &host(22 * GIB, 12 * GIB, 70 * GIB)), Ok(()));
        // Exactly enough is enough: 768 MiB of RAM + 2 x 128 MiB overhead.
        assert_eq!(check(&d, &host(1024 * MIB, 768 * MIB, 64 * MIB)), Ok(()));
    }

    #[test]
    fn memory_short_names_memory_with_the_overhead_counted() {
        let d = vms(&[256, 512]);
        let e = check(&d, &host(1024 * MIB - 1, 12 * GIB, 70 * GIB)).unwrap_err();
        assert_eq!(e.resource, Resource::Memory);
        assert_eq!(e.need, 1024 * MIB);
        assert_eq!(e.have, 1024 * MIB - 1);
    }

    #[test]
    fn shm_short_names_shm_without_the_overhead() {
        let d = vms(&[1024]);
        let e = check(&d, &host(22 * GIB, 1000 * MIB, 70 * GIB)).unwrap_err();
        assert_eq!(e.resource, Resource::Shm);
        assert_eq!(e.need, 1024 * MIB);
        assert_eq!(e.have, 1000 * MIB);
    }

    #[test]
    fn disk_short_asks_only_the_headroom() {
        let d = vms(&[128]);
        let e = check(&d, &host(22 * GIB, 12 * GIB, 10 * MIB)).unwrap_err();
        assert_eq!(e.resource, Resource::Disk);
        assert_eq!(e.need, DISK_HEADROOM_MIB * MIB);
        // A big guest needs no more disk: its overlay starts small.
        assert_eq!(
            check(&vms(&[8192]), &host(22 * GIB, 12 * GIB, 64 * MIB)),
            Ok(())
        );
    }

    #[test]
    fn replaced_ram_files_are_not_counted_twice() {
        // /dev/shm holds 1 GiB of an old RAM file at the path the new VM
        // gets: the restore removes it first, so 1.5 GiB free is enough.
        let d = Demand {
            replaced_bytes: GIB,
            ..vms(&[2048])
        };
        assert_eq!(check(&d, &host(22 * GIB, 1536 * MIB, 70 * GIB)), Ok(()));
        let e = check(&d, &host(22 * GIB, 512 * MIB, 70 * GIB)).unwrap_err();
        assert_eq!((e.resource, e.have), (Resource::Shm, 1536 * MIB));
        // Disk space is not credited with it.
        let e = check(&d, &host(22 * GIB, 12 * GIB, MIB)).unwrap_err();
        assert_eq!((e.resource, e.have), (Resource::Disk, MIB));
    }

    #[test]
    fn huge_sums_saturate_instead_of_overflowing() {
        assert_eq!(ram_bytes(u64::MAX), u64::MAX);
        let d = vms(&[u64::MAX, u64::MAX, 1 << 20]);
        assert_eq!(guest_ram(&d), u64::MAX);
        assert_eq!(memory_need(&d), u64::MAX);
        let e = check(&d, &host(u64::MAX - 1, u64::MAX, u64::MAX)).unwrap_err();
        assert_eq!((e.resource, e.need), (Resource::Memory, u64::MAX));
        let e = check(&d, &host(u64::MAX, u64::MAX - 1, u64::MAX)).unwrap_err();
        assert_eq!(e.resource, Resource::Shm);
        // 248 VMs of the spec's largest memory_mib: 248 TiB, no overflow.
        let d = vms(&[1 << 20; 248]);
        assert_eq!(guest_ram(&d), 248 << 40);
        let e = check(&d, &host(22 * GIB, 12 * GIB, 70 * GIB)).unwrap_err();
        assert_eq!(e.resource, Resource::Memory);
    }

    #[test]
    fn unknown_figures_skip_their_rule() {
        let d = vms(&[1 << 20]);
        assert_eq!(check(&d, &Host::default()), Ok(()));
    }

    #[test]
    fn mem_available_is_read_from_meminfo() {
        let text = "MemTotal:       24608708 kB\nMemFree:        22081276 kB\nMemAvailable:   23440512 kB\n";
        assert_eq!(parse_mem_available(text), Some(23440512 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: lots\n"), None);
    }

    #[test]
    fn the_error_names_what_is_short_the_numbers_and_what_to_do() {
        let d = vms(&[1 << 20]);
        let s = check(&d, &host(22 * GIB, 12 * GIB, 70 * GIB)).unwrap_err();
        let e = shortfall_error(Start::Up, &d, &s, Path::new("/r")).to_string();
        assert_eq!(
            e,
            "not enough memory to start 1 VM: 1048704 MiB needed (1048576 MiB of guest RAM \
             + 1 x 128 MiB estimated QEMU overhead), 22528 MiB available (MemAvailable in \
             /proc/meminfo); lower memory_mib or stop other VMs"
        );
        let s = check(&vms(&[128]), &host(22 * GIB, 12 * GIB, MIB + 1)).unwrap_err();
        let e = shortfall_error(Start::Restore("a"), &d, &s, Path::new("/r")).to_string();
        assert!(
            e.starts_with("not enough disk space to restore VM \"a\": 64 MiB needed"),
            "{e}"
        );
        assert!(e.contains("1 MiB free in /r"), "{e}");
        // A restore cannot lower memory_mib; replaced files are named.
        let d = Demand {
            replaced_bytes: 100 * MIB,
            ..vms(&[1024, 1024, 1024])
        };
        let s = check(&d, &host(22 * GIB, GIB, 70 * GIB)).unwrap_err();
        let e = shortfall_error(Start::ClusterRestore("s"), &d, &s, Path::new("/r")).to_string();
        assert_eq!(
            e,
            "not enough space in /dev/shm to restore 3 VMs of cluster snapshot \"s\": 3072 MiB \
             needed (the guest RAM files of 3 VM(s)), 1124 MiB free in /dev/shm, counting 100 MiB \
             of old RAM files this replaces; stop other VMs (guest RAM lives in /dev/shm; \
             `df -h /dev/shm` shows what uses it)"
        );
    }
}
