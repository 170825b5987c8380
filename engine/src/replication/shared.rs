//! What the node's tasks share, and the small questions every job asks of it.
//!
//! Owns `Shared`: the node's configuration, local store, hello and counters; the peer table; the
//! bounds (pull, fetch and connection slots, the in-flight tables); the plugins (the replicator,
//! and the read cache's `ShardCache`); the lag accounting the reconciler keeps; the event log.
//! Its methods answer what several jobs need: who holds an object, where a shard belongs, what
//! a dataset's shards are, what the replicator places. Never: a job's own logic. Learning and
//! watching peers (`heartbeat.rs`), pulling (`pull.rs`), read repair and the read cache
//! (`read_repair.rs`), replicating (`replicate.rs`), reconciling (`reconcile.rs`), the report
//! (`status.rs`) and serving (`server.rs`) sit above this file, which depends on none of them.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{Notify, Semaphore, watch};

use super::admission::{HandshakeSlot, Handshakes};
use super::config::NodeConfig;
use super::flight::InFlight;
use super::frame::{ReplyCode, WireKind};
use super::local::LocalStore;
use super::peers::PeerTable;
use super::secure::{Channel, Hello};
use crate::error::{Error, Result, TransportError};
use crate::id::{ObjectId, ShardId};
use crate::policy::{Holding, NodeInfo, Placement, Replicator, ShardCache, Transfer, shard_key};
use crate::store::DatasetName;

/// Pulls running at once on a node.
pub(super) const PULLS_MAX: usize = 4;
/// Fetch requests this node has outstanding with its peers at once.
pub(super) const FETCHES_MAX: usize = 8;
/// Recent events kept for the status report.
const EVENTS_MAX: usize = 32;
/// A read or a fetch request that needs an object from a peer waits at most this long for one
/// that is up and can serve it (right after a start, no heartbeat has answered yet).
pub(super) const PEER_WAIT_FOR_SOURCE: Duration = Duration::from_secs(10);

/// How a pull (`pull.rs`) ended well: the outcome its in-flight table shares with joiners.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pulled {
    /// The object was already here.
    AlreadyHeld,
    /// A verified copy was published; `bytes` were received in this pull.
    Published { bytes: u64 },
    /// Another pull of the same object, which this one waited for, published it.
    Joined,
}

/// Counters of a node.
#[derive(Default)]
pub(crate) struct Stats {
    pub(crate) objects_received: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    /// Bytes of transfers received from peers (those that failed verification included).
    pub(crate) bytes_received: AtomicU64,
    pub(crate) verify_failures: AtomicU64,
    pub(crate) demotions: AtomicU64,
    pub(crate) connections_refused: AtomicU64,
    /// Connections told the node is busy (no handshake slot, or evicted for a newer one).
    pub(crate) connections_busy: AtomicU64,
    pub(crate) frames_rejected: AtomicU64,
    pub(crate) copies_made: AtomicU64,
    pub(crate) copies_failed: AtomicU64,
    pub(crate) repairs: AtomicU64,
    pub(crate) evicted: AtomicU64,
    pub(crate) kept_last_copy: AtomicU64,
    /// Peers' heat that could not be had (down meanwhile, or older than the heat frames).
    pub(crate) heat_failures: AtomicU64,
}

/// The lag accounting of under-replicated shards (the reconciler writes it, the report reads
/// it).
#[derive(Default)]
pub(super) struct Lag {
    /// Shards below their goal, since when.
    pub(super) under: std::collections::HashMap<ShardId, Instant>,
    /// Their bytes.
    pub(super) under_bytes: u64,
    /// Shards with no copy on a node that is up.
    pub(super) unavailable: usize,
    pub(super) last: Option<Duration>,
    pub(super) max: Duration,
}

