//! The glue between the plain traits and the generated component bindings.

use crate::options::{Error, Options};

macro_rules! policy_error {
    ($module:path) => {
        impl From<Error> for $module {
            fn from(error: Error) -> Self {
                use $module as E;
                match error {
                    Error::InvalidInput(detail) => E::InvalidInput(detail),
                    Error::Unsupported(detail) => E::Unsupported(detail),
                }
            }
        }
    };
}

#[cfg(feature = "partitioner")]
mod partitioner {
    use std::marker::PhantomData;

    use super::*;
    use crate::partition::{Epoch, Node, Partitioner, Rank, RankMeasure, RebalancePoint, Shard};
    use crate::partitioner_bindings::exports::granary::policy::partitioner as wit;
    use crate::partitioner_bindings::granary::policy::types::PolicyError;

    policy_error!(PolicyError);

    /// Adapts a [`Partitioner`] to the generated `Guest` trait.
    pub struct PartitionerAdapter<P>(PhantomData<P>);

    impl<P: Partitioner> wit::Guest for PartitionerAdapter<P> {
        fn plan(
            shards: Vec<wit::Shard>,
            membership: wit::Membership,
            epoch: wit::Epoch,
            options: Vec<(String, String)>,
        ) -> Result<Vec<wit::RankPlan>, PolicyError> {
            let shards = shards
                .into_iter()
                .map(|s| {
                    let id = <[u8; 32]>::try_from(s.id.as_slice())
                        .map_err(|_| Error::InvalidInput(format!("a shard id of {} bytes, not 32", s.id.len())))?;
                    Ok(Shard { id, bytes: s.bytes, records: s.records, replicas: s.replicas })
                })
                .collect::<Result<Vec<Shard>, Error>>()?;
            let ranks: Vec<Rank> =
                membership.ranks.iter().map(|r| Rank { id: r.id, node: r.node, weight: r.weight, up: r.up }).collect();
            let nodes: Vec<Node> = membership
                .nodes
                .iter()
                .map(|n| Node { id: n.id, weight: n.weight, failure_domain: n.failure_domain, up: n.up })
                .collect();
            let epoch =
                Epoch { seed: epoch.seed, epoch: epoch.epoch, batch_size: epoch.batch_size, start: epoch.start };
            let plans = P::plan(&shards, &ranks, &nodes, epoch, &Options(options))?;
            Ok(plans
                .into_iter()
                .map(|plan| wit::RankPlan {
                    rank: plan.rank,
                    ranges: plan.ranges.into_iter().map(|r| wit::RecordRange { start: r.start, end: r.end }).collect(),
                })
                .collect())
        }

        fn rebalance(
            point: wit::RebalancePoint,
            options: Vec<(String, String)>,
        ) -> Result<Vec<wit::RankWeight>, PolicyError> {
            let point = RebalancePoint {
                step: point.step,
                weights: point.weights.iter().map(|w| (w.rank, w.weight)).collect(),
                measured: point
                    .measured
                    .iter()
                    .map(|m| RankMeasure { rank: m.rank, records: m.records, busy_nanos: m.busy_nanos })
                    .collect(),
            };
            let weights = P::rebalance(&point, &Options(options))?;
            Ok(weights.into_iter().map(|(rank, weight)| wit::RankWeight { rank, weight }).collect())
        }
    }
}

#[cfg(feature = "partitioner")]
pub use partitioner::PartitionerAdapter;

#[cfg(feature = "evictor")]
mod evictor {
    use std::cell::RefCell;

    use super::*;
    use crate::evict::{Cache, Evictor};
    use crate::evictor_bindings::exports::granary::policy::evictor as wit;
    use crate::evictor_bindings::granary::policy::types::PolicyError;

    policy_error!(PolicyError);

    /// Adapts an [`Evictor`] to the generated `Guest` traits: the resource holds a [`Cache`].
    pub struct EvictorAdapter<P> {
        cache: RefCell<Cache<P>>,
    }

    impl<P: Evictor> wit::Guest for EvictorAdapter<P> {
        type Policy = Self;
    }

    impl<P: Evictor> wit::GuestPolicy for EvictorAdapter<P> {
        fn create(capacity: u64, options: Vec<(String, String)>) -> Result<wit::Policy, PolicyError> {
            let cache = Cache::<P>::new(capacity, &Options(options))?;
            Ok(wit::Policy::new(Self { cache: RefCell::new(cache) }))
        }

