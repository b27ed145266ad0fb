//! Port lifecycle: socket files, errors, stop.

mod common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;

use common::*;
use vmcsnap_switch::{Switch, SwitchError};

#[test]
fn socket_is_private_and_removed_with_port() {
    let dir = tempfile::tempdir().unwrap();
    let sw = Switch::start().unwrap();
    let path = dir.path().join("a.sock");
    let id = sw.add_port("a", &path).unwrap();
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let s = sw.stats().unwrap();
    assert_eq!(port(&s, id).socket_path, path);
    assert_eq!(s.port_by_name("a").unwrap().id, id);

    sw.remove_port(id).unwrap();
    assert!(!path.exists());
    assert!(sw.stats().unwrap().ports.is_empty());
    assert!(matches!(sw.remove_port(id), Err(SwitchError::UnknownPort(p)) if p == id));
    assert!(matches!(sw.hold(id), Err(SwitchError::UnknownPort(_))));
    assert!(matches!(sw.release(id), Err(SwitchError::UnknownPort(_))));
}

#[test]
fn stale_socket_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stale.sock");
    drop(UnixListener::bind(&path).unwrap()); // leaves the file behind
    assert!(path.exists());
    let sw = Switch::start().unwrap();
    let id = sw.add_port("a", &path).unwrap();
    let _c = Client::connect(&path);
    wait_connected(&sw, id, 1);
}

#[test]
fn refuses_live_socket_and_regular_file() {
    let dir = tempfile::tempdir().unwrap();
    let sw = Switch::start().unwrap();

    let live = dir.path().join("live.sock");
    let _other = UnixListener::bind(&live).unwrap();
    let err = sw.add_port("a", &live).unwrap_err();
    assert!(matches!(err, SwitchError::SocketInUse { .. }), "{err}");
    assert!(live.exists());

    let file = dir.path().join("file");
    std::fs::write(&file, b"keep me").unwrap();
    let err = sw.add_port("b", &file).unwrap_err();
    assert!(matches!(err, SwitchError::NotASocket { .. }), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");

    let err = sw
        .add_port("c", &dir.path().join("no/such/dir.sock"))
        .unwrap_err();
    assert!(matches!(err, SwitchError::Listen { .. }), "{err}");
    assert!(sw.stats().unwrap().ports.is_empty());
}

#[test]
fn duplicates_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let sw = Switch::start().unwrap();
    let path = dir.path().join("a.sock");
    let id = sw.add_port("a", &path).unwrap();
    let mut c = Client::connect(&path);
    wait_connected(&sw, id, 1);

    let err = sw.add_port("a", &dir.path().join("b.sock")).unwrap_err();
    assert!(
        matches!(err, SwitchError::DuplicateName { port, .. } if port == id),
        "{err}"
    );
    let err = sw.add_port("b", &path).unwrap_err();
    assert!(
        matches!(err, SwitchError::DuplicatePath { port, .. } if port == id),
        "{err}"
    );
    // Same socket through another spelling of the path.
    let alias = dir.path().join(".").join("a.sock");
    let err = sw.add_port("b", &alias).unwrap_err();
    assert!(matches!(err, SwitchError::DuplicatePath { .. }), "{err}");

    // The existing client was not disturbed by the checks.
    let s = sw.stats().unwrap();
    assert_eq!(port(&s, id).counters.connections, 1);
    assert!(port(&s, id).connected);
    let b = sw.add_port("b", &dir.path().join("b.sock")).unwrap();
    let mut cb = Client::connect(&dir.path().join("b.sock"));
    wait_connected(&sw, b, 1);
    cb.send(&eth(BCAST, mac(2), 3, 60));
    assert_eq!(seq_of(&c.recv()), 3);
}

#[test]
fn path_too_long_names_the_path() {
    let sw = Switch::start().unwrap();
    let path = PathBuf::from(format!("/tmp/{}.sock", "x".repeat(120)));
    let err = sw.add_port("a", &path).unwrap_err();
    assert!(
        matches!(err, SwitchError::SocketPathTooLong { len: 130, .. }),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains("xxxx.sock") && msg.contains("107"), "{msg}");
}

#[test]
fn stop_closes_everything() {
    let mut r = Rig::new(2);
    let other = r.sw.clone();
    r.sw.stop();
    for c in &mut r.clients {
        c.expect_eof();
    }
    assert!(!r.path(0).exists() && !r.path(1).exists());
    assert!(matches!(other.stats(), Err(SwitchError::Stopped)));
    assert!(matches!(
        other.add_port("x", &r.path(0)),
        Err(SwitchError::Stopped)
    ));
    other.stop(); // idempotent
}

#[test]
fn dropping_last_handle_stops() {
    let r = Rig::new(1);
    let clone = r.sw.clone();
    drop(clone);
    assert!(
        r.path(0).exists(),
        "a remaining handle keeps the switch running"
    );
    let Rig {
        dir,
        sw,
        mut clients,
        ..
    } = r;
    drop(sw);
    clients[0].expect_eof();
    assert!(!dir.path().join("vm0.sock").exists());
}

#[test]
fn handle_is_send_sync_clone() {
    fn check<T: Send + Sync + Clone + 'static>() {}
    check::<vmcsnap_switch::SwitchHandle>();
    let mut r = Rig::new(2);
    let sw = r.sw.clone();
    let id = r.ports[1];
    std::thread::spawn(move || sw.hold(id).unwrap())
        .join()
        .unwrap();
    r.clients[0].send(&eth(BCAST, mac(0), 1, 60));
    wait_for(&r.sw, "held", |s| port(s, id).counters.held == 1);
}
