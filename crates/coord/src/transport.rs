//! How protocol messages travel: the [`Transport`] trait and an in-process
//! network.
//!
//! The protocol state machines never send anything themselves; the drivers
//! hand every outgoing [`Envelope`] to a [`Transport`]. A transport is
//! *unreliable by contract*: it may lose a message (the protocol retransmits),
//! but it must not corrupt one. A [`TransportError`] is treated by the drivers
//! like a lost message (logged; retransmission and deadlines do the rest).
//!
//! [`InProcessNetwork`] connects nodes of one process. Delivery is a
//! synchronous call of the receiver's `deliver` callback in the sender's
//! thread, so the callback must be quick and must not send itself (the usual
//! callback pushes the envelope into an [`std::sync::mpsc`] channel that the
//! receiver's driver reads). [`InProcessNetwork::set_fault`] drops chosen
//! messages, for tests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::NodeId;

/// A message as one line of JSON, ending in `\n` (how both protocols'
/// messages are written between hosts).
pub(crate) fn json_line<M: Serialize>(msg: &M) -> String {
    let mut s = serde_json::to_string(msg).expect("a protocol message always serializes");
    s.push('\n');
    s
}

/// Parses one line written by [`json_line`] (surrounding whitespace,
/// including the newline, is ignored); on error, the line's first 200
/// characters and the JSON error.
pub(crate) fn parse_json_line<M: DeserializeOwned>(
    line: &str,
) -> Result<M, (String, serde_json::Error)> {
    serde_json::from_str(line.trim()).map_err(|e| (line.trim().chars().take(200).collect(), e))
}

/// A message with its sender and receiver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope<M> {
    /// The sending node.
    pub from: NodeId,
    /// The receiving node.
    pub to: NodeId,
    /// The message.
    pub msg: M,
}

/// Why a message could not be handed to the network.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// The receiver never joined the network.
    #[error("unknown node {0:?}: it never joined the network; join it (InProcessNetwork::join) before sending to it, or check the node name")]
    UnknownNode(NodeId),
    /// The sending endpoint's node has left the network.
    #[error(
        "node {0:?} has left the network and cannot send; join it again to get a new endpoint"
    )]
    NotJoined(NodeId),
}

/// Sends messages of type `M` on behalf of one node.
pub trait Transport<M>: Send + Sync {
    /// The node this transport sends for (the `from` of every envelope).
    fn me(&self) -> &NodeId;
    /// Hands `msg` to the network for `to`. `Ok` does not mean delivered:
    /// the network may still lose it.
    fn send(&self, to: &NodeId, msg: M) -> Result<(), TransportError>;
}

/// A protocol's message, named for logs.
pub trait Named {
    /// The message's name, e.g. `"SNAPSHOT"`.
    fn name(&self) -> &'static str;
}

/// Sends every envelope of `out`; a send that fails is logged and treated
/// as a lost message (the protocols' retransmission and deadlines cope).
pub(crate) fn send_all<M: Named>(transport: &dyn Transport<M>, out: Vec<Envelope<M>>) {
    for env in out {
        let name = env.msg.name();
        if let Err(e) = transport.send(&env.to, env.msg) {
            log::warn!("{}: cannot send {name} to {}: {e}", transport.me(), env.to);
        }
    }
}

/// Counters of an [`InProcessNetwork`]: `sent == delivered + dropped`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NetStats {
    /// Messages accepted by `send` (delivered or dropped).
    pub sent: u64,
    /// Messages handed to the receiver's callback.
    pub delivered: u64,
    /// Messages dropped: by the fault function, or to a node that left.
    pub dropped: u64,
}

type Deliver<M> = Arc<dyn Fn(Envelope<M>) + Send + Sync>;
type Fault<M> = Arc<dyn Fn(&Envelope<M>) -> bool + Send + Sync>;

enum Slot<M> {
    Joined(Deliver<M>),
    Left,
}

/// A network of nodes inside one process. Shared through an [`Arc`];
/// every node gets an [`InProcessEndpoint`] from [`join`](Self::join).
pub struct InProcessNetwork<M> {
    nodes: Mutex<HashMap<NodeId, Slot<M>>>,
    fault: Mutex<Option<Fault<M>>>,
    sent: AtomicU64,
    delivered: AtomicU64,
    dropped: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking callback cannot leave the maps half-updated; go on.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<M: Send + 'static> InProcessNetwork<M> {
    /// An empty network.
    pub fn new() -> Arc<Self> {
        Arc::new(InProcessNetwork {
            nodes: Mutex::new(HashMap::new()),
            fault: Mutex::new(None),
            sent: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        })
    }

    /// Adds `node` to the network; messages to it are passed to `deliver`
    /// (in the sender's thread). Joining a name again replaces its callback
    /// (like a restarted host), also after [`leave`](Self::leave).
    pub fn join(
        self: &Arc<Self>,
        node: impl Into<NodeId>,
        deliver: impl Fn(Envelope<M>) + Send + Sync + 'static,
    ) -> InProcessEndpoint<M> {
        let node = node.into();
        lock(&self.nodes).insert(node.clone(), Slot::Joined(Arc::new(deliver)));
        InProcessEndpoint {
            net: Arc::clone(self),
            me: node,
        }
    }

