//! Helpers for robustness tests and fuzzing (not needed by normal users).
//!
//! [`exercise_guest_bytes`] runs a program of guest bytes and switch
//! operations through the framing decoder and the core (MAC learning,
//! forwarding, DHCP, queues, the cut-session rules of the
//! [mediator](crate::mediator)), as the event loop does without its
//! sockets, and checks the invariants. [`sample_program`] is a program that
//! reaches every rule. The `guest_frames` fuzz target (`crates/switch/fuzz`)
//! and the unit tests in `src/testing_tests.rs` run them.

use std::net::Ipv4Addr;

use crate::core::MIN_FRAME_LEN;
use crate::framing::{self, Decoder, HEADER_LEN, MAX_FRAME_LEN};
use crate::{DhcpConfig, DhcpLease, MacAddr, PortId, QueuedFrame, SwitchCore};

/// Ports of the switch [`exercise_guest_bytes`] drives.
pub const PORTS: usize = 3;
/// Their tx queue bound: small, so that queues fill and drop.
pub const MAX_QUEUE_BYTES: usize = 8 << 10;
/// The cut session's log bound: small, so that the log overflows.
pub const MAX_LOG_BYTES: usize = 4 << 10;

/// The MAC of port `i`'s VM (leased, as `vmcsnap_spec::addressing` gives).
fn vm_mac(i: usize) -> MacAddr {
    MacAddr([0x52, 0x54, 0x00, 0x77, 0x00, 2 + i as u8])
}

/// Operations of a program, `op & 0x0f`; the port is `(op >> 4) % PORTS`.
pub mod op {
    /// `[op, n, n bytes]`: the port's guest wrote these stream bytes.
    pub const RAW: u8 = 0;
    /// `[op, dst, n, n bytes]`: the guest wrote one well-formed record, an
    /// Ethernet frame from its MAC to `dst % 4` (0-2: a VM's MAC, 3:
    /// broadcast), EtherType 0x0800, with the `n` bytes as payload.
    pub const FRAME: u8 = 1;
    /// `[op, n]`: as `FRAME` with `n * 256` payload bytes of zeros (large
    /// frames without long inputs).
    pub const BIG_FRAME: u8 = 2;
    /// Begin a cut session over every port (if none is active).
    pub const BEGIN: u8 = 3;
    /// `prepare_cut` the port.
    pub const PREPARE: u8 = 4;
    /// `cut` the port; a frame is half read (`partial_pending`) if the
    /// op's top bit is set and the port's decoder holds part of a record.
    pub const CUT: u8 = 5;
    /// `release` the port.
    pub const RELEASE: u8 = 6;
    /// `hold` the port.
    pub const HOLD: u8 = 7;
    /// Write out the port's queue; `[op, k]`: put the last `k % 4` frames
    /// back (a short write).
    pub const FLUSH: u8 = 8;
    /// End the cut session and check its log.
    pub const END: u8 = 9;
    /// Abort the cut session.
    pub const ABORT: u8 = 10;
    /// The port's connection closes and a new one opens (a fresh stream).
    pub const RECONNECT: u8 = 11;
    /// The port's connection closes and stays closed until `RECONNECT`.
    pub const DISCONNECT: u8 = 12;
    /// The clock advances 1 ms; triggers are taken.
    pub const TICK: u8 = 13;
}

/// What [`exercise_guest_bytes`] saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GuestRun {
    /// Complete frames the decoders returned.
    pub frames: u64,
    /// Protocol errors (bad length prefixes).
    pub protocol_errors: u64,
    /// Frames logged as channel state by the sessions that ended.
    pub logged: u64,
    /// Frames written out to ports.
    pub delivered: u64,
}

/// The unread rest of a program.
struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }

    fn take(&mut self, n: usize) -> &'a [u8] {
        let (a, b) = self.0.split_at(n.min(self.0.len()));
        self.0 = b;
        a
    }
}

struct Link {
    decoder: Decoder,
    connected: bool,
    /// Stream bytes fed since the connection opened.
    fed: Vec<u8>,
    /// The frames returned since then, encoded again.
    returned: Vec<u8>,
}

impl Link {
    fn new() -> Self {
        Link {
            decoder: Decoder::new(),
            connected: true,
            fed: Vec::new(),
            returned: Vec::new(),
        }
    }
}

