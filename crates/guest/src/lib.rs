//! The guest side of vmcsnap: what runs inside each VM, and how to get it.
//!
//! The guest is the stock Debian cloud kernel plus a small initramfs
//! (busybox, the virtio modules, an init script and four test programs:
//! `memtouch`, `pingpong`, `kvserver`, `kvload`). Its sources live in the
//! repository's `guest/` directory and are embedded in this crate, so a
//! binary using it is self-contained: [`ensure_assets`] writes them out, runs
//! `guest/build.sh` once, and caches the result under a key derived from the
//! sources ([`input_key`]).
//!
//! A VM boots with `-kernel <GuestAssets::kernel> -initrd <GuestAssets::initrd>
//! -append <kernel_cmdline(..)>` on `-M microvm,acpi=on` (TCG), with `-serial`
//! as its console, a `virtio-net-device` (eth0) and optionally a
//! `virtio-blk-device` ([`make_data_disk`], mounted on /data). Contract of the
//! console output (see `guest/init` and `guest/README.md`):
//!
//! * `VMCSNAP-READY <name>` ([`READY_MARKER`]) once eth0 is up and the
//!   workload started;
//! * `vmcsnap-stat name=<name> uptime=<s> retrans=<n>` ([`STAT_PREFIX`]) every
//!   second (uptime as in /proc/uptime, e.g. `12.34`; retrans = TCP RetransSegs);
//! * whatever the workload prints (it runs with its output on the console),
//!   e.g. `memtouch: ... errors=<n>` lines and `MEMTOUCH-CORRUPTION` on a bad page.

use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, OnceLock};
use std::time::Instant;

use sha2::{Digest, Sha256};

pub mod image;

/// First word of the line the guest prints on its console once it is ready.
pub const READY_MARKER: &str = "VMCSNAP-READY";

/// First word of the once-a-second status line of the guest's init.
pub const STAT_PREFIX: &str = "vmcsnap-stat";

/// Smallest guest RAM (`-m`, MiB) to give a VM, for the guest itself: add
/// what the workload needs (e.g. memtouch's `-m`; its mlock'ed pages count).
///
/// How it was measured (QEMU 7.2 TCG, `-M microvm,acpi=on`, RAM in a shared
/// memory-backend-file, virtio-net + virtio-blk with the ext4 data disk
/// mounted, kernel 6.1.0-56-cloud-amd64, empty workload): lowering `-m` in
/// 2 MiB steps, a VM counted as booted when it printed `VMCSNAP-READY` and 8
/// stat lines. The uncompressed `vmlinux` booted with 76 MiB and not with 74,
/// `vmlinuz` with 74 and not with 72; below that the kernel panics while
/// unpacking the initramfs ("System is deadlocked on memory"). Once booted
/// the guest uses about 19 MiB, and MemTotal is `-m` minus about 37 MiB.
/// 76 MiB plus about 50 MiB of margin for page cache, sockets and the small
/// workloads (pingpong, kvserver, kvload) gives 128.
pub const MIN_MEMORY_MIB: u64 = 128;

/// A build's workspace: bash, a temporary directory in `cache_root` (gone
/// when dropped) and its `src/` holding `files` (path, contents,
/// executable), for the guest assets' and the images' build scripts.
pub(crate) fn build_workspace<'a>(
    cache_root: &Path,
    prefix: &str,
    files: impl Iterator<Item = (&'a str, &'a str, bool)>,
) -> Result<(PathBuf, tempfile::TempDir, PathBuf), GuestError> {
    let bash = find_tool("bash").ok_or(GuestError::ToolMissing {
        tool: "bash",
        package: "bash",
    })?;
    let work = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(cache_root)
        .map_err(io_err(format!(
            "cannot create a temporary directory in {}",
            cache_root.display()
        )))?;
    let src = work.path().join("src");
    for (path, contents, executable) in files {
        let p = src.join(path);
        fs::create_dir_all(p.parent().expect("embedded paths have a parent"))
            .map_err(io_err(format!("cannot create {}", src.display())))?;
        fs::write(&p, contents).map_err(io_err(format!("cannot write {}", p.display())))?;
        let mode = if executable { 0o755 } else { 0o644 };
        fs::set_permissions(&p, fs::Permissions::from_mode(mode))
            .map_err(io_err(format!("cannot chmod {}", p.display())))?;
    }
    Ok((bash, work, src))
}

/// Longest kernel command line the x86 boot protocol accepts (bytes).
pub const MAX_CMDLINE_LEN: usize = 2047;

/// A built guest: kernel and initrd in a cache directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestAssets {
    /// `<cache_root>/guest-<key>/`
    pub dir: PathBuf,
    /// `-kernel` for QEMU: `vmlinux` (uncompressed, booted through its PVH
    /// entry, about 1 s faster under TCG) when build.sh could extract it
    /// (needs the Debian package lz4), else `vmlinuz`. Both boot the same way.
    pub kernel: PathBuf,
    /// `-initrd` for QEMU.
    pub initrd: PathBuf,
    /// [`input_key`] of the sources it was built from.
    pub key: String,
}

