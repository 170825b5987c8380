//! Admission: which connections may run a handshake now. A node has room for
//! `HANDSHAKES_MAX` handshakes in progress, `HANDSHAKES_PER_ADDRESS_MAX` from one address.
//!
//! Owns: the table of handshakes in progress, oldest first, each with its source address,
//! whether its first message has authenticated, and the signal that evicts it. Invariant: the
//! table never holds more than `HANDSHAKES_MAX` entries, nor more than
//! `HANDSHAKES_PER_ADDRESS_MAX` from one address; a connection is evicted only before its first
//! message authenticated (it is then told busy by its task). Never: touches a socket (the
//! server and the channel do) or reads a byte.

use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Notify;

/// Handshakes in progress at once, in all and from one address: a peer without the key can
/// hold a handshake slot only until its first message is due, or until newer connections need
/// the room (the oldest waiting for a first message is told busy and closed). A node opens up to
/// about 16 connections at once to one peer (fetch requests, pulls, its heartbeat, a ref), and
/// nodes may share an address (one host, loopback), hence the room per address.
pub(crate) const HANDSHAKES_MAX: usize = 64;
pub(crate) const HANDSHAKES_PER_ADDRESS_MAX: usize = 32;

/// The handshakes in progress, oldest first.
#[derive(Default)]
pub(crate) struct Handshakes {
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    next_id: u64,
    pending: Vec<PendingHandshake>,
}

struct PendingHandshake {
    id: u64,
    ip: IpAddr,
    authenticated: bool,
    evict: Arc<Notify>,
}

/// A handshake in progress; released on drop.
pub(crate) struct HandshakeSlot {
    handshakes: Arc<Handshakes>,
    id: u64,
    evict: Arc<Notify>,
}

impl Handshakes {
    /// A slot for a connection from `ip`, and whether another connection was evicted for it.
    /// When the node already has `HANDSHAKES_MAX` in progress, or that address
    /// `HANDSHAKES_PER_ADDRESS_MAX`, the oldest one (of that address) still waiting for its
    /// first message is evicted to make room: a flood of connections that send nothing then
    /// holds each slot only until the next few arrive, while a real peer's first message comes
    /// within a round trip of its connection. `None` (the connection is refused as busy) only
    /// when every slot it could take has authenticated.
    pub(crate) fn begin(this: &Arc<Self>, ip: IpAddr) -> Option<(HandshakeSlot, bool)> {
        let mut table = this.table.lock();
        assert!(table.pending.len() <= HANDSHAKES_MAX);
        let from_ip = table.pending.iter().filter(|p| p.ip == ip).count();
        let victim = if from_ip >= HANDSHAKES_PER_ADDRESS_MAX {
            Some(table.pending.iter().position(|p| p.ip == ip && !p.authenticated)?)
        } else if table.pending.len() >= HANDSHAKES_MAX {
            Some(table.pending.iter().position(|p| !p.authenticated)?)
        } else {
            None
        };
        if let Some(victim) = victim {
            let evicted = table.pending.remove(victim);
            // A permit is stored if its task is not waiting yet: it finds it when it does.
            evicted.evict.notify_one();
        }
        table.next_id += 1;
        let (id, evict) = (table.next_id, Arc::new(Notify::new()));
        table.pending.push(PendingHandshake { id, ip, authenticated: false, evict: Arc::clone(&evict) });
        assert!(table.pending.len() <= HANDSHAKES_MAX);
        Some((HandshakeSlot { handshakes: Arc::clone(this), id, evict }, victim.is_some()))
    }
}

impl HandshakeSlot {
    /// Completes when the node has taken this slot back for a newer connection.
    pub(crate) fn evicted(&self) -> impl std::future::Future<Output = ()> + use<> {
        let evict = Arc::clone(&self.evict);
        async move { evict.notified().await }
    }

    /// The connection's first message authenticated: it holds the key (or replays a message of
    /// one that does), and is no longer evicted for newer connections.
    pub(crate) fn authenticated(&self) {
        let mut table = self.handshakes.table.lock();
        if let Some(pending) = table.pending.iter_mut().find(|p| p.id == self.id) {
            pending.authenticated = true;
        }
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let mut table = self.handshakes.table.lock();
        table.pending.retain(|p| p.id != self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[test]
    fn a_full_table_evicts_the_oldest_handshake_not_yet_authenticated() {
        let handshakes = Arc::new(Handshakes::default());
        let mut slots = Vec::new();
        for i in 0..HANDSHAKES_MAX {
            let (slot, evicted) = Handshakes::begin(&handshakes, ip(2 + (i % 100) as u8)).expect("room");
            assert!(!evicted);
            slots.push(slot);
        }
        slots[1].authenticated();
        // The oldest (slot 0) makes room; slot 1 has authenticated and is kept.
        let (_newer, evicted) = Handshakes::begin(&handshakes, ip(250)).expect("room by eviction");
        assert!(evicted);
        let table = handshakes.table.lock();
        assert_eq!(table.pending.len(), HANDSHAKES_MAX);
        assert!(!table.pending.iter().any(|p| p.id == slots[0].id));
        assert!(table.pending.iter().any(|p| p.id == slots[1].id));
        drop(table);
        for slot in &slots {
            slot.authenticated();
        }
        // Every slot but the newest has authenticated; the newest has not, so it goes next.
        assert!(Handshakes::begin(&handshakes, ip(251)).is_some_and(|(_, evicted)| evicted));
    }

    #[test]
    fn one_address_is_bounded_to_its_own_share() {
        let handshakes = Arc::new(Handshakes::default());
        let same: Vec<HandshakeSlot> =
            (0..HANDSHAKES_PER_ADDRESS_MAX).map(|_| Handshakes::begin(&handshakes, ip(9)).expect("room").0).collect();
        let other = Handshakes::begin(&handshakes, ip(10)).expect("room").0;
        // A further connection from the same address evicts that address's oldest, not another's.
        let (_next, evicted) = Handshakes::begin(&handshakes, ip(9)).expect("room by eviction");
        assert!(evicted);
        let table = handshakes.table.lock();
        assert!(!table.pending.iter().any(|p| p.id == same[0].id));
        assert!(table.pending.iter().any(|p| p.id == other.id));
        drop(table);
        for slot in &same[1..] {
            slot.authenticated();
        }
        // All of that address's slots authenticated (the newest one too): refused, busy.
        _next.authenticated();
        assert!(Handshakes::begin(&handshakes, ip(9)).is_none());
    }
}
