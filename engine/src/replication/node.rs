//! The node: the public handle of a store's replication service, on a tokio runtime of its own.
//!
//! Owns `Node`: it builds the shared state (`shared.rs`), starts the runtime's tasks (the
//! listener in `server.rs`, a heartbeat per peer from `heartbeat.rs`, the reconciler in
//! `reconcile.rs`) and runs callers' requests on that runtime, never on theirs. Never: holds
//! a job's logic itself (each job's file does); never runs on a trainer's threads.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore, watch};

use super::admission::Handshakes;
pub use super::config::{Faults, NodeConfig};
use super::flight::InFlight;
use super::frame::{Goal, ReplicateMode, Role};
use super::local::LocalStore;
use super::peers::PeerTable;
pub use super::replicate::ReplicateReport;
use super::secure::Hello;
use super::shared::{FETCHES_MAX, Lag, PULLS_MAX, Shared, Stats};
pub use super::status::{CodedVersionStatus, GoalStatus, NodeStatus, PeerStatus};
use crate::error::{Error, Result};
use crate::id::ShardId;
use crate::policy::{PolicyHost, ShardCache};
use crate::read::ShardSource;

/// The node id derived from a listen address (when neither the user nor a launcher gives one).
fn node_id_of(listen: &SocketAddr) -> u32 {
    let hash = blake3::hash(listen.to_string().as_bytes());
    u32::from_le_bytes(hash.as_bytes()[..4].try_into().expect("4 bytes")) & 0x7fff_ffff
}

/// A running node. Dropping it stops its tasks and joins its threads.
pub struct Node {
    runtime: Option<tokio::runtime::Runtime>,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    /// `/metrics`, when `NodeConfig::metrics_listen` asked for it.
    metrics: Option<crate::metrics::Endpoint>,
    /// The node's metrics source, told when the node is dropped.
    metrics_source: Option<Arc<super::metrics::NodeMetrics>>,
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
        let (heat, hot) =
            (super::heat_state::HeatWindow::new(config.heat_window), super::heat_state::HotState::load(&config.root));
        let shared = Arc::new(Shared {
            config,
            local,
            hello,
            stats: Stats::default(),
            peers: PeerTable::new(node_id),
            pulls: InFlight::new(),
            pull_slots: Semaphore::new(PULLS_MAX),
            fetch_slots: Arc::new(Semaphore::new(FETCHES_MAX)),
            fetching: InFlight::new(),
            pushing: Mutex::new(std::collections::HashSet::new()),
            coding_work: Mutex::new(std::collections::HashSet::new()),
            encode_slots: tokio::sync::Semaphore::new(super::coded::ENCODES_MAX),
            goals_pending: Mutex::new(std::collections::HashSet::new()),
            declined: Mutex::new(std::collections::HashSet::new()),
            heat: Mutex::new(heat),
            hot: Mutex::new(hot),
            fragment_headers: Mutex::new(std::collections::HashMap::new()),
            outgoing: Mutex::new(std::collections::HashMap::new()),
            connection_slots: Arc::new(Semaphore::new(super::server::CONNECTIONS_MAX)),
            handshakes: Arc::new(Handshakes::default()),
            wake: Notify::new(),
            events: Mutex::new(std::collections::VecDeque::new()),
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
        let peers = runtime.block_on(shared.config.membership.resolve(
            &shared.hello,
            &shared.config.key,
            shared.config.deadlines,
        ))?;
        for addr in peers {
            shared.learn_peer(addr);
        }
        // The cache entries of an earlier life count against the bound again.
        shared.readmit_cache()?;
        runtime.spawn(super::reconcile::reconciler(Arc::clone(&shared), shutdown));
        let registry = shared.config.metrics.registry();
        let metrics_source = registry.as_ref().map(|registry| {
            let source = Arc::new(super::metrics::NodeMetrics::new(Arc::downgrade(&shared)));
            registry.register(Arc::clone(&source) as Arc<dyn crate::metrics::Source>);
            source
        });
        let metrics = match shared.config.metrics_listen {
            // Asked to serve with its metrics off, a node serves the process's registry (the
            // loaders and plugins of the process, without the node).
            Some(addr) => Some(crate::metrics::Endpoint::start(
                addr,
                registry.unwrap_or_else(|| crate::metrics::global().clone()),
                Some(runtime.handle()),
            )?),
            None => None,
        };
        shared.local.record_metrics_listen(metrics.as_ref().map(|e| e.addr()).as_ref())?;
        shared.event(format!("node {node_id} (incarnation {}) listening on {bound}", shared.hello.epoch));
        Ok(Node { runtime: Some(runtime), shared, stop, metrics, metrics_source })
    }

    /// This node's id.
    pub fn id(&self) -> u32 {
        self.shared.hello.node_id
    }

    /// Where it listens.
    pub fn listen_addr(&self) -> SocketAddr {
        self.shared.hello.listen.parse().expect("the bound address parses")
    }

    /// Where its `/metrics` endpoint listens, if it serves one.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(crate::metrics::Endpoint::addr)
    }

    /// What the node knows now.
    pub fn status(&self) -> NodeStatus {
        self.shared.status()
    }

    /// Replicates dataset version `spec` (NAME or NAME@N) with `replicas` copies of each shard.
    /// In synchronous mode (the replicator decides) this returns once every copy is verified on
    /// its node; in asynchronous mode once the copies are scheduled.
    pub fn replicate(&self, spec: &str, replicas: u32) -> Result<ReplicateReport> {
        self.replicate_in(spec, Goal::Replicas(replicas), ReplicateMode::Node)
    }

    /// [`Node::replicate`] as `goal` says (copies, or fragments of a coding), waiting for them
    /// or not as `mode` says for this call (the replicator's setting stays the default of other
    /// calls).
    pub fn replicate_in(&self, spec: &str, goal: Goal, mode: ReplicateMode) -> Result<ReplicateReport> {
        let shared = Arc::clone(&self.shared);
        let spec = spec.to_owned();
        self.block_on(async move { shared.replicate(&spec, goal, mode, None).await })
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
        if let Some(source) = &self.metrics_source {
            source.end();
        }
        if self.metrics.take().is_some() {
            // No endpoint of a stopped node to be found by `granary top`.
            let _ = self.shared.local.record_metrics_listen(None);
        }
        let _ = self.stop.send(true);
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

impl ShardSource for Node {
    fn repair(&self, shard: ShardId, _cause: &Error) -> Result<()> {
        Node::repair(self, shard).map(|_| ())
    }

    fn accessed(&self, shards: &[ShardId]) {
        self.shared.accessed(shards);
    }
}
