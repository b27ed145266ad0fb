//! The packet mediator (cluster-snapshot cut sessions) over real unix
//! sockets: a whole session while clients exchange frames continuously,
//! prepare_cut against a client that does not read, and the errors.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, TryRecvError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use vmcsnap_switch::mediator::probe::PROBE_MAC;
use vmcsnap_switch::{PortId, SwitchError};

/// Seq of the broadcast each writer sends last: readers stop after one
/// from each other client.
const SENTINEL: u32 = u32::MAX;
const HELLO: u32 = u32::MAX - 1;

fn index_of(mac_addr: [u8; 6]) -> usize {
    usize::from(mac_addr[5])
}

/// What a fake VM (a writer and a reader thread) is told to do.
#[derive(Default)]
struct CtlState {
    /// Paused (between prepare_cut and resume): neither sends nor reads.
    pause: bool,
    writer_paused: bool,
    reader_paused: bool,
    stop: bool,
}

#[derive(Default)]
struct Ctl {
    state: Mutex<CtlState>,
    cv: Condvar,
}

impl Ctl {
    /// Pauses the VM and waits until both its threads stopped.
    fn pause(&self) {
        let deadline = Instant::now() + TIMEOUT;
        let mut st = self.state.lock().unwrap();
        st.pause = true;
        self.cv.notify_all();
        while !(st.writer_paused && st.reader_paused) {
            let left = deadline
                .checked_duration_since(Instant::now())
                .expect("client threads did not pause");
            st = self.cv.wait_timeout(st, left).unwrap().0;
        }
    }

    fn resume(&self) {
        self.state.lock().unwrap().pause = false;
        self.cv.notify_all();
    }

    fn stop(&self) {
        self.state.lock().unwrap().stop = true;
    }

    /// Worker side: if a pause is requested, marks this side paused and
    /// waits for the resume. Returns whether it paused.
    fn checkpoint(&self, side: fn(&mut CtlState) -> &mut bool) -> bool {
        let mut st = self.state.lock().unwrap();
        if !st.pause {
            return false;
        }
        *side(&mut st) = true;
        self.cv.notify_all();
        while st.pause {
            st = self.cv.wait(st).unwrap();
        }
        *side(&mut st) = false;
        true
    }

    fn stopping(&self) -> bool {
        self.state.lock().unwrap().stop
    }

    fn pause_requested(&self) -> bool {
        self.state.lock().unwrap().pause
    }
}

/// A frame a writer sent: to `dst` (None: broadcast), before its own cut?
struct Sent {
    seq: u32,
    dst: Option<usize>,
    before_cut: bool,
}

/// A frame a reader got: from `src`, after its own cut?
struct Got {
    src: usize,
    seq: u32,
    after_cut: bool,
}

fn record(frame: &[u8]) -> Vec<u8> {
    let mut r = (frame.len() as u32).to_be_bytes().to_vec();
    r.extend_from_slice(frame);
    r
}

/// Sends numbered frames to the two other clients and broadcasts, until
/// stopped. With `split_at_pause`, it pauses with half a frame written.
fn writer(mut stream: UnixStream, me: usize, ctl: Arc<Ctl>, split_at_pause: bool) -> Vec<Sent> {
    let mut sent = Vec::new();
    let mut before_cut = true;
    let mut seq = 0u32;
    let next = |seq: u32| -> (Option<usize>, Vec<u8>) {
        let dst = match seq % 5 {
            0 | 1 => Some((me + 1) % 3),
            2 | 3 => Some((me + 2) % 3),
            _ => None,
        };
        let dst_mac = dst.map_or(BCAST, |d| mac(d as u8));
        let frame = eth(dst_mac, mac(me as u8), seq, 60 + (seq as usize * 7) % 300);
        (dst, frame)
    };
    while !ctl.stopping() {
        if before_cut && ctl.pause_requested() {
            let mut rest = Vec::new();
            if split_at_pause {
                let (dst, frame) = next(seq);
                let wire = record(&frame);
                let half = wire.len() / 2;
                stream.write_all(&wire[..half]).unwrap();
                rest = wire[half..].to_vec();
                sent.push(Sent {
                    seq,
                    dst,
                    before_cut: true,
                });
                seq += 1;
            }
            if ctl.checkpoint(|s| &mut s.writer_paused) {
                before_cut = false;
            }
            stream.write_all(&rest).unwrap();
        }
        let (dst, frame) = next(seq);
        stream.write_all(&record(&frame)).unwrap();
        sent.push(Sent {
            seq,
            dst,
            before_cut,
        });
        seq += 1;
        thread::sleep(Duration::from_micros(200));
    }
    stream
        .write_all(&record(&eth(BCAST, mac(me as u8), SENTINEL, 60)))
        .unwrap();
    sent
}

