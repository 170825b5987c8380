//! The reconciler: restores every replication goal's factor after membership changes, lost
//! copies and new goals.
//!
//! Owns: the `reconciler` task and one pass of it (`Shared::reconcile`), and closing the node's
//! write session once it is idle between passes (`WRITE_SESSION_IDLE`), so that an ingest can take
//! the store.
//!
//! Every tick, or when woken (a peer up or down, a new inventory, a goal, a published object),
//! it reads the goals, asks the replicator plugin for the repair plan of each goal's shards over
//! the nodes that are up, and asks each target of a transfer whose source is this node to pull
//! the shard (`Fetch`, through `replicate.rs`); coded goals' lost fragments are rebuilt by
//! `coded/reconcile.rs`. It brings refs and manifests to peers that lack them (and a goal set here to
//! peers it has not reached), and measures the replication lag. Never: starts more than
//! `FETCHES_PER_PASS_MAX` fetch requests and coded rebuilds together in one pass (counting the
//! rebuilds still running; each asks up to `m` targets), or a second request for a (shard,
//! target) already asked.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::frame::{Goal, WireKind};
use super::shared::{FETCHES_MAX, Shared};
use crate::erasure::Coding;
use crate::error::{Error, Result};
use crate::id::ShardId;
use crate::policy::{Holding, shard_key};
use crate::store::DatasetName;

/// Fetch requests the reconciler starts in one pass (the others wait for a later pass).
const FETCHES_PER_PASS_MAX: usize = 4 * FETCHES_MAX;
/// A write session idle for this long is closed, so that an ingest can take the store.
const WRITE_SESSION_IDLE: Duration = Duration::from_millis(500);

impl Shared {
    /// One pass of the reconciler.
    async fn reconcile(self: &Arc<Self>) -> Result<()> {
        {
            let shared = Arc::clone(self);
            tokio::task::spawn_blocking(move || shared.local.rescan())
                .await
                .map_err(|e| Error::invalid_input(format!("rescan failed: {e}")))??;
        }
        let goals = self.local.goals()?;
        let nodes = self.node_infos();
        let n_up = nodes.iter().filter(|n| n.up).count();
        let mut by_factor: BTreeMap<u32, BTreeMap<ShardId, u64>> = BTreeMap::new();
        let mut coded: BTreeMap<Coding, BTreeMap<ShardId, u64>> = BTreeMap::new();
        for (name, &goal) in &goals {
            match (self.shards_of(name), goal) {
                (Ok(shards), Goal::Replicas(replicas)) => by_factor.entry(replicas).or_default().extend(shards),
                (Ok(shards), Goal::Coded(coding)) => coded.entry(coding).or_default().extend(shards),
                (Err(e), _) => self.event(format!("goal {name}: {e}")),
            }
            self.bring_ref(name, goal);
        }
        let now = Instant::now();
        let mut under: HashMap<ShardId, Instant> = HashMap::new();
        let mut unavailable = 0;
        let mut under_bytes = 0;
        // Fetch requests started in this pass, across factors; none while many are pending.
        let mut started = self.fetching.len();
        for (&replicas, shards) in &by_factor {
            let want = (replicas as usize).min(n_up);
            let mut holdings = Vec::with_capacity(shards.len());
            let mut by_key: HashMap<u64, (ShardId, u64)> = HashMap::with_capacity(shards.len());
            for (&shard, &bytes) in shards {
                let holders = self.holders(WireKind::Shard, shard.0);
                if holders.is_empty() {
                    unavailable += 1;
                }
                if holders.len() < want && under.insert(shard, now).is_none() {
                    under_bytes += bytes;
                }
                let key = shard_key(shard.0.as_bytes());
                by_key.insert(key, (shard, bytes));
                holdings.push(Holding { key, nodes: holders });
            }
            let transfers = match self.repair_plan(nodes.clone(), replicas, holdings).await {
                Ok(transfers) => transfers,
                Err(e) => {
                    self.event(format!("the replicator's repair plan failed: {e}"));
                    continue;
                }
            };
            for t in transfers {
                if t.source != self.hello.node_id {
                    continue;
                }
                let Some(&(shard, bytes)) = by_key.get(&t.key) else { continue };
                // One request per (shard, target) at a time, and a bounded number started per
                // pass: the rest wait for the next pass.
                if started >= FETCHES_PER_PASS_MAX || self.fetching.contains(&(shard.0, t.target)) {
                    continue;
                }
                started += 1;
                let others = self.holders(WireKind::Shard, shard.0);
                let shared = Arc::clone(self);
                tokio::spawn(async move {
                    let _ = shared.fetch_once(t.target, WireKind::Shard, shard.0, bytes, others).await;
                });
            }
        }
        // Hot shards: extra copies of the most read ones, and back to the factor once they cool.
        if !by_factor.is_empty() {
            self.adapt_hot(&by_factor).await;
        }
        // Coded goals: lost fragments rebuilt, within what this pass may still start.
        let (coded_under, coded_unreadable) = {
            let busy = self.coding_work.lock().len();
            self.reconcile_coded(&coded, FETCHES_PER_PASS_MAX.saturating_sub(started + busy)).await
        };
        unavailable += coded_unreadable;
        // Fragments of a coding no goal names any more, once the goal that replaced it is met.
        self.drop_stale_fragments(&goals).await;
        for (shard, bytes) in coded_under {
            if under.insert(shard, now).is_none() {
                under_bytes += bytes;
            }
        }
        self.record_lag(now, under, under_bytes, unavailable);
        Ok(())
    }

