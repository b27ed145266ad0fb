//! Tests against a scripted fake QEMU; the real QEMU is exercised by the
//! cluster tests of the `vmcsnap` binary.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::thread;
use std::time::Duration;

use serde_json::{json, Value};

use super::*;

const GREETING: &str = r#"{"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": ""}, "capabilities": ["oob"]}}"#;

/// A fake QEMU: greets, then for each command line calls `script` and writes
/// whatever lines it returns.
fn fake_qemu(
    script: impl Fn(&Value) -> Vec<String> + Send + 'static,
) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qmp.sock");
    let listener = UnixListener::bind(&path).unwrap();
    thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut w = stream.try_clone().unwrap();
        writeln!(w, "{GREETING}").unwrap();
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            let cmd: Value = serde_json::from_str(&line).unwrap();
            for out in script(&cmd) {
                w.write_all(out.as_bytes()).unwrap();
                w.write_all(b"\n").unwrap();
            }
        }
    });
    (dir, path)
}

fn reply(cmd: &Value, body: Value) -> String {
    let mut v = body;
    v["id"] = cmd["id"].clone();
    v.to_string()
}

/// Regression: after an agent was killed, QEMU sent the next client an event
/// it had buffered for the old one before the greeting, and connect failed.
#[test]
fn an_event_before_the_greeting_is_queued_not_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qmp.sock");
    let listener = UnixListener::bind(&path).unwrap();
    thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut w = stream.try_clone().unwrap();
        writeln!(w, r#"{{"event": "NETDEV_STREAM_DISCONNECTED", "data": {{"netdev-id": "net0"}}, "timestamp": {{"seconds": 1, "microseconds": 2}}}}"#).unwrap();
        writeln!(w, "{GREETING}").unwrap();
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            let cmd: Value = serde_json::from_str(&line).unwrap();
            writeln!(w, "{}", reply(&cmd, json!({"return": {}}))).unwrap();
        }
    });
    let mut q = QmpClient::connect(&path, Duration::from_secs(5)).unwrap();
    assert_eq!(q.version().to_string(), "7.2.0");
    let events = q.take_events().unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].name, "NETDEV_STREAM_DISCONNECTED");
}

#[test]
fn negotiates_and_reads_version() {
    let (_d, p) = fake_qemu(|c| vec![reply(c, json!({"return": {}}))]);
    let q = QmpClient::connect(&p, Duration::from_secs(5)).unwrap();
    assert_eq!(
        q.version(),
        QemuVersion {
            major: 7,
            minor: 2,
            micro: 0
        }
    );
    assert_eq!(q.version().to_string(), "7.2.0");
}

#[test]
fn queues_events_that_arrive_before_the_reply() {
    let (_d, p) = fake_qemu(|c| {
        if c["execute"] == "stop" {
            vec![
                r#"{"event": "STOP", "timestamp": {"seconds": 10, "microseconds": 5}}"#.to_string(),
                reply(c, json!({"return": {}})),
            ]
        } else {
            vec![reply(c, json!({"return": {"status": "paused"}}))]
        }
    });
    let mut q = QmpClient::connect(&p, Duration::from_secs(5)).unwrap();
    q.execute("stop", Value::Null).unwrap();
    let ret = q.execute("query-status", Value::Null).unwrap();
    assert_eq!(ret["status"], "paused");
    let ev = q.wait_event("STOP", Duration::from_secs(1)).unwrap();
    assert_eq!(ev.timestamp_us, 10_000_005);
    assert!(q.take_events().unwrap().is_empty());
}

#[test]
fn command_error_carries_class_and_description() {
    let (_d, p) = fake_qemu(|c| {
        if c["execute"] == "qmp_capabilities" {
            vec![reply(c, json!({"return": {}}))]
        } else {
            vec![reply(
                c,
                json!({"error": {"class": "GenericError", "desc": "no such thing"}}),
            )]
        }
    });
    let mut q = QmpClient::connect(&p, Duration::from_secs(5)).unwrap();
    let e = q.execute("bogus", Value::Null).unwrap_err();
    assert_eq!(
        e.to_string(),
        "QMP command bogus failed: GenericError: no such thing"
    );
}

#[test]
fn closed_connection_is_reported_not_hung() {
    let (_d, p) = fake_qemu(|c| {
        if c["execute"] == "qmp_capabilities" {
            vec![reply(c, json!({"return": {}}))]
        } else {
            panic!("fake QEMU exits")
        }
    });
    let mut q = QmpClient::connect(&p, Duration::from_secs(5)).unwrap();
    assert!(matches!(
        q.execute("quit", Value::Null),
        Err(QmpError::Closed)
    ));
}

#[test]
fn timeout_when_no_event_arrives() {
    let (_d, p) = fake_qemu(|c| vec![reply(c, json!({"return": {}}))]);
    let mut q = QmpClient::connect(&p, Duration::from_secs(5)).unwrap();
    let e = q
        .wait_event("RESUME", Duration::from_millis(50))
        .unwrap_err();
    assert!(matches!(e, QmpError::Timeout(..)), "{e}");
}

#[test]
fn connect_to_missing_socket_fails_with_path() {
    let e = match QmpClient::connect(
        Path::new("/nonexistent/qmp.sock"),
        Duration::from_millis(30),
    ) {
        Err(e) => e,
        Ok(_) => panic!("connected to nothing"),
    };
    assert!(e.to_string().contains("/nonexistent/qmp.sock"), "{e}");
}

