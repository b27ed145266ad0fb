//! Unit tests of the cut-session rules (see [`crate::mediator`]) in the core.

use super::*;
use crate::error::SwitchError;
use crate::mediator::{Color, LogReason, LoggedFrame, SessionPort, SessionStats};

const MAX_LOG: usize = 1 << 20;
const BCAST: [u8; 6] = [0xff; 6];

fn mac(n: usize) -> [u8; 6] {
    [0x52, 0x54, 0x00, 0x00, 0x00, n as u8]
}

/// A 60-byte frame whose byte 14 is `id`.
fn frame(dst: [u8; 6], src: [u8; 6], id: u8) -> Vec<u8> {
    let mut f = dst.to_vec();
    f.extend_from_slice(&src);
    f.extend_from_slice(&[0x08, 0x00, id]);
    f.resize(60, 0);
    f
}

/// Core with `n` connected ports; mac(i) is learned on port i and every
/// queue is empty.
fn setup(n: usize) -> (SwitchCore, Vec<PortId>) {
    let mut c = SwitchCore::new(1 << 20);
    let p: Vec<PortId> = (0..n)
        .map(|i| {
            let id = c.add_port(format!("vm{i}"));
            c.client_connected(id);
            id
        })
        .collect();
    for (i, &id) in p.iter().enumerate() {
        c.receive(id, &frame(BCAST, mac(i), 0));
    }
    for &id in &p {
        drain(&mut c, id);
    }
    (c, p)
}

/// `from` (port index) sends frame `id` to `to` (port index).
fn send(c: &mut SwitchCore, p: &[PortId], from: usize, to: usize, id: u8) {
    c.receive(p[from], &frame(mac(to), mac(from), id));
}

/// Ids (byte 14) of the frames popped from `port` until none is left.
fn drain(c: &mut SwitchCore, port: PortId) -> Vec<u8> {
    std::iter::from_fn(|| c.pop_tx(port))
        .map(|f| f[14])
        .collect()
}

fn begin(c: &mut SwitchCore, ports: &[PortId]) {
    c.begin_session(42, ports, MAX_LOG).unwrap();
}

/// The whole cut of a port: prepare, cut, release.
fn cut_and_release(c: &mut SwitchCore, port: PortId) {
    c.prepare_cut(port).unwrap();
    c.cut(port, false).unwrap();
    c.release(port);
}

fn stats(c: &SwitchCore) -> SessionStats {
    c.session_stats().expect("a session is active")
}

fn sport(s: &SessionStats, port: PortId) -> &SessionPort {
    s.ports
        .iter()
        .find(|x| x.port == port)
        .expect("session port")
}

fn ids_and_reasons(frames: &[LoggedFrame]) -> Vec<(u8, LogReason)> {
    frames.iter().map(|f| (f.data[14], f.reason)).collect()
}

#[test]
fn post_frame_auto_holds_pre_port_and_triggers_once() {
    let (mut c, p) = setup(3);
    begin(&mut c, &p);
    send(&mut c, &p, 1, 2, 1); // pre -> pre, not handed over yet
    cut_and_release(&mut c, p[0]);
    assert!(c.take_triggers().is_empty());

    send(&mut c, &p, 0, 2, 2); // post -> pre
    assert!(c.port(p[2]).unwrap().holding, "auto hold");
    assert_eq!(c.pop_tx(p[2]), None, "earlier frames wait too");
    assert_eq!(c.take_triggers(), vec![p[2]]);
    send(&mut c, &p, 0, 2, 3);
    assert!(c.take_triggers().is_empty(), "one trigger per session");
    let s = stats(&c);
    assert_eq!((s.triggers, s.violations), (1, 0));
    assert!(sport(&s, p[2]).auto_held && sport(&s, p[2]).triggered);
    assert!(!sport(&s, p[1]).auto_held);

    // Releasing it before its cut would hand it post frames.
    assert!(c.release_blocked(p[2]));
    c.release(p[2]);
    assert_eq!(c.pop_tx(p[2]), None, "still held");

    cut_and_release(&mut c, p[2]);
    assert_eq!(drain(&mut c, p[2]), vec![1, 2, 3], "order kept");
    let s = stats(&c);
    assert_eq!((s.logged, s.violations, s.triggers), (1, 0, 1));
    let log = c.end_session().unwrap().0;
    assert_eq!(
        ids_and_reasons(&log.frames),
        vec![(1, LogReason::HeldAtCut)]
    );
    assert_eq!(
        (
            log.frames[0].sender.as_str(),
            log.frames[0].receiver.as_str()
        ),
        ("vm1", "vm2")
    );
}

