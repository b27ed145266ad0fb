//! The switch survives `execve` of the process that hosts it.
//!
//! A helper process (this test binary, re-executed with `HELPER_MODE` set,
//! running only [`helper_process`]) hosts a switch and obeys line commands
//! on stdin. On `exec` it freezes the switch, writes the state to a file,
//! clears `FD_CLOEXEC` and execs itself; the new image thaws the switch from
//! the file and the inherited descriptors. The fake QEMUs, in this process,
//! listen and keep the switch's connections throughout and check that no frame is lost,
//! duplicated or reordered, and that holds, the MAC table and the counters
//! carry over. The pid reported before and after shows the exec happened in
//! the same process.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use common::*;
use vmcsnap_switch::{FrozenState, Switch, SwitchConfig, SwitchHandle, SwitchStats};

const HELPER_MODE: &str = "VMCSNAP_SWITCH_TEST_HELPER";
const HELPER_DIR: &str = "VMCSNAP_SWITCH_TEST_HELPER_DIR";
const HELPER_GEN: &str = "VMCSNAP_SWITCH_TEST_HELPER_GEN";
/// Marks the helper's protocol lines among the test harness's output.
const TAG: &str = "HELPER:";

/// Not a test by itself: the body of the helper process, which runs only
/// when this binary is re-executed with `HELPER_MODE` set.
#[test]
fn helper_process() {
    if let Ok(mode) = std::env::var(HELPER_MODE) {
        helper::run(&mode);
    }
}

mod helper {
    use super::*;

    fn reply(msg: &str) {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{TAG}{msg}").unwrap();
        out.flush().unwrap();
    }

    pub(super) fn run(mode: &str) {
        let dir = PathBuf::from(std::env::var(HELPER_DIR).unwrap());
        let gen: u32 = std::env::var(HELPER_GEN).unwrap().parse().unwrap();
        let state_file = dir.join("state.json");
        let sw = if mode == "start" {
            let sw = Switch::start().unwrap();
            for i in 0..3 {
                sw.add_port(&format!("vm{i}"), &dir.join(format!("vm{i}.sock")))
                    .unwrap();
            }
            sw
        } else {
            let state: FrozenState =
                serde_json::from_slice(&std::fs::read(&state_file).unwrap()).unwrap();
            Switch::thaw(state, SwitchConfig::default()).unwrap()
        };
        reply(&format!("up pid={} gen={gen}", std::process::id()));
        let port = |i: &str| {
            let name = format!("vm{i}");
            sw.stats().unwrap().port_by_name(&name).unwrap().id
        };
        for line in std::io::stdin().lines() {
            let line = line.unwrap();
            let (cmd, arg) = line.split_once(' ').unwrap_or((&line, ""));
            match cmd {
                "hold" => sw.hold(port(arg)).unwrap(),
                "release" => sw.release(port(arg)).unwrap(),
                "stats" => {
                    reply(&serde_json::to_string(&sw.stats().unwrap()).unwrap());
                    continue;
                }
                "exec" => exec(&sw, &state_file, gen + 1),
                "quit" => {
                    sw.stop();
                    reply("bye");
                    return;
                }
                _ => panic!("unknown helper command {line:?}"),
            }
            reply("ok");
        }
    }

    /// Freezes the switch and execs this binary again, which thaws it.
    fn exec(sw: &SwitchHandle, state_file: &Path, gen: u32) -> ! {
        let frozen = sw.freeze().unwrap();
        std::fs::write(state_file, serde_json::to_vec(frozen.state()).unwrap()).unwrap();
        frozen.keep_across_exec().unwrap();
        let err = Command::new(std::env::current_exe().unwrap())
            .args(std::env::args_os().skip(1))
            .env(HELPER_MODE, "thaw")
            .env(HELPER_GEN, gen.to_string())
            .exec();
        panic!("exec failed: {err}");
    }
}