/// Reads frames until it has the sentinel of both other clients.
fn reader(mut stream: UnixStream, ctl: Arc<Ctl>) -> Vec<Got> {
    stream
        .set_read_timeout(Some(Duration::from_millis(2)))
        .unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let (mut got, mut buf, mut chunk) = (Vec::new(), Vec::new(), vec![0u8; 64 << 10]);
    let (mut after_cut, mut sentinels) = (false, 0);
    loop {
        assert!(Instant::now() < deadline, "reader timed out");
        if !after_cut && ctl.pause_requested() {
            assert!(buf.is_empty(), "paused with half a frame read");
            after_cut = ctl.checkpoint(|s| &mut s.reader_paused);
        }
        let n = match stream.read(&mut chunk) {
            Ok(0) => panic!("switch closed the connection"),
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(e) => panic!("read: {e}"),
        };
        buf.extend_from_slice(&chunk[..n]);
        while buf.len() >= 4 {
            let len = u32::from_be_bytes(buf[..4].try_into().unwrap()) as usize;
            if buf.len() < 4 + len {
                break;
            }
            let frame: Vec<u8> = buf.drain(..4 + len).skip(4).collect();
            if frame[..6] == PROBE_MAC {
                continue; // a cut probe: a real NIC discards it
            }
            let (src, seq) = (index_of(src_of(&frame)), seq_of(&frame));
            if seq == SENTINEL {
                sentinels += 1;
                if sentinels == 2 {
                    return got;
                }
            } else {
                got.push(Got {
                    src,
                    seq,
                    after_cut,
                });
            }
        }
    }
}

