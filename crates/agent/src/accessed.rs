//! How much guest RAM a VM touched, reads included, from the host's
//! accessed bits.
//!
//! Writing `1` to `/proc/<QEMU pid>/clear_refs` clears the accessed bits of
//! QEMU's pages (its own process only: nothing host-wide); the
//! `Referenced:` line of the guest-RAM mapping in `/proc/<pid>/smaps` then
//! counts the pages touched since, reads included (under TCG the guest's
//! loads go through QEMU's mapping; under KVM the MMU notifiers age the
//! secondary page tables with it). It is a size per mapping, not which
//! pages. Each clear costs QEMU a few ms (6-32 ms measured for 256 MiB
//! under TCG), so the sampler clears once per sampling interval.
//!
//! Two uses:
//! * the sampler's WSS_sample and the snapshot-time size see reads
//!   ([`crate::sampler`]);
//! * a restore measures how many pages of its working set the guest used:
//!   pages placed by postcopy after the clear are young as well, so
//!   `used = Referenced − (Rss now − Rss at the clear)`
//!   ([`RamUse::working_set_used`]).

use std::path::{Path, PathBuf};

/// Accessed-bit measurements that failed.
#[derive(Debug, thiserror::Error)]
pub enum AccessedError {
    /// /proc could not be read or written.
    #[error(
        "{path}: {source} (the accessed-bit measurement needs the agent to own QEMU's process)"
    )]
    Proc {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// No mapping of the RAM file.
    #[error("QEMU pid {pid} has no mapping of {ram_file} in /proc/{pid}/smaps")]
    NoMapping {
        /// QEMU.
        pid: u32,
        /// The guest-RAM file.
        ram_file: PathBuf,
    },
}

/// The guest-RAM mapping's counters, in 4 KiB pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct RamUse {
    /// Pages present.
    pub rss: u64,
    /// Pages accessed since the last clear (or ever).
    pub referenced: u64,
}

impl RamUse {
    /// Pages loaded before `at_clear` that the guest touched since: every
    /// page placed after the clear is young and counted in `referenced`
    /// too, so those are subtracted.
    pub fn working_set_used(&self, at_clear: &RamUse) -> u64 {
        let placed_since = self.rss.saturating_sub(at_clear.rss);
        self.referenced.saturating_sub(placed_since)
    }
}

fn proc_err(path: PathBuf) -> impl FnOnce(std::io::Error) -> AccessedError {
    move |source| AccessedError::Proc { path, source }
}

/// Clears QEMU's accessed bits.
pub fn clear(pid: u32) -> Result<(), AccessedError> {
    let path = PathBuf::from(format!("/proc/{pid}/clear_refs"));
    std::fs::write(&path, b"1").map_err(proc_err(path))
}

/// The guest-RAM file of QEMU `pid` (its `mem-path=`), from its command
/// line.
pub fn ram_file_of(pid: u32) -> Option<PathBuf> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    parse_mem_path(&cmdline)
}

fn parse_mem_path(cmdline: &[u8]) -> Option<PathBuf> {
    cmdline.split(|&b| b == 0).find_map(|arg| {
        // QEMU's option syntax: `,` separates, `,,` is a literal comma.
        let arg = std::str::from_utf8(arg).ok()?.replace(",,", "\u{0}");
        arg.split(',')
            .find_map(|kv| kv.strip_prefix("mem-path="))
            .map(|v| PathBuf::from(v.replace('\u{0}', ",")))
    })
}

/// The counters of QEMU's mapping of `ram_file`.
pub fn ram_use(pid: u32, ram_file: &Path) -> Result<RamUse, AccessedError> {
    let path = PathBuf::from(format!("/proc/{pid}/smaps"));
    let text = std::fs::read_to_string(&path).map_err(proc_err(path))?;
    parse_smaps(&text, ram_file).ok_or_else(|| AccessedError::NoMapping {
        pid,
        ram_file: ram_file.to_path_buf(),
    })
}

