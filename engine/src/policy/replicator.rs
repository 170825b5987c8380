//! The replicator host: a placement table per topology (the host looks shards up in it
//! natively), and repair plans after membership changes, both checked before use.

use std::collections::{HashMap, HashSet};

use super::bindings::replicator::ReplicatorPlugin;
use super::bindings::replicator::exports::granary::policy::replicator as wit;
use super::partitioner::NodeInfo;
use super::supervise::{PolicyStatus, Supervisor, SwapHandle};
use super::{Instance, Plugin, PolicyKind, invalid, rejected};
use crate::error::{Error, PluginError};

/// Whether an ingest waits for its copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplicationMode {
    /// Wait until the copies are verified on their nodes.
    Synchronous,
    /// Copy in the background.
    Asynchronous,
}

/// Where every shard's copies go, as a table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Sync or async.
    pub mode: ReplicationMode,
    /// Shard key k lives on `buckets[k % len]`, most preferred first.
    pub buckets: Vec<Vec<u32>>,
}

impl Placement {
    /// The nodes of a shard, by its id.
    pub fn nodes(&self, shard_id: &[u8; 32]) -> &[u32] {
        self.nodes_of_key(shard_key(shard_id))
    }

    /// The nodes of a shard key.
    pub fn nodes_of_key(&self, key: u64) -> &[u32] {
        &self.buckets[(key % self.buckets.len() as u64) as usize]
    }
}

/// The placement key of a shard: the first 8 bytes of its id, little-endian.
pub fn shard_key(shard_id: &[u8; 32]) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&shard_id[..8]);
    u64::from_le_bytes(word)
}

/// Where a shard's copies are now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    /// The shard key.
    pub key: u64,
    /// Nodes with a copy.
    pub nodes: Vec<u32>,
}

/// One copy to make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// The shard key.
    pub key: u64,
    /// A node with a copy.
    pub source: u32,
    /// The node to copy to.
    pub target: u32,
}

/// A supervised replicator plugin.
pub struct Replicator {
    supervisor: Supervisor<Instance<ReplicatorPlugin>>,
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
        plugin.expect_kind(PolicyKind::Replicator)?;
        if let Some(fallback) = &fallback {
            fallback.expect_kind(PolicyKind::Replicator)?;
        }
        let instance = instantiate(&plugin).map_err(Error::Plugin)?;
        let limits = plugin.host().limits().clone();
        Ok(Self { supervisor: Supervisor::new(plugin, options.to_vec(), Some(instance), fallback, limits) })
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
                .call("place", deadline, |b, s| {
                    b.granary_policy_replicator().call_place(s, &wit_nodes, replicas, &options)
                })?
                .map_err(|e| rejected(&plugin, "place", e))?;
            check_placement(&placement.buckets, nodes, replicas).map_err(|detail| invalid(&plugin, "place", detail))?;
            let mode = match placement.mode {
                wit::Mode::Synchronous => ReplicationMode::Synchronous,
                wit::Mode::Asynchronous => ReplicationMode::Asynchronous,
            };
            Ok(Placement { mode, buckets: placement.buckets })
        })
    }

    /// The copies that restore the replication factor after a membership change; checked: each
    /// copies a shard it was told about, from a node up that holds it, to a node up that does not,
    /// once.
    pub fn repair(&mut self, nodes: &[NodeInfo], replicas: u32, holdings: &[Holding]) -> Result<Vec<Transfer>, Error> {
        check_nodes(nodes)?;
        let wit_nodes = wit_nodes(nodes);
        let wit_holdings: Vec<wit::Holding> =
            holdings.iter().map(|h| wit::Holding { key: h.key, nodes: h.nodes.clone() }).collect();
        self.supervisor.run(&mut |plugin, _| instantiate(plugin), &mut |instance, _, options| {
            let options = options.to_vec();
            let plugin = instance.plugin.clone();
            let deadline = plugin.host().limits().deadline_replicate;
            let transfers = instance
                .call("repair", deadline, |b, s| {
                    b.granary_policy_replicator().call_repair(s, &wit_nodes, replicas, &wit_holdings, &options)
                })?
                .map_err(|e| rejected(&plugin, "repair", e))?;
            let transfers: Vec<Transfer> =
                transfers.into_iter().map(|t| Transfer { key: t.key, source: t.source, target: t.target }).collect();
            check_transfers(&transfers, nodes, holdings).map_err(|detail| invalid(&plugin, "repair", detail))?;
            Ok(transfers)
        })
    }

    /// Switches to `plugin` (run with `options`) now; the current one becomes the fallback.
    pub fn swap(&mut self, plugin: Plugin, options: &[(String, String)]) -> Result<(), Error> {
        plugin.expect_kind(PolicyKind::Replicator)?;
        let instance = instantiate(&plugin).map_err(Error::Plugin)?;
        self.supervisor.promote(plugin, options.to_vec(), Some(instance));
        Ok(())
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

fn instantiate(plugin: &Plugin) -> Result<Instance<ReplicatorPlugin>, PluginError> {
    let super::PluginPre::Replicator(pre) = &plugin.inner.pre else {
        return Err(PluginError::Load { plugin: plugin.name().to_owned(), detail: "not a replicator".to_owned() });
    };
    super::instantiate_with(plugin, |store| pre.instantiate(store))
}
