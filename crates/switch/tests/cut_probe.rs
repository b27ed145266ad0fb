//! Cut probes against a client that behaves like QEMU's stream netdev in
//! front of a slow guest: it reads its socket in chunks, hands frames to a
//! small receive ring, keeps what does not fit in its own queue and stops
//! reading the socket until that queue is empty again. The socket alone
//! (`SIOCOUTQ == 0`) then says "all read" while frames still wait outside
//! the guest; two probes read in turn say they reached it.

mod common;

use std::collections::VecDeque;
use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use vmcsnap_switch::mediator::probe::PROBE_MAC;

/// What the modelled guest and its QEMU hold.
#[derive(Default)]
struct Model {
    /// Sequence numbers of the frames the guest took, in order.
    guest: Vec<u32>,
    /// Frames in the ring, not yet taken.
    ring: VecDeque<u32>,
    /// Frames QEMU read but could not put in the ring (its net queue).
    queued: VecDeque<Vec<u8>>,
    /// Probes read from the socket.
    probes: u32,
}

const RING: usize = 8;
/// The guest takes one frame of its ring this often.
const GUEST_TICK: Duration = Duration::from_millis(1);

/// Runs the model until `stop`: QEMU's loop (read a chunk when its queue is
/// empty, deliver into the ring, queue the rest) and the guest's (take a
/// frame every tick, then let QEMU flush its queue into the ring).
fn qemu_model(mut stream: UnixStream, m: Arc<Mutex<Model>>, stop: Arc<AtomicBool>) {
    stream
        .set_read_timeout(Some(Duration::from_micros(200)))
        .unwrap();
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 69632]; // QEMU's NET_BUFSIZE
    let mut next_tick = Instant::now() + GUEST_TICK;
    while !stop.load(Ordering::Relaxed) {
        let reading = m.lock().unwrap().queued.is_empty();
        if reading {
            match stream.read(&mut chunk) {
                Ok(0) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => panic!("model read: {e}"),
            }
            let mut st = m.lock().unwrap();
            while buf.len() >= 4 {
                let len = u32::from_be_bytes(buf[..4].try_into().unwrap()) as usize;
                if buf.len() < 4 + len {
                    break;
                }
                let frame: Vec<u8> = buf.drain(..4 + len).skip(4).collect();
                if frame[..6] == PROBE_MAC {
                    st.probes += 1;
                }
                deliver(&mut st, frame);
            }
        } else {
            thread::sleep(Duration::from_micros(200));
        }
        if Instant::now() >= next_tick {
            next_tick += GUEST_TICK;
            let mut st = m.lock().unwrap();
            if let Some(seq) = st.ring.pop_front() {
                st.guest.push(seq);
            }
            while st.ring.len() < RING {
                let Some(f) = st.queued.pop_front() else {
                    break;
                };
                put(&mut st, f);
            }
        }
    }
}

/// QEMU's send: straight into the ring if it has room and nothing waits
/// before it, else into its queue.
fn deliver(st: &mut Model, frame: Vec<u8>) {
    if st.queued.is_empty() && st.ring.len() < RING {
        put(st, frame);
    } else {
        st.queued.push_back(frame);
    }
}

/// The NIC: a probe (another host's unicast) is discarded, a frame takes a
/// ring slot.
fn put(st: &mut Model, frame: Vec<u8>) {
    if frame[..6] != PROBE_MAC {
        st.ring.push_back(seq_of(&frame));
    }
}

#[test]
fn two_probes_read_in_turn_mean_the_guest_has_every_frame() {
    const BURST: u32 = 60;
    let mut r = Rig::new(2);
    let (p0, p1) = (r.ports[0], r.ports[1]);
    // Port 1 learns its MAC, then becomes the modelled QEMU.
    r.clients[1].send(&eth(BCAST, mac(1), 0, 60));
    assert_eq!(seq_of(&r.clients[0].recv()), 0);
    let model = Arc::new(Mutex::new(Model::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let stream = r.clients[1].stream.try_clone().unwrap();
    let (m, s) = (model.clone(), stop.clone());
    let qemu = thread::spawn(move || qemu_model(stream, m, s));

    // A burst the guest needs ~60 ms to take, read by QEMU in one chunk.
    let burst = |r: &mut Rig, from: u32| {
        for seq in from..from + BURST {
            r.clients[0].send(&eth(mac(1), mac(0), seq, 200));
        }
        wait_for(&r.sw, "the burst written to port 1", |s| {
            port(s, p1).counters.tx_frames >= u64::from(from + BURST - 1)
        });
    };

    // Without probes the socket drains at once, with most of the burst
    // still in QEMU's queue: a pause now would lose it.
    burst(&mut r, 1);
    let (tx, _t) = mpsc::channel();
    r.sw.begin_cut_session(1, &[p0, p1], tx).unwrap();
    let rep =
        r.sw.prepare_cut_with(p1, Duration::from_secs(10), 0)
            .unwrap();
    let outside = {
        let st = model.lock().unwrap();
        st.queued.len()
    };
    assert!(!rep.bound_hit && rep.probes_read == 0, "{rep:?}");
    assert!(
        outside > 0,
        "the model should have frames queued outside the guest right after the drain"
    );
    r.sw.abort_cut_session().unwrap();

    // With probes, prepare returns once QEMU's queue was empty: every frame
    // of the burst is in the guest's ring or taken.
    burst(&mut r, 1 + BURST);
    let (tx, _t) = mpsc::channel();
    r.sw.begin_cut_session(2, &[p0, p1], tx).unwrap();
    let rep = r.sw.prepare_cut(p1, Duration::from_secs(10)).unwrap();
    {
        let st = model.lock().unwrap();
        let mut inside: Vec<u32> = st.guest.iter().chain(st.ring.iter()).copied().collect();
        inside.sort();
        let want: Vec<u32> = (1..1 + 2 * BURST).collect();
        assert!(
            st.queued.iter().all(|f| f[..6] == PROBE_MAC),
            "only a probe may wait outside the guest"
        );
        assert_eq!(
            inside, want,
            "every frame written before the cut is in the guest"
        );
        assert!(st.probes >= 2);
    }
    assert_eq!(
        (rep.probes_read, rep.unsettled, rep.bound_hit),
        (2, false, false),
        "{rep:?}"
    );
    assert!(rep.settle_us > 0, "{rep:?}");
    let s = r.sw.session_stats().unwrap().unwrap();
    assert_eq!(s.unsettled_cuts, 0);
    assert_eq!(s.forwarded, 0, "probes are not forwarded frames");
    r.sw.abort_cut_session().unwrap();

    // A bound shorter than the guest needs: reported as unsettled.
    burst(&mut r, 1 + 2 * BURST);
    let (tx, _t) = mpsc::channel();
    r.sw.begin_cut_session(3, &[p0, p1], tx).unwrap();
    let rep = r.sw.prepare_cut(p1, Duration::from_millis(5)).unwrap();
    assert!(rep.unsettled && rep.probes_read < 2, "{rep:?}");
    assert_eq!(r.sw.session_stats().unwrap().unwrap().unsettled_cuts, 1);
    r.sw.abort_cut_session().unwrap();

    stop.store(true, Ordering::Relaxed);
    qemu.join().unwrap();
}