#[test]
fn whole_session_under_continuous_traffic() {
    let mut r = Rig::new(3);
    let ports = r.ports.clone();
    // Learn every MAC, so that unicasts never flood.
    for i in 0..3 {
        r.clients[i].send(&eth(BCAST, mac(i as u8), HELLO, 60));
        for j in (0..3).filter(|&j| j != i) {
            assert_eq!(seq_of(&r.clients[j].recv()), HELLO);
        }
    }
    let ctls: Vec<Arc<Ctl>> = (0..3).map(|_| Arc::default()).collect();
    let mut writers = Vec::new();
    let mut readers = Vec::new();
    for (i, client) in r.clients.drain(..).enumerate() {
        let w = client.stream.try_clone().unwrap();
        let (c1, c2) = (ctls[i].clone(), ctls[i].clone());
        writers.push(thread::spawn(move || writer(w, i, c1, i == 1)));
        readers.push(thread::spawn(move || reader(client.stream, c2)));
    }
    thread::sleep(Duration::from_millis(20)); // frames queued and in flight at the begin

    let (tx, triggers) = mpsc::channel();
    r.sw.begin_cut_session(7, &ports, tx).unwrap();
    let mut triggered = Vec::new();
    for i in 0..3 {
        thread::sleep(Duration::from_millis(15));
        let prep = r.sw.prepare_cut(ports[i], Duration::from_secs(10)).unwrap();
        assert!(!prep.bound_hit && prep.unread_bytes == 0, "{prep:?}");
        assert_eq!((prep.probes_read, prep.unsettled), (2, false), "{prep:?}");
        ctls[i].pause(); // QMP stop
        let cut = r.sw.cut(ports[i]).unwrap();
        assert_eq!(cut.partial_pending, i == 1, "{cut:?}");
        thread::sleep(Duration::from_millis(3)); // the transient snapshot
        ctls[i].resume(); // the VM runs again after its transient snapshot
        r.sw.release(ports[i]).unwrap();
        if i == 0 {
            // Port 0 now sends post frames to both others: each is held and
            // reported.
            while triggered.len() < 2 {
                triggered.push(triggers.recv_timeout(TIMEOUT).expect("trigger"));
            }
        }
    }
    let deadline = Instant::now() + TIMEOUT;
    let stats = loop {
        let s = r.sw.session_stats().unwrap().unwrap();
        if s.pending_pre_frames == 0 {
            break s;
        }
        assert!(Instant::now() < deadline, "pre frames still queued: {s:?}");
        thread::sleep(Duration::from_millis(1));
    };
    assert!(stats
        .ports
        .iter()
        .all(|p| !p.partial_pending && p.cut_unix_us.is_some()));
    let log = r.sw.end_cut_session().unwrap();
    assert!(r.sw.session_stats().unwrap().is_none());
    loop {
        match triggers.try_recv() {
            Ok(p) => triggered.push(p),
            Err(TryRecvError::Disconnected) => break,
            Err(TryRecvError::Empty) => panic!("triggers channel kept after the end"),
        }
    }
    triggered.sort();
    assert_eq!(triggered, vec![ports[1], ports[2]], "each triggered once");

    for c in &ctls {
        c.stop();
    }
    let sent: Vec<Vec<Sent>> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    let got: Vec<Vec<Got>> = readers.into_iter().map(|h| h.join().unwrap()).collect();

    let s = &log.stats;
    assert_eq!(
        (
            s.dropped,
            s.violations,
            s.log_overflow,
            s.bound_hits,
            s.unlogged_at_end,
            s.unsettled_cuts
        ),
        (0, 0, 0, 0, 0, 0),
        "{s:?}"
    );
    assert_eq!(s.triggers, 2);
    assert_eq!(r.stats().totals.drops, 0);
    assert_eq!(s.pairs.len(), 6, "every VM talks to every other");

    // Every frame reached each of its destinations exactly once.
    let mut expected = BTreeSet::new();
    for (i, frames) in sent.iter().enumerate() {
        for f in frames {
            for j in (0..3).filter(|&j| j != i && f.dst.is_none_or(|d| d == j)) {
                expected.insert((i, j, f.seq));
            }
        }
    }
    let mut received = HashMap::new();
    for (j, frames) in got.iter().enumerate() {
        for g in frames {
            *received.entry((g.src, j, g.seq)).or_insert(0) += 1;
        }
    }
    assert!(received.values().all(|&n| n == 1), "a frame arrived twice");
    let received_set: BTreeSet<_> = received.keys().copied().collect();
    assert_eq!(received_set, expected, "lost or unexpected frames");

    // The log is exactly the frames read after the receiver's cut and sent
    // before the sender's cut.
    let before_cut: HashMap<(usize, u32), bool> = sent
        .iter()
        .enumerate()
        .flat_map(|(i, v)| v.iter().map(move |f| ((i, f.seq), f.before_cut)))
        .collect();
    let mut want = BTreeSet::new();
    for (j, frames) in got.iter().enumerate() {
        for g in frames.iter().filter(|g| g.after_cut) {
            if before_cut[&(g.src, g.seq)] {
                want.insert((g.src, j, g.seq));
            }
        }
    }
    let idx = |p: PortId| ports.iter().position(|&q| q == p).unwrap();
    let logged: Vec<(usize, usize, u32)> = log
        .frames
        .iter()
        .map(|f| {
            assert_eq!(index_of(src_of(&f.data)), idx(f.sender_port));
            assert_eq!(f.sender, format!("vm{}", idx(f.sender_port)));
            (idx(f.sender_port), idx(f.receiver_port), seq_of(&f.data))
        })
        .collect();
    let logged_set: BTreeSet<_> = logged.iter().copied().collect();
    assert_eq!(logged_set.len(), logged.len(), "a frame logged twice");
    assert!(!want.is_empty(), "the test should produce channel state");
    assert_eq!(logged_set, want, "log differs from the clients' view");
    assert_eq!(s.logged, logged.len() as u64);
    let per_port: u64 = r.stats().ports.iter().map(|p| p.counters.logged).sum();
    assert_eq!(per_port, s.logged);
}

