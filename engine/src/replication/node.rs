//! The node: a store's replication service, on a tokio runtime of its own.
//!
//! Tasks: the listener (`server`), one heartbeat per peer (connects, pings, refreshes the peer's
//! inventory when its generation changes, marks it up or down), and the reconciler: every tick,
//! or when woken by a membership change or a new goal, it reads the replication goals, asks the
//! replicator plugin for the repair plan of every goal's shards over the nodes that are up, and
//! asks each target of a transfer whose source is this node to pull the shard (`Fetch`). It also
//! pushes refs and manifests to peers that lack them, and measures the replication lag. Pulls,
//! fetch requests and connections are bounded by semaphores; every wait on the network has a
//! deadline. Policy calls run on blocking threads.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore, mpsc, watch};

use super::admission::{HandshakeSlot, Handshakes};
pub use super::config::{Faults, NodeConfig};
use super::flight::{Flight, InFlight};
use super::frame::{Frame, InventoryEntry, ReplicateMode, ReplyCode, Role, WireKind};
use super::local::LocalStore;
use super::pull::{self, Pulled};
pub use super::report::{GoalStatus, NodeStatus, PeerStatus};
use super::secure::{Channel, Hello};
use crate::error::{Error, Result, TransportError};
use crate::id::{ObjectId, ShardId};
use crate::policy::{Holding, NodeInfo, Placement, PolicyHost, ReplicationMode, Replicator, ShardCache, shard_key};
use crate::read::ShardRepair;
use crate::store::{DatasetName, VersionSpec};

/// Pulls running at once on a node.
const PULLS_MAX: usize = 4;
/// Fetch requests this node has outstanding with its peers at once.
const FETCHES_MAX: usize = 8;
/// Fetch requests the reconciler starts in one pass (the others wait for a later pass).
const FETCHES_PER_PASS_MAX: usize = 4 * FETCHES_MAX;
/// Recent events kept for the status report.
const EVENTS_MAX: usize = 32;
/// A read or a fetch request that needs an object from a peer waits at most this long for one
/// that is up and can serve it (right after a start, no heartbeat has answered yet).
const PEER_WAIT_FOR_SOURCE: Duration = Duration::from_secs(10);
/// A probe of a peer (ping, and its inventory when that changed) takes at most this long.
const PROBE_DEADLINE: Duration = Duration::from_secs(30);
/// The shortest wait for a pong: a peer that is alive but busy answers within this.
const PONG_WAIT_MIN: Duration = Duration::from_secs(2);
/// Objects a peer's inventory may list (bounds the memory a peer can make this node use).
const PEER_OBJECTS_MAX: usize = 1 << 20;
/// Peers a node keeps (each has a heartbeat task and an inventory).
const PEERS_MAX: usize = super::frame::MEMBERS_MAX;

/// A write session idle for this long is closed, so that an ingest can take the store.
const WRITE_SESSION_IDLE: Duration = Duration::from_millis(500);

/// The node id derived from a listen address (when neither the user nor a launcher gives one).
fn node_id_of(listen: &SocketAddr) -> u32 {
    let hash = blake3::hash(listen.to_string().as_bytes());
    u32::from_le_bytes(hash.as_bytes()[..4].try_into().expect("4 bytes")) & 0x7fff_ffff
}

/// Counters of a node.
#[derive(Default)]
pub(crate) struct Stats {
    pub(crate) objects_received: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
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
}

/// What this node knows of one peer.
struct Peer {
    addr: SocketAddr,
    hello: Option<Hello>,
    up: bool,
    last_ok: Option<Instant>,
    changed: Instant,
    generation: u64,
    /// (kind, id) -> (bytes, held only as a cache entry).
    inventory: HashMap<(WireKind, ObjectId), (u64, bool)>,
    demoted_until: Option<Instant>,
    last_error: String,
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

    fn id(&self) -> Option<u32> {
        self.hello.as_ref().map(|h| h.node_id)
    }

    fn demoted(&self, now: Instant) -> bool {
        self.demoted_until.is_some_and(|until| until > now)
    }
}

/// The lag accounting of under-replicated shards.
#[derive(Default)]
struct Lag {
    /// Shards below their goal, since when.
    under: HashMap<ShardId, Instant>,
    /// Shards with no copy on a node that is up.
    unavailable: usize,
    last: Option<Duration>,
    max: Duration,
}

/// Everything the node's tasks share.
pub(crate) struct Shared {
    pub(crate) config: NodeConfig,
    pub(crate) local: LocalStore,
    pub(crate) hello: Hello,
    pub(crate) stats: Stats,
    peers: Mutex<Vec<Peer>>,
    incarnations: Mutex<HashMap<u32, u64>>,
    pub(crate) pulls: InFlight<(WireKind, ObjectId), Pulled>,
    pub(crate) pull_slots: Semaphore,
    fetch_slots: Arc<Semaphore>,
    /// Fetch requests outstanding, by (object, target): a second asker waits for the first's
    /// answer instead of asking again.
    fetching: InFlight<(ObjectId, u32), ()>,
    /// Refs being brought to peers, by (peer, dataset): one at a time each.
    pushing: Mutex<std::collections::HashSet<(u32, DatasetName)>>,
    pub(crate) connection_slots: Arc<Semaphore>,
    /// Handshakes in progress.
    handshakes: Arc<Handshakes>,
    pub(crate) wake: Notify,
    events: Mutex<VecDeque<String>>,
    replicator: Mutex<Replicator>,
    cache: Mutex<ShardCache>,
    lag: Mutex<Lag>,
    request_ids: AtomicU32,
    shutdown: watch::Receiver<bool>,
    started: Instant,
    /// The node's runtime, for tasks started from outside it.
    runtime: tokio::runtime::Handle,
}

/// A running node. Dropping it stops its tasks and joins its threads.
pub struct Node {
    runtime: Option<tokio::runtime::Runtime>,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.shared.hello.node_id)
            .field("listen", &self.shared.hello.listen)
            .finish()
    }
}