/// The sums of `Rss` and `Referenced` over the mappings of `ram_file` in
/// smaps `text` (`None` if it has none).
pub fn parse_smaps(text: &str, ram_file: &Path) -> Option<RamUse> {
    let want = ram_file.to_string_lossy();
    let mut found = false;
    let mut inside = false;
    let mut total = RamUse::default();
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let first = fields.next().unwrap_or("");
        if is_mapping_header(first) {
            // `start-end perms offset dev inode [path]`
            let path = line.splitn(6, char::is_whitespace).nth(5).map(str::trim);
            inside = path == Some(want.as_ref());
            found |= inside;
            continue;
        }
        if !inside {
            continue;
        }
        let kib = || fields.clone().next().and_then(|v| v.parse::<u64>().ok());
        match first {
            "Rss:" => total.rss += kib().unwrap_or(0) / 4,
            "Referenced:" => total.referenced += kib().unwrap_or(0) / 4,
            _ => {}
        }
    }
    found.then_some(total)
}

fn is_mapping_header(first: &str) -> bool {
    first.split_once('-').is_some_and(|(a, b)| {
        !a.is_empty() && a.bytes().chain(b.bytes()).all(|c| c.is_ascii_hexdigit())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0c0000000-55d0c0100000 r-xp 00000000 fe:01 123   /usr/bin/qemu-system-x86_64
Rss:                1024 kB
Referenced:         1024 kB
7f0000000000-7f0010000000 rw-s 00000000 00:19 42    /dev/shm/vmcsnap-x-vm0
Size:             262144 kB
Rss:              131072 kB
Pss:              131072 kB
Referenced:        40960 kB
Anonymous:             0 kB
7f0010000000-7f0010001000 rw-p 00000000 00:00 0
Rss:                   4 kB
Referenced:            4 kB
";

    #[test]
    fn the_ram_mapping_is_found_and_counted_in_pages() {
        let u = parse_smaps(SMAPS, Path::new("/dev/shm/vmcsnap-x-vm0")).unwrap();
        assert_eq!(
            u,
            RamUse {
                rss: 32768,
                referenced: 10240
            }
        );
        assert_eq!(parse_smaps(SMAPS, Path::new("/dev/shm/other")), None);
    }

    #[test]
    fn pages_placed_after_the_clear_are_not_working_set_hits() {
        let at_clear = RamUse {
            rss: 1000,
            referenced: 0,
        };
        // 500 pages placed since (all young) and 300 working-set pages touched.
        let now = RamUse {
            rss: 1500,
            referenced: 800,
        };
        assert_eq!(now.working_set_used(&at_clear), 300);
        let odd = RamUse {
            rss: 1500,
            referenced: 100,
        };
        assert_eq!(odd.working_set_used(&at_clear), 0, "never negative");
    }

    #[test]
    fn the_ram_file_comes_from_the_command_line() {
        let cmd = b"qemu-system-x86_64\0-object\0memory-backend-file,id=mem,size=256M,mem-path=/dev/shm/vmcsnap-a-vm0,share=on\0-S\0";
        assert_eq!(
            parse_mem_path(cmd),
            Some(PathBuf::from("/dev/shm/vmcsnap-a-vm0"))
        );
        assert_eq!(parse_mem_path(b"qemu\0-m\0x\0"), None);
        assert_eq!(
            parse_mem_path(b"memory-backend-file,mem-path=/dev/shm/a,,b,share=on"),
            Some(PathBuf::from("/dev/shm/a,b"))
        );
    }

    #[test]
    fn the_real_process_can_be_measured() {
        // This test process maps no RAM file: the mapping is not found, and
        // that is the error it says.
        let pid = std::process::id();
        let e = ram_use(pid, Path::new("/dev/shm/no-such-ram")).unwrap_err();
        assert!(e.to_string().contains("no mapping"), "{e}");
    }
}
