//! Freezing the event loop into a [`FrozenSwitch`] and building an event
//! loop from a frozen state (see [`crate::handover`]).

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use super::*;
use crate::core::frozen::{CoreImage, PortImage};
use crate::handover::{
    FrozenConnection, FrozenMac, FrozenPort, FrozenState, FrozenSwitch, PartialFrame,
    FORMAT_VERSION,
};
use crate::server::conn::OutBuf;

impl EventLoop {
    /// Takes every connection and the whole state out of the loop, which is
    /// left without ports (so its shutdown closes nothing). A port that is
    /// dialing at this moment is frozen without a connection and dials
    /// again once thawed.
    pub(super) fn freeze(&mut self) -> FrozenSwitch {
        // The capture files do not cross the exec: write them out.
        if let Some(c) = self.capture.as_mut() {
            c.flush_all();
        }
        // Frames of the current write batch not started yet go back to the
        // head of their queue; only a partly written one stays behind.
        for (&id, io) in self.ports.iter_mut() {
            if let Some(conn) = io.conn.as_mut() {
                let unstarted = conn.out.take_unstarted();
                self.core.requeue_front(id, unstarted);
            }
        }
        let image = self.core.export();
        let registry = self.poll.registry();
        let mut fds = Vec::new();
        let mut ports = Vec::new();
        for p in image.ports {
            let Some(io) = self.ports.remove(&p.id) else {
                continue; // every core port has its I/O state
            };
            let connection = io.conn.map(|mut conn| {
                let _ = registry.deregister(&mut conn.stream);
                let tx_partial = conn
                    .out
                    .partial()
                    .map(|(remainder, frame_len)| PartialFrame {
                        remainder,
                        frame_len,
                    });
                let rx_pending = conn.decoder.pending_input().to_vec();
                let fd = OwnedFd::from(conn.stream);
                let raw = fd.as_raw_fd();
                fds.push(fd);
                FrozenConnection {
                    fd: raw,
                    rx_pending,
                    tx_partial,
                }
            });
            ports.push(FrozenPort {
                id: p.id,
                name: p.name,
                socket_path: io.path,
                holding: p.holding,
                queue: p.queue.iter().map(|f| f.to_vec()).collect(),
                counters: p.counters,
                connection,
            });
        }
        self.dirty.clear();
        self.pending_read.clear();
        let macs = image
            .macs
            .into_iter()
            .map(|(mac, port)| FrozenMac { mac, port })
            .collect();
        let state = FrozenState {
            version: FORMAT_VERSION,
            next_port_id: image.next_id,
            ports,
            macs,
            totals: image.totals,
        };
        log::debug!("switch frozen with {} ports", state.ports.len());
        FrozenSwitch::new(state, fds)
    }

    /// An event loop resuming a frozen switch. `fds` are the connections the
    /// state names, in the order of `FrozenState::expected_fds`, owned and
    /// already non-blocking. Ports frozen without a connection dial at once.
    pub(crate) fn thaw(
        poll: Poll,
        commands: Receiver<Command>,
        config: &SwitchConfig,
        state: FrozenState,
        fds: Vec<OwnedFd>,
    ) -> Result<Self> {
        let mut el = EventLoop::new(poll, commands, config);
        let mut fds = fds.into_iter();
        let mut next_fd = |want: i32| {
            let fd = fds.next().expect("one descriptor per socket of the state");
            debug_assert_eq!(fd.as_raw_fd(), want);
            fd
        };
        let mut images = Vec::new();
        for p in state.ports {
            let addr = peer::address(&p.socket_path)?;
            let conn = p.connection.map(|c| {
                let out = c.tx_partial.map_or_else(OutBuf::default, |t| {
                    OutBuf::resume(t.remainder, t.frame_len)
                });
                Conn::resume(UnixStream::from(next_fd(c.fd)), &c.rx_pending, out)
            });
            images.push(PortImage {
                id: p.id,
                name: p.name,
                connected: conn.is_some(),
                holding: p.holding,
                queue: p.queue.into_iter().map(Arc::from).collect(),
                counters: p.counters,
            });
            el.ports
                .insert(p.id, PortIo::new(p.socket_path, addr, conn));
        }
        let image = CoreImage {
            next_id: state.next_port_id,
            ports: images,
            macs: state.macs.into_iter().map(|m| (m.mac, m.port)).collect(),
            totals: state.totals,
        };
        el.core = SwitchCore::import(image, config.max_queue_bytes, config.max_macs);
        crate::server::dhcp::enable(&mut el.core, config);

        let registry = el.poll.registry();
        for (&id, io) in el.ports.iter_mut() {
            if let Some(conn) = io.conn.as_mut() {
                let interest = Interest::READABLE | Interest::WRITABLE;
                registry
                    .register(&mut conn.stream, conn_token(id), interest)
                    .map_err(SwitchError::Start)?;
                // Data may wait in the socket already: read it on the first
                // iteration whatever the readiness events say.
                el.pending_read.push(id);
            }
            // A remainder or queued frames may be waiting to be written.
            el.dirty.insert(id);
        }
        // Ports without a connection dial on the first iteration (their
        // `next_dial` is now).
        log::debug!("switch thawed with {} ports", el.ports.len());
        Ok(el)
    }
}
