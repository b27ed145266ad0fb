//! Tests against a fake guest agent: a thread on a unix socket speaking
//! QGA's protocol (0xFF resets its parser; guest-sync-delimited replies
//! after a 0xFF). The real agent is exercised by the image VM tests.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;

use super::*;

const SNMP: &str = include_str!("../ga_fixtures/snmp");
const NETSTAT: &str = include_str!("../ga_fixtures/netstat");

/// How the fake behaves.
#[derive(Default)]
struct Script {
    /// Written before the first sync reply: what a previous client left.
    stale_prefix: Vec<u8>,
    /// Guest files; each read of a path takes the next version (the last
    /// one stays).
    files: HashMap<String, Vec<Vec<u8>>>,
    /// `guest-exec-status` replies, in order (the last one repeats); none:
    /// guest-exec is disabled.
    exec_status: Vec<Value>,
    /// The first `guest-ping` is answered only once this fires.
    hold_first_ping: Option<mpsc::Receiver<()>>,
    /// Never answer anything.
    silent: bool,
    /// The guest clock's offset from the host's (ns); guest-set-time
    /// changes it.
    clock_offset_ns: i64,
    /// guest-set-time fails as on a guest without /sbin/hwclock (after
    /// setting the system clock, as QEMU 7.2's agent does).
    no_hwclock: bool,
}

fn host_ns() -> i64 {
    std::time::SystemTime::UNIX_EPOCH
        .elapsed()
        .unwrap()
        .as_nanos() as i64
}

/// What the fake saw.
#[derive(Default, Debug)]
struct Seen {
    /// Commands in order.
    commands: Vec<String>,
    /// A 0xFF came right before each guest-sync-delimited.
    delimited_syncs: usize,
    /// Open file handles.
    open: usize,
}

fn fake_agent(mut script: Script) -> (tempfile::TempDir, PathBuf, Arc<Mutex<Seen>>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qga.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let seen2 = seen.clone();
    thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut w = stream.try_clone().unwrap();
        let (mut partial, mut after_delimiter, mut reads) =
            (Vec::new(), false, HashMap::<String, usize>::new());
        let mut handles: HashMap<i64, (Vec<u8>, usize)> = HashMap::new();
        let mut chunk = [0u8; 1];
        while stream.read(&mut chunk).map(|n| n == 1).unwrap_or(false) {
            match chunk[0] {
                DELIMITER => {
                    partial.clear();
                    after_delimiter = true;
                    continue;
                }
                b'\n' => {}
                b => {
                    partial.push(b);
                    continue;
                }
            }
            let cmd: Value = serde_json::from_slice(&std::mem::take(&mut partial)).unwrap();
            let name = cmd["execute"].as_str().unwrap().to_string();
            let args = &cmd["arguments"];
            let mut seen = seen2.lock().unwrap();
            seen.commands.push(name.clone());
            if script.silent {
                continue;
            }
            let mut out = Vec::new();
            let ret = match name.as_str() {
                "guest-sync-delimited" => {
                    seen.delimited_syncs += usize::from(after_delimiter);
                    out.append(&mut script.stale_prefix);
                    out.push(DELIMITER);
                    Ok(args["id"].clone())
                }
                "guest-ping" => {
                    if let Some(rx) = script.hold_first_ping.take() {
                        drop(seen);
                        rx.recv().unwrap();
                    }
                    Ok(json!({}))
                }
                "guest-file-open" => {
                    let p = args["path"].as_str().unwrap();
                    match script.files.get(p) {
                        Some(versions) => {
                            let n = reads.entry(p.to_string()).or_default();
                            let data = versions[(*n).min(versions.len() - 1)].clone();
                            *n += 1;
                            let h = 1000 + handles.len() as i64;
                            handles.insert(h, (data, 0));
                            seen.open += 1;
                            Ok(json!(h))
                        }
                        None => Err(
                            json!({"class": "GenericError", "desc": format!("failed to open file '{p}' (mode: 'r'): No such file or directory")}),
                        ),
                    }
                }
                "guest-file-read" => {
                    // Small chunks, as a seq_file may give them.
                    let (data, pos) = handles.get_mut(&args["handle"].as_i64().unwrap()).unwrap();
                    let n = (data.len() - *pos)
                        .min(100)
                        .min(args["count"].as_u64().unwrap() as usize);
                    let part = &data[*pos..*pos + n];
                    *pos += n;
                    Ok(json!({"count": n, "buf-b64": BASE64.encode(part), "eof": n == 0}))
                }
                "guest-file-close" => {
                    handles.remove(&args["handle"].as_i64().unwrap()).unwrap();
                    seen.open -= 1;
                    Ok(json!({}))
                }
                "guest-get-time" => Ok(json!(host_ns() + script.clock_offset_ns)),
                "guest-set-time" => {
                    script.clock_offset_ns = args["time"].as_i64().unwrap() - host_ns();
                    if script.no_hwclock {
                        Err(
                            json!({"class": "GenericError", "desc": "failed to set hardware clock to system time: No such file or directory"}),
                        )
                    } else {
                        Ok(json!({}))
                    }
                }
                "guest-exec" if !script.exec_status.is_empty() => Ok(json!({"pid": 4321})),
                "guest-exec-status" => {
                    assert_eq!(args["pid"], 4321);
                    let st = if script.exec_status.len() > 1 {
                        script.exec_status.remove(0)
                    } else {
                        script.exec_status[0].clone()
                    };
                    Ok(st)
                }
                // As QGA answers a command its configuration disabled.
                _ => Err(
                    json!({"class": "CommandNotFound", "desc": format!("The command {name} has been disabled")}),
                ),
            };
            after_delimiter = false;
            let body = match ret {
                Ok(v) => json!({ "return": v }),
                Err(e) => json!({ "error": e }),
            };
            out.extend_from_slice(body.to_string().as_bytes());
            out.push(b'\n');
            if w.write_all(&out).is_err() {
                break;
            }
        }
    });
    (dir, path, seen)
}

