//! The partitioner host: one call per epoch (or membership change, or rebalance point) returns
//! every rank's reads, checked to be a permutation of the records left in the epoch before it
//! is used; one call per rebalance point turns the ranks' measurements into new rank weights,
//! checked to be one bounded weight per rank. Plugins built against `@0.1.0` plan as they did
//! and cannot rebalance.
//!
//! Owns: `Partitioner` (a supervised partitioner plugin) and the checks of its input and its
//! answers (`check_plan`, the weights' checks). What it is given and answers are the records of
//! `granary-policy-types` (one definition with the plugin SDK), here under the engine's names:
//! `ShardInfo`, `RankInfo`, `NodeInfo`, `EpochSpec`, `RankPlan`, `RebalancePoint`, `RankMeasure`.
//! Never: reads a record (a plan is index ranges the loader reads), or returns a plan or weights
//! that failed their check.

use super::bindings::partitioner::PartitionerPlugin;
use super::bindings::partitioner::exports::granary::policy::partitioner as wit;
use super::bindings::v1::partitioner::PartitionerPlugin as PartitionerPluginV1;
use super::bindings::v1::partitioner::exports::granary::policy::partitioner as wit_v1;
use super::supervise::{PolicyStatus, Supervisor, SwapHandle};
use super::{Instance, Plugin, PolicyKind, WitVersion, invalid, rejected};
use crate::error::{Error, PluginError};

pub use granary_policy_types::partition::{
    Epoch as EpochSpec, Node as NodeInfo, Rank as RankInfo, RankMeasure, RankPlan, RebalancePoint, Shard as ShardInfo,
    WEIGHT_MAX,
};

/// A partitioner instance's bindings, of the version its plugin was built against.
enum Bindings {
    V2(PartitionerPlugin),
    V1(PartitionerPluginV1),
}

/// A supervised partitioner plugin.
pub struct Partitioner {
    supervisor: Supervisor<Instance<Bindings>>,
}

impl Partitioner {
    /// A partitioner run by `plugin` with `options`, and `fallback` (with its defaults)
    /// answering when it fails.
    pub fn new(plugin: Plugin, options: &[(String, String)], fallback: Option<Plugin>) -> Result<Self, Error> {
        let supervisor = Supervisor::of_kind(PolicyKind::Partitioner, plugin, options, fallback, |plugin| {
            instantiate(plugin).map_err(Error::Plugin)
        })?;
        Ok(Self { supervisor })
    }

    /// The plan of one epoch: every record from global position `epoch.start` on, read exactly
    /// once, by ranks that are up. Checked before it is returned.
    pub fn plan(
        &mut self,
        shards: &[ShardInfo],
        ranks: &[RankInfo],
        nodes: &[NodeInfo],
        epoch: EpochSpec,
    ) -> Result<Vec<RankPlan>, Error> {
        check_input(ranks)?;
        if let Some((plugin, options)) = self.supervisor.take_pending() {
            self.swap(plugin, &options)?;
        }
        let total = shards.iter().try_fold(0u64, |sum, shard| sum.checked_add(shard.records));
        let total = total.ok_or_else(|| Error::invalid_input("more than 2^64 records"))?;
        let shards: Vec<wit::Shard> = shards
            .iter()
            .map(|s| wit::Shard { id: s.id.to_vec(), bytes: s.bytes, records: s.records, replicas: s.replicas.clone() })
            .collect();
        let membership = wit::Membership {
            ranks: ranks.iter().map(|r| wit::Rank { id: r.id, node: r.node, weight: r.weight, up: r.up }).collect(),
            nodes: nodes
                .iter()
                .map(|n| super::bindings::WitNode {
                    id: n.id,
                    weight: n.weight,
                    failure_domain: n.failure_domain,
                    up: n.up,
                })
                .collect(),
        };
        let wit_epoch =
            wit::Epoch { seed: epoch.seed, epoch: epoch.epoch, batch_size: epoch.batch_size, start: epoch.start };
        self.supervisor.run(&mut |plugin, _| instantiate(plugin), &mut |instance, _, options| {
            let options = options.to_vec();
            let plugin = instance.plugin.clone();
            let deadline = plugin.host().limits().deadline_plan;
            let plans: Vec<RankPlan> = instance
                .call("plan", deadline, |b, s| match b {
                    Bindings::V2(b) => Ok(b
                        .granary_policy_partitioner()
                        .call_plan(s, &shards, &membership, wit_epoch, &options)?
                        .map(|plans| {
                            plans
                                .into_iter()
                                .map(|p| RankPlan {
                                    rank: p.rank,
                                    ranges: p.ranges.iter().map(|r| r.start..r.end).collect(),
                                })
                                .collect()
                        })),
                    Bindings::V1(b) => {
                        let (shards, membership, epoch) = v1_inputs(&shards, &membership, wit_epoch);
                        Ok(b.granary_policy_partitioner()
                            .call_plan(s, &shards, &membership, epoch, &options)?
                            .map_or_else(
                                |e| Err(e.into()),
                                |plans| {
                                    Ok(plans
                                        .into_iter()
                                        .map(|p| RankPlan {
                                            rank: p.rank,
                                            ranges: p.ranges.iter().map(|r| r.start..r.end).collect(),
                                        })
                                        .collect())
                                },
                            ))
                    }
                })?
                .map_err(|e| rejected(&plugin, "plan", e))?;
            check_plan(&plans, ranks, total, epoch.start).map_err(|detail| invalid(&plugin, "plan", detail))?;
            Ok(plans)
        })
    }

