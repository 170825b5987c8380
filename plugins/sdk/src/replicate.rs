//! Replication policies: implement [`Replicator::place`]; a repair plan follows from it. The
//! records are `granary-policy-types`' (the same the host uses).

use std::collections::HashSet;

use crate::options::{Error, Options};
pub use granary_policy_types::replicate::{
    Holding, Mode, Node, NodeSpace, Placement, ShardGoal, ShardHeat, Transfer, shard_key,
};

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
