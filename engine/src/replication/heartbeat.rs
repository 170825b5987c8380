//! Learning peers and watching them: a peer named by the membership or by a hello joins the
//! peer table and gets a heartbeat task, which keeps a channel to it, pings it, refreshes its
//! inventory when its generation changes, and marks it up or down.
//!
//! Owns the heartbeat tasks and the checks of a peer's hello (its id, its incarnation). Never:
//! acts on what it finds beyond waking the reconciler (the jobs above read the peer table), or
//! waits on a peer without a deadline.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::frame::{Frame, InventoryEntry, Role};
use super::peers::{Added, PEERS_MAX};
use super::secure::Channel;
use super::shared::Shared;
use crate::error::TransportError;

/// A probe of a peer (ping, and its inventory when that changed) takes at most this long.
const PROBE_DEADLINE: Duration = Duration::from_secs(30);
/// The shortest wait for a pong: a peer that is alive but busy answers within this.
const PONG_WAIT_MIN: Duration = Duration::from_secs(2);
/// Objects a peer's inventory may list (bounds the memory a peer can make this node use).
const PEER_OBJECTS_MAX: usize = 1 << 20;

impl Shared {
    /// Adds a peer at `addr` (if new) and starts its heartbeat.
    pub(crate) fn learn_peer(self: &Arc<Self>, addr: SocketAddr) {
        if addr.to_string() == self.hello.listen {
            return;
        }
        match self.peers.add(addr) {
            Added::New(index) => {
                self.runtime.spawn(heartbeat(Arc::clone(self), index, self.shutdown.clone()));
            }
            Added::Known => {}
            Added::Full => self.event(format!("not adding a peer at {addr}: {PEERS_MAX} peers already")),
        }
    }

    /// Checks a peer's `Hello` on an inbound connection: its incarnation must not be older than
    /// one already seen (a replayed or stale node), its id not this node's. Learns its address.
    pub(crate) fn check_incarnation(
        self: &Arc<Self>,
        node_id: u32,
        epoch: u64,
        listen: &str,
        observed: SocketAddr,
    ) -> std::result::Result<(), String> {
        self.peers.check_incarnation(node_id, epoch)?;
        if let Ok(mut addr) = listen.parse::<SocketAddr>() {
            // A node listening on every interface is reached at the address it came from.
            if addr.ip().is_unspecified() {
                addr.set_ip(observed.ip());
            }
            self.learn_peer(addr);
        }
        Ok(())
    }
}

/// The heartbeat of peer `index`: keeps a channel to it, pings it, refreshes its inventory.
async fn heartbeat(shared: Arc<Shared>, index: usize, mut shutdown: watch::Receiver<bool>) {
    let addr = shared.peers.addr_at(index);
    let mut channel: Option<Channel> = None;
    let mut ticker = tokio::time::interval(shared.config.heartbeat);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut nonce = 0u64;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.changed() => return,
        }
        nonce += 1;
        // The whole probe, inventory pages included, has a deadline: a peer that keeps answering
        // slowly must not stall its heartbeat.
        let probed = tokio::time::timeout(PROBE_DEADLINE, probe(&shared, index, addr, &mut channel, nonce))
            .await
            .unwrap_or(Err(TransportError::Timeout { what: "probing a peer", after: PROBE_DEADLINE }));
        let error = match probed {
            Ok(()) => None,
            Err(e) => {
                channel = None;
                Some(e.to_string())
            }
        };
        if let Some((id, up)) = shared.peers.record_probe(index, error, shared.config.down_after, Instant::now()) {
            let who = id.map_or_else(|| addr.to_string(), |id| format!("node {id} ({addr})"));
            shared.event(format!("{who} is {}", if up { "up" } else { "down" }));
            shared.wake.notify_one();
        }
    }
}

/// One probe: connect if needed, ping, and refetch the inventory when it changed.
async fn probe(
    shared: &Arc<Shared>,
    index: usize,
    addr: SocketAddr,
    channel: &mut Option<Channel>,
    nonce: u64,
) -> std::result::Result<(), TransportError> {
    if channel.is_none() {
        let (fresh, hello) = shared.connect(addr).await?;
        if hello.role != Role::Peer {
            return Err(TransportError::Protocol { detail: format!("{addr} is not a node") });
        }
        if hello.node_id == shared.hello.node_id {
            return Err(TransportError::Protocol { detail: format!("{addr} claims this node's id {}", hello.node_id) });
        }
        shared.peers.adopt_hello(index, addr, hello).map_err(|detail| TransportError::Protocol { detail })?;
        *channel = Some(fresh);
    }
    let channel = channel.as_mut().expect("connected above");
    channel.send(&Frame::Ping(nonce)).await?;
    // A peer silent for `down_after` is down: its pong is waited for that long (at least
    // `PONG_WAIT_MIN`, so that a short setting does not take a busy peer for a dead one), not for
    // the channel's 10 s I/O deadline.
    let pong_wait = shared.config.down_after.max(PONG_WAIT_MIN);
    let generation = match channel.recv_within(pong_wait).await? {
        Frame::Pong { nonce: n, generation } if n == nonce => generation,
        Frame::Reply { code, message, .. } => {
            return Err(TransportError::Protocol { detail: format!("refused: {code}: {message}") });
        }
        other => return Err(TransportError::Protocol { detail: format!("answered a ping with {:?}", other.kind()) }),
    };
    if generation == shared.peers.generation_at(index) {
        return Ok(());
    }
    let mut inventory = HashMap::new();
    let mut after = None;
    loop {
        channel.send(&Frame::InventoryRequest { after }).await?;
        let (entries, more): (Vec<InventoryEntry>, bool) = match channel.recv().await? {
            Frame::Inventory { entries, more } => (entries, more),
            other => {
                return Err(TransportError::Protocol {
                    detail: format!("answered an inventory request with {:?}", other.kind()),
                });
            }
        };
        // Each page must start after the last one (a peer cannot make this loop forever by
        // sending the same page), and the whole inventory is bounded.
        if let (Some(previous), Some(first)) = (after, entries.first())
            && (first.kind, first.id) <= previous
        {
            return Err(TransportError::Protocol { detail: "an inventory page went backwards".to_owned() });
        }
        if let Some(last) = entries.last() {
            after = Some((last.kind, last.id));
        }
        inventory.extend(entries.into_iter().map(|e| ((e.kind, e.id), (e.bytes, e.cached))));
        if inventory.len() > PEER_OBJECTS_MAX {
            return Err(TransportError::Protocol {
                detail: format!("an inventory of more than {PEER_OBJECTS_MAX} objects"),
            });
        }
        if !more || after.is_none() {
            break;
        }
    }
    shared.peers.set_inventory(index, inventory, generation);
    shared.wake.notify_one();
    Ok(())
}