    /// Peers that lack dataset `name`'s manifests get them, then the ref; a peer that a goal
    /// set here has not reached yet gets the ref with it.
    fn bring_ref(self: &Arc<Self>, name: &DatasetName, goal: Goal) {
        for (peer, _) in self.peers.up() {
            let missing = match self.local.paths().read_ref(name) {
                Ok(log) => log.versions().iter().any(|v| !self.node_holds(peer, WireKind::Manifest, v.manifest.0)),
                Err(_) => false,
            };
            let untold = self.goals_pending.lock().contains(&(peer, name.clone()));
            if (missing || untold) && self.pushing.lock().insert((peer, name.clone())) {
                let shared = Arc::clone(self);
                let name = name.clone();
                tokio::spawn(async move {
                    if let Err(e) = shared.push_ref(peer, &name, goal).await {
                        shared.event(format!("could not bring {name} to node {peer}: {e}"));
                    }
                    shared.pushing.lock().remove(&(peer, name));
                });
            }
        }
    }

    /// The shards under their goal now (each since when it first was), and how long those
    /// that reached it again took.
    fn record_lag(&self, now: Instant, mut under: HashMap<ShardId, Instant>, under_bytes: u64, unavailable: usize) {
        let mut lag = self.lag.lock();
        let previous = std::mem::take(&mut lag.under);
        for (shard, since) in &mut under {
            if let Some(&first) = previous.get(shard) {
                *since = first;
            }
        }
        for (shard, since) in previous {
            if !under.contains_key(&shard) {
                let took = now.duration_since(since);
                lag.last = Some(took);
                lag.max = lag.max.max(took);
            }
        }
        lag.under = under;
        lag.under_bytes = under_bytes;
        lag.unavailable = unavailable;
    }
}

/// The reconciler task.
pub(super) async fn reconciler(shared: Arc<Shared>, mut shutdown: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(shared.config.reconcile_every) => {}
            _ = shared.wake.notified() => {}
            _ = shutdown.changed() => return,
        }
        if let Err(e) = shared.reconcile().await {
            shared.event(format!("reconcile failed: {e}"));
        }
        // Publications come in bursts; between them an ingest may want the store.
        shared.local.release_if_idle(WRITE_SESSION_IDLE);
    }
}
