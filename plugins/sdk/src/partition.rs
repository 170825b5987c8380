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

/// What one rank measured over the window before a rebalance point.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankMeasure {
    /// The rank.
    pub rank: u32,
    /// Records its trainer took in the window.
    pub records: u64,
    /// Nanoseconds the trainer spent on them.
    pub busy_nanos: u64,
}

/// A rebalance point: every rank switches to the new weights at global step `step`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RebalancePoint {
    /// The global step the new weights apply from.
    pub step: u64,
    /// (rank, weight) in force until then, one per rank that is up.
    pub weights: Vec<(u32, u32)>,
    /// One measure per rank of `weights`.
    pub measured: Vec<RankMeasure>,
}

/// The largest weight `rebalance` may answer.
pub const WEIGHT_MAX: u32 = 1 << 20;

/// How a step of `step` positions is split among ranks of `weights` (in rank order): each
/// takes `floor(step * w / W)`, and the positions left over go one each to the ranks of
/// largest remainder `step * w mod W`, ties to the lower index. This is the split the host cuts
/// a plan by (the WIT's `plan` documents it); with equal weights (all 0 included) every rank
/// takes `step / ranks`, and the first `step % ranks` ranks one more.
pub fn step_shares(step: u64, weights: &[u32]) -> Vec<u64> {
    let total: u128 = weights.iter().map(|&w| u128::from(w)).sum();
    if weights.iter().all(|&w| w == weights[0]) {
        // Equal weights (all 0 included) split evenly.
        let n = weights.len().max(1) as u64;
        return (0..n).take(weights.len()).map(|i| step / n + u64::from(i < step % n)).collect();
    }
    let mut shares: Vec<u64> = Vec::with_capacity(weights.len());
    let mut remainders: Vec<(u128, usize)> = Vec::with_capacity(weights.len());
    for (i, &w) in weights.iter().enumerate() {
        let product = u128::from(step) * u128::from(w);
        shares.push((product / total) as u64);
        remainders.push((product % total, i));
    }
    let left = step - shares.iter().sum::<u64>();
    remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, i) in remainders.iter().take(left as usize) {
        shares[i] += 1;
    }
    shares
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

    /// New rank weights at a rebalance point; by default the policy does not rebalance.
    fn rebalance(point: &RebalancePoint, options: &Options) -> Result<Vec<(u32, u32)>, Error> {
        let _ = (point, options);
        Err(Error::Unsupported("this partitioner does not rebalance".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::step_shares;

    #[test]
    fn shares_split_a_step_by_weight_and_equal_weights_split_as_before() {
        assert_eq!(step_shares(12, &[1, 1, 1]), [4, 4, 4]);
        // A short step: the first ranks take one more.
        assert_eq!(step_shares(11, &[1, 1, 1]), [4, 4, 3]);
        assert_eq!(step_shares(10, &[5, 5, 5, 5]), [3, 3, 2, 2]);
        assert_eq!(step_shares(12, &[2, 1, 1]), [6, 3, 3]);
        assert_eq!(step_shares(10, &[3, 1]), [8, 2]);
        assert_eq!(step_shares(0, &[3, 1]), [0, 0]);
        assert_eq!(step_shares(5, &[0, 0]), [3, 2]);
        assert_eq!(step_shares(5, &[0, 1]), [0, 5]);
        assert_eq!(step_shares(5, &[]), Vec::<u64>::new());
        for step in 0..200u64 {
            let shares = step_shares(step, &[7, 3, 1 << 20, 1]);
            assert_eq!(shares.iter().sum::<u64>(), step);
        }
    }
}