    /// Whether the plugin answering now can rebalance (it was built against `@0.2.0` or later).
    pub fn can_rebalance(&self) -> bool {
        self.supervisor.active_plugin().wit_version() != WitVersion::V0_1
    }

    /// New rank weights at a rebalance point, from the ranks' measures: one per rank of
    /// `point.weights`, each in `1..=WEIGHT_MAX`, checked before they are returned. A plugin
    /// built against `@0.1.0` has no `rebalance`: the call fails, naming it.
    pub fn rebalance(&mut self, point: &RebalancePoint) -> Result<Vec<(u32, u32)>, Error> {
        check_point(point)?;
        if let Some((plugin, options)) = self.supervisor.take_pending() {
            self.swap(plugin, &options)?;
        }
        let wit_point = wit::RebalancePoint {
            step: point.step,
            weights: point.weights.iter().map(|&(rank, weight)| wit::RankWeight { rank, weight }).collect(),
            measured: point
                .measured
                .iter()
                .map(|m| wit::RankMeasure { rank: m.rank, records: m.records, busy_nanos: m.busy_nanos })
                .collect(),
        };
        self.supervisor.run(&mut |plugin, _| instantiate(plugin), &mut |instance, _, options| {
            let options = options.to_vec();
            let plugin = instance.plugin.clone();
            let deadline = plugin.host().limits().deadline_plan;
            let weights = instance
                .call("rebalance", deadline, |b, s| match b {
                    Bindings::V2(b) => b.granary_policy_partitioner().call_rebalance(s, &wit_point, &options),
                    // Callers ask `can_rebalance` first; this answer is for one that did not.
                    Bindings::V1(_) => Ok(Err(super::bindings::WitPolicyError::Unsupported(
                        "it is built against granary:policy@0.1.0, which has no rebalance; rebuild it against 0.2.0"
                            .to_owned(),
                    ))),
                })?
                .map_err(|e| rejected(&plugin, "rebalance", e))?;
            let weights: Vec<(u32, u32)> = weights.into_iter().map(|w| (w.rank, w.weight)).collect();
            check_weights(&weights, point).map_err(|detail| invalid(&plugin, "rebalance", detail))?;
            Ok(weights)
        })
    }

    /// Switches to `plugin` (run with `options`) now; it must instantiate. The current one
    /// becomes the fallback.
    pub fn swap(&mut self, plugin: Plugin, options: &[(String, String)]) -> Result<(), Error> {
        self.supervisor
            .swap_to(PolicyKind::Partitioner, plugin, options, |plugin| instantiate(plugin).map_err(Error::Plugin))
    }

    /// A handle to swap the plugin from another thread.
    pub fn swap_handle(&self) -> SwapHandle {
        self.supervisor.swap_handle()
    }

    /// Supervision state.
    pub fn status(&self) -> PolicyStatus {
        self.supervisor.status()
    }
}

fn v1_inputs(
    shards: &[wit::Shard],
    membership: &wit::Membership,
    epoch: wit::Epoch,
) -> (Vec<wit_v1::Shard>, wit_v1::Membership, wit_v1::Epoch) {
    let shards = shards
        .iter()
        .map(|s| wit_v1::Shard { id: s.id.clone(), bytes: s.bytes, records: s.records, replicas: s.replicas.clone() })
        .collect();
    let membership = wit_v1::Membership {
        ranks: membership
            .ranks
            .iter()
            .map(|r| wit_v1::Rank { id: r.id, node: r.node, weight: r.weight, up: r.up })
            .collect(),
        nodes: membership.nodes.iter().map(Into::into).collect(),
    };
    let epoch =
        wit_v1::Epoch { seed: epoch.seed, epoch: epoch.epoch, batch_size: epoch.batch_size, start: epoch.start };
    (shards, membership, epoch)
}