/// Everything the node's tasks share.
pub(crate) struct Shared {
    pub(crate) config: NodeConfig,
    pub(crate) local: LocalStore,
    pub(crate) hello: Hello,
    pub(crate) stats: Stats,
    pub(super) peers: PeerTable,
    pub(crate) pulls: InFlight<(WireKind, ObjectId), Pulled>,
    pub(crate) pull_slots: Semaphore,
    pub(super) fetch_slots: Arc<Semaphore>,
    /// Fetch requests outstanding, by (object, target): a second asker waits for the first's
    /// answer instead of asking again.
    pub(super) fetching: InFlight<(ObjectId, u32), ()>,
    /// Refs being brought to peers, by (peer, dataset): one at a time each.
    pub(super) pushing: Mutex<HashSet<(u32, DatasetName)>>,
    /// Coded shards whose lost fragments this node is rebuilding: one rebuild at a time each.
    pub(super) coding_work: Mutex<HashSet<ShardId>>,
    /// Shards encoded at once (`coded/`, `ENCODES_MAX`): each is in memory with its fragments.
    pub(super) encode_slots: Semaphore,
    /// Peers a goal set here (by `replicate`) has not reached yet, by (peer, dataset): the
    /// reconciler brings them the ref and goal once they are up. Only the node a goal was set
    /// on brings it, so two nodes never echo a goal back and forth.
    pub(super) goals_pending: Mutex<HashSet<(u32, DatasetName)>>,
    /// Whole copies of coded shards the read cache declined (kept as copies, not offered again),
    /// and hot copies it declined (deleted again, not pulled again).
    pub(super) declined: Mutex<HashSet<ShardId>>,
    /// What the header of each fragment held here names (its shard and coding), read once.
    pub(super) fragment_headers: Mutex<std::collections::HashMap<ObjectId, (ShardId, crate::erasure::Coding)>>,
    /// Fragments this node encoded for peers to pull, served from memory and never listed (a
    /// node holds at most one fragment of a shard; these are in transit, not held).
    pub(super) outgoing: Mutex<std::collections::HashMap<ObjectId, Arc<Vec<u8>>>>,
    pub(crate) connection_slots: Arc<Semaphore>,
    /// Handshakes in progress.
    pub(super) handshakes: Arc<Handshakes>,
    pub(crate) wake: Notify,
    pub(super) events: Mutex<VecDeque<String>>,
    pub(super) replicator: Mutex<Replicator>,
    pub(super) cache: Mutex<ShardCache>,
    pub(super) lag: Mutex<Lag>,
    pub(super) request_ids: AtomicU32,
    pub(super) shutdown: watch::Receiver<bool>,
    pub(super) started: Instant,
    /// The node's runtime, for tasks started from outside it.
    pub(super) runtime: tokio::runtime::Handle,
    /// This node's reads per shard (`heat.rs`).
    pub(crate) heat: Mutex<super::heat_state::HeatWindow>,
    /// The hot pass's goals and the hot copies held here.
    pub(crate) hot: Mutex<super::heat_state::HotState>,
}

/// The reply code that tells a peer what kind of failure `error` is.
pub(crate) fn reply_code_of(error: &Error) -> ReplyCode {
    match error {
        Error::NotFound { .. } => ReplyCode::NotFound,
        e if e.is_corruption() => ReplyCode::Corrupt,
        Error::InvalidInput { .. } | Error::InvalidName { .. } | Error::RecordOutOfRange { .. } => ReplyCode::Invalid,
        Error::Unavailable { .. } => ReplyCode::Unavailable,
        Error::PeerRefused { .. } => ReplyCode::Refused,
        _ => ReplyCode::Internal,
    }
}

impl Shared {
    /// Records an event for the status report (and stderr, for `granary serve`'s log).
    pub(crate) fn event(&self, text: String) {
        eprintln!("granary node {}: {text}", self.hello.node_id);
        let mut events = self.events.lock();
        if events.len() == EVENTS_MAX {
            events.pop_front();
        }
        events.push_back(text);
    }

    /// A handshake slot for a connection from `ip` (see `Handshakes::begin`), counting the
    /// connection it evicted, if any, as told busy.
    pub(crate) fn begin_handshake(&self, ip: std::net::IpAddr) -> Option<HandshakeSlot> {
        let (slot, evicted) = Handshakes::begin(&self.handshakes, ip)?;
        if evicted {
            self.stats.connections_busy.fetch_add(1, Ordering::Relaxed);
        }
        Some(slot)
    }

    pub(crate) fn next_request_id(&self) -> u32 {
        self.request_ids.fetch_add(1, Ordering::Relaxed)
    }

    /// Opens an authenticated channel to a peer.
    pub(crate) async fn connect(&self, addr: SocketAddr) -> std::result::Result<(Channel, Hello), TransportError> {
        Channel::connect(addr, &self.config.key, &self.hello, self.config.deadlines).await
    }

    /// The members known so far, for a rendezvous: this node and every peer that said hello.
    pub(crate) fn rendezvous_members(&self) -> Vec<(u32, String)> {
        let mut members = vec![(self.hello.node_id, self.hello.listen.clone())];
        members.extend(self.peers.members());
        members.sort();
        members.dedup_by_key(|m| m.0);
        members
    }

    /// Stops using `id` as a source for a while.
    pub(crate) fn demote(&self, id: u32, why: &str) {
        self.peers.demote(id, self.config.demote_for, why);
        self.stats.demotions.fetch_add(1, Ordering::Relaxed);
        self.event(format!("demoted node {id}: {why}"));
    }