/// The helper process, killed when dropped.
struct Helper {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Helper {
    fn spawn(dir: &Path) -> Helper {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "helper_process",
                "--exact",
                "--nocapture",
                "--test-threads=1",
                "-q",
            ])
            .env(HELPER_MODE, "start")
            .env(HELPER_DIR, dir)
            .env(HELPER_GEN, "0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        // A reader thread, so that every wait below is bounded.
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { return };
                // The harness may print on the same line before the tag.
                if let Some(at) = line.find(TAG) {
                    if tx.send(line[at + TAG.len()..].to_owned()).is_err() {
                        return;
                    }
                }
            }
        });
        Helper {
            child,
            stdin,
            lines,
        }
    }

    fn next_line(&mut self) -> String {
        match self.lines.recv_timeout(TIMEOUT) {
            Ok(line) => line,
            Err(e) => panic!(
                "no answer from the helper ({e}); status {:?}",
                self.child.try_wait()
            ),
        }
    }

    fn cmd(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        self.next_line()
    }

    fn stats(&mut self) -> SwitchStats {
        serde_json::from_str(&self.cmd("stats")).unwrap()
    }

    fn wait_stats(&mut self, what: &str, cond: impl Fn(&SwitchStats) -> bool) -> SwitchStats {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let s = self.stats();
            if cond(&s) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {s:#?}"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Freezes, execs and thaws; checks it is the same process, one generation on.
    fn exec(&mut self, pid: u32, gen: u32) {
        assert_eq!(self.cmd("exec"), format!("up pid={pid} gen={gen}"));
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn record(frame: &[u8]) -> Vec<u8> {
    let mut r = (frame.len() as u32).to_be_bytes().to_vec();
    r.extend_from_slice(frame);
    r
}

#[test]
fn switch_survives_exec_of_its_process() {
    const BIG: usize = 7915; // a prime-sized record, see tests/handover.rs
    const SLOW: u32 = 300;
    let dir = tempfile::tempdir().unwrap();
    let mut h = Helper::spawn(dir.path());
    let up = h.next_line();
    let pid: u32 = up
        .strip_prefix("up pid=")
        .and_then(|r| r.strip_suffix(" gen=0"))
        .unwrap_or_else(|| panic!("unexpected greeting {up:?}"))
        .parse()
        .unwrap();
    assert_eq!(pid, h.child.id());
    let path = |i: usize| dir.path().join(format!("vm{i}.sock"));
    // The helper added its ports before anyone listened: it dials until
    // these fake QEMUs listen.
    let mut c: Vec<Client> = (0..3).map(|i| Client::serve(&path(i))).collect();
    h.wait_stats("connected", |s| s.ports.iter().all(|p| p.connected));
    for i in 0..3 {
        c[i].send(&eth(BCAST, mac(i as u8), i as u32, 60));
        for j in (0..3).filter(|&j| j != i) {
            assert_eq!(seq_of(&c[j].recv()), i as u32);
        }
    }

    // Port 1 held with frames, port 2 a slow reader with a partly written
    // frame, half a frame from client 0 in the switch's decoder.
    // (Port 2's frames are queued while held and then released, so they
    // are written in large batches and the socket fills mid-frame.)
    assert_eq!(h.cmd("hold 1"), "ok");
    assert_eq!(h.cmd("hold 2"), "ok");
    for seq in 100..110 {
        c[0].send(&eth(mac(1), mac(0), seq, 200));
    }
    for seq in 1000..1000 + SLOW {
        c[0].send(&eth(mac(2), mac(0), seq, BIG));
    }
    let rx0 = 1 + 10 + u64::from(SLOW);
    h.wait_stats("all read", |s| s.ports[0].counters.rx_frames == rx0);
    assert_eq!(h.cmd("release 2"), "ok");
    h.wait_stats("port 2 backed up", |s| s.ports[2].counters.tx_frames > 2);
    let half = record(&eth(mac(1), mac(0), 111, 1000));
    let cut = half.len() / 2;
    let mut wire = record(&eth(mac(1), mac(0), 110, 200));
    wire.extend_from_slice(&half[..cut]);
    c[0].stream.write_all(&wire).unwrap();
    let before = h.wait_stats("whole frame read", |s| {
        s.ports[0].counters.rx_frames == rx0 + 1
    });

    h.exec(pid, 1);
    let after = h.stats();
    // (`queued_bytes` may differ: frames of a write batch count their length
    // prefixes until taken back into the queue, as on a hold.)
    let view = |s: &SwitchStats| {
        let ports: Vec<_> = s
            .ports
            .iter()
            .map(|p| {
                (
                    p.id,
                    p.name.clone(),
                    p.connected,
                    p.holding,
                    p.queued_frames,
                    p.counters,
                )
            })
            .collect();
        (ports, s.totals)
    };
    assert_eq!(
        view(&after),
        view(&before),
        "ports and counters carried over exactly"
    );
    let st: FrozenState =
        serde_json::from_slice(&std::fs::read(dir.path().join("state.json")).unwrap()).unwrap();
    assert_eq!(
        st.ports[0].connection.as_ref().unwrap().rx_pending,
        half[..cut]
    );
    assert!(st.ports[2]
        .connection
        .as_ref()
        .unwrap()
        .tx_partial
        .is_some());

    // Traffic goes on over the same connections.
    c[0].stream.write_all(&half[cut..]).unwrap();
    for seq in 1000..1000 + SLOW {
        let f = c[2].recv();
        assert_eq!((seq_of(&f), f.len()), (seq, BIG));
    }
    h.wait_stats("frame 111 read", |s| {
        s.ports[0].counters.rx_frames == rx0 + 2
    });
    assert_eq!(h.cmd("release 1"), "ok");
    for seq in 100..=111 {
        assert_eq!(seq_of(&c[1].recv()), seq);
    }
    // The MAC table survived: a unicast to mac(2) reaches port 2 only.
    c[1].send(&eth(mac(2), mac(1), 7777, 60));
    assert_eq!(seq_of(&c[2].recv()), 7777);

    // A second handover, with nothing special in flight.
    h.exec(pid, 2);
    c[2].send(&eth(BCAST, mac(2), 8888, 60));
    assert_eq!(
        seq_of(&c[0].recv()),
        8888,
        "port 0 got the unicast or lost the broadcast"
    );
    assert_eq!(seq_of(&c[1].recv()), 8888);
    let s = h.wait_stats("all counted", |s| s.ports[0].counters.tx_frames == 3);
    for p in &s.ports {
        assert_eq!((p.counters.connections, p.counters.drops), (1, 0), "{p:?}");
        assert!(p.connected && !p.holding);
    }
    assert_eq!(s.ports[2].counters.tx_frames, 2 + u64::from(SLOW) + 1);
    assert_eq!(s.ports[1].counters.held, 12);
    assert_eq!(s.ports[2].counters.held, u64::from(SLOW));
    assert_eq!(s.totals.rx_frames, rx0 + 2 + 2 + 2);

    assert_eq!(h.cmd("quit"), "bye");
    assert!(h.child.wait().unwrap().success());
    for (i, client) in c.iter_mut().enumerate() {
        client.expect_eof();
        assert!(path(i).exists(), "socket file {i} (the peer's) removed");
    }
}