#[test]
fn pre_frames_to_post_port_are_logged_at_pop_with_reason() {
    let (mut c, p) = setup(2);
    begin(&mut c, &p);
    c.set_now(10);
    send(&mut c, &p, 1, 0, 1); // queued before the prepare
    c.prepare_cut(p[0]).unwrap();
    send(&mut c, &p, 1, 0, 2); // held before the cut
    c.set_now(1000);
    c.cut(p[0], false).unwrap();
    send(&mut c, &p, 1, 0, 3); // after the cut
    let s = stats(&c);
    assert_eq!(
        (s.logged, s.pending_pre_frames),
        (0, 3),
        "nothing logged before pop"
    );
    assert_eq!(sport(&s, p[0]).color, Color::Post);
    assert_eq!(sport(&s, p[0]).cut_unix_us, Some(1000));
    assert_eq!(sport(&s, p[1]).color, Color::Pre);

    c.release(p[0]);
    c.set_now(2000);
    assert_eq!(c.pop_tx(p[0]).unwrap()[14], 1);
    assert_eq!(stats(&c).logged, 1);
    assert_eq!(drain(&mut c, p[0]), vec![2, 3]);
    let s = stats(&c);
    assert_eq!(
        (s.logged, s.logged_bytes, s.pending_pre_frames),
        (3, 180, 0)
    );
    assert_eq!(c.port(p[0]).unwrap().counters.logged, 3);
    assert_eq!(
        (c.totals().logged, c.port(p[1]).unwrap().counters.logged),
        (3, 0)
    );

    let (log, _) = c.end_session().unwrap();
    assert_eq!(
        ids_and_reasons(&log.frames),
        vec![
            (1, LogReason::HeldAtCut),
            (2, LogReason::HeldAtCut),
            (3, LogReason::InFlight)
        ]
    );
    let f = &log.frames[0];
    assert_eq!((f.sender_port, f.receiver_port), (p[1], p[0]));
    assert_eq!((f.received_unix_us, f.delivered_unix_us), (10, 2000));
    assert_eq!(f.data, frame(mac(0), mac(1), 1));
    assert_eq!(log.stats.unlogged_at_end, 0);
}

#[test]
fn violations_stay_zero_in_normal_sequences_and_count_when_forced() {
    let (mut c, p) = setup(3);
    begin(&mut c, &p);
    // Everyone talks to everyone, with broadcasts, while the ports are cut
    // one by one; queues are drained at varying points.
    let mut id = 0u8;
    for round in 0..6 {
        for from in 0..3 {
            for to in (0..3).filter(|&t| t != from) {
                id = id.wrapping_add(1);
                send(&mut c, &p, from, to, id);
            }
            c.receive(p[from], &frame(BCAST, mac(from), id));
        }
        if round % 2 == 1 {
            cut_and_release(&mut c, p[round / 2]);
        }
        for &q in &p[..round % 3 + 1] {
            drain(&mut c, q);
        }
    }
    for &q in &p {
        drain(&mut c, q);
    }
    let s = stats(&c);
    assert_eq!((s.violations, s.dropped, s.pending_pre_frames), (0, 0, 0));
    assert!(s.logged > 0 && s.triggers > 0, "{s:?}");
    c.end_session().unwrap();

    // Forced: a pre port auto-held for a post frame is released behind the
    // session's back.
    begin(&mut c, &p);
    cut_and_release(&mut c, p[0]);
    send(&mut c, &p, 0, 1, 99);
    c.force_release(p[1]);
    assert_eq!(c.pop_tx(p[1]).unwrap()[14], 99);
    assert_eq!(stats(&c).violations, 1);
}

