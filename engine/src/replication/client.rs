//! A client of a running node: what `granary replicate` and `granary status` use, and the
//! read-time repair hook of reader processes beside a `granary serve`.
//!
//! Owns: `NodeClient` (`status`, `replicate`, `repair`, `report_reads`; `for_store` finds the node
//! of a store through `replication/listen`) and its `ShardSource` hook, which counts a reader's
//! shard reads and reports them about once a second. Never: writes to the store (the node it asks
//! repairs and publishes), or keeps a connection between calls (each call opens its own,
//! authenticated).

use std::net::SocketAddr;
use std::path::Path;

use super::frame::{Frame, Goal, ReplicateMode, ReplyCode, Role};
use super::secure::{Channel, ClusterKey, Deadlines, Hello};
use super::status::NodeStatus;
use crate::error::{Error, Result, TransportError};
use crate::id::ShardId;
use crate::read::ShardSource;

/// Talks to one node. Each call opens its own authenticated connection.
#[derive(Debug)]
pub struct NodeClient {
    addr: SocketAddr,
    key: ClusterKey,
    deadlines: Deadlines,
    /// Shard reads of a reader using this client as its repair hook, not yet reported, and when
    /// they were last.
    reads: parking_lot::Mutex<(Option<std::time::Instant>, std::collections::HashMap<ShardId, u64>)>,
}