const T: Duration = Duration::from_secs(5);

fn proc_files(snmp: &[&str], netstat: &[&str]) -> HashMap<String, Vec<Vec<u8>>> {
    let v = |s: &[&str]| s.iter().map(|t| t.as_bytes().to_vec()).collect();
    HashMap::from([
        ("/proc/net/snmp".to_string(), v(snmp)),
        ("/proc/net/netstat".to_string(), v(netstat)),
    ])
}

#[test]
fn syncs_with_a_delimiter_and_pings() {
    let (_d, p, seen) = fake_agent(Script::default());
    let mut ga = GuestAgent::connect(&p, T).unwrap();
    ga.ping().unwrap();
    ga.ping().unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen.commands,
        ["guest-sync-delimited", "guest-ping", "guest-ping"]
    );
    assert_eq!(
        seen.delimited_syncs, 1,
        "the sync request is preceded by 0xFF"
    );
}

#[test]
fn skips_what_a_previous_client_left_before_the_sync_reply() {
    let stale = b"{\"return\": {\"pid\": 7}}\n\xff{\"return\": 4242}\n{\"retu".to_vec();
    let (_d, p, _seen) = fake_agent(Script {
        stale_prefix: stale,
        files: proc_files(&["Tcp: RetransSegs\nTcp: 9\n"], &[""]),
        ..Script::default()
    });
    let mut ga = GuestAgent::connect(&p, T).unwrap();
    // Had the client taken a stale reply for its own, this would get the
    // sync reply or garbage instead of the counters.
    assert_eq!(ga.tcp_counters().unwrap().retrans_segs, 9);
}