/// What went wrong, phrased so the user knows what to do next.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    /// A host program is missing.
    #[error("{tool} not found: install the Debian package {package} (apt-get install {package})")]
    ToolMissing {
        tool: &'static str,
        package: &'static str,
    },
    /// A file system operation failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// `guest/build.sh` failed.
    #[error(
        "building the guest kernel and initrd failed ({status}); last lines of build.sh:\n{tail}\n\
         Fix the cause shown above (a missing Debian package, no access to the Debian mirror) \
         and try again; nothing was cached."
    )]
    Build { status: String, tail: String },
    /// An external command failed.
    #[error("`{command}` failed ({status}):\n{output}")]
    Command {
        command: String,
        status: String,
        output: String,
    },
    /// A bad argument from the caller.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> GuestError {
    let context = context.into();
    move |source| GuestError::Io { context, source }
}

// ------------------------------------------------------------ embedded files

struct Embedded {
    /// Path relative to the build directory (mirrors the repository's guest/).
    path: &'static str,
    contents: &'static str,
    executable: bool,
}

const EMBEDDED: &[Embedded] = &[
    Embedded {
        path: "build.sh",
        contents: include_str!("../../../guest/build.sh"),
        executable: true,
    },
    Embedded {
        path: "init",
        contents: include_str!("../../../guest/init"),
        executable: true,
    },
    Embedded {
        path: "src/common.h",
        contents: include_str!("../../../guest/src/common.h"),
        executable: false,
    },
    Embedded {
        path: "src/memtouch.c",
        contents: include_str!("../../../guest/src/memtouch.c"),
        executable: false,
    },
    Embedded {
        path: "src/pingpong.c",
        contents: include_str!("../../../guest/src/pingpong.c"),
        executable: false,
    },
    Embedded {
        path: "src/kvserver.c",
        contents: include_str!("../../../guest/src/kvserver.c"),
        executable: false,
    },
    Embedded {
        path: "src/kvload.c",
        contents: include_str!("../../../guest/src/kvload.c"),
        executable: false,
    },
];

/// Bump to force a rebuild when the build's meaning changes without the
/// embedded files changing.
const FORMAT: &str = "vmcsnap-guest-assets-v1";

fn key_of(files: &[(&str, &str)]) -> String {
    let mut h = Sha256::new();
    h.update(FORMAT.as_bytes());
    for (path, contents) in files {
        h.update((path.len() as u64).to_le_bytes());
        h.update(path.as_bytes());
        h.update((contents.len() as u64).to_le_bytes());
        h.update(contents.as_bytes());
    }
    h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Short hex SHA-256 (16 digits) of all embedded guest sources: the cache key.
pub fn input_key() -> String {
    let files: Vec<(&str, &str)> = EMBEDDED.iter().map(|e| (e.path, e.contents)).collect();
    key_of(&files)
}

// ------------------------------------------------------------ cache + build

/// `$VMCSNAP_CACHE`, else `$XDG_CACHE_HOME/vmcsnap`, else `~/.cache/vmcsnap`
/// (`/tmp/vmcsnap-cache` when there is no home either).
pub fn default_cache_root() -> PathBuf {
    let nonempty = |v: &str| std::env::var_os(v).filter(|s| !s.is_empty());
    if let Some(p) = nonempty("VMCSNAP_CACHE") {
        return PathBuf::from(p);
    }
    if let Some(p) = nonempty("XDG_CACHE_HOME") {
        return PathBuf::from(p).join("vmcsnap");
    }
    if let Some(p) = nonempty("HOME") {
        return PathBuf::from(p).join(".cache").join("vmcsnap");
    }
    std::env::temp_dir().join("vmcsnap-cache")
}

fn assets_in(dir: &Path, key: &str) -> Option<GuestAssets> {
    // The uncompressed kernel if build.sh could extract it (boots ~1 s faster).
    let vmlinux = dir.join("vmlinux");
    let a = GuestAssets {
        dir: dir.to_path_buf(),
        kernel: if vmlinux.is_file() {
            vmlinux
        } else {
            dir.join("vmlinuz")
        },
        initrd: dir.join("initrd.img"),
        key: key.to_string(),
    };
    (dir.join("complete").is_file() && a.kernel.is_file() && a.initrd.is_file()).then_some(a)
}

/// An exclusive lock on a file, held until dropped (flock(2): released by the
/// kernel if the process dies, and taken per open file, so threads of one
/// process exclude each other too).
pub(crate) struct FileLock {
    _file: fs::File,
}

impl FileLock {
    pub(crate) fn acquire(
        path: &Path,
        progress: &mut dyn FnMut(&str),
    ) -> Result<FileLock, GuestError> {
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(io_err(format!("cannot open lock file {}", path.display())))?;
        let fd = file.as_raw_fd();
        // SAFETY: flock only takes an integer descriptor and flags; `fd` is a
        // valid descriptor owned by `file`, which outlives the call.
        if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            progress(&format!(
                "waiting for another process building the same thing (lock {})",
                path.display()
            ));
            loop {
                // SAFETY: as above.
                if unsafe { libc::flock(fd, libc::LOCK_EX) } == 0 {
                    break;
                }
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(io_err(format!("cannot lock {}", path.display()))(e));
                }
            }
        }
        Ok(FileLock { _file: file })
    }
}

