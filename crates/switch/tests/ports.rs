//! Port lifecycle: peers' socket files, errors, stop.

mod common;

use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;

use common::*;
use vmcsnap_switch::{Switch, SwitchError};

fn inode(path: &std::path::Path) -> u64 {
    std::fs::symlink_metadata(path).unwrap().ino()
}

#[test]
fn remove_port_leaves_the_peers_socket_file() {
    let dir = tempfile::tempdir().unwrap();
    let sw = Switch::start().unwrap();
    let path = dir.path().join("a.sock");
    let listener = listen(&path);
    let ino = inode(&path);
    let id = sw.add_port("a", &path).unwrap();
    let mut peer = Client::accept_on(listener);
    let s = sw.stats().unwrap();
    assert_eq!(port(&s, id).socket_path, path);
    assert_eq!(s.port_by_name("a").unwrap().id, id);

    sw.remove_port(id).unwrap();
    peer.expect_eof();
    assert_eq!(inode(&path), ino, "the peer's socket file is untouched");
    assert!(!has_pending(&peer.listener), "a removed port does not dial");
    assert!(sw.stats().unwrap().ports.is_empty());
    assert!(matches!(sw.remove_port(id), Err(SwitchError::UnknownPort(p)) if p == id));
    assert!(matches!(sw.hold(id), Err(SwitchError::UnknownPort(_))));
    assert!(matches!(sw.release(id), Err(SwitchError::UnknownPort(_))));
    assert!(matches!(
        sw.port_connected(id),
        Err(SwitchError::UnknownPort(_))
    ));
}

#[test]
fn a_path_without_a_listening_peer_is_dialed_until_one_listens() {
    let dir = tempfile::tempdir().unwrap();
    let sw = Switch::start().unwrap();
    // Nothing there, not even the directory.
    let absent = dir.path().join("later/a.sock");
    let a = sw.add_port("a", &absent).unwrap();
    // A stale socket file nobody listens on (a QEMU that died).
    let stale = dir.path().join("b.sock");
    drop(UnixListener::bind(&stale).unwrap());
    let b = sw.add_port("b", &stale).unwrap();
    // A regular file: not the switch's to remove.
    let file = dir.path().join("c.sock");
    std::fs::write(&file, b"keep me").unwrap();
    let c = sw.add_port("c", &file).unwrap();
    for id in [a, b, c] {
        let st = sw.connection_state(id).unwrap();
        assert!(!st.connected && st.connections == 0, "{st:?}");
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    assert!(stale.exists());

    std::fs::create_dir(dir.path().join("later")).unwrap();
    let mut peers: Vec<Client> = [&absent, &stale, &file]
        .iter()
        .map(|p| Client::serve(p))
        .collect();
    for id in [a, b, c] {
        wait_connected(&sw, id, 1);
    }
    peers[0].send(&eth(BCAST, mac(0), 1, 60));
    assert_eq!(seq_of(&peers[1].recv()), 1);
    assert_eq!(seq_of(&peers[2].recv()), 1);
}

#[test]
fn duplicates_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let sw = Switch::start().unwrap();
    let path = dir.path().join("a.sock");
    let id = sw.add_port("a", &path).unwrap();
    let mut c = Client::serve(&path);
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
    let mut cb = Client::serve(&dir.path().join("b.sock"));
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
    let err = sw.add_port("b", &PathBuf::from("")).unwrap_err();
    assert!(
        matches!(err, SwitchError::InvalidSocketPath { .. }),
        "{err}"
    );
    use std::os::unix::ffi::OsStrExt;
    let nul = PathBuf::from(std::ffi::OsStr::from_bytes(b"/tmp/a\0b.sock"));
    let err = sw.add_port("b", &nul).unwrap_err();
    assert!(err.to_string().contains("NUL"), "{err}");
    assert!(sw.stats().unwrap().ports.is_empty());
}

#[test]
fn stop_closes_everything() {
    let mut r = Rig::new(2);
    let other = r.sw.clone();
    r.sw.stop();
    for c in &mut r.clients {
        c.expect_eof();
    }
    assert!(
        r.path(0).exists() && r.path(1).exists(),
        "the peers' files stay"
    );
    for c in &r.clients {
        assert!(!has_pending(&c.listener), "a stopped switch does not dial");
    }
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
    assert!(
        dir.path().join("vm0.sock").exists(),
        "the peer's file stays"
    );
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
