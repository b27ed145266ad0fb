//! Unit tests of tunnel ports in the core: colors from the header, the
//! header's color of frames sent into a tunnel, split horizon.

use super::*;
use crate::mediator::{Color, LogReason};

const MAX_LOG: usize = 1 << 20;
const BCAST: [u8; 6] = [0xff; 6];
const EPOCH: u64 = 7;

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

/// Core with local ports vm0, vm1 (mac 0, 1) and a tunnel (remote mac
/// 10 learned on it), all connected and drained; a session over vm0, vm1.
fn setup() -> (SwitchCore, [PortId; 2], PortId) {
    let mut c = SwitchCore::new(1 << 20);
    let vm = [c.add_port("vm0"), c.add_port("vm1")];
    let tun = c.add_tunnel_port("tun");
    for id in [vm[0], vm[1], tun] {
        c.client_connected(id);
    }
    c.receive(vm[0], &frame(BCAST, mac(0), 0));
    c.receive(vm[1], &frame(BCAST, mac(1), 0));
    c.receive_remote(tun, &frame(BCAST, mac(10), 0), None);
    for id in [vm[0], vm[1], tun] {
        while c.pop_tx(id).is_some() {}
    }
    c.begin_session(EPOCH, &vm, MAX_LOG).unwrap();
    (c, vm, tun)
}

/// Each frame popped from `port` with the header's color and epoch.
fn wire(c: &mut SwitchCore, port: PortId) -> Vec<(u8, Option<(Color, u64)>)> {
    let mut out = Vec::new();
    while let Some(f) = c.pop_tx(port) {
        out.push((f[14], c.wire_tag(&f)));
    }
    out
}

fn ids(c: &mut SwitchCore, port: PortId) -> Vec<u8> {
    std::iter::from_fn(|| c.pop_tx(port))
        .map(|f| f[14])
        .collect()
}

#[test]
fn a_post_header_holds_a_pre_port_and_triggers_its_cut() {
    let (mut c, vm, tun) = setup();
    let (d, colored) =
        c.receive_remote(tun, &frame(mac(0), mac(10), 1), Some((Color::Post, EPOCH)));
    assert_eq!(d, Decision::Unicast(vm[0]));
    assert_eq!(colored, RemoteColor::Session(Color::Post));
    assert!(c.port(vm[0]).unwrap().holding);
    assert_eq!(c.take_triggers(), vec![vm[0]]);
    assert!(c.pop_tx(vm[0]).is_none());
    // Once vm0 is cut, it gets the frame; no violation.
    c.prepare_cut(vm[0]).unwrap();
    c.cut(vm[0], false).unwrap();
    c.release(vm[0]);
    assert_eq!(ids(&mut c, vm[0]), vec![1]);
    assert_eq!(c.session_stats().unwrap().violations, 0);
}

#[test]
fn a_pre_header_to_a_post_port_is_logged_with_the_tunnel_as_sender() {
    let (mut c, vm, tun) = setup();
    c.prepare_cut(vm[1]).unwrap();
    c.cut(vm[1], false).unwrap();
    c.release(vm[1]);
    c.receive_remote(tun, &frame(mac(1), mac(10), 2), Some((Color::Pre, EPOCH)));
    // Untagged and post frames are not channel state.
    c.receive_remote(tun, &frame(mac(1), mac(10), 3), None);
    c.receive_remote(tun, &frame(mac(1), mac(10), 4), Some((Color::Post, EPOCH)));
    assert_eq!(ids(&mut c, vm[1]), vec![2, 3, 4]);
    let (log, _) = c.end_session().unwrap();
    assert_eq!(log.frames.len(), 1);
    let f = &log.frames[0];
    assert_eq!((f.data[14], f.reason), (2, LogReason::InFlight));
    assert_eq!((f.sender.as_str(), f.sender_port), ("tun", tun));
    assert_eq!(log.stats.violations, 0);
}