fn check_point(point: &RebalancePoint) -> Result<(), Error> {
    let mut ranks: Vec<u32> = point.weights.iter().map(|&(rank, _)| rank).collect();
    ranks.sort_unstable();
    if ranks.is_empty() || ranks.windows(2).any(|w| w[0] == w[1]) {
        return Err(Error::invalid_input("a rebalance point needs one weight per rank, each rank once"));
    }
    let mut measured: Vec<u32> = point.measured.iter().map(|m| m.rank).collect();
    measured.sort_unstable();
    if measured != ranks {
        return Err(Error::invalid_input("a rebalance point needs one measure per rank of its weights"));
    }
    Ok(())
}

/// One weight per rank of the point, each in `1..=WEIGHT_MAX`.
fn check_weights(weights: &[(u32, u32)], point: &RebalancePoint) -> Result<(), String> {
    if weights.len() != point.weights.len() {
        return Err(format!("{} weights for {} ranks", weights.len(), point.weights.len()));
    }
    for &(rank, weight) in weights {
        if !point.weights.iter().any(|&(r, _)| r == rank) {
            return Err(format!("rank {rank} is not one of the point's ranks"));
        }
        if weight == 0 || weight > WEIGHT_MAX {
            return Err(format!("rank {rank}: weight {weight} is not in 1..={WEIGHT_MAX}"));
        }
    }
    let mut ranks: Vec<u32> = weights.iter().map(|&(rank, _)| rank).collect();
    ranks.sort_unstable();
    if ranks.windows(2).any(|w| w[0] == w[1]) {
        return Err("a rank has two weights".to_owned());
    }
    Ok(())
}

fn check_input(ranks: &[RankInfo]) -> Result<(), Error> {
    let mut ids: Vec<u32> = ranks.iter().map(|r| r.id).collect();
    ids.sort_unstable();
    if ids.windows(2).any(|w| w[0] == w[1]) {
        return Err(Error::invalid_input("two ranks share an id"));
    }
    if !ranks.iter().any(|r| r.up) {
        return Err(Error::invalid_input("no rank is up"));
    }
    Ok(())
}

/// A plan is valid when every range is non-empty and inside the dataset, no record is read
/// twice, only known ranks that are up read, each at most once in the list, and the ranges cover
/// exactly the `total - start` records left (all of them when `start` is 0: a permutation).
pub(crate) fn check_plan(plans: &[RankPlan], ranks: &[RankInfo], total: u64, start: u64) -> Result<(), String> {
    let mut seen_ranks = std::collections::HashSet::new();
    let mut ranges: Vec<std::ops::Range<u64>> = Vec::new();
    for plan in plans {
        match ranks.iter().find(|r| r.id == plan.rank) {
            None => return Err(format!("rank {} is not in the membership", plan.rank)),
            Some(rank) if !rank.up => return Err(format!("rank {} is down but has reads", plan.rank)),
            Some(_) => {}
        }
        if !seen_ranks.insert(plan.rank) {
            return Err(format!("rank {} has two plans", plan.rank));
        }
        for range in &plan.ranges {
            if range.start >= range.end {
                return Err(format!("rank {}: empty or reversed range {range:?}", plan.rank));
            }
            if range.end > total {
                return Err(format!("rank {}: range {range:?} past the last record {}", plan.rank, total));
            }
            ranges.push(range.clone());
        }
    }
    ranges.sort_unstable_by_key(|r| r.start);
    let mut covered = 0u64;
    let mut previous_end = 0u64;
    for range in &ranges {
        if range.start < previous_end {
            return Err(format!("records {}..{} are read twice", range.start, previous_end.min(range.end)));
        }
        previous_end = range.end;
        covered += range.end - range.start;
    }
    let left = total.saturating_sub(start);
    if covered != left {
        return Err(format!("the plan reads {covered} records, {left} are left in the epoch"));
    }
    Ok(())
}

fn instantiate(plugin: &Plugin) -> Result<Instance<Bindings>, PluginError> {
    match &plugin.inner.pre {
        super::PluginPre::Partitioner(pre) => {
            super::instantiate_with(plugin, |store| pre.instantiate(store).map(Bindings::V2))
        }
        super::PluginPre::PartitionerV1(pre) => {
            super::instantiate_with(plugin, |store| pre.instantiate(store).map(Bindings::V1))
        }
        _ => Err(PluginError::Load { plugin: plugin.name().to_owned(), detail: "not a partitioner".to_owned() }),
    }
}
