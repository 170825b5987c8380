//! Replication policies: implement [`Replicator::place`]; a repair plan follows from it.

use std::collections::HashSet;

use crate::options::{Error, Options};
pub use crate::partition::Node;

/// Whether an ingest waits for its copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Wait until the copies are verified.
    Sync,
    /// Copy in the background.
    Async,
}

/// Shard key k lives on `buckets[k % buckets.len()]`, most preferred first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Sync or async.
    pub mode: Mode,
    /// The table.
    pub buckets: Vec<Vec<u32>>,
}

impl Placement {
    /// The nodes of shard `key`.
    pub fn nodes(&self, key: u64) -> &[u32] {
        if self.buckets.is_empty() { &[] } else { &self.buckets[(key % self.buckets.len() as u64) as usize] }
    }
}

/// Where the copies of a shard are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    /// The shard's key.
    pub key: u64,
    /// Nodes with a copy.
    pub nodes: Vec<u32>,
}

/// One copy to make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// The shard's key.
    pub key: u64,
    /// A node with a copy.
    pub source: u32,
    /// A node that should have one.
    pub target: u32,
}

/// A node's free space, as it last reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeSpace {
    /// The node.
    pub id: u32,
    /// Bytes its store may still take.
    pub free_bytes: u64,
}

/// A shard as the job reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardHeat {
    /// The shard's key.
    pub key: u64,
    /// Bytes of the shard file.
    pub bytes: u64,
    /// How often it was read over the last window, summed over the nodes (each batch of a
    /// node's readers that reads its records counts once).
    pub reads: u64,
    /// Nodes that hold a copy now.
    pub holders: Vec<u32>,
    /// The nodes the previous answer named for it (empty: it had no goal).
    pub previous: Vec<u32>,
}

/// Where one shard's copies should be, when not where the table puts them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardGoal {
    /// The shard's key.
    pub key: u64,
    /// The nodes that should hold a copy, most preferred first.
    pub nodes: Vec<u32>,
    /// Sync for a core shard, async for the rest (the host reports it; hot copies are pulled
    /// in the background either way).
    pub mode: Mode,
}

/// A replication policy.
pub trait Replicator: 'static {
    /// The placement table for these nodes.
    fn place(nodes: &[Node], replicas: u32, options: &Options) -> Result<Placement, Error>;

    /// The copies that bring every shard to its placement: for each target of a shard's bucket
    /// that is up and lacks a copy, copy from the first up holder. Shards with no up holder
    /// cannot be repaired and are left out.
    fn repair(nodes: &[Node], replicas: u32, holdings: &[Holding], options: &Options) -> Result<Vec<Transfer>, Error> {
        let placement = Self::place(nodes, replicas, options)?;
        let up: HashSet<u32> = nodes.iter().filter(|n| n.up).map(|n| n.id).collect();
        let mut transfers = Vec::new();
        for holding in holdings {
            let Some(&source) = holding.nodes.iter().find(|n| up.contains(n)) else { continue };
            for &target in placement.nodes(holding.key) {
                if up.contains(&target) && !holding.nodes.contains(&target) {
                    transfers.push(Transfer { key: holding.key, source, target });
                }
            }
        }
        Ok(transfers)
    }

    /// Per-shard goals from read counts and free space; by default none (every shard keeps the
    /// table's placement).
    fn adapt(
        nodes: &[Node],
        space: &[NodeSpace],
        replicas: u32,
        shards: &[ShardHeat],
        options: &Options,
    ) -> Result<Vec<ShardGoal>, Error> {
        let _ = (nodes, space, replicas, shards, options);
        Ok(Vec::new())
    }
}
