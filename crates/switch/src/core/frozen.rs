//! Taking the core's whole state out and building a core from it again, for
//! handing a running switch over to a new process (see [`crate::handover`]).

use super::*;

/// One port of a [`CoreImage`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PortImage {
    pub(crate) id: PortId,
    pub(crate) name: String,
    pub(crate) connected: bool,
    pub(crate) holding: bool,
    /// The tx queue, head first.
    pub(crate) queue: Vec<Arc<[u8]>>,
    pub(crate) counters: Counters,
}

/// Everything a [`SwitchCore`] holds except its tunables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CoreImage {
    /// Id the next added port gets.
    pub(crate) next_id: u32,
    /// Ports by increasing id.
    pub(crate) ports: Vec<PortImage>,
    /// The MAC table, by increasing address.
    pub(crate) macs: Vec<(MacAddr, PortId)>,
    pub(crate) totals: Counters,
}

impl SwitchCore {
    /// A copy of the whole state (queued frames are shared, not copied).
    /// Frame tags and a cut session are not part of it.
    pub(crate) fn export(&self) -> CoreImage {
        let ports = self
            .ports
            .iter()
            .map(|(&id, p)| PortImage {
                id,
                name: p.name.clone(),
                connected: p.connected,
                holding: p.holding,
                queue: p.queue.iter().map(|f| f.data.clone()).collect(),
                counters: p.counters,
            })
            .collect();
        let mut macs: Vec<(MacAddr, PortId)> = self.macs.iter().map(|(&m, &p)| (m, p)).collect();
        macs.sort_unstable();
        CoreImage {
            next_id: self.next_id,
            ports,
            macs,
            totals: self.totals,
        }
    }

    /// A core with the given state and tunables. Restored queues are kept
    /// even beyond `max_queue_bytes` (they were within the old bound); the
    /// bound applies to frames queued from now on. MAC entries for ports not
    /// in the image are skipped; a queue of a port neither connected nor
    /// held is discarded and counted as drops, as the queue policy requires.
    pub(crate) fn import(image: CoreImage, max_queue_bytes: usize, max_macs: usize) -> Self {
        let mut core = SwitchCore::new(max_queue_bytes);
        core.set_max_macs(max_macs);
        core.next_id = image.next_id;
        core.totals = image.totals;
        for p in image.ports {
            let queued_bytes = p.queue.iter().map(|f| f.len()).sum();
            let queue = p
                .queue
                .into_iter()
                .map(|data| {
                    let mut f = QueuedFrame::untagged(data);
                    f.tag.seq = core.next_seq;
                    core.next_seq += 1;
                    f
                })
                .collect();
            let port = Port {
                name: p.name,
                connected: p.connected,
                holding: p.holding,
                queue,
                queued_bytes,
                counters: p.counters,
                // A switch with tunnels refuses to freeze.
                tunnel: false,
            };
            core.next_id = core.next_id.max(p.id.0 + 1);
            core.ports.insert(p.id, port);
        }
        for (mac, port) in image.macs {
            if core.ports.contains_key(&port) {
                core.macs.insert(mac, port);
            }
        }
        let ids: Vec<PortId> = core.ports.keys().copied().collect();
        for id in ids {
            core.discard_if_unreachable(id);
        }
        core
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(dst: [u8; 6], src: [u8; 6], n: u8) -> Vec<u8> {
        let mut f = dst.to_vec();
        f.extend_from_slice(&src);
        f.extend_from_slice(&[0x08, 0x00, n]);
        f
    }

    #[test]
    fn export_import_round_trip_keeps_everything() {
        const A: [u8; 6] = [2, 0, 0, 0, 0, 0xa];
        const B: [u8; 6] = [2, 0, 0, 0, 0, 0xb];
        let mut c = SwitchCore::new(1 << 20);
        let (pa, pb, pc) = (c.add_port("a"), c.add_port("b"), c.add_port("c"));
        for p in [pa, pb, pc] {
            c.client_connected(p);
        }
        c.receive(pb, &frame([0xff; 6], B, 0)); // learn B on pb
        c.hold(pb);
        c.receive(pa, &frame(B, A, 1));
        c.receive(pa, &frame(B, A, 2));
        let image = c.export();
        assert_eq!(image.macs, vec![(MacAddr(A), pa), (MacAddr(B), pb)]);

        let mut d = SwitchCore::import(image.clone(), 1 << 20, 16);
        assert_eq!(d.export(), image);
        assert_eq!(
            d.route(pc, &frame(B, MacAddr::BROADCAST.0, 3)),
            Decision::Unicast(pb)
        );
        assert!(d.pop_tx(pb).is_none(), "still held");
        d.release(pb);
        let got: Vec<u8> = std::iter::from_fn(|| d.pop_tx(pb)).map(|f| f[14]).collect();
        assert_eq!(got, vec![1, 2]);
        assert_eq!(d.add_port("d").as_u32(), 3, "ids are not reused");
    }

    #[test]
    fn import_discards_unreachable_queue() {
        let mut c = SwitchCore::new(1 << 20);
        let p = c.add_port("a");
        c.hold(p);
        c.enqueue(p, Arc::from(vec![0u8; 20]));
        let mut image = c.export();
        image.ports[0].holding = false;
        let d = SwitchCore::import(image, 1 << 20, 16);
        let v = d.port(p).unwrap();
        assert_eq!(
            (v.queued_frames, v.counters.drops, d.totals().drops),
            (0, 1, 1)
        );
    }
}
