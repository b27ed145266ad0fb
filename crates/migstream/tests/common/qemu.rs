//! Helpers for tests that run the real QEMU 7.2 (`$VMCSNAP_QEMU` or
//! `qemu-system-x86_64`) with the writer guest of tests/data/guest: a
//! process guard, a small QMP client, building the guest, and capturing a
//! background snapshot of it into memory.
//!
//! Such tests fail when QEMU or binutils are missing, unless
//! `VMCSNAP_SKIP_QEMU_TESTS=1` is set ([`qemu_or_skip`]).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use std::sync::Arc;

use serde_json::{json, Value};

use super::postcopy::Pages;
use vmcsnap_migstream::{Event, RamBlock, StreamReader};

/// Kills QEMU when the test ends, however it ends.
pub struct Qemu(pub Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A QMP connection.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    /// Connects (retrying while QEMU starts) and negotiates capabilities.
    pub fn connect(path: &Path) -> Qmp {
        let deadline = Instant::now() + Duration::from_secs(20);
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => panic!("QMP connect: {e}"),
            }
        };
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut q = Qmp {
            reader: BufReader::new(stream.try_clone().unwrap()),
            writer: stream,
        };
        q.line(); // greeting
        q.cmd("qmp_capabilities", json!({}));
        q
    }

    fn line(&mut self) -> Value {
        let mut l = String::new();
        self.reader.read_line(&mut l).expect("QMP read");
        serde_json::from_str(&l).unwrap_or_else(|e| panic!("QMP reply {l:?}: {e}"))
    }

    /// Runs a command; panics on a QMP error.
    pub fn cmd(&mut self, name: &str, args: Value) -> Value {
        let msg = json!({"execute": name, "arguments": args});
        writeln!(self.writer, "{msg}").unwrap();
        loop {
            let v = self.line();
            if v.get("event").is_some() {
                continue;
            }
            if let Some(e) = v.get("error") {
                panic!("{name}: {e}");
            }
            return v["return"].clone();
        }
    }
}