#[test]
fn prepare_cut_returns_at_the_bound_when_the_client_does_not_read() {
    const N: u32 = 400;
    let mut r = Rig::new(2);
    let (p0, p1) = (r.ports[0], r.ports[1]);
    r.clients[1].send(&eth(BCAST, mac(1), 0, 60));
    assert_eq!(seq_of(&r.clients[0].recv()), 0);
    // 600 KB for a client that does not read: far more than its socket takes.
    for seq in 1..=N {
        r.clients[0].send(&eth(mac(1), mac(0), seq, 1500));
    }
    wait_for(&r.sw, "port 1 backed up", |s| {
        port(s, p0).counters.rx_frames == u64::from(N) && port(s, p1).queued_frames > 0
    });
    let (tx, _triggers) = mpsc::channel();
    r.sw.begin_cut_session(1, &r.ports, tx).unwrap();
    let bound = Duration::from_millis(50);
    let rep = r.sw.prepare_cut(p1, bound).unwrap();
    assert!(rep.bound_hit && rep.unread_bytes > 0, "{rep:?}");
    assert!(rep.waited_us >= bound.as_micros() as u64, "{rep:?}");
    let s = r.sw.session_stats().unwrap().unwrap();
    assert_eq!(s.bound_hits, 1);
    assert_eq!(s.unread_bytes_at_cut, rep.unread_bytes as u64);
    assert!(port(&r.stats(), p1).holding);

    let s = r.sw.abort_cut_session().unwrap();
    assert_eq!((s.dropped, s.bound_hits), (0, 1));
    assert!(
        !port(&r.stats(), p1).holding,
        "abort releases the prepare hold"
    );
    for seq in 1..=N {
        assert_eq!(seq_of(&r.clients[1].recv()), seq);
    }
}

#[test]
fn begin_twice_is_an_error() {
    let r = Rig::new(2);
    let (tx, _rx) = mpsc::channel();
    r.sw.begin_cut_session(5, &r.ports, tx.clone()).unwrap();
    let err = r.sw.begin_cut_session(6, &r.ports, tx.clone()).unwrap_err();
    assert!(
        matches!(err, SwitchError::CutSessionActive { epoch: 5 }),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains("wait") && msg.contains("abort"), "{msg}");
    assert_eq!(r.sw.end_cut_session().unwrap().stats.epoch, 5);
    r.sw.begin_cut_session(6, &r.ports, tx).unwrap();
    assert_eq!(r.sw.session_stats().unwrap().unwrap().epoch, 6);
}

#[test]
fn freeze_during_a_session_is_an_error() {
    let mut r = Rig::new(2);
    let (tx, _rx) = mpsc::channel();
    r.sw.begin_cut_session(3, &r.ports, tx).unwrap();
    let err = r.sw.freeze().unwrap_err();
    assert!(
        matches!(err, SwitchError::FreezeDuringCutSession { epoch: 3 }),
        "{err}"
    );
    assert!(err.to_string().contains("finish"), "{err}");
    // The switch keeps running.
    r.clients[0].send(&eth(BCAST, mac(0), 1, 60));
    assert_eq!(seq_of(&r.clients[1].recv()), 1);
    r.sw.abort_cut_session().unwrap();
    r.sw.freeze()
        .expect("freezing works once the session is over");
}

#[test]
fn session_errors_over_the_handle() {
    let mut r = Rig::new(3);
    let (p0, p1, p2) = (r.ports[0], r.ports[1], r.ports[2]);
    assert!(matches!(r.sw.cut(p0), Err(SwitchError::NoCutSession)));
    assert!(matches!(
        r.sw.end_cut_session(),
        Err(SwitchError::NoCutSession)
    ));
    assert!(r.sw.session_stats().unwrap().is_none());
    r.sw.remove_port(p2).unwrap();
    let (tx, triggers) = mpsc::channel();
    assert!(matches!(
        r.sw.begin_cut_session(1, &[p0, p2], tx.clone()),
        Err(SwitchError::UnknownPort(p)) if p == p2
    ));
    r.sw.begin_cut_session(1, &[p0, p1], tx).unwrap();
    // Learn mac(1) on port 1, then cut port 0 (without prepare: allowed).
    r.clients[1].send(&eth(BCAST, mac(1), 0, 60));
    assert_eq!(seq_of(&r.clients[0].recv()), 0);
    let cut = r.sw.cut(p0).unwrap();
    assert_eq!((cut.frames_drained, cut.partial_pending), (0, false));
    assert!(matches!(r.sw.cut(p0), Err(SwitchError::AlreadyCut { .. })));
    // A post frame for pre port 1: held, triggered, and not releasable.
    r.clients[0].send(&eth(mac(1), mac(0), 1, 60));
    assert_eq!(triggers.recv_timeout(TIMEOUT).unwrap(), p1);
    assert!(matches!(r.sw.release(p1), Err(SwitchError::HeldByCutSession(p)) if p == p1));
    assert!(port(&r.stats(), p1).holding);
    r.sw.abort_cut_session().unwrap();
    assert_eq!(seq_of(&r.clients[1].recv()), 1, "delivered after the abort");
}