/// How often a reader's shard reads are reported to its node.
const READS_REPORT_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl NodeClient {
    /// A client of the node listening at `addr`.
    pub fn new(addr: SocketAddr, key: ClusterKey) -> Self {
        Self { addr, key, deadlines: Deadlines::default(), reads: parking_lot::Mutex::new((None, Default::default())) }
    }

    /// A client of the node serving the store at `root` (it records where it listens).
    pub fn for_store(root: &Path, key: ClusterKey) -> Result<Self> {
        let path = root.join("replication").join("listen");
        let text = std::fs::read_to_string(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                Error::NotFound { what: format!("a node serving {} (start one with `granary serve`)", root.display()) }
            }
            _ => Error::io("read", &path, e),
        })?;
        let addr = text
            .trim()
            .parse()
            .map_err(|_| Error::invalid_input(format!("{}: not an address: {text:?}", path.display())))?;
        Ok(Self::new(addr, key))
    }

    /// A client of the node serving the store at `root`, when one does (`for_store`'s "no node"
    /// is `None`; any other failure, such as an unreadable address, is the error).
    pub fn serving(root: &Path, key: ClusterKey) -> Result<Option<Self>> {
        match Self::for_store(root, key) {
            Ok(client) => Ok(Some(client)),
            Err(Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The node beside a process reading the store at `root`: the one serving it, when
    /// `GRANARY_CLUSTER_KEY` holds the cluster's key (the loaders' and the origin cache's way to
    /// find their peers).
    pub fn beside(root: &Path) -> Result<Option<Self>> {
        match ClusterKey::from_env()? {
            Some(key) => Self::serving(root, key),
            None => Ok(None),
        }
    }

    /// The node's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Runs `work` on a connection, on a runtime of this call's own (on a thread of its own, so
    /// a caller inside another async runtime is not disturbed).
    fn run<R: Send + 'static>(
        &self,
        work: impl FnOnce(Channel) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<R>> + Send>>
        + Send
        + 'static,
    ) -> Result<R> {
        let (addr, key, deadlines) = (self.addr, self.key.clone(), self.deadlines);
        let peer = format!("node at {addr}");
        std::thread::scope(|scope| {
            scope
                .spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .map_err(|e| Error::io("start a client runtime", "tokio", e))?;
                    runtime.block_on(async move {
                        let hello = Hello {
                            node_id: 0,
                            role: Role::Client,
                            weight: 0,
                            failure_domain: 0,
                            listen: String::new(),
                            epoch: 0,
                        };
                        let (channel, _) = Channel::connect(addr, &key, &hello, deadlines)
                            .await
                            .map_err(|source| Error::Transport { peer, source })?;
                        work(channel).await
                    })
                })
                .join()
                .unwrap_or_else(|_| Err(Error::invalid_input("the client thread panicked")))
        })
    }

    /// The node's status report.
    pub fn status(&self) -> Result<NodeStatus> {
        let peer = self.addr;
        self.run(move |mut channel| {
            Box::pin(async move {
                let transport = |source| Error::Transport { peer: format!("node at {peer}"), source };
                channel.send(&Frame::StatusRequest { request: 1 }).await.map_err(transport)?;
                match channel.recv().await.map_err(transport)? {
                    Frame::Status { text, .. } => NodeStatus::from_json(text),
                    other => Err(unexpected(peer, other.kind())),
                }
            })
        })
    }

    /// Asks the node to replicate `spec` as `goal` says (copies, or coded fragments), waiting
    /// for them as `mode` says (`ReplicateMode::Node`: as the node's replicator says);
    /// `progress(done, total)` is called as shards are confirmed. Returns the node's report.
    pub fn replicate(
        &self,
        spec: &str,
        goal: Goal,
        mode: ReplicateMode,
        mut progress: impl FnMut(u64, u64) + Send + 'static,
    ) -> Result<String> {
        let peer = self.addr;
        let spec = spec.to_owned();
        self.run(move |mut channel| {
            Box::pin(async move {
                let transport = |source| Error::Transport { peer: format!("node at {peer}"), source };
                channel.send(&Frame::Replicate { request: 1, goal, mode, spec: &spec }).await.map_err(transport)?;
                loop {
                    // Copies of large datasets take a while: wait for progress without a short
                    // deadline (each frame still has the per-record one once it starts).
                    let frame =
                        channel.recv_within(std::time::Duration::from_secs(24 * 3600)).await.map_err(transport)?;
                    match frame {
                        Frame::Progress { last: false, done, total, .. } => progress(done, total),
                        Frame::Progress { last: true, code: ReplyCode::Ok, message, .. } => {
                            return Ok(message.to_owned());
                        }
                        Frame::Progress { last: true, code, message, .. } | Frame::Reply { code, message, .. } => {
                            return Err(Error::PeerRefused {
                                peer: format!("node at {peer}"),
                                request: "replicate",
                                code: code.to_string(),
                                message: message.to_owned(),
                            });
                        }
                        other => return Err(unexpected(peer, other.kind())),
                    }
                }
            })
        })
    }

    /// Asks the node to replace shard `id` with a verified copy from a peer.
    pub fn repair(&self, id: ShardId) -> Result<String> {
        let peer = self.addr;
        self.run(move |mut channel| {
            Box::pin(async move {
                let transport = |source| Error::Transport { peer: format!("node at {peer}"), source };
                channel.send(&Frame::Repair { request: 1, id: id.0 }).await.map_err(transport)?;
                match channel.recv_within(std::time::Duration::from_secs(600)).await.map_err(transport)? {
                    Frame::Reply { code: ReplyCode::Ok, message, .. } => Ok(message.to_owned()),
                    Frame::Reply { code, message, .. } => Err(Error::PeerRefused {
                        peer: format!("node at {peer}"),
                        request: "repair",
                        code: code.to_string(),
                        message: message.to_owned(),
                    }),
                    other => Err(unexpected(peer, other.kind())),
                }
            })
        })
    }

    /// Tells the node that a reader beside it read these shards (how many times each): they
    /// count in the node's heat, from which the replicator gives the most read shards more
    /// copies. Sent in frames of at most `HEAT_ENTRIES_MAX` shards.
    pub fn report_reads(&self, reads: &[(ShardId, u64)]) -> Result<()> {
        let peer = self.addr;
        let mut merged: std::collections::BTreeMap<crate::id::ObjectId, u64> = std::collections::BTreeMap::new();
        for &(shard, n) in reads {
            let sum = merged.entry(shard.0).or_default();
            *sum = sum.saturating_add(n);
        }
        let entries: Vec<(crate::id::ObjectId, u64)> = merged.into_iter().filter(|&(_, n)| n > 0).collect();
        if entries.is_empty() {
            return Ok(());
        }
        self.run(move |mut channel| {
            Box::pin(async move {
                let transport = |source| Error::Transport { peer: format!("node at {peer}"), source };
                for (page, entries) in entries.chunks(super::frame::HEAT_ENTRIES_MAX).enumerate() {
                    let request = page as u32 + 1;
                    channel.send(&Frame::Accessed { request, entries: entries.to_vec() }).await.map_err(transport)?;
                    match channel.recv().await.map_err(transport)? {
                        Frame::Reply { code: ReplyCode::Ok, .. } => {}
                        Frame::Reply { code, message, .. } => {
                            return Err(Error::PeerRefused {
                                peer: format!("node at {peer}"),
                                request: "report reads",
                                code: code.to_string(),
                                message: message.to_owned(),
                            });
                        }
                        other => return Err(unexpected(peer, other.kind())),
                    }
                }
                Ok(())
            })
        })
    }

    #[doc(hidden)]
    /// Connects and hands the raw channel to `work`, for tests of what a node does with bad
    /// frames.
    pub fn with_channel<R: Send + 'static>(
        &self,
        work: impl FnOnce(Channel) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<R>> + Send>>
        + Send
        + 'static,
    ) -> Result<R> {
        self.run(work)
    }
}

fn unexpected(peer: SocketAddr, kind: super::frame::Kind) -> Error {
    Error::Transport {
        peer: format!("node at {peer}"),
        source: TransportError::Protocol { detail: format!("unexpected {kind:?}") },
    }
}

impl ShardSource for NodeClient {
    fn repair(&self, shard: ShardId, _cause: &Error) -> Result<()> {
        NodeClient::repair(self, shard).map(|_| ())
    }

    /// Counts the reads, and about once a second reports them to the node on a thread of its
    /// own (the reader does not wait; a report that fails is lost, as heat may be).
    fn accessed(&self, shards: &[ShardId]) {
        let mut reads = self.reads.lock();
        for &shard in shards {
            *reads.1.entry(shard).or_default() += 1;
        }
        let now = std::time::Instant::now();
        if reads.0.is_some_and(|at| now.saturating_duration_since(at) < READS_REPORT_EVERY) {
            return;
        }
        reads.0 = Some(now);
        let entries: Vec<(ShardId, u64)> = std::mem::take(&mut reads.1).into_iter().collect();
        drop(reads);
        let client = NodeClient::new(self.addr, self.key.clone());
        let _ = std::thread::Builder::new().name("granary-report-reads".to_owned()).spawn(move || {
            let _ = client.report_reads(&entries);
        });
    }
}
