//! The replicator host: a placement table per topology (the host looks shards up in it
//! natively), repair plans after membership changes, and per-shard goals from measured reads
//! and space (`adapt`), all checked before use. A plugin built against `@0.1.0` has no `adapt`:
//! it answers no goals, and every shard keeps the table's placement.
//!
//! Owns: `Replicator` (a supervised replicator plugin) and the checks of its answers
//! (`check_placement`, `check_transfers`, `check_goals`). What it is given and answers are the
//! records of `granary-policy-types` (one definition with the plugin SDK; `Placement` is looked up
//! natively by `shard_key`): `Holding`, `Transfer`, `ShardHeat`, `NodeSpace`, `ShardGoal`, and its
//! `Mode` here named `ReplicationMode`. Never: moves a shard (`replication` pulls and publishes what
//! it plans), or returns an answer that failed its check.

use std::collections::{HashMap, HashSet};

use super::bindings::replicator::ReplicatorPlugin;
use super::bindings::replicator::exports::granary::policy::replicator as wit;
use super::bindings::v1::replicator::ReplicatorPlugin as ReplicatorPluginV1;
use super::bindings::v1::replicator::exports::granary::policy::replicator as wit_v1;
use super::partitioner::NodeInfo;
use super::supervise::{PolicyStatus, Supervisor, SwapHandle};
use super::{Instance, Plugin, PolicyKind, invalid, rejected};
use crate::error::{Error, PluginError};

/// A replicator instance's bindings, of the version its plugin was built against.
enum Bindings {
    V2(ReplicatorPlugin),
    V1(ReplicatorPluginV1),
}

pub use granary_policy_types::replicate::{
    Holding, Mode as ReplicationMode, NodeSpace, Placement, ShardGoal, ShardHeat, Transfer, shard_key,
};

/// A supervised replicator plugin.
pub struct Replicator {
    supervisor: Supervisor<Instance<Bindings>>,
}

fn wit_nodes(nodes: &[NodeInfo]) -> Vec<super::bindings::WitNode> {
    nodes
        .iter()
        .map(|n| super::bindings::WitNode { id: n.id, weight: n.weight, failure_domain: n.failure_domain, up: n.up })
        .collect()
}

impl Replicator {
    /// A replicator run by `plugin` with `options`, and `fallback` (with its defaults)
    /// answering when it fails.
    pub fn new(plugin: Plugin, options: &[(String, String)], fallback: Option<Plugin>) -> Result<Self, Error> {
        let supervisor = Supervisor::of_kind(PolicyKind::Replicator, plugin, options, fallback, |plugin| {
            instantiate(plugin).map_err(Error::Plugin)
        })?;
        Ok(Self { supervisor })
    }

    /// The placement of every shard over `nodes` with `replicas` copies each; checked: every
    /// bucket names `min(replicas, nodes up)` distinct nodes that are up.
    pub fn place(&mut self, nodes: &[NodeInfo], replicas: u32) -> Result<Placement, Error> {
        check_nodes(nodes)?;
        if let Some((plugin, options)) = self.supervisor.take_pending() {
            self.swap(plugin, &options)?;
        }
        let wit_nodes = wit_nodes(nodes);
        self.supervisor.run(&mut |plugin, _| instantiate(plugin), &mut |instance, _, options| {
            let options = options.to_vec();
            let plugin = instance.plugin.clone();
            let deadline = plugin.host().limits().deadline_replicate;
            let placement = instance
                .call("place", deadline, |b, s| match b {
                    Bindings::V2(b) => Ok(b
                        .granary_policy_replicator()
                        .call_place(s, &wit_nodes, replicas, &options)?
                        .map(|p| Placement { mode: p.mode.into(), buckets: p.buckets })),
                    Bindings::V1(b) => {
                        let nodes: Vec<_> = wit_nodes.iter().map(Into::into).collect();
                        Ok(b.granary_policy_replicator().call_place(s, &nodes, replicas, &options)?.map_or_else(
                            |e| Err(e.into()),
                            |p| {
                                let mode = match p.mode {
                                    wit_v1::Mode::Synchronous => ReplicationMode::Synchronous,
                                    wit_v1::Mode::Asynchronous => ReplicationMode::Asynchronous,
                                };
                                Ok(Placement { mode, buckets: p.buckets })
                            },
                        ))
                    }
                })?
                .map_err(|e| rejected(&plugin, "place", e))?;
            check_placement(&placement.buckets, nodes, replicas).map_err(|detail| invalid(&plugin, "place", detail))?;
            Ok(placement)
        })
    }