        fn access(&self, batch: wit::Accesses) -> Result<wit::Outcome, PolicyError> {
            let mut hits = Vec::with_capacity(batch.keys.len());
            let mut evictions = Vec::new();
            self.cache.borrow_mut().access(&batch.keys, &batch.sizes, &batch.next_uses, &mut hits, &mut evictions)?;
            let evictions = evictions.into_iter().map(|(before, key)| wit::Eviction { before, key }).collect();
            Ok(wit::Outcome { hits, evictions })
        }

        fn evict(&self, bytes: u64) -> Vec<u64> {
            // A policy that finds no victim in a non-empty cache evicts nothing more; the host
            // sees too little freed and treats the policy as failed.
            self.cache.borrow_mut().evict_bytes(bytes).unwrap_or_default()
        }

        fn remove(&self, keys: Vec<u64>) {
            self.cache.borrow_mut().remove(&keys);
        }

        fn snapshot(&self) -> wit::Snapshot {
            let (resident, state) = self.cache.borrow().snapshot();
            wit::Snapshot {
                policy: P::NAME.to_owned(),
                resident: resident.into_iter().map(|(key, size)| wit::Entry { key, size }).collect(),
                state,
            }
        }

        fn restore(&self, snapshot: wit::Snapshot) -> Result<(), PolicyError> {
            let resident: Vec<(u64, u32)> = snapshot.resident.iter().map(|e| (e.key, e.size)).collect();
            self.cache.borrow_mut().restore(&snapshot.policy, &resident, &snapshot.state)?;
            Ok(())
        }
    }
}

#[cfg(feature = "evictor")]
pub use evictor::EvictorAdapter;

#[cfg(feature = "replicator")]
mod replicator {
    use std::marker::PhantomData;

    use super::*;
    use crate::replicate::{Holding, Mode, Node, NodeSpace, Replicator, ShardHeat};
    use crate::replicator_bindings::exports::granary::policy::replicator as wit;
    use crate::replicator_bindings::granary::policy::types::{Node as WitNode, PolicyError};

    policy_error!(PolicyError);

    /// Adapts a [`Replicator`] to the generated `Guest` trait.
    pub struct ReplicatorAdapter<P>(PhantomData<P>);

    fn nodes(nodes: &[WitNode]) -> Vec<Node> {
        nodes.iter().map(|n| Node { id: n.id, weight: n.weight, failure_domain: n.failure_domain, up: n.up }).collect()
    }

    impl<P: Replicator> wit::Guest for ReplicatorAdapter<P> {
        fn place(
            nodes_in: Vec<WitNode>,
            replicas: u32,
            options: Vec<(String, String)>,
        ) -> Result<wit::Placement, PolicyError> {
            let placement = P::place(&nodes(&nodes_in), replicas, &Options(options))?;
            Ok(wit::Placement { mode: mode(placement.mode), buckets: placement.buckets })
        }

        fn repair(
            nodes_in: Vec<WitNode>,
            replicas: u32,
            holdings: Vec<wit::Holding>,
            options: Vec<(String, String)>,
        ) -> Result<Vec<wit::Transfer>, PolicyError> {
            let holdings: Vec<Holding> = holdings.into_iter().map(|h| Holding { key: h.key, nodes: h.nodes }).collect();
            let transfers = P::repair(&nodes(&nodes_in), replicas, &holdings, &Options(options))?;
            Ok(transfers
                .into_iter()
                .map(|t| wit::Transfer { key: t.key, source: t.source, target: t.target })
                .collect())
        }

        fn adapt(
            nodes_in: Vec<WitNode>,
            space: Vec<wit::NodeSpace>,
            replicas: u32,
            shards: Vec<wit::ShardHeat>,
            options: Vec<(String, String)>,
        ) -> Result<Vec<wit::ShardGoal>, PolicyError> {
            let space: Vec<NodeSpace> =
                space.iter().map(|n| NodeSpace { id: n.id, free_bytes: n.free_bytes }).collect();
            let shards: Vec<ShardHeat> = shards
                .into_iter()
                .map(|h| ShardHeat {
                    key: h.key,
                    bytes: h.bytes,
                    reads: h.reads,
                    holders: h.holders,
                    previous: h.previous,
                })
                .collect();
            let goals = P::adapt(&nodes(&nodes_in), &space, replicas, &shards, &Options(options))?;
            Ok(goals.into_iter().map(|g| wit::ShardGoal { key: g.key, nodes: g.nodes, mode: mode(g.mode) }).collect())
        }
    }

    fn mode(mode: Mode) -> wit::Mode {
        match mode {
            Mode::Synchronous => wit::Mode::Synchronous,
            Mode::Asynchronous => wit::Mode::Asynchronous,
        }
    }
}

#[cfg(feature = "replicator")]
pub use replicator::ReplicatorAdapter;
