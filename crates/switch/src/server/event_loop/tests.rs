//! Event-loop tests driven step by step (the loop does not run), so that
//! data can wait unread in a socket when a command is handled.

use std::io::Write;
use std::os::unix::net::{UnixListener as StdListener, UnixStream as StdStream};
use std::sync::mpsc;

use socket2::SockRef;

use super::*;
use crate::mediator::DEFAULT_MAX_LOG_BYTES;

fn eth(src: u8, n: u32, len: usize) -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&[0x52, 0x54, 0, 0, 0, src]);
    f.extend_from_slice(&[0x08, 0x00]);
    f.extend_from_slice(&n.to_be_bytes());
    f.resize(len, 0);
    f
}

fn record(frame: &[u8]) -> Vec<u8> {
    let mut r = (frame.len() as u32).to_be_bytes().to_vec();
    r.extend_from_slice(frame);
    r
}

/// An event loop with two ports (vm0, vm1), each connected to a listening
/// peer (which add_port dials at once), and a cut session over both.
fn setup(dir: &std::path::Path) -> (EventLoop, [PortId; 2], [StdStream; 2]) {
    let (_tx, rx) = mpsc::channel();
    let config = SwitchConfig {
        max_log_bytes: DEFAULT_MAX_LOG_BYTES,
        ..SwitchConfig::default()
    };
    let mut el = EventLoop::new(Poll::new().unwrap(), rx, &config);
    let mut ports = Vec::new();
    let mut clients = Vec::new();
    for i in 0..2 {
        let path = dir.join(format!("vm{i}.sock"));
        let listener = StdListener::bind(&path).unwrap();
        let port = el.add_port(format!("vm{i}"), path.clone()).unwrap();
        assert!(el.core.port(port).unwrap().connected);
        clients.push(listener.accept().unwrap().0);
        ports.push(port);
    }
    let (triggers, _) = mpsc::channel();
    el.begin_cut_session(1, &ports, triggers).unwrap();
    let ports = [ports[0], ports[1]];
    let clients = clients.try_into().unwrap();
    (el, ports, clients)
}

#[test]
fn cut_drains_what_the_client_wrote_beyond_the_read_budget() {
    let dir = tempfile::tempdir().unwrap();
    let (mut el, [p0, p1], [mut c0, _c1]) = setup(dir.path());
    // Room for more than a read budget in the client's socket, if the
    // system allows; nothing reads it until the cut.
    let _ = SockRef::from(&c0).set_send_buffer_size(4 << 20);
    c0.set_nonblocking(true).unwrap();
    const LEN: usize = 1000;
    let (mut frames, mut bytes, mut partial) = (0u64, 0usize, false);
    while bytes < 2 * READ_BUDGET {
        let rec = record(&eth(0, frames as u32, LEN));
        match c0.write(&rec) {
            Ok(n) if n == rec.len() => {
                frames += 1;
                bytes += n;
            }
            Ok(_) => {
                partial = true; // the socket filled up in the middle of a record
                break;
            }
            Err(_) => break,
        }
    }
    if bytes <= READ_BUDGET {
        eprintln!("note: the socket buffer holds less than a read budget ({bytes} bytes)");
    }
    let report = el.cut(p0).unwrap();
    assert_eq!(
        (
            report.frames_drained,
            report.bytes_drained,
            report.partial_pending
        ),
        (frames, frames * LEN as u64, partial)
    );
    // They were switched as pre frames: p1, once cut, logs every one.
    el.cut(p1).unwrap();
    let got = std::iter::from_fn(|| el.core.pop_tx(p1)).count() as u64;
    assert_eq!(got, frames);
    assert_eq!(el.core.session_stats().unwrap().logged, frames);
}

#[test]
fn half_a_frame_at_the_cut_completes_as_pre() {
    let dir = tempfile::tempdir().unwrap();
    let (mut el, [p0, p1], [mut c0, _c1]) = setup(dir.path());
    el.cut(p1).unwrap();
    let (a, b) = (record(&eth(0, 1, 100)), record(&eth(0, 2, 100)));
    let mut wire = a.clone();
    wire.extend_from_slice(&b[..50]);
    c0.write_all(&wire).unwrap();
    let report = el.cut(p0).unwrap();
    assert_eq!((report.frames_drained, report.partial_pending), (1, true));
    c0.write_all(&b[50..]).unwrap();
    c0.write_all(&record(&eth(0, 3, 100))).unwrap();
    el.read(p0);
    let tags: Vec<(u8, bool)> = std::iter::from_fn(|| el.core.pop_tx(p1))
        .map(|f| (f[17], f.tag.is_logged()))
        .collect();
    assert_eq!(tags, vec![(1, true), (2, true), (3, false)]);
}
