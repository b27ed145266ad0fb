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