/// Runs `program` (see [`op`]) on a switch of [`PORTS`] connected ports,
/// DHCP on with a lease per port, and checks after every step: the decoder
/// returns exactly the records fed (re-encoded frames plus its pending
/// input give back the stream) and buffers less than one record; no queue
/// holds more than [`MAX_QUEUE_BYTES`]; no post frame ever reaches a pre
/// port (`violations` 0); an ended session's log holds frames of session
/// ports within [`MAX_LOG_BYTES`]. Panics on a violation, which is a bug;
/// never on bytes it rejects.
pub fn exercise_guest_bytes(program: &[u8]) -> GuestRun {
    let mut run = GuestRun::default();
    let mut core = SwitchCore::new(MAX_QUEUE_BYTES);
    if let Err(e) = core.set_dhcp(Some(DhcpConfig::default())) {
        panic!("the default DHCP config is valid: {e}");
    }
    let ports: Vec<PortId> = (0..PORTS)
        .map(|i| {
            let id = core.add_port(format!("vm{i}"));
            core.client_connected(id);
            let lease = DhcpLease {
                mac: vm_mac(i),
                ip: Ipv4Addr::new(10, 77, 0, 2 + i as u8),
                hostname: format!("vm{i}"),
            };
            if let Err(e) = core.set_dhcp_lease(id, lease) {
                panic!("the lease is valid: {e}");
            }
            id
        })
        .collect();
    let mut links: Vec<Link> = (0..PORTS).map(|_| Link::new()).collect();
    let mut now = 1_700_000_000_000_000u64;
    let mut epoch = 0;
    let mut input = Input(program);
    while let Some(code) = input.byte() {
        let i = usize::from(code >> 4) % PORTS;
        let port = ports[i];
        match code & 0x0f {
            op::RAW | op::FRAME | op::BIG_FRAME => {
                let bytes = match code & 0x0f {
                    op::RAW => {
                        let n = input.byte().map_or(0, usize::from);
                        input.take(n).to_vec()
                    }
                    kind => {
                        let dst = input.byte().map_or(3, |d| usize::from(d) % 4);
                        let payload = if kind == op::FRAME {
                            let n = input.byte().map_or(0, usize::from);
                            input.take(n).to_vec()
                        } else {
                            vec![0; input.byte().map_or(0, usize::from) * 256]
                        };
                        let mut frame = if dst == 3 {
                            MacAddr::BROADCAST.0.to_vec()
                        } else {
                            vm_mac(dst).0.to_vec()
                        };
                        frame.extend_from_slice(&vm_mac(i).0);
                        frame.extend_from_slice(&[0x08, 0x00]);
                        frame.extend_from_slice(&payload);
                        let mut wire = Vec::new();
                        if framing::encode(&frame, &mut wire).is_err() {
                            continue;
                        }
                        wire
                    }
                };
                if !links[i].connected {
                    continue;
                }
                core.set_now(now);
                if read(&mut core, port, &mut links[i], &bytes, &mut run) {
                    core.record_protocol_error(port);
                    core.client_disconnected(port);
                    links[i] = Link::new();
                    core.client_connected(port);
                }
            }
            op::BEGIN => {
                if core.session_epoch().is_none() {
                    epoch += 1;
                    if let Err(e) = core.begin_session(epoch, &ports, MAX_LOG_BYTES) {
                        panic!("no session is active: {e}");
                    }
                }
            }
            op::PREPARE => drop(core.prepare_cut(port)),
            op::CUT => drop(core.cut(
                port,
                code & 0x80 != 0 && links[i].decoder.buffered_len() > 0,
            )),
            op::RELEASE => drop(core.release(port)),
            op::HOLD => drop(core.hold(port)),
            op::FLUSH => {
                let back = input.byte().map_or(0, |k| usize::from(k) % 4);
                let mut out: Vec<QueuedFrame> = std::iter::from_fn(|| core.pop_tx(port)).collect();
                let keep = out.len().saturating_sub(back);
                let unwritten = out.split_off(keep);
                for f in &out {
                    assert!(f.len() >= MIN_FRAME_LEN, "a runt was forwarded");
                    core.record_tx(port, f.len());
                    run.delivered += 1;
                }
                core.requeue_front(port, unwritten);
            }
            op::END => {
                if let Ok((log, _released)) = core.end_session() {
                    assert_eq!(log.stats.violations, 0, "a post frame reached a pre port");
                    let bytes: usize = log.frames.iter().map(|f| f.data.len()).sum();
                    assert!(bytes <= MAX_LOG_BYTES, "the log holds {bytes} bytes");
                    for f in &log.frames {
                        assert!(f.sender_port != f.receiver_port);
                        assert!(f.data.len() >= MIN_FRAME_LEN);
                    }
                    run.logged += log.frames.len() as u64;
                }
            }
            op::ABORT => {
                if let Ok((stats, _released)) = core.abort_session() {
                    assert_eq!(stats.violations, 0, "a post frame reached a pre port");
                }
            }
            op::RECONNECT => {
                core.client_disconnected(port);
                links[i] = Link::new();
                core.client_connected(port);
            }
            op::DISCONNECT => {
                core.client_disconnected(port);
                links[i].connected = false;
            }
            _ => {
                now += 1_000;
                core.set_now(now);
                let _ = core.take_triggers();
            }
        }
        for &p in &ports {
            if let Some(v) = core.port(p) {
                assert!(
                    v.queued_bytes <= MAX_QUEUE_BYTES,
                    "{p}: queue over its bound"
                );
            }
        }
        if let Some(stats) = core.session_stats() {
            assert_eq!(stats.violations, 0, "a post frame reached a pre port");
        }
    }
    run
}

