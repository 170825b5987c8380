//! The peer table: what this node knows of every other node of the job, and the rules read from
//! it: which peers are up, which are demoted, who holds what, where to pull an object from.
//!
//! Owns `Peer`, the table and its lock, and the incarnations seen in hellos. The heartbeats
//! (`heartbeat.rs`) write it from what their probes find; besides them, a pull demotes a source
//! that sent bad bytes (`demote`) and a confirmed fetch notes the new holder (`note_has`); every
//! job reads it. Never: talks to the network, starts a task, or decides what to copy (it answers
//! questions about what the heartbeats saw; the jobs above it act on the answers).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::frame::WireKind;
use super::secure::Hello;
use crate::id::ObjectId;
use crate::policy::NodeInfo;

/// Peers a node keeps (each has a heartbeat task and an inventory).
pub(super) const PEERS_MAX: usize = super::frame::MEMBERS_MAX;

/// What this node knows of one peer.
pub(super) struct Peer {
    pub(super) addr: SocketAddr,
    pub(super) hello: Option<Hello>,
    pub(super) up: bool,
    last_ok: Option<Instant>,
    pub(super) changed: Instant,
    generation: u64,
    /// (kind, id) -> (bytes, held only as a cache entry).
    inventory: HashMap<(WireKind, ObjectId), (u64, bool)>,
    demoted_until: Option<Instant>,
    pub(super) last_error: String,
}

impl Peer {
    fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            hello: None,
            up: false,
            last_ok: None,
            changed: Instant::now(),
            generation: 0,
            inventory: HashMap::new(),
            demoted_until: None,
            last_error: String::new(),
        }
    }

    /// When it last answered a heartbeat.
    pub(super) fn last_ok(&self) -> Option<Instant> {
        self.last_ok
    }

    pub(super) fn id(&self) -> Option<u32> {
        self.hello.as_ref().map(|h| h.node_id)
    }

    pub(super) fn demoted(&self, now: Instant) -> bool {
        self.demoted_until.is_some_and(|until| until > now)
    }

    /// Objects its inventory lists.
    pub(super) fn objects(&self) -> usize {
        self.inventory.len()
    }
}

/// What `PeerTable::add` did.
pub(super) enum Added {
    /// A new peer, at this index (its heartbeat is to be started).
    New(usize),
    /// The address is known already.
    Known,
    /// The table is full.
    Full,
}

/// The peers of this node (never itself).
pub(super) struct PeerTable {
    /// This node's id: never a source, never a peer.
    own: u32,
    peers: Mutex<Vec<Peer>>,
    /// The newest incarnation seen in a hello, by node id.
    incarnations: Mutex<HashMap<u32, u64>>,
    /// Bytes of objects sent to and received from each node, by id: kept by id, so a node
    /// that comes back at another address goes on counting where it was.
    bytes: Mutex<HashMap<u32, (u64, u64)>>,
}

