//! Who the other nodes are: a list of addresses, or a launcher's environment and one rendezvous.
//!
//! Owns: `Membership` (a peer list, resolved when given, or a launcher's environment:
//! `from_launcher_env`, `RENDEZVOUS_PORT_ENV`) and `resolve`, which asks the rendezvous for the
//! other nodes' addresses.
//!
//! Membership is given, never agreed on: a peer list names the other nodes (a node that
//! connects later with its listen address is learned as well), and under torchrun node 0 of the
//! job is the rendezvous where every node announces its address once and learns the others'.
//! Which nodes are up is then each node's own observation (heartbeats). Never: elects, votes or
//! orders anything.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::frame::Frame;
use super::secure::{Channel, ClusterKey, Deadlines, Hello};
use crate::error::{Error, Result};

/// Where the membership comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Membership {
    /// The other nodes' addresses.
    Peers(Vec<SocketAddr>),
    /// A launcher's environment (torchrun): this node's rank among the nodes, their number, and
    /// the rendezvous address (node 0 listens there).
    Launcher {
        /// This node's rank among the job's nodes (torchrun's `GROUP_RANK`).
        node_rank: u32,
        /// Nodes in the job.
        n_nodes: u32,
        /// `MASTER_ADDR` and the rendezvous port.
        rendezvous: String,
        /// How long to wait for every node to join.
        wait: Duration,
    },
}

/// The environment variable that overrides the rendezvous port (default `MASTER_PORT + 1`, so
/// it never collides with torch's own store).
pub const RENDEZVOUS_PORT_ENV: &str = "GRANARY_RENDEZVOUS_PORT";

impl Membership {
    /// A peer list of `host:port` entries (names are resolved now).
    pub fn peers<S: AsRef<str>>(list: &[S]) -> Result<Self> {
        let mut addrs = Vec::with_capacity(list.len());
        for entry in list {
            let entry = entry.as_ref().trim();
            if entry.is_empty() {
                continue;
            }
            let addr = entry
                .to_socket_addrs()
                .map_err(|e| Error::invalid_input(format!("peer {entry:?}: {e}")))?
                .next()
                .ok_or_else(|| Error::invalid_input(format!("peer {entry:?} resolves to no address")))?;
            addrs.push(addr);
        }
        Ok(Self::Peers(addrs))
    }

    /// The membership torchrun describes (`GROUP_RANK` or `RANK`, `WORLD_SIZE`,
    /// `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), if this process runs under it.
    pub fn from_launcher_env() -> Result<Option<Self>> {
        let var = |name: &str| std::env::var(name).ok();
        let number = |name: &str| -> Result<Option<u32>> {
            var(name)
                .map(|v| {
                    v.trim().parse::<u32>().map_err(|_| Error::invalid_input(format!("{name}={v:?} is not a number")))
                })
                .transpose()
        };
        let (Some(world), Some(master)) = (number("WORLD_SIZE")?, var("MASTER_ADDR")) else { return Ok(None) };
        let local_world = number("LOCAL_WORLD_SIZE")?.unwrap_or(1).max(1);
        let node_rank = match number("GROUP_RANK")? {
            Some(rank) => rank,
            None => number("RANK")?.unwrap_or(0) / local_world,
        };
        let n_nodes = (world / local_world).max(1);
        if node_rank >= n_nodes {
            return Err(Error::invalid_input(format!("node rank {node_rank} is not below the {n_nodes} nodes")));
        }
        let port = match number(RENDEZVOUS_PORT_ENV)? {
            Some(port) => port,
            None => number("MASTER_PORT")?.map_or(29501, |p| p + 1),
        };
        Ok(Some(Self::Launcher {
            node_rank,
            n_nodes,
            rendezvous: format!("{master}:{port}"),
            wait: Duration::from_secs(120),
        }))
    }

    /// The launcher's node rank, used as the node id.
    pub(crate) fn node_rank(&self) -> Option<u32> {
        match self {
            Self::Peers(_) => None,
            Self::Launcher { node_rank, .. } => Some(*node_rank),
        }
    }

    /// The other nodes' addresses: the list, or what the rendezvous answers once every node has
    /// joined (node 0 answers, and learns the others as they connect). `hello` is this node's,
    /// sent to the rendezvous with `key`.
    pub(crate) async fn resolve(
        &self,
        hello: &Hello,
        key: &ClusterKey,
        deadlines: Deadlines,
    ) -> Result<Vec<SocketAddr>> {
        let (n_nodes, rendezvous, wait) = match self {
            Self::Peers(addrs) => return Ok(addrs.clone()),
            Self::Launcher { node_rank: 0, .. } => return Ok(Vec::new()),
            Self::Launcher { n_nodes, rendezvous, wait, .. } => (*n_nodes, rendezvous.clone(), *wait),
        };
        let addr = rendezvous
            .to_socket_addrs()
            .map_err(|e| Error::invalid_input(format!("rendezvous {rendezvous:?}: {e}")))?
            .next()
            .ok_or_else(|| Error::invalid_input(format!("rendezvous {rendezvous:?} resolves to no address")))?;
        let started = Instant::now();
        let mut last = String::from("no answer yet");
        while started.elapsed() < wait {
            match ask_members(hello, key, deadlines, addr).await {
                Ok(members) if members.len() >= n_nodes as usize => {
                    return Ok(members
                        .into_iter()
                        .filter(|(id, _)| *id != hello.node_id)
                        .map(|(_, addr)| addr)
                        .collect());
                }
                Ok(members) => last = format!("{} of {n_nodes} nodes joined", members.len()),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(Error::Unavailable {
            what: format!("the rendezvous at {rendezvous}"),
            detail: format!("not every node joined within {} s: {last}", wait.as_secs()),
        })
    }
}

async fn ask_members(
    hello: &Hello,
    key: &ClusterKey,
    deadlines: Deadlines,
    addr: SocketAddr,
) -> Result<Vec<(u32, SocketAddr)>> {
    let transport = |source| Error::Transport { peer: format!("rendezvous {addr}"), source };
    let (mut channel, _) = Channel::connect(addr, key, hello, deadlines).await.map_err(transport)?;
    // The channel carries this one request.
    let request = 1;
    channel.send(&Frame::MembersRequest { request }).await.map_err(transport)?;
    match channel.recv().await.map_err(transport)? {
        Frame::Members { request: r, members } if r == request => members
            .into_iter()
            .map(|(id, text)| {
                text.parse::<SocketAddr>()
                    .map(|addr| (id, addr))
                    .map_err(|_| Error::invalid_input(format!("the rendezvous listed {text:?} for node {id}")))
            })
            .collect(),
        other => Err(Error::invalid_input(format!("the rendezvous answered with {:?}", other.kind()))),
    }
}