#[test]
fn resyncs_after_a_request_timed_out() {
    let (tx, rx) = mpsc::channel();
    let (_d, p, seen) = fake_agent(Script {
        hold_first_ping: Some(rx),
        ..Script::default()
    });
    let mut ga = GuestAgent::connect(&p, T).unwrap();
    ga.set_timeout(Duration::from_millis(50));
    let e = ga.ping().unwrap_err();
    assert!(matches!(e, GaError::NoAnswer { .. }), "{e}");
    tx.send(()).unwrap();
    // The late reply to the first ping is still in flight: it must not be
    // taken for the reply to the next request.
    ga.set_timeout(T);
    ga.ping().unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen.commands,
        [
            "guest-sync-delimited",
            "guest-ping",
            "guest-sync-delimited",
            "guest-ping"
        ]
    );
    assert_eq!(seen.delimited_syncs, 2);
}

#[test]
fn a_silent_guest_is_no_answer_with_advice() {
    let (_d, p, seen) = fake_agent(Script {
        silent: true,
        ..Script::default()
    });
    let e = GuestAgent::connect(&p, Duration::from_millis(100))
        .err()
        .unwrap();
    assert!(matches!(e, GaError::NoAnswer { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("is qemu-guest-agent installed and running in the guest?"),
        "{e}"
    );
    assert_eq!(seen.lock().unwrap().commands, ["guest-sync-delimited"]);
    let e =
        read_tcp_counters(&p.with_file_name("none.sock"), Duration::from_millis(50)).unwrap_err();
    assert!(matches!(e, GaError::Connect { .. }), "{e}");
}

#[test]
fn a_closed_socket_is_reported_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qga.sock");
    let listener = UnixListener::bind(&path).unwrap();
    thread::spawn(move || drop(listener.accept().unwrap()));
    let e = GuestAgent::connect(&path, T).err().unwrap();
    assert!(matches!(e, GaError::Closed(_) | GaError::Io(_)), "{e}");
}

#[test]
fn exec_polls_until_exit_and_decodes_the_output() {
    let running = json!({"exited": false});
    let done = json!({"exited": true, "exitcode": 3, "out-data": BASE64.encode(b"hello\n\xff"), "err-data": BASE64.encode("oops")});
    let (_d, p, seen) = fake_agent(Script {
        exec_status: vec![running.clone(), running, done],
        ..Script::default()
    });
    let mut ga = GuestAgent::connect(&p, T).unwrap();
    let out = ga.exec("/bin/sh", &["-c", "echo hello; exit 3"]).unwrap();
    assert_eq!(
        out,
        ExecOutput {
            exit_code: Some(3),
            signal: None,
            stdout: b"hello\n\xff".to_vec(),
            stderr: b"oops".to_vec(),
            truncated: false
        }
    );
    assert!(!out.success());
    let polls = seen
        .lock()
        .unwrap()
        .commands
        .iter()
        .filter(|c| *c == "guest-exec-status")
        .count();
    assert_eq!(polls, 3);
}

#[test]
fn exec_output_that_is_not_base64_is_a_protocol_error() {
    let (_d, p, _) = fake_agent(Script {
        exec_status: vec![json!({"exited": true, "exitcode": 0, "out-data": "not base64!"})],
        ..Script::default()
    });
    let e = GuestAgent::connect(&p, T)
        .unwrap()
        .exec("/bin/true", &[])
        .unwrap_err();
    assert!(
        matches!(&e, GaError::Protocol(m) if m.contains("out-data")),
        "{e}"
    );
}

#[test]
fn exec_that_does_not_exit_times_out() {
    let (_d, p, _) = fake_agent(Script {
        exec_status: vec![json!({"exited": false})],
        ..Script::default()
    });
    let mut ga = GuestAgent::connect(&p, T).unwrap();
    ga.set_timeout(Duration::from_millis(100));
    let e = ga.exec("/bin/sleep", &["100"]).unwrap_err();
    assert!(
        matches!(&e, GaError::ExecTimeout { program, .. } if program == "/bin/sleep"),
        "{e}"
    );
}

#[test]
fn reads_files_in_chunks_and_closes_them() {
    let (_d, p, seen) = fake_agent(Script {
        files: proc_files(&[SNMP], &[NETSTAT]),
        ..Script::default()
    });
    let mut ga = GuestAgent::connect(&p, T).unwrap();
    assert_eq!(
        ga.read_file("/proc/net/netstat").unwrap(),
        NETSTAT.as_bytes()
    );
    let e = ga.read_file("/nope").unwrap_err();
    assert!(
        matches!(&e, GaError::Command { class, .. } if class == "GenericError"),
        "{e}"
    );
    let e = ga.exec("/bin/true", &[]).unwrap_err();
    assert!(
        matches!(&e, GaError::Command { class, .. } if class == "CommandNotFound"),
        "{e}"
    );
    assert_eq!(seen.lock().unwrap().open, 0, "every handle was closed");
}

#[test]
fn reads_tcp_counters_through_the_agent() {
    let (_d, p, seen) = fake_agent(Script {
        files: proc_files(&[SNMP], &[NETSTAT]),
        ..Script::default()
    });
    let c = read_tcp_counters(&p, T).unwrap();
    assert_eq!(c, parse_tcp_counters(SNMP, NETSTAT).unwrap());
    assert_eq!(seen.lock().unwrap().open, 0);
}

#[test]
fn rereads_when_retransmissions_happened_while_reading() {
    let snmp = |n: u64| format!("Tcp: RetransSegs\nTcp: {n}\n");
    let netstat = |n: u64| {
        format!("TcpExt: TCPLossProbes TCPTimeouts TCPDSACKRecv TCPDSACKOfoRecv TCPLossProbeRecovery\nTcpExt: {n} 0 0 0 0\n")
    };
    let (s1, s2, s3) = (snmp(10), snmp(11), snmp(11));
    let (n1, n2) = (netstat(0), netstat(1));
    let (_d, p, seen) = fake_agent(Script {
        files: proc_files(&[&s1, &s2, &s3], &[&n1, &n2]),
        ..Script::default()
    });
    let c = read_tcp_counters(&p, T).unwrap();
    // The probe counted in the first TcpExt reading was retransmission 11.
    assert_eq!((c.retrans_segs, c.tcp_loss_probes), (11, Some(1)));
    let reads = seen
        .lock()
        .unwrap()
        .commands
        .iter()
        .filter(|c| *c == "guest-file-open")
        .count();
    assert_eq!(reads, 5, "snmp, netstat, snmp (changed), netstat, snmp");
}

#[test]
fn malformed_counter_files_are_an_error_not_zero() {
    let (_d, p, _) = fake_agent(Script {
        files: proc_files(&["Tcp: RetransSegs\nTcp: x\n"], &[NETSTAT]),
        ..Script::default()
    });
    let e = read_tcp_counters(&p, T).unwrap_err();
    assert!(
        matches!(e, GaError::Counters(ProcNetError::NotANumber { .. })),
        "{e}"
    );
}

#[test]
fn reads_and_sets_the_guest_clock() {
    // A guest 60 s behind (restored from a snapshot a minute old).
    let (_d, p, seen) = fake_agent(Script {
        clock_offset_ns: -60_000_000_000,
        ..Script::default()
    });
    let mut ga = GuestAgent::connect(&p, T).unwrap();
    let behind = host_ns() - ga.get_time_ns().unwrap();
    assert!(
        (59_000_000_000..61_000_000_000).contains(&behind),
        "{behind}"
    );
    ga.set_time_ns(host_ns()).unwrap();
    let off = (ga.get_time_ns().unwrap() - host_ns()).abs();
    assert!(off < 1_000_000_000, "{off}");
    assert!(seen
        .lock()
        .unwrap()
        .commands
        .contains(&"guest-set-time".to_string()));
}

#[test]
fn a_guest_without_hwclock_says_so() {
    let (_d, p, _seen) = fake_agent(Script {
        no_hwclock: true,
        ..Script::default()
    });
    let mut ga = GuestAgent::connect(&p, T).unwrap();
    let e = ga.set_time_ns(host_ns()).unwrap_err();
    assert!(
        matches!(&e, GaError::Command { command, desc, .. } if command == "guest-set-time" && desc.contains("hardware clock")),
        "{e}"
    );
}