#[test]
fn garbage_is_a_protocol_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q.sock");
    let listener = UnixListener::bind(&path).unwrap();
    thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.write_all(b"HTTP/1.1 200 OK\n").unwrap();
        thread::sleep(Duration::from_millis(200));
    });
    let e = match QmpClient::connect(&path, Duration::from_secs(2)) {
        Err(e) => e,
        Ok(_) => panic!("accepted garbage"),
    };
    assert!(matches!(e, QmpError::Protocol(_)), "{e}");
}

#[test]
fn pipelined_commands_get_their_own_replies_in_order() {
    let (_d, p) = fake_qemu(|c| match c["execute"].as_str() {
        Some("transaction") => vec![
            r#"{"event": "STOP", "timestamp": {"seconds": 1, "microseconds": 5}}"#.into(),
            reply(
                c,
                json!({"error": {"class": "GenericError", "desc": "no such node"}}),
            ),
        ],
        Some(cmd) => vec![reply(c, json!({"return": {"ran": cmd}}))],
        None => vec![],
    });
    let mut q = QmpClient::connect(&p, Duration::from_secs(5)).unwrap();
    let out = q.execute_pipelined(vec![
        ("stop", Value::Null),
        ("transaction", json!({"actions": []})),
        ("migrate", json!({"uri": "fd:x"})),
    ]);
    assert_eq!(out.len(), 3);
    assert_eq!(out[0].0.as_ref().unwrap()["ran"], "stop");
    // A failed command does not stop the ones after it.
    let err = out[1].0.as_ref().unwrap_err().to_string();
    assert!(
        err.contains("transaction") && err.contains("no such node"),
        "{err}"
    );
    assert_eq!(out[2].0.as_ref().unwrap()["ran"], "migrate");
    assert!(out[0].1 > 0 && out[0].1 <= out[2].1);
    // The event between them is kept.
    assert_eq!(q.take_events().unwrap()[0].name, "STOP");
}

#[test]
fn a_file_descriptor_goes_with_the_command() {
    use std::io::Read;
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qmp.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let server = thread::spawn(move || {
        use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
        let (stream, _) = listener.accept().unwrap();
        let mut w = stream.try_clone().unwrap();
        writeln!(w, "{GREETING}").unwrap();
        let mut got_fd = None;
        let mut pending = Vec::new();
        loop {
            let mut buf = [0u8; 4096];
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let r = recvmsg(
                &stream,
                &mut [std::io::IoSliceMut::new(&mut buf)],
                &mut control,
                RecvFlags::empty(),
            )
            .unwrap();
            if r.bytes == 0 {
                return got_fd;
            }
            for m in control.drain() {
                if let RecvAncillaryMessage::ScmRights(mut fds) = m {
                    got_fd = fds.next();
                }
            }
            pending.extend_from_slice(&buf[..r.bytes]);
            while let Some(nl) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=nl).collect();
                let cmd: Value = serde_json::from_slice(&line).unwrap();
                writeln!(w, "{}", reply(&cmd, json!({"return": {}}))).unwrap();
                if cmd["execute"] == "getfd" {
                    return got_fd;
                }
            }
        }
    });
    let mut q = QmpClient::connect(&path, Duration::from_secs(5)).unwrap();
    let (mut r, w) = std::os::unix::net::UnixStream::pair().unwrap();
    q.execute_with_fd("getfd", json!({"fdname": "x"}), w.as_fd())
        .unwrap();
    drop(w);
    let fd: OwnedFd = server.join().unwrap().expect("the server got a descriptor");
    // It is the other end of our pair: what is written to it arrives here.
    // SAFETY: `fd` is a valid, owned socket descriptor we now hand over.
    let mut s = unsafe {
        std::os::unix::net::UnixStream::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(fd))
    };
    s.write_all(b"hi").unwrap();
    drop(s);
    let mut got = String::new();
    r.read_to_string(&mut got).unwrap();
    assert_eq!(got, "hi");
}

/// Events already taken or waited for stay in the history a failure's
/// post-mortem shows, the newest [`HISTORY`] of them.
#[test]
fn recent_events_keep_what_was_taken_up_to_the_bound() {
    let n = HISTORY + 5;
    let (_d, p) = fake_qemu(move |c| {
        let mut out: Vec<String> = (0..n)
            .map(|i| {
                format!(
                    r#"{{"event": "E{i}", "timestamp": {{"seconds": {i}, "microseconds": 0}}}}"#
                )
            })
            .collect();
        out.push(reply(c, json!({"return": {}})));
        if c["execute"] == "qmp_capabilities" {
            out.drain(..n);
        }
        out
    });
    let mut q = QmpClient::connect(&p, Duration::from_secs(5)).unwrap();
    assert!(q.recent_events().is_empty());
    q.execute("cont", Value::Null).unwrap();
    q.wait_event("E3", Duration::from_secs(1)).unwrap();
    assert_eq!(q.take_events().unwrap().len(), n - 1);
    let names: Vec<String> = q.recent_events().into_iter().map(|e| e.name).collect();
    assert_eq!(names.len(), HISTORY);
    assert_eq!(names.first().unwrap(), "E5", "the oldest are dropped");
    assert_eq!(names.last().unwrap(), &format!("E{}", n - 1));
}
