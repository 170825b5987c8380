//! The partitioner's records: what a partitioner is told (shards, ranks, nodes, the epoch, a
//! rebalance point) and what it answers (rank plans, weights), and the rule that cuts a
//! weighted plan into batches (`step_shares`).

use std::ops::Range;

/// The largest rank weight a partitioner may answer (`rebalance`).
pub const WEIGHT_MAX: u32 = 1 << 20;

/// A shard of the dataset version; shard i holds the `records` dataset indices after shard
/// i - 1's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    /// The 32-byte content id.
    pub id: [u8; 32],
    /// Bytes of the shard file.
    pub bytes: u64,
    /// Records in the shard.
    pub records: u64,
    /// Nodes that hold a copy.
    pub replicas: Vec<u32>,
}

/// A rank: one training process of the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rank {
    /// 0..n-1.
    pub id: u32,
    /// The node it runs on.
    pub node: u32,
    /// Relative share of the records.
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
    /// Global positions of the epoch already consumed.
    pub start: u64,
}

/// One rank's reads: half-open ranges of dataset indices, in read order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankPlan {
    /// The rank.
    pub rank: u32,
    /// The ranges, in order.
    pub ranges: Vec<Range<u64>>,
}

impl RankPlan {
    /// Appends `start..end`, merging it into the last range when the two touch; an empty range
    /// adds nothing.
    pub fn push(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        match self.ranges.last_mut() {
            Some(last) if last.end == start => last.end = end,
            _ => self.ranges.push(start..end),
        }
    }

    /// Records the rank reads.
    pub fn n_records(&self) -> u64 {
        self.ranges.iter().map(|r| r.end.saturating_sub(r.start)).sum()
    }

    /// The dataset indices, in read order.
    pub fn records(&self) -> impl Iterator<Item = u64> + '_ {
        self.ranges.iter().flat_map(|r| r.clone())
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

impl RankMeasure {
    /// Records per second (0 when nothing was measured).
    pub fn records_per_second(&self) -> f64 {
        if self.busy_nanos == 0 { 0.0 } else { self.records as f64 * 1e9 / self.busy_nanos as f64 }
    }
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

/// How a step of `step` positions is split among ranks of `weights` (in rank order): each
/// takes `floor(step * w / W)` and the positions left over go one each to the ranks of largest
/// remainder `step * w mod W`, ties to the lower rank; equal weights (all 0 included) split as
/// evenly as possible, the first ranks one more. The rule of the WIT's `plan` (and of the
/// plugin SDK's `step_shares`), by which a weighted plan is cut into batches.
pub fn step_shares(step: u64, weights: &[u32]) -> Vec<u64> {
    if weights.iter().all(|&w| w == weights[0]) {
        let n = weights.len().max(1) as u64;
        return (0..weights.len() as u64).map(|i| step / n + u64::from(i < step % n)).collect();
    }
    let total: u128 = weights.iter().map(|&w| u128::from(w)).sum();
    let mut shares = Vec::with_capacity(weights.len());
    let mut remainders = Vec::with_capacity(weights.len());
    for (i, &w) in weights.iter().enumerate() {
        let product = u128::from(step) * u128::from(w);
        // At most `step`: the quotient fits.
        shares.push(u64::try_from(product / total).unwrap_or(step));
        remainders.push((product % total, i));
    }
    let left = step - shares.iter().sum::<u64>();
    remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, i) in remainders.iter().take(usize::try_from(left).unwrap_or(usize::MAX)) {
        shares[i] += 1;
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::{RankPlan, step_shares};

    #[test]
    fn shares_split_a_step_by_weight_and_equal_weights_split_evenly() {
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

    #[test]
    fn a_plan_merges_touching_ranges_and_skips_empty_ones() {
        let mut plan = RankPlan { rank: 1, ranges: Vec::new() };
        plan.push(0, 4);
        plan.push(4, 6);
        plan.push(6, 6);
        plan.push(10, 12);
        assert_eq!(plan.ranges, [0..6, 10..12]);
        assert_eq!(plan.n_records(), 8);
        assert_eq!(plan.records().collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5, 10, 11]);
    }
}