/// Returns the guest kernel and initrd, building them first if needed.
///
/// Looks for `<cache_root>/guest-<key>/` with a `complete` marker; if it is
/// not there, writes the embedded sources to a temporary directory in
/// `cache_root`, runs `build.sh` (about 5-15 s here: one kernel package
/// download, four small C programs; plus `apt-get update` if apt knows no
/// kernel yet), and renames the output into place atomically.
/// Concurrent callers (threads or processes) wait for one build. `progress`
/// gets human-readable lines, including build.sh's output.
pub fn ensure_assets(
    cache_root: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<GuestAssets, GuestError> {
    let key = input_key();
    let final_dir = cache_root.join(format!("guest-{key}"));
    if let Some(a) = assets_in(&final_dir, &key) {
        progress(&format!("guest assets: cached in {}", final_dir.display()));
        return Ok(a);
    }
    fs::create_dir_all(cache_root).map_err(io_err(format!(
        "cannot create cache directory {}",
        cache_root.display()
    )))?;
    let _lock = FileLock::acquire(&cache_root.join(format!("guest-{key}.lock")), progress)?;
    if let Some(a) = assets_in(&final_dir, &key) {
        progress(&format!(
            "guest assets: built by another process in {}",
            final_dir.display()
        ));
        return Ok(a);
    }
    if final_dir.exists() {
        // Not complete and nobody is building (we hold the lock): debris.
        fs::remove_dir_all(&final_dir).map_err(io_err(format!(
            "cannot remove incomplete {}",
            final_dir.display()
        )))?;
    }

    let (bash, work, src) = build_workspace(
        cache_root,
        &format!(".guest-{key}-"),
        EMBEDDED.iter().map(|e| (e.path, e.contents, e.executable)),
    )?;
    let out = work.path().join("out");

    progress(&format!(
        "guest assets: building kernel + initrd (key {key}) into {}",
        final_dir.display()
    ));
    let started = Instant::now();
    let mut cmd = Command::new(bash);
    cmd.arg(src.join("build.sh"))
        .arg(&out)
        .env("TMPDIR", work.path());
    let (status, tail) = run_streaming(cmd, progress)?;
    if !status.success() {
        return Err(GuestError::Build {
            status: status.to_string(),
            tail,
        });
    }
    if !(out.join("vmlinuz").is_file() && out.join("initrd.img").is_file()) {
        return Err(GuestError::Build {
            status: "build.sh succeeded but wrote no vmlinuz/initrd.img".into(),
            tail,
        });
    }
    fs::write(
        out.join("complete"),
        format!(
            "key={key}\nbuild_seconds={:.1}\n",
            started.elapsed().as_secs_f64()
        ),
    )
    .map_err(io_err(format!("cannot write {}/complete", out.display())))?;
    fs::rename(&out, &final_dir).map_err(io_err(format!(
        "cannot rename {} to {}",
        out.display(),
        final_dir.display()
    )))?;
    progress(&format!(
        "guest assets: built in {:.1} s: {}",
        started.elapsed().as_secs_f64(),
        final_dir.display()
    ));
    assets_in(&final_dir, &key).ok_or_else(|| GuestError::Build {
        status: "assets vanished after the build".into(),
        tail: String::new(),
    })
}

/// Runs `cmd`, passing each line of its stdout and stderr to `progress`.
/// Returns the exit status and the last lines of output.
pub(crate) fn run_streaming(
    mut cmd: Command,
    progress: &mut dyn FnMut(&str),
) -> Result<(std::process::ExitStatus, String), GuestError> {
    const TAIL_LINES: usize = 30;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io_err("cannot start bash"))?;
    let (tx, rx) = mpsc::channel::<String>();
    let mut readers = Vec::new();
    for pipe in [
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || {
            for line in BufReader::new(pipe).split(b'\n').map_while(Result::ok) {
                if tx
                    .send(String::from_utf8_lossy(&line).into_owned())
                    .is_err()
                {
                    break;
                }
            }
        }));
    }
    drop(tx);
    let mut tail = std::collections::VecDeque::new();
    for line in rx {
        progress(&line);
        if tail.len() == TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line);
    }
    for r in readers {
        let _ = r.join();
    }
    let status = child
        .wait()
        .map_err(io_err("waiting for the build script"))?;
    Ok((status, Vec::from(tail).join("\n")))
}