pub fn tool_works(cmd: &str, arg: &str) -> bool {
    Command::new(cmd)
        .arg(arg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The QEMU binary, or `None` (with a message) if the test is to be
/// skipped because `VMCSNAP_SKIP_QEMU_TESTS=1`. Panics when QEMU is missing
/// otherwise: a missing QEMU must not turn into a silently passing test.
pub fn qemu_or_skip(test: &str) -> Option<String> {
    if std::env::var("VMCSNAP_SKIP_QEMU_TESTS").is_ok_and(|v| v == "1") {
        eprintln!("{test}: skipped (VMCSNAP_SKIP_QEMU_TESTS=1)");
        return None;
    }
    let qemu_bin = std::env::var("VMCSNAP_QEMU").unwrap_or_else(|_| "qemu-system-x86_64".into());
    assert!(
        tool_works(&qemu_bin, "--version"),
        "{qemu_bin} not available: install qemu-system-x86 (scripts/install-deps.sh), \
         or set VMCSNAP_SKIP_QEMU_TESTS=1 to skip the tests that need it"
    );
    Some(qemu_bin)
}

/// Builds the writer guest into `dir`; panics if binutils are missing.
pub fn build_writer(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/guest");
    let (obj, elf) = (dir.join("writer.o"), dir.join("writer.elf"));
    let run = |c: &mut Command| c.status().is_ok_and(|s| s.success());
    let ok = run(Command::new("as")
        .args(["--32", "-o"])
        .arg(&obj)
        .arg(src.join("writer.S")))
        && run(Command::new("ld")
            .args(["-m", "elf_i386", "-T"])
            .arg(src.join("writer.ld"))
            .arg("-o")
            .arg(&elf)
            .arg(&obj));
    assert!(
        ok,
        "cannot build the writer guest: install binutils (as, ld; scripts/install-deps.sh)"
    );
    elf
}

/// Guest-physical address of the writer's counter.
pub const COUNTER: u64 = 0x1ff000;

/// QEMU arguments for the writer guest: microvm, TCG, 16 MiB of RAM from
/// memory backend `mem` described by `mem_object` (an `-object` value).
pub fn writer_args(kernel: &Path, mem_object: &str) -> Vec<String> {
    let mut a: Vec<String> = [
        "-M",
        "microvm,memory-backend=mem",
        "-object",
        mem_object,
        "-accel",
        "tcg",
        "-nodefaults",
        "-display",
        "none",
        "-m",
        "16M",
        "-kernel",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.push(kernel.display().to_string());
    a
}

/// Starts QEMU with `args`, a QMP socket at `qmp`, stderr to `log`.
pub fn spawn_qemu(qemu_bin: &str, args: &[String], qmp: &Path, log: &Path) -> Qemu {
    Qemu(
        Command::new(qemu_bin)
            .args(args)
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", qmp.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .expect("start QEMU"),
    )
}

/// A background snapshot of the running writer guest, in memory.
pub struct Snapshot {
    pub machine: String,
    pub blocks: Vec<RamBlock>,
    pub ram_section_id: u32,
    /// Per block, per page: `None` for a zero page.
    pub pages: Arc<Pages>,
    pub device_state: Vec<u8>,
    /// The counter's value in the snapshot.
    pub counter: u32,
}

impl Snapshot {
    /// Total pages.
    pub fn page_count(&self) -> usize {
        self.pages.iter().map(Vec::len).sum()
    }
}

/// Runs the writer guest for a moment, takes a background snapshot over a
/// unix socket and reads it into memory; QEMU is gone when this returns.
/// Boots the writer guest (memfd RAM), lets it run 300 ms and starts a
/// background snapshot into a unix socket in `dir` (files named
/// `<prefix>qmp.sock`, `<prefix>mig.sock`, `<prefix>qemu.log`). Returns
/// QEMU, its QMP session and the accepted migration connection.
pub fn start_background_snapshot(
    qemu_bin: &str,
    kernel: &Path,
    dir: &Path,
    prefix: &str,
) -> (Qemu, Qmp, UnixStream) {
    let qmp_path = dir.join(format!("{prefix}qmp.sock"));
    let mig_path = dir.join(format!("{prefix}mig.sock"));
    let listener = UnixListener::bind(&mig_path).unwrap();
    let args = writer_args(kernel, "memory-backend-memfd,id=mem,size=16M,share=on");
    let qemu = spawn_qemu(
        qemu_bin,
        &args,
        &qmp_path,
        &dir.join(format!("{prefix}qemu.log")),
    );
    let mut qmp = Qmp::connect(&qmp_path);
    std::thread::sleep(Duration::from_millis(300)); // let the guest run
    qmp.cmd(
        "migrate-set-capabilities",
        json!({"capabilities": [{"capability": "background-snapshot", "state": true}]}),
    );
    qmp.cmd(
        "migrate",
        json!({"uri": format!("unix:{}", mig_path.display())}),
    );
    let (conn, _) = listener.accept().unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    (qemu, qmp, conn)
}

pub fn capture_writer(qemu_bin: &str, kernel: &Path, dir: &Path) -> Snapshot {
    let (_qemu, mut qmp, conn) = start_background_snapshot(qemu_bin, kernel, dir, "src-");
    let mut reader = StreamReader::new(conn);
    let mut snap = Snapshot {
        machine: String::new(),
        blocks: Vec::new(),
        ram_section_id: 0,
        pages: Arc::new(Vec::new()),
        device_state: Vec::new(),
        counter: 0,
    };
    let page_size = 4096;
    let mut pages: Pages = Vec::new();
    while let Some(ev) = reader.next_event().expect("read the live stream") {
        match ev {
            Event::Header { configuration, .. } => {
                snap.machine = configuration
                    .expect("configuration section")
                    .machine
                    .clone()
            }
            Event::SectionStart(h) if h.ident.as_ref().is_some_and(|i| i.idstr == "ram") => {
                snap.ram_section_id = h.section_id;
            }
            Event::RamBlocks(b) => {
                snap.blocks = b.to_vec();
                pages = b
                    .iter()
                    .map(|b| vec![None; (b.used_length / page_size) as usize])
                    .collect();
            }
            Event::Page {
                block,
                offset,
                data,
                ..
            } => {
                let data = data.iter().any(|&b| b != 0).then(|| data.into());
                pages[block][(offset / page_size) as usize] = data;
            }
            Event::ZeroPage { fill, .. } => assert_eq!(fill, 0),
            Event::DeviceState { data, .. } => snap.device_state = data.to_vec(),
            _ => {}
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while qmp.cmd("query-migrate", json!({}))["status"] != "completed" {
        assert!(Instant::now() < deadline, "snapshot did not complete");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(snap.blocks[0].name, "mem");
    snap.pages = Arc::new(pages);
    let counter_page = snap.pages[0][(COUNTER / page_size) as usize]
        .as_ref()
        .expect("counter page is zero");
    snap.counter = u32::from_le_bytes(counter_page[..4].try_into().unwrap());
    snap
}