#[test]
fn flood_copies_are_mediated_per_receiver() {
    let (mut c, p) = setup(3);
    begin(&mut c, &p);
    cut_and_release(&mut c, p[0]);
    c.receive(p[1], &frame(BCAST, mac(1), 1)); // pre flood: p0 post, p2 pre
    let a = c.pop_tx(p[0]).unwrap();
    let b = c.pop_tx(p[2]).unwrap();
    assert!(
        Arc::ptr_eq(&a.data, &b.data),
        "flood copies share the frame"
    );
    assert!(a.tag.is_logged() && !b.tag.is_logged());
    assert_eq!(a.tag.sender(), Some(p[1]));

    c.receive(p[0], &frame(BCAST, mac(0), 2)); // post flood: both pre ports held
    let mut t = c.take_triggers();
    t.sort();
    assert_eq!(t, vec![p[1], p[2]]);
    assert_eq!((c.pop_tx(p[1]), c.pop_tx(p[2])), (None, None));
    let s = stats(&c);
    assert_eq!((s.logged, s.triggers, s.violations), (1, 2, 0));
}

#[test]
fn pairs_count_unicast_and_flood_copies() {
    let (mut c, p) = setup(4);
    begin(&mut c, &p[..3]);
    send(&mut c, &p, 0, 1, 1);
    send(&mut c, &p, 0, 1, 2);
    c.receive(p[0], &frame(BCAST, mac(0), 3)); // to 1, 2 and 3 (outside)
    send(&mut c, &p, 2, 0, 4);
    c.receive(p[0], &frame(mac(0), mac(0), 5)); // filtered: no pair
    let pairs: Vec<(String, String, u64, u64)> = stats(&c)
        .pairs
        .into_iter()
        .map(|x| (x.from, x.to, x.frames, x.bytes))
        .collect();
    let pair = |f: &str, t: &str, n: u64| (f.to_owned(), t.to_owned(), n, n * 60);
    assert_eq!(
        pairs,
        vec![
            pair("vm0", "vm1", 3),
            pair("vm0", "vm2", 1),
            pair("vm0", "vm3", 1),
            pair("vm2", "vm0", 1)
        ]
    );
}

#[test]
fn end_releases_session_holds_and_reports_unlogged() {
    let (mut c, p) = setup(4);
    c.hold(p[3]); // a hold of someone else, on a port outside the session
    begin(&mut c, &p[..3]);
    c.prepare_cut(p[0]).unwrap();
    c.cut(p[0], false).unwrap(); // not released
    c.prepare_cut(p[1]).unwrap(); // prepared only
    send(&mut c, &p, 0, 2, 1); // auto hold on p2
    send(&mut c, &p, 2, 0, 2); // pre frame waiting for post p0
    assert!((0..3).all(|i| c.port(p[i]).unwrap().holding));
    assert!(sport(&stats(&c), p[1]).session_hold);

    let (log, released) = c.end_session().unwrap();
    assert_eq!(released, p[..3].to_vec());
    assert_eq!((log.stats.unlogged_at_end, log.stats.logged), (1, 0));
    assert!(log.frames.is_empty());
    assert!(c.session_stats().is_none());
    assert!((0..3).all(|i| !c.port(p[i]).unwrap().holding));
    assert!(c.port(p[3]).unwrap().holding, "not the session's hold");
    assert_eq!(drain(&mut c, p[0]), vec![2]);
    assert_eq!(c.port(p[0]).unwrap().counters.logged, 0);
    // No session: nothing is held any more for post frames.
    send(&mut c, &p, 0, 1, 3);
    assert_eq!(drain(&mut c, p[1]), vec![3]);
    assert!(c.take_triggers().is_empty());
}