    /// Takes `node` off the network, as if its host crashed: later messages
    /// to it are dropped silently (and counted), its endpoint can no longer
    /// send. Unknown names are ignored.
    pub fn leave(&self, node: &str) {
        if let Some(slot) = lock(&self.nodes).get_mut(node) {
            *slot = Slot::Left;
        }
    }

    /// Installs a fault function: it sees every message before delivery and
    /// returns `true` to drop it. Replaces the previous one.
    pub fn set_fault(&self, f: impl Fn(&Envelope<M>) -> bool + Send + Sync + 'static) {
        *lock(&self.fault) = Some(Arc::new(f));
    }

    /// Removes the fault function: every message is delivered again.
    pub fn clear_fault(&self) {
        *lock(&self.fault) = None;
    }

    /// The counters so far.
    pub fn stats(&self) -> NetStats {
        NetStats {
            sent: self.sent.load(Ordering::SeqCst),
            delivered: self.delivered.load(Ordering::SeqCst),
            dropped: self.dropped.load(Ordering::SeqCst),
        }
    }

    fn send_from(&self, from: &NodeId, to: &NodeId, msg: M) -> Result<(), TransportError> {
        let deliver = {
            let nodes = lock(&self.nodes);
            if !matches!(nodes.get(from), Some(Slot::Joined(_))) {
                return Err(TransportError::NotJoined(from.clone()));
            }
            match nodes.get(to) {
                None => return Err(TransportError::UnknownNode(to.clone())),
                Some(Slot::Left) => None,
                Some(Slot::Joined(d)) => Some(Arc::clone(d)),
            }
        };
        self.sent.fetch_add(1, Ordering::SeqCst);
        let env = Envelope {
            from: from.clone(),
            to: to.clone(),
            msg,
        };
        let Some(deliver) = deliver else {
            self.dropped.fetch_add(1, Ordering::SeqCst);
            return Ok(());
        };
        // Clone the fault function out of the lock so that it may itself use
        // the network (e.g. read stats) without deadlocking.
        let fault = lock(&self.fault).clone();
        if fault.is_some_and(|f| f(&env)) {
            self.dropped.fetch_add(1, Ordering::SeqCst);
            return Ok(());
        }
        self.delivered.fetch_add(1, Ordering::SeqCst);
        deliver(env);
        Ok(())
    }
}

/// One node's access to an [`InProcessNetwork`].
pub struct InProcessEndpoint<M> {
    net: Arc<InProcessNetwork<M>>,
    me: NodeId,
}

impl<M> Clone for InProcessEndpoint<M> {
    fn clone(&self) -> Self {
        InProcessEndpoint {
            net: Arc::clone(&self.net),
            me: self.me.clone(),
        }
    }
}

impl<M: Send + 'static> InProcessEndpoint<M> {
    /// The network this endpoint belongs to.
    pub fn network(&self) -> &Arc<InProcessNetwork<M>> {
        &self.net
    }
}

impl<M: Send + 'static> Transport<M> for InProcessEndpoint<M> {
    fn me(&self) -> &NodeId {
        &self.me
    }

    fn send(&self, to: &NodeId, msg: M) -> Result<(), TransportError> {
        self.net.send_from(&self.me, to, msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn delivers_drops_and_counts() {
        let net = InProcessNetwork::<u32>::new();
        let (tx, rx) = mpsc::channel();
        let a = net.join("a", |_| {});
        let _b = net.join("b", move |e| tx.send(e).unwrap());
        a.send(&"b".to_string(), 7).unwrap();
        assert_eq!(
            rx.try_recv().unwrap(),
            Envelope {
                from: "a".into(),
                to: "b".into(),
                msg: 7
            }
        );
        assert_eq!(
            a.send(&"c".to_string(), 1),
            Err(TransportError::UnknownNode("c".into()))
        );
        net.set_fault(|e| e.msg == 2);
        a.send(&"b".to_string(), 2).unwrap();
        a.send(&"b".to_string(), 3).unwrap();
        assert_eq!(rx.try_recv().unwrap().msg, 3);
        net.clear_fault();
        net.leave("b");
        a.send(&"b".to_string(), 4).unwrap();
        assert!(rx.try_recv().is_err());
        assert_eq!(
            net.stats(),
            NetStats {
                sent: 4,
                delivered: 2,
                dropped: 2
            }
        );
        net.leave("a");
        assert_eq!(
            a.send(&"b".to_string(), 5),
            Err(TransportError::NotJoined("a".into()))
        );
        let msg = TransportError::UnknownNode("c".into()).to_string();
        assert!(msg.contains("join it"), "{msg}");
    }

    #[test]
    fn rejoin_replaces_callback() {
        let net = InProcessNetwork::<u32>::new();
        let a = net.join("a", |_| {});
        let (tx1, rx1) = mpsc::channel();
        let (tx2, rx2) = mpsc::channel();
        net.join("b", move |e: Envelope<u32>| tx1.send(e.msg).unwrap());
        net.leave("b");
        net.join("b", move |e: Envelope<u32>| tx2.send(e.msg).unwrap());
        a.send(&"b".to_string(), 9).unwrap();
        assert!(rx1.try_recv().is_err());
        assert_eq!(rx2.try_recv().unwrap(), 9);
    }
}