/// A program in $PATH, or in the sbin directories (not in a normal user's $PATH).
pub(crate) fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(
            ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
                .iter()
                .map(PathBuf::from),
        )
        .map(|d| d.join(name))
        .find(|p| {
            p.metadata()
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

// ------------------------------------------------------------ kernel command line

/// Checks a VM name: 1-63 characters of `[A-Za-z0-9._-]`, not starting with
/// `-` or `.` (it becomes the guest's hostname and a word on the command line).
pub fn validate_vm_name(name: &str) -> Result<(), GuestError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && !name.starts_with(['-', '.'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(GuestError::InvalidArgument(format!(
            "VM name {name:?}: use 1-63 characters of A-Z a-z 0-9 . _ - (not starting with - or .)"
        )))
    }
}

fn validate_ip_cidr(ip_cidr: &str) -> Result<(), GuestError> {
    let bad = || {
        GuestError::InvalidArgument(format!(
            "guest address {ip_cidr:?}: expected IPv4 address/prefix length, like 10.0.0.2/24"
        ))
    };
    let (addr, prefix) = ip_cidr.split_once('/').ok_or_else(bad)?;
    addr.parse::<std::net::Ipv4Addr>().map_err(|_| bad())?;
    match prefix.parse::<u8>() {
        Ok(p) if p <= 32 && !prefix.starts_with('+') => Ok(()),
        _ => Err(bad()),
    }
}

/// TSC frequency (kHz) to give the guest kernel: `$VMCSNAP_GUEST_TSC_KHZ` if
/// set (0 leaves the parameter out), else the host's TSC rate, measured once
/// per process (about 75 ms). Under TCG the guest's TSC is the host's TSC.
pub fn guest_tsc_khz() -> Option<u64> {
    static KHZ: OnceLock<Option<u64>> = OnceLock::new();
    *KHZ.get_or_init(|| match std::env::var("VMCSNAP_GUEST_TSC_KHZ") {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().ok().filter(|&k| k > 0),
        _ => measure_tsc_khz(),
    })
}

#[cfg(target_arch = "x86_64")]
fn measure_tsc_khz() -> Option<u64> {
    use std::time::Duration;
    fn rdtsc() -> u64 {
        // SAFETY: RDTSC reads the time-stamp counter; it touches no memory
        // and exists on every x86_64 CPU (the intrinsic is only marked
        // unsafe because it is a raw instruction).
        unsafe { std::arch::x86_64::_rdtsc() }
    }
    // (time, tsc) read close together: retry if we were preempted between.
    fn sample() -> Option<(Instant, u64)> {
        (0..20).find_map(|_| {
            let a = Instant::now();
            let tsc = rdtsc();
            let b = Instant::now();
            (b - a < Duration::from_micros(20)).then(|| (a + (b - a) / 2, tsc))
        })
    }
    let mut rates = Vec::new();
    for _ in 0..3 {
        let (t0, c0) = sample()?;
        std::thread::sleep(Duration::from_millis(25));
        let (t1, c1) = sample()?;
        let ns = (t1 - t0).as_nanos();
        if c1 <= c0 || ns == 0 {
            return None;
        }
        rates.push((u128::from(c1 - c0) * 1_000_000 / ns) as u64);
    }
    rates.sort_unstable();
    // Plausible TSC rates only (100 MHz .. 10 GHz).
    Some(rates[1]).filter(|k| (100_000..10_000_000).contains(k))
}

#[cfg(not(target_arch = "x86_64"))]
fn measure_tsc_khz() -> Option<u64> {
    None
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding (what busybox `base64 -d` reads).
fn base64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Like [`kernel_cmdline`], but reports a bad name or address, or a command
/// line longer than [`MAX_CMDLINE_LEN`] (the workload script is limited to
/// about 1.4 KB), as an error.
pub fn try_kernel_cmdline(name: &str, ip_cidr: &str, workload: &str) -> Result<String, GuestError> {
    validate_vm_name(name)?;
    validate_ip_cidr(ip_cidr)?;
    // quiet loglevel=1: only kernel emergencies on the console (init sets the
    // same once it runs). panic=-1: reboot at once on a panic, which with
    // QEMU's -no-reboot makes QEMU exit instead of hanging.
    // cryptomgr.notests: skip the crypto self-tests at boot (~0.2 s under TCG).
    let mut line = String::from("console=ttyS0 quiet loglevel=1 panic=-1 cryptomgr.notests");
    // Timer set-up that does not depend on the host being idle. Under TCG
    // the guest's TSC ticks at the host's TSC rate. Left to calibrate it
    // against the PIT, a guest whose vCPU thread is descheduled (several VMs
    // booting on few cores) fails ("tsc: Unable to calibrate against PIT"),
    // and then hangs for good in the delay-loop calibration. So tell it the
    // rate; tsc=reliable skips the clocksource watchdog, no_timer_check the
    // IO-APIC timer test (both also time-sensitive).
    if let Some(khz) = guest_tsc_khz() {
        line.push_str(&format!(" tsc_early_khz={khz} tsc=reliable no_timer_check"));
    }
    line.push_str(&format!(" vmcsnap.name={name} vmcsnap.ip={ip_cidr}"));
    if !workload.is_empty() {
        line.push_str(" vmcsnap.run=");
        line.push_str(&base64_encode(workload.as_bytes()));
    }
    if line.len() > MAX_CMDLINE_LEN {
        return Err(GuestError::InvalidArgument(format!(
            "kernel command line would be {} bytes, the limit is {MAX_CMDLINE_LEN}: \
             the workload script ({} bytes, base64 in vmcsnap.run) is too long; \
             keep it under ~1.4 KB (put bigger things on the data disk)",
            line.len(),
            workload.len()
        )));
    }
    Ok(line)
}

/// Kernel command line for a VM (the contract with `guest/init`):
///
/// `console=ttyS0 quiet loglevel=1 panic=-1 cryptomgr.notests [tsc_early_khz=KHZ tsc=reliable no_timer_check]
/// vmcsnap.name=NAME vmcsnap.ip=A.B.C.D/NN [vmcsnap.run=BASE64]`
///
/// (one line; the TSC part, see [`guest_tsc_khz`], keeps the boot from
/// hanging when the host is busy).
///
/// `workload` is a shell script; init runs it with `sh` in the background,
/// output to the console, cwd `/data` if the disk is mounted; it sees
/// `VMCSNAP_NAME`, `VMCSNAP_IP` and `VMCSNAP_ADDR` in its environment. An empty
/// workload leaves out `vmcsnap.run`.
///
/// # Panics
/// On an invalid name or address or a too long workload; use
/// [`try_kernel_cmdline`] to get these as errors.
pub fn kernel_cmdline(name: &str, ip_cidr: &str, workload: &str) -> String {
    match try_kernel_cmdline(name, ip_cidr, workload) {
        Ok(line) => line,
        Err(e) => panic!("kernel_cmdline: {e}"),
    }
}

// ------------------------------------------------------------ data disk

/// Size of `/data/blob` on a data disk of `size_mib` MiB.
fn blob_len(size_mib: u64) -> u64 {
    (4u64 << 20).min((size_mib << 20) / 4)
}

/// The deterministic content of `/data/blob` (same for every VM).
fn blob_bytes(len: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len as usize);
    let mut x: u64 = 0x5643_4D53_4E41_5021;
    while (out.len() as u64) < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len as usize);
    out
}

fn run_tool(cmd: &mut Command) -> Result<(), GuestError> {
    let shown = format!("{cmd:?}");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(io_err(format!("cannot run {shown}")))?;
    if out.status.success() {
        return Ok(());
    }
    let mut output = String::from_utf8_lossy(&out.stderr).into_owned();
    output.push_str(&String::from_utf8_lossy(&out.stdout));
    Err(GuestError::Command {
        command: shown,
        status: out.status.to_string(),
        output: output.trim().to_string(),
    })
}

/// Creates a qcow2 data disk of `size_mib` MiB (at least 16) at `path`, with an
/// ext4 file system that the guest mounts on `/data`:
///
/// * `README`: what the disk is, with the VM name; `name`: the VM name;
/// * `blob`: 4 MiB of deterministic bytes (the same on every disk; a quarter of
///   the disk if that is smaller) and `blob.sha256`, so the guest can check it
///   with `cd /data && sha256sum -c blob.sha256`;
/// * `files/small-00.txt` .. `small-15.txt`: small text files.
///
/// Built with `mkfs.ext4 -d` on a raw temporary file and `qemu-img convert`,
/// without root; `path` appears atomically (temporary file, then rename).
pub fn make_data_disk(path: &Path, size_mib: u64, vm_name: &str) -> Result<(), GuestError> {
    if !(16..=1 << 20).contains(&size_mib) {
        return Err(GuestError::InvalidArgument(format!(
            "data disk size {size_mib} MiB: use 16 MiB to 1 TiB"
        )));
    }
    let mkfs = find_tool("mkfs.ext4").ok_or(GuestError::ToolMissing {
        tool: "mkfs.ext4",
        package: "e2fsprogs",
    })?;
    let qemu_img = find_tool("qemu-img").ok_or(GuestError::ToolMissing {
        tool: "qemu-img",
        package: "qemu-utils",
    })?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    fs::create_dir_all(&parent).map_err(io_err(format!("cannot create {}", parent.display())))?;
    let file_name = path
        .file_name()
        .ok_or_else(|| {
            GuestError::InvalidArgument(format!("{} is not a file path", path.display()))
        })?
        .to_string_lossy()
        .into_owned();

    // The files of the new file system.
    let stage = tempfile::Builder::new()
        .prefix(&format!(".{file_name}.stage-"))
        .tempdir_in(&parent)
        .map_err(io_err(format!(
            "cannot create a temporary directory in {}",
            parent.display()
        )))?;
    let put = |rel: &str, data: &[u8]| -> Result<(), GuestError> {
        let p = stage.path().join(rel);
        if let Some(d) = p.parent() {
            fs::create_dir_all(d).map_err(io_err(format!("cannot create {}", d.display())))?;
        }
        fs::write(&p, data).map_err(io_err(format!("cannot write {}", p.display())))
    };
    put(
        "README",
        format!(
            "vmcsnap data disk of VM {vm_name} ({size_mib} MiB, ext4, mounted on /data).\n\
             blob: deterministic test data; check it with: cd /data && sha256sum -c blob.sha256\n\
             files/: small text files. name: the VM name.\n"
        )
        .as_bytes(),
    )?;
    put("name", format!("{vm_name}\n").as_bytes())?;
    let blob = blob_bytes(blob_len(size_mib));
    let digest: String = Sha256::digest(&blob)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    put("blob", &blob)?;
    put("blob.sha256", format!("{digest}  blob\n").as_bytes())?;
    for i in 0..16 {
        let mut text = String::new();
        for line in 0..=i {
            text.push_str(&format!("vm={vm_name} file={i:02} line={line}\n"));
        }
        put(&format!("files/small-{i:02}.txt"), text.as_bytes())?;
    }

    // Raw image with the file system, then qcow2.
    let raw = tempfile::Builder::new()
        .prefix(&format!(".{file_name}."))
        .suffix(".raw")
        .tempfile_in(&parent)
        .map_err(io_err(format!(
            "cannot create a temporary file in {}",
            parent.display()
        )))?;
    raw.as_file()
        .set_len(size_mib << 20)
        .map_err(io_err(format!("cannot size {}", raw.path().display())))?;
    run_tool(
        Command::new(&mkfs)
            .args([
                "-q",
                "-F",
                "-L",
                "vmcsnap-data",
                "-E",
                "root_owner=0:0",
                // 4 KiB blocks even on small disks (mke2fs would pick 1 KiB
                // under 512 MiB): file pages in the guest's page cache are
                // then whole, aligned disk blocks, which the detection layer
                // of a snapshot can find on the frozen disk.
                "-b",
                "4096",
                "-d",
            ])
            .arg(stage.path())
            .arg(raw.path()),
    )?;
    let qcow = tempfile::Builder::new()
        .prefix(&format!(".{file_name}."))
        .suffix(".qcow2.tmp")
        .tempfile_in(&parent)
        .map_err(io_err(format!(
            "cannot create a temporary file in {}",
            parent.display()
        )))?
        .into_temp_path();
    run_tool(
        Command::new(&qemu_img)
            .args(["convert", "-q", "-f", "raw", "-O", "qcow2"])
            .arg(raw.path())
            .arg(&qcow),
    )?;
    fs::set_permissions(&qcow, fs::Permissions::from_mode(0o644))
        .map_err(io_err(format!("cannot chmod {}", qcow.display())))?;
    qcow.persist(path).map_err(|e| GuestError::Io {
        context: format!("cannot rename the new disk to {}", path.display()),
        source: e.error,
    })?;
    // Make the new name durable (best effort).
    if let Ok(d) = fs::File::open(&parent) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base64_decode(s: &str) -> Vec<u8> {
        let val = |c: u8| B64.iter().position(|&b| b == c).expect("base64 alphabet") as u32;
        let bytes: Vec<u8> = s.bytes().filter(|&c| c != b'=').collect();
        let mut out = Vec::new();
        for chunk in bytes.chunks(4) {
            let mut n = 0u32;
            for (i, &c) in chunk.iter().enumerate() {
                n |= val(c) << (18 - 6 * i);
            }
            for i in 0..chunk.len() - 1 {
                out.push((n >> (16 - 8 * i)) as u8);
            }
        }
        out
    }

    fn param<'a>(line: &'a str, key: &str) -> Option<&'a str> {
        line.split(' ')
            .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
    }

    #[test]
    fn base64_matches_known_vectors() {
        for (plain, enc) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
            ("\u{fb}\u{ff}", "w7vDvw=="), // bytes with the high bits set: + and / territory
        ] {
            assert_eq!(base64_encode(plain.as_bytes()), enc, "{plain:?}");
        }
        assert_eq!(base64_encode(&[0xfb, 0xff, 0xbf]), "+/+/");
    }

    #[test]
    fn kernel_cmdline_carries_the_contract() {
        let script =
            "memtouch -m 64 &\npingpong server 7000 > /dev/null &\necho 'a+b/c=d' \"$x\"\n";
        let line = kernel_cmdline("vm-1", "10.0.0.2/24", script);
        assert!(line.starts_with("console=ttyS0 "), "{line}");
        assert!(line.contains(" panic=-1 "), "{line}");
        assert_eq!(param(&line, "vmcsnap.name"), Some("vm-1"));
        assert_eq!(param(&line, "vmcsnap.ip"), Some("10.0.0.2/24"));
        let run = param(&line, "vmcsnap.run").expect("vmcsnap.run present");
        assert!(!run.contains(char::is_whitespace));
        assert_eq!(String::from_utf8(base64_decode(run)).unwrap(), script);
        // One word per parameter: nothing in the line may contain a space but separators.
        assert_eq!(
            line.split(' ')
                .filter(|w| w.starts_with("vmcsnap."))
                .count(),
            3
        );
    }

    #[test]
    fn base64_round_trips_all_lengths_and_bytes() {
        let data: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
        for n in 0..data.len() {
            assert_eq!(base64_decode(&base64_encode(&data[..n])), &data[..n]);
        }
    }

    #[test]
    fn empty_workload_leaves_out_run() {
        let line = kernel_cmdline("a", "192.168.7.1/30", "");
        assert_eq!(param(&line, "vmcsnap.run"), None);
        assert!(
            line.ends_with("vmcsnap.name=a vmcsnap.ip=192.168.7.1/30"),
            "{line}"
        );
    }

    #[test]
    fn bad_arguments_are_errors() {
        for name in ["", "a b", "-x", ".x", "x\ny", &"n".repeat(64), "é"] {
            assert!(
                try_kernel_cmdline(name, "10.0.0.1/24", "").is_err(),
                "{name:?}"
            );
        }
        for ip in [
            "10.0.0.1",
            "10.0.0.1/33",
            "10.0.0/24",
            "10.0.0.1/x",
            "10.0.0.1/24 x",
        ] {
            assert!(try_kernel_cmdline("vm", ip, "").is_err(), "{ip:?}");
        }
        let long = "x".repeat(1600);
        let e = try_kernel_cmdline("vm", "10.0.0.1/24", &long).unwrap_err();
        assert!(e.to_string().contains("too long"), "{e}");
        assert!(try_kernel_cmdline("vm", "10.0.0.1/24", &"x".repeat(1400)).is_ok());
    }

    #[test]
    #[should_panic(expected = "VM name")]
    fn kernel_cmdline_panics_on_bad_name() {
        kernel_cmdline("no spaces please", "10.0.0.1/24", "");
    }

    #[test]
    fn input_key_is_stable_and_covers_contents() {
        let k = input_key();
        assert_eq!(k, input_key());
        assert_eq!(k.len(), 16);
        assert!(k.bytes().all(|b| b.is_ascii_hexdigit()));
        let mut files: Vec<(&str, &str)> = EMBEDDED.iter().map(|e| (e.path, e.contents)).collect();
        assert_eq!(key_of(&files), k);
        files[1].1 = "#!/bin/sh\n";
        assert_ne!(key_of(&files), k);
        // Moving bytes between path and contents changes the key too.
        assert_ne!(key_of(&[("ab", "c")]), key_of(&[("a", "bc")]));
    }

    #[test]
    fn embedded_files_are_what_build_sh_expects() {
        let paths: Vec<&str> = EMBEDDED.iter().map(|e| e.path).collect();
        let build = EMBEDDED[0].contents;
        assert!(build.starts_with("#!/bin/bash"));
        for prog in ["memtouch", "pingpong", "kvserver", "kvload"] {
            assert!(paths.contains(&format!("src/{prog}.c").as_str()), "{prog}");
            assert!(
                build.contains(prog),
                "{prog} missing from PROGRAMS in build.sh"
            );
        }
        let init = EMBEDDED[1].contents;
        assert!(init.contains(&format!("echo \"{READY_MARKER} $NAME\"")));
        assert!(init.contains(&format!("echo \"{STAT_PREFIX} name=")));
        // The status loop runs every second in every guest on emulated CPUs:
        // it and the functions it calls fork nothing but `sleep` (six command
        // substitutions per line once starved a guest's loop past a cluster
        // snapshot's window).
        let code = &init[init.find("prefix_lines() {").expect("prefix_lines in init")..];
        for f in ["retrans_segs", "tcp_ext", "tcp_counters"] {
            assert!(
                code.contains(&format!("{f}() {{")),
                "{f} is defined after prefix_lines"
            );
        }
        assert!(
            code.contains("while :; do"),
            "the status loop follows its functions"
        );
        // `$(` not followed by `(` (arithmetic), or a backquote.
        let substitution = code
            .match_indices("$(")
            .any(|(i, _)| !code[i + 2..].starts_with('('));
        assert!(
            !substitution && !code.contains('`'),
            "the status loop forks a command substitution:\n{code}"
        );
        // Regression: RetransSegs and TcpExt were read once each, one after
        // the other; a line read across a stall counted a loss probe in
        // TcpExt but not in RetransSegs, and cluster restores reported
        // retransmissions that nothing explained. RetransSegs is read on
        // both sides of TcpExt until it did not change.
        let counters = &code[code.find("tcp_counters() {").expect("tcp_counters")..];
        let counters = &counters[..counters.find("\n}\n").expect("end of tcp_counters")];
        let order: Vec<usize> = ["retrans_segs\n", "tcp_ext\n", "retrans_segs\n"]
            .iter()
            .scan(0, |from, call| {
                let at = *from + counters[*from..].find(call)?;
                *from = at + call.len();
                Some(at)
            })
            .collect();
        assert_eq!(
            order.len(),
            3,
            "tcp_counters reads RetransSegs, TcpExt, RetransSegs:\n{counters}"
        );
        assert!(
            counters.contains("\"$retrans\" = \"$before\""),
            "tcp_counters compares both reads:\n{counters}"
        );
    }

    #[test]
    fn default_cache_root_prefers_vmcsnap_cache() {
        // Only reads the environment: check the shape, not the precedence
        // (tests run in parallel, so do not set variables here).
        let root = default_cache_root();
        assert!(root.is_absolute() || std::env::var_os("VMCSNAP_CACHE").is_some());
    }

    #[test]
    fn ensure_assets_builds_once_then_hits_the_cache() {
        let cache = tempfile::tempdir().unwrap();
        let mut lines = Vec::new();
        let a = ensure_assets(cache.path(), &mut |l: &str| lines.push(l.to_string()))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a.key, input_key());
        assert_eq!(a.dir, cache.path().join(format!("guest-{}", a.key)));
        let kernel_len = fs::metadata(&a.kernel).unwrap().len();
        assert!(a.dir.join("vmlinuz").is_file());
        let mut elf = [0u8; 4];
        if a.kernel.ends_with("vmlinux") {
            fs::File::open(&a.kernel)
                .unwrap()
                .read_exact(&mut elf)
                .unwrap();
            assert_eq!(&elf, b"\x7fELF");
        }
        let initrd = fs::read(&a.initrd).unwrap();
        assert!(kernel_len > 1 << 20, "vmlinuz is {kernel_len} bytes");
        assert_eq!(&initrd[..2], &[0x1f, 0x8b], "initrd.img is not gzip");
        assert!(lines.iter().any(|l| l.contains("build.sh")), "{lines:?}");
        // No temporary directories left behind.
        let names: Vec<String> = fs::read_dir(cache.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with(".guest-")), "{names:?}");

        let t = Instant::now();
        let mut lines2 = Vec::new();
        let b = ensure_assets(cache.path(), &mut |l: &str| lines2.push(l.to_string())).unwrap();
        assert_eq!(a, b);
        assert!(
            t.elapsed().as_millis() < 500,
            "cache hit took {:?}",
            t.elapsed()
        );
        assert_eq!(lines2.len(), 1, "{lines2:?}");
        assert!(lines2[0].contains("cached"), "{lines2:?}");
    }

    #[test]
    fn data_disk_is_qcow2_with_the_files() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("sub").join("vm1.qcow2");
        make_data_disk(&disk, 32, "vm1").unwrap_or_else(|e| panic!("{e}"));
        let leftovers: Vec<_> = fs::read_dir(disk.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(leftovers, vec![std::ffi::OsString::from("vm1.qcow2")]);
        let mut head = [0u8; 4];
        fs::File::open(&disk)
            .unwrap()
            .read_exact(&mut head)
            .unwrap();
        assert_eq!(&head, b"QFI\xfb");

        // Read the blob back through qemu-img and debugfs (both unprivileged).
        let raw = dir.path().join("back.raw");
        run_tool(
            Command::new(find_tool("qemu-img").unwrap())
                .args(["convert", "-O", "raw"])
                .arg(&disk)
                .arg(&raw),
        )
        .unwrap();
        let out = dir.path().join("blob.out");
        let debugfs = find_tool("debugfs").expect("debugfs (e2fsprogs)");
        let req = format!("dump /blob {}", out.display());
        run_tool(Command::new(&debugfs).arg("-R").arg(&req).arg(&raw)).unwrap();
        assert_eq!(fs::read(&out).unwrap(), blob_bytes(blob_len(32)));
        let req = format!("dump /name {}", out.display());
        run_tool(Command::new(&debugfs).arg("-R").arg(&req).arg(&raw)).unwrap();
        assert_eq!(fs::read_to_string(&out).unwrap(), "vm1\n");

        assert!(matches!(
            make_data_disk(&disk, 8, "vm1"),
            Err(GuestError::InvalidArgument(_))
        ));
    }

    #[test]
    fn messages_tell_what_to_install() {
        let e = GuestError::ToolMissing {
            tool: "mkfs.ext4",
            package: "e2fsprogs",
        };
        assert_eq!(
            e.to_string(),
            "mkfs.ext4 not found: install the Debian package e2fsprogs (apt-get install e2fsprogs)"
        );
    }

    #[test]
    fn public_types_are_send_and_sync() {
        fn f<T: Send + Sync>() {}
        f::<GuestAssets>();
        f::<GuestError>();
    }
}