#[test]
fn abort_discards_the_log_and_drops_nothing() {
    let (mut c, p) = setup(3);
    begin(&mut c, &p);
    cut_and_release(&mut c, p[0]);
    send(&mut c, &p, 1, 0, 1);
    assert_eq!(drain(&mut c, p[0]), vec![1]);
    send(&mut c, &p, 0, 1, 2); // auto hold
    send(&mut c, &p, 2, 1, 3);
    c.prepare_cut(p[2]).unwrap();
    send(&mut c, &p, 1, 2, 4);
    let s = c.abort_session().unwrap().0;
    assert_eq!((s.logged, s.dropped, s.triggers), (1, 0, 1));
    assert!(c.session_stats().is_none());
    assert_eq!(drain(&mut c, p[1]), vec![2, 3]);
    assert_eq!(drain(&mut c, p[2]), vec![4]);
    assert_eq!(c.totals().drops, 0);
    assert!(matches!(c.end_session(), Err(SwitchError::NoCutSession)));
}

#[test]
fn ports_outside_the_session_never_trigger_nor_log() {
    let (mut c, p) = setup(3);
    begin(&mut c, &p[..2]); // p2 is outside
    cut_and_release(&mut c, p[0]);
    send(&mut c, &p, 0, 2, 1); // post -> outside
    assert!(!c.port(p[2]).unwrap().holding);
    assert_eq!(drain(&mut c, p[2]), vec![1]);
    send(&mut c, &p, 2, 0, 2); // outside -> post
    assert_eq!(drain(&mut c, p[0]), vec![2]);
    send(&mut c, &p, 2, 1, 3); // outside -> pre
    assert_eq!(drain(&mut c, p[1]), vec![3]);
    c.enqueue(p[0], Arc::from(frame(mac(0), mac(9), 4))); // injected
    assert_eq!(drain(&mut c, p[0]), vec![4]);
    let s = stats(&c);
    assert_eq!((s.logged, s.triggers, s.violations), (0, 0, 0));
    assert!(c.take_triggers().is_empty());
    assert_eq!(
        s.ports.iter().map(|x| x.port).collect::<Vec<_>>(),
        p[..2].to_vec()
    );
    assert!(matches!(
        c.prepare_cut(p[2]),
        Err(SwitchError::NotInCutSession { .. })
    ));
}

#[test]
fn log_bound_overflow_still_delivers() {
    let (mut c, p) = setup(2);
    c.begin_session(1, &p, 150).unwrap();
    cut_and_release(&mut c, p[0]);
    for id in 1..=3 {
        send(&mut c, &p, 1, 0, id);
    }
    assert_eq!(drain(&mut c, p[0]), vec![1, 2, 3]);
    let s = stats(&c);
    assert_eq!((s.logged, s.logged_bytes, s.log_overflow), (2, 120, 1));
    assert_eq!(c.port(p[0]).unwrap().counters.logged, 2);
    let (log, _) = c.end_session().unwrap();
    assert_eq!(log.frames.len(), 2);
    assert_eq!(log.stats.log_overflow, 1);
}

#[test]
fn partial_frame_at_cut_stays_pre() {
    let (mut c, p) = setup(3);
    begin(&mut c, &p);
    cut_and_release(&mut c, p[2]);
    c.prepare_cut(p[1]).unwrap();
    c.cut(p[1], true).unwrap(); // half a frame was in its socket
    c.release(p[1]);
    let s = stats(&c);
    assert_eq!(
        sport(&s, p[1]).color,
        Color::Post,
        "post as a receiver at once"
    );
    assert!(sport(&s, p[1]).partial_pending);

    send(&mut c, &p, 1, 2, 1); // the completed frame: pre
    assert!(!sport(&stats(&c), p[1]).partial_pending);
    send(&mut c, &p, 1, 2, 2); // post
    assert_eq!(drain(&mut c, p[2]), vec![1, 2]);
    assert_eq!(stats(&c).logged, 1);
    send(&mut c, &p, 1, 0, 3); // post -> pre p0
    assert_eq!(c.take_triggers(), vec![p[0]]);
    let (log, _) = c.end_session().unwrap();
    assert_eq!(ids_and_reasons(&log.frames), vec![(1, LogReason::InFlight)]);

    // A frame that never completes (the client went away) settles too.
    begin(&mut c, &p);
    cut_and_release(&mut c, p[2]);
    c.cut(p[0], true).unwrap();
    c.client_disconnected(p[0]);
    c.client_connected(p[0]);
    assert!(!sport(&stats(&c), p[0]).partial_pending);
    send(&mut c, &p, 0, 1, 4); // post -> pre p1
    assert_eq!(c.take_triggers(), vec![p[1]]);
}