    /// Waits (at most `PEER_WAIT_FOR_SOURCE`) until some peer that is up can serve the object:
    /// one of `preferred`, or one that lists it.
    pub(super) async fn wait_for_source(&self, kind: WireKind, id: ObjectId, preferred: &[u32]) {
        let started = Instant::now();
        while self.peers.sources_for(kind, id, preferred).is_empty() && started.elapsed() < PEER_WAIT_FOR_SOURCE {
            tokio::time::sleep(self.config.heartbeat.min(Duration::from_millis(100))).await;
        }
    }

    /// The length of shard `id` as a manifest stored here says (verified: manifests are
    /// checked against their ids when read).
    pub(super) fn manifest_bytes(&self, id: ShardId) -> Option<u64> {
        let paths = self.local.paths();
        for name in paths.list_refs().ok()? {
            let Ok(log) = paths.read_ref(&name) else { continue };
            for version in log.versions() {
                let Ok(manifest) = paths.read_manifest(version.manifest) else { continue };
                if let Some(entry) = manifest.entries().iter().find(|e| e.shard == id) {
                    return Some(entry.file_bytes);
                }
            }
        }
        None
    }

    /// The shards of every live version of `name`, with their lengths.
    pub(super) fn shards_of(&self, name: &DatasetName) -> Result<BTreeMap<ShardId, u64>> {
        let paths = self.local.paths();
        let log = paths.read_ref(name)?;
        let mut shards = BTreeMap::new();
        for version in log.versions() {
            let manifest = paths.read_manifest(version.manifest)?;
            for entry in manifest.entries() {
                shards.insert(entry.shard, entry.file_bytes);
            }
        }
        Ok(shards)
    }

    /// The nodes for placement: this one and every peer that has said hello.
    pub(super) fn node_infos(&self) -> Vec<NodeInfo> {
        let own = NodeInfo {
            id: self.hello.node_id,
            weight: self.hello.weight,
            failure_domain: self.hello.failure_domain,
            up: true,
        };
        self.peers.node_infos(own)
    }

    /// Nodes (this one included) that are up and hold the object.
    pub(super) fn holders(&self, kind: WireKind, id: ObjectId) -> Vec<u32> {
        let mut out = Vec::new();
        if self.local.holds(kind, id).is_some() {
            out.push(self.hello.node_id);
        }
        out.extend(self.peers.holders(kind, id));
        out
    }

    /// Whether node `node` (this one, or a peer) holds the object.
    pub(super) fn node_holds(&self, node: u32, kind: WireKind, id: ObjectId) -> bool {
        if node == self.hello.node_id {
            return self.local.holds(kind, id).is_some();
        }
        self.peers.holds(node, kind, id)
    }

    /// Where the replicator places shards with `replicas` copies over `nodes`.
    pub(super) async fn placement(&self, nodes: Vec<NodeInfo>, replicas: u32) -> Result<Placement> {
        // The plugin call is short and bounded by its deadline; it runs on this worker thread
        // under block_in_place so the runtime moves other tasks away meanwhile.
        tokio::task::block_in_place(|| self.replicator.lock().place(&nodes, replicas))
    }

    /// The replicator's transfers that bring `holdings` to `replicas` copies over `nodes`.
    pub(super) async fn repair_plan(
        &self,
        nodes: Vec<NodeInfo>,
        replicas: u32,
        holdings: Vec<Holding>,
    ) -> Result<Vec<Transfer>> {
        tokio::task::block_in_place(|| self.replicator.lock().repair(&nodes, replicas, &holdings))
    }

    /// Whether the replicator places shard `id` on this node for some replication goal. When
    /// that cannot be told (a goal or the plugin fails), the answer is yes: the copy is kept.
    pub(super) async fn is_placed_here(self: &Arc<Self>, id: ShardId) -> bool {
        let Ok(goals) = self.local.goals() else { return true };
        for (name, goal) in goals {
            // A coded goal places fragments, not whole copies.
            let super::frame::Goal::Replicas(replicas) = goal else { continue };
            match self.shards_of(&name) {
                Ok(shards) if shards.contains_key(&id) => {}
                Ok(_) => continue,
                Err(_) => return true,
            }
            match self.placement(self.node_infos(), replicas).await {
                Ok(placement) if placement.nodes(shard_key(id.0.as_bytes())).contains(&self.hello.node_id) => {
                    return true;
                }
                Ok(_) => {}
                Err(_) => return true,
            }
        }
        false
    }
}
