//! A client of a running node: what `granary replicate` and `granary status` use, and the
//! read-time repair hook of reader processes beside a `granary serve`.

use std::net::SocketAddr;
use std::path::Path;

use super::frame::{Frame, Goal, ReplicateMode, ReplyCode, Role};
use super::secure::{Channel, ClusterKey, Deadlines, Hello};
use super::status::NodeStatus;
use crate::error::{Error, Result, TransportError};
use crate::id::ShardId;
use crate::read::ShardRepair;

/// Talks to one node. Each call opens its own authenticated connection.
#[derive(Debug)]
pub struct NodeClient {
    addr: SocketAddr,
    key: ClusterKey,
    deadlines: Deadlines,
}

impl NodeClient {
    /// A client of the node listening at `addr`.
    pub fn new(addr: SocketAddr, key: ClusterKey) -> Self {
        Self { addr, key, deadlines: Deadlines::default() }
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

impl ShardRepair for NodeClient {
    fn repair(&self, shard: ShardId, _cause: &Error) -> Result<()> {
        NodeClient::repair(self, shard).map(|_| ())
    }
}