impl PeerTable {
    pub(super) fn new(own: u32) -> Self {
        Self {
            own,
            peers: Mutex::new(Vec::new()),
            incarnations: Mutex::new(HashMap::new()),
            bytes: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, Vec<Peer>> {
        self.peers.lock()
    }

    /// Adds a peer at `addr` unless it is known or the table is full.
    pub(super) fn add(&self, addr: SocketAddr) -> Added {
        let mut peers = self.lock();
        if peers.iter().any(|p| p.addr == addr) {
            return Added::Known;
        }
        if peers.len() >= PEERS_MAX {
            return Added::Full;
        }
        peers.push(Peer::new(addr));
        Added::New(peers.len() - 1)
    }

    /// Records the incarnation `epoch` of node `node_id` from a hello: refused when it is older
    /// than one already seen (a replayed or stale node) or the id is this node's.
    pub(super) fn check_incarnation(&self, node_id: u32, epoch: u64) -> std::result::Result<(), String> {
        if node_id == self.own {
            return Err(format!("it claims this node's id {node_id}"));
        }
        let mut seen = self.incarnations.lock();
        let known = seen.entry(node_id).or_insert(epoch);
        if epoch < *known {
            return Err(format!("incarnation {epoch} is older than {known}, already seen"));
        }
        *known = epoch;
        Ok(())
    }

    /// Every peer that said hello, as (id, address).
    pub(super) fn members(&self) -> Vec<(u32, String)> {
        self.lock().iter().filter_map(|p| p.id().map(|id| (id, p.addr.to_string()))).collect()
    }

    /// Counts bytes of objects sent to and received from peer `id` (nothing for a node that is
    /// not a peer, such as a client).
    pub(super) fn count_bytes(&self, id: u32, sent: u64, received: u64) {
        if id == self.own || !self.lock().iter().any(|p| p.id() == Some(id)) {
            return;
        }
        let mut bytes = self.bytes.lock();
        let entry = bytes.entry(id).or_default();
        entry.0 += sent;
        entry.1 += received;
    }

    /// Bytes of objects sent to and received from node `id` so far.
    pub(super) fn bytes_of(&self, id: u32) -> (u64, u64) {
        self.bytes.lock().get(&id).copied().unwrap_or_default()
    }

    pub(super) fn addr_of(&self, id: u32) -> Option<SocketAddr> {
        self.lock().iter().find(|p| p.id() == Some(id)).map(|p| p.addr)
    }

    /// Where to pull an object from: `preferred` first (in order), then every other peer that
    /// is up and lists it; never this node, a peer that is down, or a demoted one.
    pub(super) fn sources_for(&self, kind: WireKind, id: ObjectId, preferred: &[u32]) -> Vec<u32> {
        let now = Instant::now();
        let peers = self.lock();
        let usable =
            |node: u32| peers.iter().any(|p| p.id() == Some(node) && p.up && !p.demoted(now)) && node != self.own;
        let mut out: Vec<u32> = Vec::new();
        for &node in preferred {
            if usable(node) && !out.contains(&node) {
                out.push(node);
            }
        }
        for p in peers.iter() {
            if let Some(node) = p.id()
                && p.inventory.contains_key(&(kind, id))
                && usable(node)
                && !out.contains(&node)
            {
                out.push(node);
            }
        }
        out
    }

    /// Stops using peer `id` as a source for `demote_for`.
    pub(super) fn demote(&self, id: u32, demote_for: Duration, why: &str) {
        if let Some(peer) = self.lock().iter_mut().find(|p| p.id() == Some(id)) {
            peer.demoted_until = Some(Instant::now() + demote_for);
            peer.last_error = why.to_owned();
        }
    }

    /// The length of an object as some peer lists it (0 when no peer does).
    pub(super) fn bytes_known(&self, kind: WireKind, id: ObjectId) -> u64 {
        self.lock().iter().find_map(|p| p.inventory.get(&(kind, id)).map(|&(bytes, _)| bytes)).unwrap_or(0)
    }

    /// Peers that are up and hold shard `id` as a copy that is not a cache entry.
    pub(super) fn durable_holders(&self, id: ObjectId) -> usize {
        let peers = self.lock();
        peers
            .iter()
            .filter(|p| p.up && p.inventory.get(&(WireKind::Shard, id)).is_some_and(|&(_, cached)| !cached))
            .count()
    }

    /// Whether a peer that is up holds shard `id` as a copy that is not a cache entry.
    pub(super) fn durable_copy_up(&self, id: ObjectId) -> bool {
        self.lock().iter().any(|p| p.up && p.inventory.get(&(WireKind::Shard, id)).is_some_and(|&(_, cached)| !cached))
    }

    /// The nodes for placement: `own` and every peer that has said hello, by id.
    pub(super) fn node_infos(&self, own: NodeInfo) -> Vec<NodeInfo> {
        let mut nodes = vec![own];
        for p in self.lock().iter() {
            if let Some(h) = &p.hello
                && !nodes.iter().any(|n| n.id == h.node_id)
            {
                nodes.push(NodeInfo { id: h.node_id, weight: h.weight, failure_domain: h.failure_domain, up: p.up });
            }
        }
        nodes.sort_by_key(|n| n.id);
        nodes
    }

    /// Peers of the membership that have not said hello yet (not started, or unreachable since
    /// this node started): nodes of the job all the same.
    pub(super) fn not_heard_from(&self) -> usize {
        self.lock().iter().filter(|p| p.hello.is_none()).count()
    }

    /// Peers that are up and list the object.
    pub(super) fn holders(&self, kind: WireKind, id: ObjectId) -> Vec<u32> {
        self.lock().iter().filter(|p| p.up && p.inventory.contains_key(&(kind, id))).filter_map(Peer::id).collect()
    }

    /// Whether peer `node` lists the object (up or not).
    pub(super) fn holds(&self, node: u32, kind: WireKind, id: ObjectId) -> bool {
        self.lock().iter().any(|p| p.id() == Some(node) && p.inventory.contains_key(&(kind, id)))
    }

    /// Notes that peer `node` now holds the object (until its next inventory says otherwise).
    pub(super) fn note_has(&self, node: u32, kind: WireKind, id: ObjectId, bytes: u64) {
        if let Some(p) = self.lock().iter_mut().find(|p| p.id() == Some(node)) {
            p.inventory.entry((kind, id)).or_insert((bytes, false));
        }
    }

    /// Whether peer `id` is up, as its heartbeat last found it.
    pub(super) fn is_up(&self, id: u32) -> bool {
        self.lock().iter().any(|p| p.id() == Some(id) && p.up)
    }

    /// The peers that are up, as (id, address).
    pub(super) fn up(&self) -> Vec<(u32, SocketAddr)> {
        self.lock().iter().filter(|p| p.up).filter_map(|p| p.id().map(|id| (id, p.addr))).collect()
    }

    /// `f` of every peer, in the table's order.
    pub(super) fn map<T>(&self, f: impl FnMut(&Peer) -> T) -> Vec<T> {
        self.lock().iter().map(f).collect()
    }

    /// The address of the peer at `index`.
    pub(super) fn addr_at(&self, index: usize) -> SocketAddr {
        self.lock()[index].addr
    }

    /// The inventory generation last fetched from the peer at `index`.
    pub(super) fn generation_at(&self, index: usize) -> u64 {
        self.lock()[index].generation
    }

    /// Takes the hello of the peer at `index` (`addr`) on a new connection. Refused when another
    /// entry that is up has its id; an entry that is down with its id no longer names it (the
    /// node came back at another address). A new incarnation's inventory is fetched afresh.
    pub(super) fn adopt_hello(&self, index: usize, addr: SocketAddr, hello: Hello) -> std::result::Result<(), String> {
        let mut peers = self.lock();
        if let Some(other) = peers.iter().position(|p| p.id() == Some(hello.node_id) && p.addr != addr) {
            if peers[other].up {
                return Err(format!("node {} is already known, up, at {}", hello.node_id, peers[other].addr));
            }
            peers[other].hello = None;
            peers[other].inventory.clear();
            peers[other].generation = 0;
        }
        let peer = &mut peers[index];
        if peer.hello.as_ref().is_some_and(|h| h.epoch != hello.epoch) {
            peer.generation = 0;
        }
        peer.hello = Some(hello);
        Ok(())
    }

    /// Replaces the inventory of the peer at `index` with the one of `generation`.
    pub(super) fn set_inventory(
        &self,
        index: usize,
        inventory: HashMap<(WireKind, ObjectId), (u64, bool)>,
        generation: u64,
    ) {
        let mut peers = self.lock();
        peers[index].inventory = inventory;
        peers[index].generation = generation;
    }

    /// Records a probe of the peer at `index`: answered, or failed with `error`. A peer silent
    /// for `down_after` is down. Returns the peer's (id, up) when that changed.
    pub(super) fn record_probe(
        &self,
        index: usize,
        error: Option<String>,
        down_after: Duration,
        now: Instant,
    ) -> Option<(Option<u32>, bool)> {
        let mut peers = self.lock();
        let peer = &mut peers[index];
        let up = match error {
            None => {
                peer.last_ok = Some(now);
                peer.last_error.clear();
                true
            }
            Some(error) => {
                peer.last_error = error;
                let silent_for = peer.last_ok.map_or(Duration::MAX, |t| now.duration_since(t));
                peer.up && silent_for < down_after
            }
        };
        if up == peer.up {
            return None;
        }
        peer.up = up;
        peer.changed = now;
        Some((peer.id(), up))
    }
}