    /// The copies that restore the replication factor after a membership change; checked: each
    /// copies a shard it was told about, from a node up that holds it, to a node up that does not,
    /// once.
    pub fn repair(&mut self, nodes: &[NodeInfo], replicas: u32, holdings: &[Holding]) -> Result<Vec<Transfer>, Error> {
        check_nodes(nodes)?;
        let wit_nodes = wit_nodes(nodes);
        self.supervisor.run(&mut |plugin, _| instantiate(plugin), &mut |instance, _, options| {
            let options = options.to_vec();
            let plugin = instance.plugin.clone();
            let deadline = plugin.host().limits().deadline_replicate;
            let transfers = instance
                .call("repair", deadline, |b, s| match b {
                    Bindings::V2(b) => {
                        let holdings: Vec<wit::Holding> =
                            holdings.iter().map(|h| wit::Holding { key: h.key, nodes: h.nodes.clone() }).collect();
                        Ok(b.granary_policy_replicator()
                            .call_repair(s, &wit_nodes, replicas, &holdings, &options)?
                            .map(|transfers| {
                                transfers
                                    .into_iter()
                                    .map(|t| Transfer { key: t.key, source: t.source, target: t.target })
                                    .collect::<Vec<_>>()
                            }))
                    }
                    Bindings::V1(b) => {
                        let nodes: Vec<_> = wit_nodes.iter().map(Into::into).collect();
                        let holdings: Vec<wit_v1::Holding> =
                            holdings.iter().map(|h| wit_v1::Holding { key: h.key, nodes: h.nodes.clone() }).collect();
                        Ok(b.granary_policy_replicator()
                            .call_repair(s, &nodes, replicas, &holdings, &options)?
                            .map_or_else(
                                |e| Err(e.into()),
                                |transfers| {
                                    Ok(transfers
                                        .into_iter()
                                        .map(|t| Transfer { key: t.key, source: t.source, target: t.target })
                                        .collect())
                                },
                            ))
                    }
                })?
                .map_err(|e| rejected(&plugin, "repair", e))?;
            check_transfers(&transfers, nodes, holdings).map_err(|detail| invalid(&plugin, "repair", detail))?;
            Ok(transfers)
        })
    }

    /// Per-shard goals from the shards' reads over a window and the nodes' space; checked: each
    /// names a shard it was told about, once, and distinct nodes that are up. A plugin built
    /// against `@0.1.0` answers none.
    pub fn adapt(
        &mut self,
        nodes: &[NodeInfo],
        space: &[NodeSpace],
        replicas: u32,
        shards: &[ShardHeat],
    ) -> Result<Vec<ShardGoal>, Error> {
        check_nodes(nodes)?;
        if let Some((plugin, options)) = self.supervisor.take_pending() {
            self.swap(plugin, &options)?;
        }
        let wit_nodes = wit_nodes(nodes);
        let wit_space: Vec<wit::NodeSpace> =
            space.iter().map(|n| wit::NodeSpace { id: n.id, free_bytes: n.free_bytes }).collect();
        let wit_shards: Vec<wit::ShardHeat> = shards
            .iter()
            .map(|h| wit::ShardHeat {
                key: h.key,
                bytes: h.bytes,
                reads: h.reads,
                holders: h.holders.clone(),
                previous: h.previous.clone(),
            })
            .collect();
        self.supervisor.run(&mut |plugin, _| instantiate(plugin), &mut |instance, _, options| {
            let options = options.to_vec();
            let plugin = instance.plugin.clone();
            let deadline = plugin.host().limits().deadline_replicate;
            let goals = instance
                .call("adapt", deadline, |b, s| match b {
                    Bindings::V2(b) => Ok(b
                        .granary_policy_replicator()
                        .call_adapt(s, &wit_nodes, &wit_space, replicas, &wit_shards, &options)?
                        .map(|goals| {
                            goals
                                .into_iter()
                                .map(|g| ShardGoal { key: g.key, nodes: g.nodes, mode: g.mode.into() })
                                .collect::<Vec<_>>()
                        })),
                    Bindings::V1(_) => Ok(Ok(Vec::new())),
                })?
                .map_err(|e| rejected(&plugin, "adapt", e))?;
            check_goals(&goals, nodes, shards).map_err(|detail| invalid(&plugin, "adapt", detail))?;
            Ok(goals)
        })
    }