impl Node {
    /// Starts the node of the store at `config.root`: its runtime threads, its listener, the
    /// rendezvous when the membership comes from a launcher, a heartbeat per peer and the
    /// reconciler.
    pub fn start(config: NodeConfig, host: &PolicyHost) -> Result<Node> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("granary-node")
            .enable_all()
            .build()
            .map_err(|e| Error::io("start the node's runtime", "tokio", e))?;
        config.check(host)?;
        let local = LocalStore::open(&config.root, config.lock_wait)?;
        let replicator = host.replicator(config.replicator.as_deref(), &config.replicator_options)?;
        let cache = ShardCache::new(host, config.evictor.as_deref(), &config.evictor_options, config.cache_bytes_max)?;
        let listener = runtime
            .block_on(TcpListener::bind(config.listen))
            .map_err(|e| Error::io("listen", PathBuf::from(config.listen.to_string()), e))?;
        let bound =
            listener.local_addr().map_err(|e| Error::io("listen", PathBuf::from(config.listen.to_string()), e))?;
        let node_id = config.node_id.or(config.membership.node_rank()).unwrap_or_else(|| node_id_of(&bound));
        let hello = Hello {
            node_id,
            role: Role::Peer,
            weight: config.weight,
            failure_domain: config.failure_domain.unwrap_or(node_id),
            listen: bound.to_string(),
            epoch: local.incarnation(),
        };
        let (stop, shutdown) = watch::channel(false);
        let shared = Arc::new(Shared {
            config,
            local,
            hello,
            stats: Stats::default(),
            peers: Mutex::new(Vec::new()),
            incarnations: Mutex::new(HashMap::new()),
            pulls: InFlight::new(),
            pull_slots: Semaphore::new(PULLS_MAX),
            fetch_slots: Arc::new(Semaphore::new(FETCHES_MAX)),
            fetching: InFlight::new(),
            pushing: Mutex::new(std::collections::HashSet::new()),
            connection_slots: Arc::new(Semaphore::new(super::server::CONNECTIONS_MAX)),
            handshakes: Arc::new(Handshakes::default()),
            wake: Notify::new(),
            events: Mutex::new(VecDeque::new()),
            replicator: Mutex::new(replicator),
            cache: Mutex::new(cache),
            lag: Mutex::new(Lag::default()),
            request_ids: AtomicU32::new(1),
            shutdown: shutdown.clone(),
            started: Instant::now(),
            runtime: runtime.handle().clone(),
        });
        runtime.spawn(super::server::listen(Arc::clone(&shared), listener, shutdown.clone()));
        // Clients on this machine (`granary status`, readers' repair hook) find the node here.
        shared.local.record_listen(&bound)?;
        let peers = runtime.block_on(shared.config.membership.resolve(&shared))?;
        for addr in peers {
            shared.learn_peer(addr);
        }
        // The cache entries of an earlier life count against the bound again.
        let mut victims = Vec::new();
        for (id, bytes) in shared.local.cached_entries() {
            let (evicted, cached) =
                shared.cache.lock().expect("the cache lock is never poisoned").admit(ShardId(id), bytes)?;
            if !cached {
                shared.local.set_cached(id, false);
            }
            victims.extend(evicted);
        }
        if !victims.is_empty() {
            // Deleted once the peers' inventories are known (a victim with no copy that is not
            // cached on a node that is up is kept).
            let shared = Arc::clone(&shared);
            runtime.spawn(async move {
                tokio::time::sleep(shared.config.down_after * 2).await;
                shared.evict(victims).await;
            });
        }
        runtime.spawn(reconciler(Arc::clone(&shared), shutdown));
        shared.event(format!("node {node_id} (incarnation {}) listening on {bound}", shared.hello.epoch));
        Ok(Node { runtime: Some(runtime), shared, stop })
    }

    /// This node's id.
    pub fn id(&self) -> u32 {
        self.shared.hello.node_id
    }

    /// Where it listens.
    pub fn listen_addr(&self) -> SocketAddr {
        self.shared.hello.listen.parse().expect("the bound address parses")
    }

    /// What the node knows now.
    pub fn status(&self) -> NodeStatus {
        self.shared.status()
    }

    /// Replicates dataset version `spec` (NAME or NAME@N) with `replicas` copies of each shard.
    /// In synchronous mode (the replicator decides) this returns once every copy is verified on
    /// its node; in asynchronous mode once the copies are scheduled.
    pub fn replicate(&self, spec: &str, replicas: u32) -> Result<ReplicateReport> {
        self.replicate_in(spec, replicas, ReplicateMode::Node)
    }

    /// [`Node::replicate`], waiting for the copies or not as `mode` says for this call (the
    /// replicator's setting stays the default of other calls).
    pub fn replicate_in(&self, spec: &str, replicas: u32, mode: ReplicateMode) -> Result<ReplicateReport> {
        let shared = Arc::clone(&self.shared);
        let spec = spec.to_owned();
        self.block_on(async move { shared.replicate(&spec, replicas, mode, None).await })
    }

    /// Replaces shard `id` (damaged or missing here) with a verified copy from a peer.
    pub fn repair(&self, id: ShardId) -> Result<String> {
        let shared = Arc::clone(&self.shared);
        self.block_on(async move { shared.repair_shard(id).await })
    }

    /// Waits until no goal dataset has an under-replicated shard (or `timeout` passes); returns
    /// whether it converged.
    pub fn wait_converged(&self, timeout: Duration) -> bool {
        let started = Instant::now();
        loop {
            self.shared.wake.notify_one();
            std::thread::sleep(Duration::from_millis(100));
            let status = self.status();
            if status.converged() {
                return true;
            }
            if started.elapsed() > timeout {
                return false;
            }
        }
    }

    /// Serves until the process gets SIGINT or SIGTERM, then stops.
    pub fn run_until_signal(self) {
        if let Some(runtime) = &self.runtime {
            runtime.block_on(async {
                use tokio::signal::unix::{SignalKind, signal};
                let mut terminate = signal(SignalKind::terminate()).ok();
                let terminated = async {
                    match &mut terminate {
                        Some(terminate) => {
                            terminate.recv().await;
                        }
                        None => std::future::pending::<()>().await,
                    }
                };
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    () = terminated => {}
                }
            });
        }
        self.shared.event("stopping".to_owned());
    }

    fn block_on<R: Send + 'static>(&self, work: impl std::future::Future<Output = R> + Send + 'static) -> R {
        let runtime = self.runtime.as_ref().expect("the runtime lives until drop");
        // Run on the node's runtime, never on the caller's (it may have none, or be one).
        let (tx, rx) = std::sync::mpsc::channel();
        runtime.spawn(async move {
            let _ = tx.send(work.await);
        });
        rx.recv().expect("the node's task answers before the runtime stops")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

impl ShardRepair for Node {
    fn repair(&self, shard: ShardId, _cause: &Error) -> Result<()> {
        Node::repair(self, shard).map(|_| ())
    }

    fn accessed(&self, shards: &[ShardId]) {
        // On the reader's thread: the evictor call is short; a task is started only when
        // there is something to delete.
        let victims = {
            let mut cache = self.shared.cache.lock().expect("the cache lock is never poisoned");
            cache.touch(shards)
        };
        match victims {
            Ok(victims) if victims.is_empty() => {}
            Ok(victims) => {
                let shared = Arc::clone(&self.shared);
                if let Some(runtime) = &self.runtime {
                    runtime.spawn(async move { shared.evict(victims).await });
                }
            }
            Err(e) => self.shared.event(format!("cache evictor failed: {e}")),
        }
    }
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
        let mut events = self.events.lock().expect("the event lock is never poisoned");
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

    /// Adds a peer at `addr` (if new) and starts its heartbeat.
    pub(crate) fn learn_peer(self: &Arc<Self>, addr: SocketAddr) {
        if addr.to_string() == self.hello.listen {
            return;
        }
        let index = {
            let mut peers = self.peers.lock().expect("the peer lock is never poisoned");
            if peers.iter().any(|p| p.addr == addr) {
                return;
            }
            if peers.len() >= PEERS_MAX {
                drop(peers);
                self.event(format!("not adding a peer at {addr}: {PEERS_MAX} peers already"));
                return;
            }
            peers.push(Peer::new(addr));
            peers.len() - 1
        };
        self.runtime.spawn(heartbeat(Arc::clone(self), index, self.shutdown.clone()));
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
        if node_id == self.hello.node_id {
            return Err(format!("it claims this node's id {node_id}"));
        }
        {
            let mut seen = self.incarnations.lock().expect("the incarnation lock is never poisoned");
            let known = seen.entry(node_id).or_insert(epoch);
            if epoch < *known {
                return Err(format!("incarnation {epoch} is older than {known}, already seen"));
            }
            *known = epoch;
        }
        if let Ok(mut addr) = listen.parse::<SocketAddr>() {
            // A node listening on every interface is reached at the address it came from.
            if addr.ip().is_unspecified() {
                addr.set_ip(observed.ip());
            }
            self.learn_peer(addr);
        }
        Ok(())
    }

    /// The members known so far, for a rendezvous: this node and every peer that said hello.
    pub(crate) fn rendezvous_members(&self) -> Vec<(u32, String)> {
        let mut members = vec![(self.hello.node_id, self.hello.listen.clone())];
        let peers = self.peers.lock().expect("the peer lock is never poisoned");
        members.extend(peers.iter().filter_map(|p| p.id().map(|id| (id, p.addr.to_string()))));
        members.sort();
        members.dedup_by_key(|m| m.0);
        members
    }

    pub(crate) fn peer_addr(&self, id: u32) -> Option<SocketAddr> {
        let peers = self.peers.lock().expect("the peer lock is never poisoned");
        peers.iter().find(|p| p.id() == Some(id)).map(|p| p.addr)
    }

    /// Where to pull an object from: `preferred` first (in order), then every other peer that
    /// is up and lists it; never this node, a peer that is down, or a demoted one.
    pub(crate) fn sources_for(&self, kind: WireKind, id: ObjectId, preferred: &[u32]) -> Vec<u32> {
        let now = Instant::now();
        let peers = self.peers.lock().expect("the peer lock is never poisoned");
        let usable = |node: u32| {
            peers.iter().any(|p| p.id() == Some(node) && p.up && !p.demoted(now)) && node != self.hello.node_id
        };
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

    /// Stops using `id` as a source for a while.
    pub(crate) fn demote(&self, id: u32, why: &str) {
        {
            let mut peers = self.peers.lock().expect("the peer lock is never poisoned");
            if let Some(peer) = peers.iter_mut().find(|p| p.id() == Some(id)) {
                peer.demoted_until = Some(Instant::now() + self.config.demote_for);
                peer.last_error = why.to_owned();
            }
        }
        self.stats.demotions.fetch_add(1, Ordering::Relaxed);
        self.event(format!("demoted node {id}: {why}"));
    }

    /// Pulls an object here on a peer's request (a replication transfer).
    pub(crate) async fn fetch_here(
        self: &Arc<Self>,
        kind: WireKind,
        id: ObjectId,
        bytes: u64,
        sources: &[u32],
    ) -> Result<()> {
        let length = match (kind, self.manifest_bytes(ShardId(id))) {
            (WireKind::Shard, Some(known)) => {
                if bytes != known {
                    return Err(Error::invalid_input(format!(
                        "shard {id} is {known} bytes by the manifest here, not {bytes}"
                    )));
                }
                pull::Length::new(known, true)
            }
            _ => pull::Length::new(bytes, false),
        };
        // A peer asks this node to hold the object: a placed copy, not a cache entry.
        if self.local.is_cached(id) {
            self.local.set_cached(id, false);
            self.cache.lock().expect("the cache lock is never poisoned").forget(ShardId(id));
        }
        // The asking peer may not be up in this node's table yet (it just started, or its first
        // heartbeat has not been answered): give it a moment rather than refuse.
        if self.local.holds(kind, id).is_none() {
            self.wait_for_source(kind, id, sources).await;
        }
        match pull::pull(self, kind, id, length, sources).await? {
            Pulled::AlreadyHeld | Pulled::Joined => {}
            Pulled::Published { bytes } => {
                self.event(format!("received {kind:?} {} ({bytes} bytes)", id.short(12)));
                self.wake.notify_one();
            }
        }
        Ok(())
    }

    /// Quarantines this node's damaged copy; the reconciler brings a good one back when the
    /// shard belongs here.
    pub(crate) async fn quarantine_and_heal(self: &Arc<Self>, kind: WireKind, id: ObjectId) {
        self.cache.lock().expect("the cache lock is never poisoned").forget(ShardId(id));
        let shared = Arc::clone(self);
        let moved = tokio::task::spawn_blocking(move || shared.local.quarantine(kind, id)).await;
        match moved {
            Ok(Ok(Some(path))) => self.event(format!("quarantined {} to {}", id.short(12), path.display())),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => self.event(format!("could not quarantine {}: {e}", id.short(12))),
            Err(e) => self.event(format!("could not quarantine {}: {e}", id.short(12))),
        }
        self.wake.notify_one();
    }

    /// Read-time repair: a reader found shard `id` damaged or missing. Checks the local copy;
    /// when it is damaged, quarantines it; then pulls a verified copy from a peer.
    pub(crate) async fn repair_shard(self: &Arc<Self>, id: ShardId) -> Result<String> {
        let kind = WireKind::Shard;
        let was_here = self.local.holds(kind, id.0).is_some();
        let was_cached = self.local.is_cached(id.0);
        if was_here {
            let path = self.local.object_path(kind, id.0);
            let checked = tokio::task::spawn_blocking(move || crate::engine::verify_shard(&path, id))
                .await
                .map_err(|e| Error::invalid_input(format!("verification failed to run: {e}")))?;
            match checked {
                Ok(_) => return Ok(format!("shard {id} is intact here")),
                Err(e) if e.is_corruption() => {
                    self.stats.verify_failures.fetch_add(1, Ordering::Relaxed);
                    self.event(format!("read found shard {} damaged: {e}", id.0.short(12)));
                    self.quarantine_and_heal(kind, id.0).await;
                }
                // Listed but gone (removed by another process): no longer listed.
                Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                    self.local.note_missing(kind, id.0);
                }
                Err(e) => return Err(e),
            }
        }
        // A shard of an attached dataset is the store's origin cache's (which asks here before
        // its origin): taken from a peer that lists it now, else refused at once, so the
        // origin is asked instead; this node's cache never takes it.
        let origin_cached = {
            let shared = Arc::clone(self);
            tokio::task::spawn_blocking(move || {
                shared.local.is_origin_cached(id.0, false) || shared.local.is_origin_cached(id.0, true)
            })
            .await
            .unwrap_or(false)
        };
        // A shard fetched for a read and not placed here is a cache entry; peers must see it
        // flagged as such from the moment it is listed (they count on copies that are not).
        let as_cache = !origin_cached && (was_cached || !was_here) && !self.is_placed_here(id).await;
        if as_cache {
            self.local.set_cached(id.0, true);
        }
        let pulled = self.pull_for_read(id, !origin_cached).await;
        let pulled = match pulled {
            Ok(pulled) => pulled,
            Err(e) => {
                if as_cache {
                    self.local.set_cached(id.0, false);
                    self.cache.lock().expect("the cache lock is never poisoned").forget(id);
                }
                return Err(e);
            }
        };
        self.stats.repairs.fetch_add(1, Ordering::Relaxed);
        let message = match pulled {
            Pulled::AlreadyHeld | Pulled::Joined => format!("shard {id} is here"),
            Pulled::Published { bytes } => format!("shard {id} replaced with a verified copy ({bytes} bytes)"),
        };
        self.event(message.clone());
        if as_cache {
            let bytes = self.local.holds(kind, id.0).unwrap_or(0);
            let (victims, cached) = {
                let mut cache = self.cache.lock().expect("the cache lock is never poisoned");
                cache.admit(id, bytes)?
            };
            if !cached {
                self.local.set_cached(id.0, false);
                self.event(format!("shard {} is larger than the whole cache: kept outside it", id.0.short(12)));
            }
            self.evict(victims).await;
        }
        self.wake.notify_one();
        Ok(message)
    }

    /// Pulls shard `id` for a reader: its length from a manifest here when there is one (a
    /// peer's inventory is only a hint), from whichever peer lists it, waiting a little for
    /// one to be up (right after a start, no heartbeat has answered yet).
    async fn pull_for_read(self: &Arc<Self>, id: ShardId, wait: bool) -> Result<Pulled> {
        let kind = WireKind::Shard;
        if wait {
            self.wait_for_source(kind, id.0, &[]).await;
        }
        let length = match self.manifest_bytes(id) {
            Some(bytes) => pull::Length::new(bytes, true),
            None => pull::Length::new(self.bytes_known(kind, id.0), false),
        };
        pull::pull(self, kind, id.0, length, &[]).await
    }

    /// Waits (at most `PEER_WAIT_FOR_SOURCE`) until some peer that is up can serve the object:
    /// one of `preferred`, or one that lists it.
    async fn wait_for_source(&self, kind: WireKind, id: ObjectId, preferred: &[u32]) {
        let started = Instant::now();
        while self.sources_for(kind, id, preferred).is_empty() && started.elapsed() < PEER_WAIT_FOR_SOURCE {
            tokio::time::sleep(self.config.heartbeat.min(Duration::from_millis(100))).await;
        }
    }

    /// The length of an object as some peer lists it (0 when no peer does).
    fn bytes_known(&self, kind: WireKind, id: ObjectId) -> u64 {
        let peers = self.peers.lock().expect("the peer lock is never poisoned");
        peers.iter().find_map(|p| p.inventory.get(&(kind, id)).map(|&(bytes, _)| bytes)).unwrap_or(0)
    }

    /// The length of shard `id` as a manifest stored here says (verified: manifests are
    /// checked against their ids when read).
    fn manifest_bytes(&self, id: ShardId) -> Option<u64> {
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

    /// Whether the replicator places shard `id` on this node for some replication goal. When
    /// that cannot be told (a goal or the plugin fails), the answer is yes: the copy is kept.
    async fn is_placed_here(self: &Arc<Self>, id: ShardId) -> bool {
        let Ok(goals) = self.local.goals() else { return true };
        for (name, replicas) in goals {
            match self.shards_of(&name) {
                Ok(shards) if shards.contains_key(&id) => {}
                Ok(_) => continue,
                Err(_) => return true,
            }
            match self.placement(self.node_infos(), replicas).await {
                Ok(placement) if placement.nodes(id.0.as_bytes()).contains(&self.hello.node_id) => return true,
                Ok(_) => {}
                Err(_) => return true,
            }
        }
        false
    }

    /// Deletes cache victims, except a copy that may be the last: a victim is deleted only when
    /// a node that is up holds it as a copy that is not cached (such copies are never evicted,
    /// so two caches evicting at once cannot both count on each other). Kept victims become
    /// ordinary copies, no longer cached.
    async fn evict(self: &Arc<Self>, victims: Vec<(ShardId, u64)>) {
        for (id, _) in victims {
            if self.is_placed_here(id).await {
                // Placement moved it here since it was cached: it stays, as a placed copy.
                self.local.set_cached(id.0, false);
                continue;
            }
            let durable_elsewhere = {
                let peers = self.peers.lock().expect("the peer lock is never poisoned");
                peers
                    .iter()
                    .any(|p| p.up && p.inventory.get(&(WireKind::Shard, id.0)).is_some_and(|&(_, cached)| !cached))
            };
            if !durable_elsewhere {
                self.local.set_cached(id.0, false);
                self.stats.kept_last_copy.fetch_add(1, Ordering::Relaxed);
                self.event(format!(
                    "kept shard {} although evicted: no node that is up holds a copy that is not cached",
                    id.0.short(12)
                ));
                continue;
            }
            let shared = Arc::clone(self);
            match tokio::task::spawn_blocking(move || shared.local.remove(WireKind::Shard, id.0)).await {
                Ok(Ok(())) => {
                    self.stats.evicted.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Err(e)) => self.event(format!("could not evict {}: {e}", id.0.short(12))),
                Err(e) => self.event(format!("could not evict {}: {e}", id.0.short(12))),
            }
        }
    }

    /// The nodes for placement: this one and every peer that has said hello.
    fn node_infos(&self) -> Vec<NodeInfo> {
        let mut nodes = vec![NodeInfo {
            id: self.hello.node_id,
            weight: self.hello.weight,
            failure_domain: self.hello.failure_domain,
            up: true,
        }];
        let peers = self.peers.lock().expect("the peer lock is never poisoned");
        for p in peers.iter() {
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
    fn peers_not_heard_from(&self) -> usize {
        self.peers.lock().expect("the peer lock is never poisoned").iter().filter(|p| p.hello.is_none()).count()
    }

    /// Nodes (this one included) that are up and hold the object.
    fn holders(&self, kind: WireKind, id: ObjectId) -> Vec<u32> {
        let mut out = Vec::new();
        if self.local.holds(kind, id).is_some() {
            out.push(self.hello.node_id);
        }
        let peers = self.peers.lock().expect("the peer lock is never poisoned");
        for p in peers.iter() {
            if let Some(node) = p.id()
                && p.up
                && p.inventory.contains_key(&(kind, id))
            {
                out.push(node);
            }
        }
        out
    }

    fn peer_holds(&self, node: u32, kind: WireKind, id: ObjectId) -> bool {
        if node == self.hello.node_id {
            return self.local.holds(kind, id).is_some();
        }
        let peers = self.peers.lock().expect("the peer lock is never poisoned");
        peers.iter().any(|p| p.id() == Some(node) && p.inventory.contains_key(&(kind, id)))
    }

    fn note_peer_has(&self, node: u32, kind: WireKind, id: ObjectId, bytes: u64) {
        let mut peers = self.peers.lock().expect("the peer lock is never poisoned");
        if let Some(p) = peers.iter_mut().find(|p| p.id() == Some(node)) {
            p.inventory.entry((kind, id)).or_insert((bytes, false));
        }
    }

    /// Whether peer `id` is up, as its heartbeat last found it.
    fn peer_up(&self, id: u32) -> bool {
        let peers = self.peers.lock().expect("the peer lock is never poisoned");
        peers.iter().any(|p| p.id() == Some(id) && p.up)
    }

    /// Returns once the heartbeat of peer `id` finds it down (polled: the wait it ends is long).
    async fn until_down(&self, id: u32) {
        while self.peer_up(id) {
            tokio::time::sleep(self.config.heartbeat.min(Duration::from_millis(100))).await;
        }
    }

    fn up_peers(&self) -> Vec<(u32, SocketAddr)> {
        let peers = self.peers.lock().expect("the peer lock is never poisoned");
        peers.iter().filter(|p| p.up).filter_map(|p| p.id().map(|id| (id, p.addr))).collect()
    }

    async fn placement(&self, nodes: Vec<NodeInfo>, replicas: u32) -> Result<Placement> {
        let shared_replicator = &self.replicator;
        // The plugin call is short and bounded by its deadline; it runs on this worker thread
        // under block_in_place so the runtime moves other tasks away meanwhile.
        tokio::task::block_in_place(|| {
            shared_replicator.lock().expect("the replicator lock is never poisoned").place(&nodes, replicas)
        })
    }

    async fn repair_plan(
        &self,
        nodes: Vec<NodeInfo>,
        replicas: u32,
        holdings: Vec<Holding>,
    ) -> Result<Vec<crate::policy::Transfer>> {
        let shared_replicator = &self.replicator;
        tokio::task::block_in_place(|| {
            shared_replicator.lock().expect("the replicator lock is never poisoned").repair(&nodes, replicas, &holdings)
        })
    }

    /// Asks `target` to pull object `id` (from this node first, then `others`) and waits for its
    /// answer: Ok once a verified copy is published there.
    async fn ask_to_fetch(
        self: &Arc<Self>,
        target: u32,
        kind: WireKind,
        id: ObjectId,
        bytes: u64,
        others: &[u32],
    ) -> Result<()> {
        let addr = self.peer_addr(target).ok_or_else(|| Error::NotFound { what: format!("node {target}") })?;
        let went_down = |when: &str| Error::Unavailable {
            what: format!("node {target} ({addr})"),
            detail: format!("it is down{when} (its heartbeat goes unanswered)"),
        };
        if !self.peer_up(target) {
            return Err(went_down(""));
        }
        let transport = |source: TransportError| Error::Transport { peer: format!("node {target} ({addr})"), source };
        let (mut channel, _) = self.connect(addr).await.map_err(transport)?;
        let request = self.next_request_id();
        let mut sources = vec![self.hello.node_id];
        sources.extend(others.iter().copied().filter(|&n| n != self.hello.node_id && n != target));
        sources.truncate(super::frame::SOURCES_MAX);
        channel.send(&Frame::Fetch { request, kind, id, bytes, sources }).await.map_err(transport)?;
        // The target replies once it has pulled and verified the object: allow for the slowest
        // transfer a pull accepts (1 MiB/s), and for a wait for one of its pull slots. A target
        // that its heartbeat finds down meanwhile will not answer: the wait ends then, naming it.
        let wait = Duration::from_secs(120) + Duration::from_secs(bytes / (1 << 20));
        let answer = tokio::select! {
            answer = channel.recv_within(wait) => answer.map_err(transport)?,
            () = self.until_down(target) => return Err(went_down(&format!(", since the transfer of {} began", id.short(12)))),
        };
        match answer {
            Frame::Reply { request: r, code: ReplyCode::Ok, .. } if r == request => {
                self.note_peer_has(target, kind, id, bytes);
                Ok(())
            }
            Frame::Reply { request: r, code, message } if r == request => Err(Error::PeerRefused {
                peer: format!("node {target}"),
                request: "fetch",
                code: code.to_string(),
                message: message.to_owned(),
            }),
            other => {
                Err(transport(TransportError::Protocol { detail: format!("answered a fetch with {:?}", other.kind()) }))
            }
        }
    }

    /// `ask_to_fetch` once per (object, target) at a time, within the fetch bound; a concurrent
    /// caller for the same pair gets the same outcome.
    async fn fetch_once(
        self: &Arc<Self>,
        target: u32,
        kind: WireKind,
        id: ObjectId,
        bytes: u64,
        others: Vec<u32>,
    ) -> Result<()> {
        let work = async {
            let _slot =
                Arc::clone(&self.fetch_slots).acquire_owned().await.expect("the fetch semaphore is never closed");
            self.ask_to_fetch(target, kind, id, bytes, &others).await
        };
        let outcome = match self.fetching.run((id, target), work).await {
            Flight::Led(outcome) => outcome,
            Flight::Joined(outcome) => {
                return outcome.map_err(|detail| Error::Unavailable {
                    what: format!("a copy of {} on node {target}", id.short(12)),
                    detail,
                });
            }
        };
        match &outcome {
            Ok(()) => {
                if kind == WireKind::Shard {
                    self.stats.copies_made.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(e) => {
                self.stats.copies_failed.fetch_add(1, Ordering::Relaxed);
                self.event(format!("node {target} could not fetch {}: {e}", id.short(12)));
            }
        }
        outcome
    }

    /// Brings `name`'s manifests and ref (and its goal) to peer `target`.
    async fn push_ref(self: &Arc<Self>, target: u32, name: &DatasetName, replicas: u32) -> Result<()> {
        let paths = self.local.paths().clone();
        let log = paths.read_ref(name)?;
        for version in log.versions() {
            let id = version.manifest.0;
            if !self.peer_holds(target, WireKind::Manifest, id) {
                let bytes = self
                    .local
                    .holds(WireKind::Manifest, id)
                    .ok_or_else(|| Error::NotFound { what: format!("manifest {id} of {name}@{}", version.number) })?;
                self.fetch_once(target, WireKind::Manifest, id, bytes, Vec::new()).await?;
            }
        }
        let addr = self.peer_addr(target).ok_or_else(|| Error::NotFound { what: format!("node {target}") })?;
        let transport = |source: TransportError| Error::Transport { peer: format!("node {target} ({addr})"), source };
        let (mut channel, _) = self.connect(addr).await.map_err(transport)?;
        let request = self.next_request_id();
        let text = log.encode();
        channel
            .send(&Frame::PutRef { request, replicas, name: name.as_str(), log: text.as_bytes() })
            .await
            .map_err(transport)?;
        match channel.recv().await.map_err(transport)? {
            Frame::Reply { request: r, code: ReplyCode::Ok, .. } if r == request => Ok(()),
            Frame::Reply { code, message, .. } => Err(Error::PeerRefused {
                peer: format!("node {target}"),
                request: "put-ref",
                code: code.to_string(),
                message: message.to_owned(),
            }),
            other => {
                Err(transport(TransportError::Protocol { detail: format!("answered a ref with {:?}", other.kind()) }))
            }
        }
    }

    /// The shards of every live version of `name`, with their lengths.
    fn shards_of(&self, name: &DatasetName) -> Result<BTreeMap<ShardId, u64>> {
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

    /// Replicates `spec` with `replicas` copies per shard, waiting for them as `mode` says (or
    /// the replicator); reports (shards done, shards) to `progress` as copies are confirmed.
    pub(crate) async fn replicate(
        self: &Arc<Self>,
        spec: &str,
        replicas: u32,
        mode: ReplicateMode,
        progress: Option<mpsc::Sender<(u64, u64)>>,
    ) -> Result<ReplicateReport> {
        let started = Instant::now();
        if replicas == 0 {
            return Err(Error::invalid_input("--replicas must be at least 1"));
        }
        let spec = VersionSpec::parse(spec)?;
        let name = match &spec {
            VersionSpec::Latest(name) | VersionSpec::Numbered(name, _) => name.clone(),
            VersionSpec::Manifest(_) => {
                return Err(Error::invalid_input("replicate takes NAME or NAME@N (a ref goes with the copies)"));
            }
        };
        // What an ingest beside this node just published is not listed yet.
        {
            let shared = Arc::clone(self);
            tokio::task::spawn_blocking(move || shared.local.rescan())
                .await
                .map_err(|e| Error::invalid_input(format!("rescan failed: {e}")))??;
        }
        let paths = self.local.paths().clone();
        let (manifest_id, _) = paths.resolve(&spec)?;
        let manifest = paths.read_manifest(manifest_id)?;
        // A node holds at most one copy of a shard: a factor above the nodes of the job cannot
        // be met, and is refused before a goal is saved or a ref pushed. (One above the nodes
        // up now can, once they are back: a goal, kept by the reconciler.)
        check_replicas_possible(&self.node_infos(), self.peers_not_heard_from(), replicas)?;
        {
            let shared = Arc::clone(self);
            let name = name.clone();
            tokio::task::spawn_blocking(move || shared.local.set_goal(&name, replicas))
                .await
                .map_err(|e| Error::invalid_input(format!("saving the goal failed: {e}")))??;
        }
        let mut failures = Vec::new();
        for (peer, _) in self.up_peers() {
            if let Err(e) = self.push_ref(peer, &name, replicas).await {
                failures.push(format!("ref to node {peer}: {e}"));
            }
        }
        let nodes = self.node_infos();
        let placement = self.placement(nodes, replicas).await?;
        let mode = match mode {
            ReplicateMode::Node => placement.mode,
            ReplicateMode::Synchronous => ReplicationMode::Synchronous,
            ReplicateMode::Asynchronous => ReplicationMode::Asynchronous,
        };
        let shards: Vec<(ShardId, u64)> = manifest
            .entries()
            .iter()
            .map(|e| (e.shard, e.file_bytes))
            .collect::<BTreeMap<_, _>>()
            .into_iter()
            .collect();
        let total = shards.len() as u64;
        let mut report = ReplicateReport {
            name: name.to_string(),
            replicas,
            mode,
            shards: total,
            shards_done: 0,
            copies_made: 0,
            failures: Vec::new(),
            elapsed: Duration::ZERO,
        };
        let up: BTreeSet<u32> = self.up_peers().into_iter().map(|(id, _)| id).collect();
        let mut jobs = Vec::new();
        for (shard, bytes) in &shards {
            let holders = self.holders(WireKind::Shard, shard.0);
            if holders.is_empty() {
                failures.push(format!("shard {shard}: no node that is up holds it"));
                continue;
            }
            let targets: Vec<u32> = placement
                .nodes(shard.0.as_bytes())
                .iter()
                .copied()
                .filter(|t| up.contains(t) && !holders.contains(t))
                .collect();
            jobs.push((*shard, *bytes, holders, targets));
        }
        if mode == ReplicationMode::Asynchronous {
            // The reconciler makes the copies and measures how far behind they are.
            self.wake.notify_one();
            report.failures = failures;
            report.elapsed = started.elapsed();
            return Ok(report);
        }
        let mut tasks = tokio::task::JoinSet::new();
        for (shard, bytes, holders, targets) in jobs {
            let shared = Arc::clone(self);
            tasks.spawn(async move {
                let mut made = 0u64;
                let mut errors = Vec::new();
                for target in targets {
                    match shared.fetch_once(target, WireKind::Shard, shard.0, bytes, holders.clone()).await {
                        Ok(_) => made += 1,
                        Err(e) => errors.push(format!("shard {} to node {target}: {e}", shard.0.short(12))),
                    }
                }
                // A node that is down is no target: the copies are counted, not assumed from
                // the plan.
                (made, errors, holders.len() as u64 + made)
            });
        }
        // A shard counts as done once every copy it needed is confirmed (at once, when it needed
        // none); one that no node holds never does.
        let mut done = 0;
        if let Some(progress) = &progress {
            let _ = progress.send((done, total)).await;
        }
        let (mut n_short, mut copies_min) = (0u64, u64::from(replicas));
        while let Some(joined) = tasks.join_next().await {
            let (made, errors, copies) =
                joined.map_err(|e| Error::invalid_input(format!("a replication task failed: {e}")))?;
            report.copies_made += made;
            if copies < u64::from(replicas) {
                n_short += 1;
                copies_min = copies_min.min(copies);
            } else if errors.is_empty() {
                done += 1;
            }
            failures.extend(errors);
            if let Some(progress) = &progress {
                let _ = progress.send((done, total)).await;
            }
        }
        if n_short > 0 {
            failures.push(format!(
                "{n_short} of {total} shards have fewer than {replicas} copies (as few as {copies_min}) with {} nodes up",
                // Now, not when the copies were planned: a peer may have gone down meanwhile.
                self.up_peers().len() + 1
            ));
        }
        report.shards_done = done;
        report.failures = failures;
        report.elapsed = started.elapsed();
        if report.failures.is_empty() {
            Ok(report)
        } else {
            Err(Error::Unavailable {
                what: format!("{} copies of {}", replicas, report.name),
                detail: report.failures.join("; "),
            })
        }
    }

    /// One pass of the reconciler.
    async fn reconcile(self: &Arc<Self>) -> Result<()> {
        {
            let shared = Arc::clone(self);
            tokio::task::spawn_blocking(move || shared.local.rescan())
                .await
                .map_err(|e| Error::invalid_input(format!("rescan failed: {e}")))??;
        }
        let goals = self.local.goals()?;
        let nodes = self.node_infos();
        let n_up = nodes.iter().filter(|n| n.up).count();
        let mut by_factor: BTreeMap<u32, BTreeMap<ShardId, u64>> = BTreeMap::new();
        for (name, &replicas) in &goals {
            match self.shards_of(name) {
                Ok(shards) => by_factor.entry(replicas).or_default().extend(shards),
                Err(e) => self.event(format!("goal {name}: {e}")),
            }
            // Peers that lack this dataset's manifests get them, then the ref.
            for (peer, _) in self.up_peers() {
                let missing = match self.local.paths().read_ref(name) {
                    Ok(log) => log.versions().iter().any(|v| !self.peer_holds(peer, WireKind::Manifest, v.manifest.0)),
                    Err(_) => false,
                };
                if missing
                    && self.pushing.lock().expect("the push table lock is never poisoned").insert((peer, name.clone()))
                {
                    let shared = Arc::clone(self);
                    let name = name.clone();
                    tokio::spawn(async move {
                        if let Err(e) = shared.push_ref(peer, &name, replicas).await {
                            shared.event(format!("could not bring {name} to node {peer}: {e}"));
                        }
                        shared.pushing.lock().expect("the push table lock is never poisoned").remove(&(peer, name));
                    });
                }
            }
        }
        let now = Instant::now();
        let mut under: HashMap<ShardId, Instant> = HashMap::new();
        let mut unavailable = 0;
        // Fetch requests started in this pass, across factors; none while many are pending.
        let mut started = self.fetching.len();
        for (&replicas, shards) in &by_factor {
            let want = (replicas as usize).min(n_up);
            let mut holdings = Vec::with_capacity(shards.len());
            let mut by_key: HashMap<u64, (ShardId, u64)> = HashMap::with_capacity(shards.len());
            for (&shard, &bytes) in shards {
                let holders = self.holders(WireKind::Shard, shard.0);
                if holders.is_empty() {
                    unavailable += 1;
                }
                if holders.len() < want {
                    under.insert(shard, now);
                }
                let key = shard_key(shard.0.as_bytes());
                by_key.insert(key, (shard, bytes));
                holdings.push(Holding { key, nodes: holders });
            }
            let transfers = match self.repair_plan(nodes.clone(), replicas, holdings).await {
                Ok(transfers) => transfers,
                Err(e) => {
                    self.event(format!("the replicator's repair plan failed: {e}"));
                    continue;
                }
            };
            for t in transfers {
                if t.source != self.hello.node_id {
                    continue;
                }
                let Some(&(shard, bytes)) = by_key.get(&t.key) else { continue };
                // One request per (shard, target) at a time, and a bounded number started per
                // pass: the rest wait for the next pass.
                if started >= FETCHES_PER_PASS_MAX || self.fetching.contains(&(shard.0, t.target)) {
                    continue;
                }
                started += 1;
                let others = self.holders(WireKind::Shard, shard.0);
                let shared = Arc::clone(self);
                tokio::spawn(async move {
                    let _ = shared.fetch_once(t.target, WireKind::Shard, shard.0, bytes, others).await;
                });
            }
        }
        let mut lag = self.lag.lock().expect("the lag lock is never poisoned");
        let previous = std::mem::take(&mut lag.under);
        for (shard, since) in &mut under {
            if let Some(&first) = previous.get(shard) {
                *since = first;
            }
        }
        for (shard, since) in previous {
            if !under.contains_key(&shard) {
                let took = now.duration_since(since);
                lag.last = Some(took);
                lag.max = lag.max.max(took);
            }
        }
        lag.under = under;
        lag.unavailable = unavailable;
        Ok(())
    }

    /// The status report.
    pub(crate) fn status(&self) -> NodeStatus {
        let now = Instant::now();
        let peers = {
            let peers = self.peers.lock().expect("the peer lock is never poisoned");
            peers
                .iter()
                .map(|p| PeerStatus {
                    id: p.id(),
                    addr: p.addr,
                    up: p.up,
                    for_ms: now.duration_since(p.changed).as_millis() as u64,
                    objects: p.inventory.len(),
                    demoted: p.demoted(now),
                    last_error: p.last_error.clone(),
                })
                .collect()
        };
        let goals = self.local.goals().unwrap_or_default();
        let (under_replicated, unavailable, lag_oldest_ms, lag_last_ms, lag_max_ms) = {
            let lag = self.lag.lock().expect("the lag lock is never poisoned");
            let oldest = lag.under.values().map(|since| now.duration_since(*since)).max().unwrap_or_default();
            (
                lag.under.len(),
                lag.unavailable,
                oldest.as_millis() as u64,
                lag.last.map(|d| d.as_millis() as u64),
                lag.max.as_millis() as u64,
            )
        };
        let (cache_bytes, cache_objects) = {
            let cache = self.cache.lock().expect("the cache lock is never poisoned");
            (cache.used_bytes(), cache.len())
        };
        let stat = |c: &AtomicU64| c.load(Ordering::Relaxed);
        NodeStatus {
            id: self.hello.node_id,
            incarnation: self.hello.epoch,
            listen: self.hello.listen.clone(),
            root: self.config.root.clone(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            objects: self.local.entries().len(),
            peers,
            goals: goals
                .into_iter()
                .map(|(name, replicas)| GoalStatus { dataset: name.to_string(), replicas })
                .collect(),
            under_replicated,
            unavailable,
            lag_oldest_ms,
            lag_last_ms,
            lag_max_ms,
            pending_fetches: self.fetching.len(),
            copies_made: stat(&self.stats.copies_made),
            copies_failed: stat(&self.stats.copies_failed),
            objects_received: stat(&self.stats.objects_received),
            bytes_sent: stat(&self.stats.bytes_sent),
            verify_failures: stat(&self.stats.verify_failures),
            demotions: stat(&self.stats.demotions),
            connections_refused: stat(&self.stats.connections_refused),
            connections_busy: stat(&self.stats.connections_busy),
            frames_rejected: stat(&self.stats.frames_rejected),
            repairs: stat(&self.stats.repairs),
            cache_bytes,
            cache_bytes_max: self.config.cache_bytes_max,
            cache_objects,
            evicted: stat(&self.stats.evicted),
            kept_last_copy: stat(&self.stats.kept_last_copy),
            events: self.events.lock().expect("the event lock is never poisoned").iter().cloned().collect(),
            events_omitted: 0,
            peers_omitted: 0,
        }
    }
}

/// The reconciler task.
async fn reconciler(shared: Arc<Shared>, mut shutdown: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(shared.config.reconcile_every) => {}
            _ = shared.wake.notified() => {}
            _ = shutdown.changed() => return,
        }
        if let Err(e) = shared.reconcile().await {
            shared.event(format!("reconcile failed: {e}"));
        }
        // Publications come in bursts; between them an ingest may want the store.
        shared.local.release_if_idle(WRITE_SESSION_IDLE);
    }
}

/// The heartbeat of peer `index`: keeps a channel to it, pings it, refreshes its inventory.
async fn heartbeat(shared: Arc<Shared>, index: usize, mut shutdown: watch::Receiver<bool>) {
    let addr = shared.peers.lock().expect("the peer lock is never poisoned")[index].addr;
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
        let now = Instant::now();
        let mut changed = false;
        {
            let mut peers = shared.peers.lock().expect("the peer lock is never poisoned");
            let peer = &mut peers[index];
            match probed {
                Ok(()) => {
                    peer.last_ok = Some(now);
                    peer.last_error.clear();
                    if !peer.up {
                        peer.up = true;
                        peer.changed = now;
                        changed = true;
                    }
                }
                Err(e) => {
                    channel = None;
                    peer.last_error = e.to_string();
                    let silent_for = peer.last_ok.map_or(Duration::MAX, |t| now.duration_since(t));
                    if peer.up && silent_for >= shared.config.down_after {
                        peer.up = false;
                        peer.changed = now;
                        changed = true;
                    }
                }
            }
        }
        if changed {
            let (id, up) = {
                let peers = shared.peers.lock().expect("the peer lock is never poisoned");
                (peers[index].id(), peers[index].up)
            };
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
        {
            let mut peers = shared.peers.lock().expect("the peer lock is never poisoned");
            if let Some(other) = peers.iter().position(|p| p.id() == Some(hello.node_id) && p.addr != addr) {
                if peers[other].up {
                    let detail = format!("node {} is already known, up, at {}", hello.node_id, peers[other].addr);
                    return Err(TransportError::Protocol { detail });
                }
                // The node came back at another address: the old one no longer names it.
                peers[other].hello = None;
                peers[other].inventory.clear();
                peers[other].generation = 0;
            }
            let peer = &mut peers[index];
            if peer.hello.as_ref().is_some_and(|h| h.epoch != hello.epoch) {
                // A new incarnation: its inventory is fetched afresh.
                peer.generation = 0;
            }
            peer.hello = Some(hello);
        }
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
    let known = shared.peers.lock().expect("the peer lock is never poisoned")[index].generation;
    if generation == known {
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
    let mut peers = shared.peers.lock().expect("the peer lock is never poisoned");
    peers[index].inventory = inventory;
    peers[index].generation = generation;
    drop(peers);
    shared.wake.notify_one();
    Ok(())
}

/// Refuses a replication factor above the nodes of the job that may take copies (`nodes` with
/// a weight, up or not, and the peers not heard from yet): each holds at most one copy of a
/// shard, so such a goal is never met.
fn check_replicas_possible(nodes: &[NodeInfo], n_unheard: usize, replicas: u32) -> Result<()> {
    let holding: Vec<&NodeInfo> = nodes.iter().filter(|n| n.weight > 0).collect();
    let n_job = holding.len() + n_unheard;
    if replicas as usize <= n_job {
        return Ok(());
    }
    let n_up = holding.iter().filter(|n| n.up).count();
    let domains: BTreeSet<u32> = holding.iter().map(|n| n.failure_domain).collect();
    let unheard = if n_unheard > 0 { format!(", {n_unheard} not heard from") } else { String::new() };
    Err(Error::invalid_input(format!(
        "{replicas} copies of each shard asked, but the job has {n_job} nodes ({n_up} up{unheard}) in {} failure domains, and a node holds at most one copy",
        domains.len()
    )))
}

/// What `replicate` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicateReport {
    /// The dataset.
    pub name: String,
    /// Copies wanted per shard.
    pub replicas: u32,
    /// Whether the copies were waited for.
    pub mode: ReplicationMode,
    /// Shards in the version.
    pub shards: u64,
    /// Shards whose copies were all confirmed (synchronous mode).
    pub shards_done: u64,
    /// Copies made.
    pub copies_made: u64,
    /// What failed.
    pub failures: Vec<String>,
    /// How long it took.
    pub elapsed: Duration,
}

impl fmt::Display for ReplicateReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.mode {
            ReplicationMode::Synchronous => write!(
                f,
                "{}: {} shards at {} copies, synchronous: {} of {} shards confirmed, {} copies made, verified on their nodes, in {:.2} s",
                self.name,
                self.shards,
                self.replicas,
                self.shards_done,
                self.shards,
                self.copies_made,
                self.elapsed.as_secs_f64()
            ),
            ReplicationMode::Asynchronous => write!(
                f,
                "{}: {} shards at {} copies, asynchronous: copies are made in the background (`granary status` shows the lag)",
                self.name, self.shards, self.replicas
            ),
        }
    }
}
