//! Partitioning policies: implement [`Partitioner`]; the SDK converts to and from WIT types.

use crate::options::{Error, Options};

/// A shard of the dataset version; shard i holds the `records` indices after shard i - 1's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    /// The 32-byte content id.
    pub id: Vec<u8>,
    /// Bytes of the shard file.
    pub bytes: u64,
    /// Records in the shard.
    pub records: u64,
    /// Nodes that hold a copy.
    pub replicas: Vec<u32>,
}

/// A reader of the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rank {
    /// 0..n-1.
    pub id: u32,
    /// The node it runs on.
    pub node: u32,
    /// Relative share.
    pub weight: u32,
    /// Whether it takes part.
    pub up: bool,
}

/// A machine of the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Node {
    /// Stable id.
    pub id: u32,
    /// Relative capacity.
    pub weight: u32,
    /// Nodes that fail together share it.
    pub failure_domain: u32,
    /// Reachable now.
    pub up: bool,
}

/// Which epoch to plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Epoch {
    /// The run's seed.
    pub seed: u64,
    /// The epoch.
    pub epoch: u64,
    /// Records per rank per step.
    pub batch_size: u64,
    /// Global positions already consumed.
    pub start: u64,
}

/// One rank's reads: half-open ranges of dataset indices, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankPlan {
    /// The rank.
    pub rank: u32,
    /// (start, end) pairs.
    pub ranges: Vec<(u64, u64)>,
}

impl RankPlan {
    /// Appends `start..end`, merging with the previous range when they touch.
    pub fn push(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        match self.ranges.last_mut() {
            Some(last) if last.1 == start => last.1 = end,
            _ => self.ranges.push((start, end)),
        }
    }
}

/// A partitioning policy.
pub trait Partitioner: 'static {
    /// The plan of one epoch.
    fn plan(
        shards: &[Shard],
        ranks: &[Rank],
        nodes: &[Node],
        epoch: Epoch,
        options: &Options,
    ) -> Result<Vec<RankPlan>, Error>;
}