/// Feeds `bytes` to the link's decoder and switches every complete frame.
/// Returns true on a protocol error (the connection is then closed).
fn read(
    core: &mut SwitchCore,
    port: PortId,
    link: &mut Link,
    bytes: &[u8],
    run: &mut GuestRun,
) -> bool {
    link.decoder.feed(bytes);
    link.fed.extend_from_slice(bytes);
    loop {
        match link.decoder.next_frame() {
            Ok(Some(frame)) => {
                run.frames += 1;
                if let Err(e) = framing::encode(frame, &mut link.returned) {
                    panic!("a decoded frame does not encode: {e}");
                }
                let _ = core.receive(port, frame);
            }
            Ok(None) => break,
            Err(_) => {
                run.protocol_errors += 1;
                return true;
            }
        }
    }
    let pending = link.decoder.pending_input();
    assert!(
        pending.len() < HEADER_LEN + MAX_FRAME_LEN,
        "the decoder buffers more than a record"
    );
    assert_eq!(link.fed.len(), link.returned.len() + pending.len());
    assert!(
        link.fed.starts_with(&link.returned) && link.fed.ends_with(pending),
        "the decoder's frames are not the records fed"
    );
    false
}

/// A program that reaches every rule: frames between the VMs (unicast,
/// broadcast, large), a cut session that holds, cuts, logs and
/// triggers, short writes, a bad length prefix and a reconnect.
pub fn sample_program() -> Vec<u8> {
    let p = |port: u8, code: u8| (port << 4) | code;
    let mut v = Vec::new();
    for port in 0..3u8 {
        v.extend([p(port, op::FRAME), 3, 4, 1, 2, 3, 4]);
    }
    v.extend([p(0, op::FRAME), 1, 46]);
    v.extend([0u8; 46]);
    v.extend([p(1, op::BIG_FRAME), 0, 6]);
    v.extend([p(2, op::FLUSH), 1, p(1, op::FLUSH), 0, p(0, op::FLUSH), 0]);
    v.extend([
        p(0, op::BEGIN),
        p(0, op::PREPARE),
        p(0, op::CUT),
        p(0, op::TICK),
    ]);
    v.extend([p(1, op::FRAME), 0, 2, 9, 9, p(0, op::FRAME), 1, 2, 7, 7]);
    v.extend([p(0, op::RELEASE), p(0, op::FLUSH), 0, p(1, op::FLUSH), 2]);
    v.extend([
        p(1, op::PREPARE),
        p(1, op::CUT),
        p(1, op::RELEASE),
        p(1, op::FLUSH),
        0,
    ]);
    v.extend([
        p(2, op::HOLD),
        p(2, op::CUT),
        p(2, op::FLUSH),
        0,
        p(2, op::RELEASE),
    ]);
    v.extend([p(2, op::FLUSH), 0, p(0, op::FLUSH), 0, p(0, op::END)]);
    // A raw record split across two reads, then a zero length.
    v.extend([p(1, op::RAW), 6, 0, 0, 0, 14, 0xff, 0xff]);
    v.extend([
        p(1, op::RAW),
        12,
        0xff,
        0xff,
        0xff,
        0xff,
        0x52,
        0x54,
        0,
        0x77,
        0,
        3,
        8,
        6,
    ]);
    v.extend([
        p(1, op::RAW),
        4,
        0,
        0,
        0,
        0,
        p(1, op::RECONNECT),
        p(2, op::DISCONNECT),
    ]);
    v.extend([
        p(0, op::BEGIN),
        p(0, op::FRAME),
        2,
        0,
        p(0, op::ABORT),
        p(2, op::RECONNECT),
    ]);
    v
}
