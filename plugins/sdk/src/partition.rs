//! Partitioning policies: implement [`Partitioner`]; the SDK converts to and from WIT types.
//! The records are `granary-policy-types`' (the same the host uses).

use crate::options::{Error, Options};

pub use granary_policy_types::partition::{
    Epoch, Node, Rank, RankMeasure, RankPlan, RebalancePoint, Shard, WEIGHT_MAX, step_shares,
};

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