#[test]
fn a_header_of_another_epoch_is_untagged() {
    let (mut c, vm, tun) = setup();
    let (_, colored) = c.receive_remote(
        tun,
        &frame(mac(0), mac(10), 1),
        Some((Color::Post, EPOCH + 1)),
    );
    assert_eq!(colored, RemoteColor::OtherEpoch);
    assert!(!c.port(vm[0]).unwrap().holding, "no hold for another epoch");
    assert!(c.take_triggers().is_empty());
    // And with no session at all.
    c.end_session().unwrap();
    let (_, colored) = c.receive_remote(tun, &frame(mac(0), mac(10), 2), Some((Color::Pre, EPOCH)));
    assert_eq!(colored, RemoteColor::OtherEpoch);
    assert_eq!(wire(&mut c, vm[0]), vec![(1, None), (2, None)]);
}

#[test]
fn frames_into_the_tunnel_carry_their_color_at_reception() {
    let (mut c, vm, tun) = setup();
    // vm1 is cut: its frames are post, vm0's pre.
    c.prepare_cut(vm[1]).unwrap();
    c.cut(vm[1], false).unwrap();
    c.release(vm[1]);
    c.receive(vm[0], &frame(mac(10), mac(0), 1));
    c.receive(vm[1], &frame(mac(10), mac(1), 2));
    // The session ends before the tunnel sends them: the tags stay.
    c.end_session().unwrap();
    c.receive(vm[0], &frame(mac(10), mac(0), 3));
    assert_eq!(
        wire(&mut c, tun),
        vec![
            (1, Some((Color::Pre, EPOCH))),
            (2, Some((Color::Post, EPOCH))),
            (3, None)
        ]
    );
}

#[test]
fn all_post_once_every_port_is_cut_and_no_half_frame_pends() {
    let (mut c, vm, _) = setup();
    assert_eq!(c.session_all_post(), None);
    c.prepare_cut(vm[0]).unwrap();
    c.cut(vm[0], false).unwrap();
    assert_eq!(c.session_all_post(), None);
    c.prepare_cut(vm[1]).unwrap();
    c.cut(vm[1], true).unwrap(); // half a frame pending: still pre
    assert_eq!(c.session_all_post(), None);
    c.receive(vm[1], &frame(BCAST, mac(1), 9));
    assert_eq!(c.session_all_post(), Some(EPOCH));
    c.end_session().unwrap();
    assert_eq!(c.session_all_post(), None);
}

#[test]
fn a_frame_queued_before_the_session_goes_out_pre() {
    let mut c = SwitchCore::new(1 << 20);
    let vm = c.add_port("vm0");
    let tun = c.add_tunnel_port("tun");
    c.client_connected(vm);
    c.client_connected(tun);
    c.receive(vm, &frame(BCAST, mac(0), 1));
    c.begin_session(EPOCH, &[vm], MAX_LOG).unwrap();
    let f = c.pop_tx(tun).unwrap();
    assert_eq!(c.wire_tag(&f), Some((Color::Pre, EPOCH)));
}

#[test]
fn frames_from_a_tunnel_never_go_into_another() {
    let mut c = SwitchCore::new(1 << 20);
    let vm = c.add_port("vm0");
    let (t1, t2) = (c.add_tunnel_port("t1"), c.add_tunnel_port("t2"));
    for id in [vm, t1, t2] {
        c.client_connected(id);
    }
    let (d, _) = c.receive_remote(t1, &frame(BCAST, mac(10), 1), None);
    assert_eq!(d, Decision::Flood(vec![vm]));
    c.receive_remote(t2, &frame(BCAST, mac(20), 2), None);
    // mac 20 is learned on t2; from t1 it is filtered, from vm0 unicast.
    let (d, _) = c.receive_remote(t1, &frame(mac(20), mac(10), 3), None);
    assert_eq!(d, Decision::Filter);
    assert_eq!(
        c.receive(vm, &frame(mac(20), mac(0), 4)),
        Decision::Unicast(t2)
    );
    assert_eq!(
        c.receive(vm, &frame(BCAST, mac(0), 5)),
        Decision::Flood(vec![t1, t2])
    );
    assert!(c.is_tunnel(t1) && !c.is_tunnel(vm));
}