#[test]
fn frames_taken_back_leave_the_log() {
    let (mut c, p) = setup(2);
    begin(&mut c, &p);
    cut_and_release(&mut c, p[0]);
    for id in 1..=3 {
        send(&mut c, &p, 1, 0, id);
    }
    let taken: Vec<QueuedFrame> = (0..2).map(|_| c.pop_tx(p[0]).unwrap()).collect();
    assert_eq!((stats(&c).logged, c.totals().logged), (2, 2));
    c.requeue_front(p[0], taken); // e.g. a hold took back the write batch
    let s = stats(&c);
    assert_eq!((s.logged, s.logged_bytes, s.pending_pre_frames), (0, 0, 3));
    assert_eq!(c.port(p[0]).unwrap().counters.logged, 0);
    assert_eq!(drain(&mut c, p[0]), vec![1, 2, 3]);
    let (log, _) = c.end_session().unwrap();
    assert_eq!(
        ids_and_reasons(&log.frames),
        vec![
            (1, LogReason::InFlight),
            (2, LogReason::InFlight),
            (3, LogReason::InFlight)
        ]
    );
    assert_eq!(c.totals().logged, 3);
}

#[test]
fn frames_from_before_the_session_count_as_pre() {
    let (mut c, p) = setup(2);
    c.hold(p[0]); // someone else's hold
    begin(&mut c, &p);
    cut_and_release(&mut c, p[1]);
    send(&mut c, &p, 1, 0, 1); // post frame, held anyway
    assert_eq!(c.take_triggers(), vec![p[0]]);
    c.abort_session().unwrap();
    assert!(
        c.port(p[0]).unwrap().holding,
        "the session did not make that hold"
    );

    // In a new session, the frame of the aborted one was sent before any cut.
    begin(&mut c, &p);
    send(&mut c, &p, 1, 0, 2);
    cut_and_release(&mut c, p[0]);
    assert_eq!(stats(&c).pending_pre_frames, 2);
    assert_eq!(drain(&mut c, p[0]), vec![1, 2]);
    let (log, _) = c.end_session().unwrap();
    assert_eq!(
        ids_and_reasons(&log.frames),
        vec![(1, LogReason::HeldAtCut), (2, LogReason::HeldAtCut)]
    );
    assert_eq!(log.stats.violations, 0);
}

#[test]
fn session_errors() {
    let (mut c, p) = setup(3);
    assert!(matches!(
        c.prepare_cut(p[0]),
        Err(SwitchError::NoCutSession)
    ));
    assert!(matches!(c.abort_session(), Err(SwitchError::NoCutSession)));
    let ghost = PortId::from_raw(77);
    assert!(matches!(
        c.begin_session(1, &[p[0], ghost], MAX_LOG),
        Err(SwitchError::UnknownPort(id)) if id == ghost
    ));
    assert!(
        c.session_stats().is_none(),
        "a failed begin leaves no session"
    );
    begin(&mut c, &p[..2]);
    let again = c.begin_session(2, &p, MAX_LOG).unwrap_err();
    assert!(matches!(again, SwitchError::CutSessionActive { epoch: 42 }));
    assert!(again.to_string().contains("abort"), "{again}");
    assert!(matches!(
        c.cut(p[2], false),
        Err(SwitchError::NotInCutSession { .. })
    ));
    c.cut(p[0], false).unwrap(); // without prepare: allowed
    assert!(matches!(
        c.cut(p[0], false),
        Err(SwitchError::AlreadyCut { .. })
    ));
    assert!(matches!(
        c.prepare_cut(p[0]),
        Err(SwitchError::AlreadyCut { .. })
    ));
    assert_eq!(stats(&c).epoch, 42);
}

#[test]
fn counters_without_logged_still_parse() {
    let json = r#"{"rx_frames":1,"rx_bytes":2,"tx_frames":3,"tx_bytes":4,"drops":5,
        "held":6,"protocol_errors":7,"connections":8}"#;
    let c: Counters = serde_json::from_str(json).unwrap();
    assert_eq!((c.connections, c.logged), (8, 0));
}