    /// Switches to `plugin` (run with `options`) now; the current one becomes the fallback.
    pub fn swap(&mut self, plugin: Plugin, options: &[(String, String)]) -> Result<(), Error> {
        self.supervisor
            .swap_to(PolicyKind::Replicator, plugin, options, |plugin| instantiate(plugin).map_err(Error::Plugin))
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

fn check_nodes(nodes: &[NodeInfo]) -> Result<(), Error> {
    let mut ids: Vec<u32> = nodes.iter().map(|n| n.id).collect();
    ids.sort_unstable();
    if ids.windows(2).any(|w| w[0] == w[1]) {
        return Err(Error::invalid_input("two nodes share an id"));
    }
    Ok(())
}

pub(crate) fn check_placement(buckets: &[Vec<u32>], nodes: &[NodeInfo], replicas: u32) -> Result<(), String> {
    if buckets.is_empty() || buckets.len() > 1 << 20 {
        return Err(format!("{} buckets (1..=1048576 allowed)", buckets.len()));
    }
    let up: HashSet<u32> = nodes.iter().filter(|n| n.up && n.weight > 0).map(|n| n.id).collect();
    let copies = (replicas as usize).min(up.len());
    for (b, bucket) in buckets.iter().enumerate() {
        if bucket.len() != copies {
            return Err(format!("bucket {b} has {} nodes, {copies} expected", bucket.len()));
        }
        let distinct: HashSet<&u32> = bucket.iter().collect();
        if distinct.len() != bucket.len() {
            return Err(format!("bucket {b} names a node twice"));
        }
        if let Some(node) = bucket.iter().find(|n| !up.contains(n)) {
            return Err(format!("bucket {b} names node {node}, which is not up"));
        }
    }
    Ok(())
}

pub(crate) fn check_transfers(transfers: &[Transfer], nodes: &[NodeInfo], holdings: &[Holding]) -> Result<(), String> {
    let up: HashSet<u32> = nodes.iter().filter(|n| n.up).map(|n| n.id).collect();
    let held: HashMap<u64, &Vec<u32>> = holdings.iter().map(|h| (h.key, &h.nodes)).collect();
    let mut seen = HashSet::new();
    for t in transfers {
        let holders = held.get(&t.key).ok_or_else(|| format!("shard {:#x} is not one of the holdings", t.key))?;
        if !holders.contains(&t.source) || !up.contains(&t.source) {
            return Err(format!("shard {:#x}: source {} does not hold it or is down", t.key, t.source));
        }
        if holders.contains(&t.target) || !up.contains(&t.target) {
            return Err(format!("shard {:#x}: target {} already holds it or is down", t.key, t.target));
        }
        if !seen.insert((t.key, t.target)) {
            return Err(format!("shard {:#x} is copied to {} twice", t.key, t.target));
        }
    }
    Ok(())
}

pub(crate) fn check_goals(goals: &[ShardGoal], nodes: &[NodeInfo], shards: &[ShardHeat]) -> Result<(), String> {
    let up: HashSet<u32> = nodes.iter().filter(|n| n.up).map(|n| n.id).collect();
    let known: HashSet<u64> = shards.iter().map(|h| h.key).collect();
    let mut seen = HashSet::new();
    for goal in goals {
        if !known.contains(&goal.key) {
            return Err(format!("shard {:#x} is not one of the shards asked about", goal.key));
        }
        if !seen.insert(goal.key) {
            return Err(format!("shard {:#x} has two goals", goal.key));
        }
        if goal.nodes.is_empty() || goal.nodes.len() > nodes.len() {
            return Err(format!("shard {:#x}: {} nodes named", goal.key, goal.nodes.len()));
        }
        let distinct: HashSet<&u32> = goal.nodes.iter().collect();
        if distinct.len() != goal.nodes.len() {
            return Err(format!("shard {:#x} names a node twice", goal.key));
        }
        if let Some(node) = goal.nodes.iter().find(|n| !up.contains(n)) {
            return Err(format!("shard {:#x} names node {node}, which is not up", goal.key));
        }
    }
    Ok(())
}

impl From<wit::Mode> for ReplicationMode {
    fn from(mode: wit::Mode) -> Self {
        match mode {
            wit::Mode::Synchronous => Self::Synchronous,
            wit::Mode::Asynchronous => Self::Asynchronous,
        }
    }
}

fn instantiate(plugin: &Plugin) -> Result<Instance<Bindings>, PluginError> {
    match &plugin.inner.pre {
        super::PluginPre::Replicator(pre) => {
            super::instantiate_with(plugin, |store| pre.instantiate(store).map(Bindings::V2))
        }
        super::PluginPre::ReplicatorV1(pre) => {
            super::instantiate_with(plugin, |store| pre.instantiate(store).map(Bindings::V1))
        }
        _ => Err(PluginError::Load { plugin: plugin.name().to_owned(), detail: "not a replicator".to_owned() }),
    }
}
