//! Hot shards: the reads of each shard over a window, summed over the nodes, turned by the
//! replicator's `adapt` into extra copies of the shards read most, and dropped again when they
//! cool.
//!
//! Owns: the feeding of `heat_state.rs`'s `HeatWindow` (by in-process readers through
//! `accessed` and by readers beside the node through `Accessed` frames), the `Heat` answer to
//! peers, and the reconciler's hot pass
//! (`adapt_hot`): it asks the peers that are up for their heat, sums it with its own, asks the
//! replicator per replication factor, and acts for this node alone: it pulls a copy of each
//! shard a goal names it for and it lacks, and lets go of the hot copies it holds that no goal
//! names it for any more. Hot copies are read-cache entries, recorded in `replication/hot` so a
//! restart still knows them. Never: drops a copy the placement table puts here or one that is
//! not a hot copy, or deletes one unless a node that is up holds a copy that is not cached (the
//! read cache's `evict` rule: a shard never falls below its factor); starts more than
//! `HOT_FETCHES_MAX` pulls at once.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::frame::{Frame, WireKind};
use super::heat_state::HotShard;
use super::shared::Shared;
use crate::error::{Error, Result, TransportError};
use crate::id::{ObjectId, ShardId};
use crate::policy::{NodeSpace, ReplicationMode, ShardHeat, shard_key};

/// Hot copies being pulled at once by this node.
const HOT_FETCHES_MAX: usize = 4;
/// How long the hot pass waits for a peer's heat.
const HEAT_ASK_TIMEOUT: Duration = Duration::from_secs(2);
/// Hot shards named in the status report at most.
pub(crate) const HOT_SHOWN: usize = 16;

impl Shared {
    /// Readers beside the node read `entries` (shard, reads).
    pub(crate) fn count_reads(&self, entries: &[(ObjectId, u64)]) {
        let mut heat = self.heat.lock();
        for &(id, reads) in entries {
            heat.add(id, reads);
        }
    }

    /// The answer to a peer's `HeatRequest`.
    pub(crate) fn heat_report(&self) -> (u64, Vec<(ObjectId, u64)>) {
        let free = crate::io::fs_space(self.local.paths().root()).map_or(u64::MAX, |(_, free)| free);
        (free, self.heat.lock().report())
    }

    /// A peer's heat: its free space and its reads per shard.
    async fn peer_heat(self: &Arc<Self>, peer: u32) -> Result<(u64, Vec<(ObjectId, u64)>)> {
        let addr = self.peers.addr_of(peer).ok_or_else(|| Error::NotFound { what: format!("node {peer}") })?;
        let transport = |source: TransportError| Error::Transport { peer: format!("node {peer} ({addr})"), source };
        let (mut channel, _) = self.connect(addr).await.map_err(transport)?;
        let request = self.next_request_id();
        channel.send(&Frame::HeatRequest { request }).await.map_err(transport)?;
        match channel.recv().await.map_err(transport)? {
            Frame::Heat { request: r, free_bytes, entries } if r == request => Ok((free_bytes, entries)),
            Frame::Reply { code, message, .. } => Err(Error::PeerRefused {
                peer: format!("node {peer}"),
                request: "heat",
                code: code.to_string(),
                message: message.to_owned(),
            }),
            other => Err(transport(TransportError::Protocol {
                detail: format!("answered a heat request with {:?}", other.kind()),
            })),
        }
    }

    /// The hot pass (see the module documentation), over the shards of the replication goals
    /// (`by_factor`: factor -> shard -> bytes). Runs at most once per half window.
    pub(super) async fn adapt_hot(self: &Arc<Self>, by_factor: &BTreeMap<u32, BTreeMap<ShardId, u64>>) {
        let now = Instant::now();
        {
            let mut hot = self.hot.lock();
            let every = (self.config.heat_window / 2).max(Duration::from_millis(100));
            if hot.last_pass.is_some_and(|at| now.saturating_duration_since(at) < every) {
                return;
            }
            hot.last_pass = Some(now);
        }
        let nodes = self.node_infos();
        let (own_free, own) = self.heat_report();
        let mut reads: HashMap<ObjectId, u64> = own.into_iter().collect();
        let mut space = vec![NodeSpace { id: self.hello.node_id, free_bytes: own_free }];
        let mut asks = tokio::task::JoinSet::new();
        for (peer, _) in self.peers.up() {
            let shared = Arc::clone(self);
            asks.spawn(async move {
                // A peer that does not answer soon counts no reads this pass.
                let answer = tokio::time::timeout(HEAT_ASK_TIMEOUT, shared.peer_heat(peer)).await;
                (peer, answer.unwrap_or_else(|_| Err(Error::invalid_input("no heat within the pass's bound"))))
            });
        }
        while let Some(joined) = asks.join_next().await {
            let Ok((peer, answer)) = joined else { continue };
            match answer {
                Ok((free_bytes, entries)) => {
                    space.push(NodeSpace { id: peer, free_bytes });
                    for (id, count) in entries {
                        let sum = reads.entry(id).or_default();
                        *sum = sum.saturating_add(count);
                    }
                }
                // A peer that cannot say (down meanwhile, or older than the heat frames) counts
                // no reads; its space is not known.
                Err(_) => {
                    self.stats.heat_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
        let previous: HashMap<ShardId, Vec<u32>> =
            self.hot.lock().goals.iter().map(|(shard, goal)| (*shard, goal.nodes.clone())).collect();
        let mut goals: BTreeMap<ShardId, HotShard> = BTreeMap::new();
        for (&replicas, shards) in by_factor {
            let mut by_key: HashMap<u64, ShardId> = HashMap::with_capacity(shards.len());
            let heat: Vec<ShardHeat> = shards
                .iter()
                .map(|(&shard, &bytes)| {
                    let key = shard_key(shard.0.as_bytes());
                    by_key.insert(key, shard);
                    ShardHeat {
                        key,
                        bytes,
                        reads: reads.get(&shard.0).copied().unwrap_or(0),
                        holders: self.holders(WireKind::Shard, shard.0),
                        previous: previous.get(&shard).cloned().unwrap_or_default(),
                    }
                })
                .collect();
            let answer = tokio::task::block_in_place(|| self.replicator.lock().adapt(&nodes, &space, replicas, &heat));
            match answer {
                Ok(answer) => {
                    for goal in answer {
                        let Some(&shard) = by_key.get(&goal.key) else { continue };
                        let reads = reads.get(&shard.0).copied().unwrap_or(0);
                        // A shard of two goals keeps the larger answer.
                        let entry =
                            goals.entry(shard).or_insert(HotShard { reads, nodes: Vec::new(), mode: goal.mode });
                        if goal.nodes.len() > entry.nodes.len() {
                            *entry = HotShard { reads, nodes: goal.nodes, mode: goal.mode };
                        }
                    }
                }
                Err(e) => {
                    // The previous goals stand: a failed pass drops no hot copy.
                    self.event(format!("the replicator's adapt failed: {e}"));
                    for (shard, goal) in self.hot.lock().goals.iter().filter(|(shard, _)| shards.contains_key(*shard)) {
                        goals.entry(*shard).or_insert_with(|| goal.clone());
                    }
                }
            }
        }
        self.act_on_hot(goals, by_factor).await;
    }

    /// Pulls the hot copies the goals name this node for, and lets go of those they no longer
    /// name it for.
    async fn act_on_hot(
        self: &Arc<Self>,
        goals: BTreeMap<ShardId, HotShard>,
        by_factor: &BTreeMap<u32, BTreeMap<ShardId, u64>>,
    ) {
        let me = self.hello.node_id;
        let bytes_of = |shard: &ShardId| by_factor.values().find_map(|shards| shards.get(shard).copied());
        let (to_pull, to_drop) = {
            let mut hot = self.hot.lock();
            hot.goals = goals;
            let to_pull: Vec<(ShardId, u64)> = hot
                .goals
                .iter()
                .filter(|(shard, goal)| {
                    goal.nodes.contains(&me)
                        && self.local.holds(WireKind::Shard, shard.0).is_none()
                        && !hot.fetching.contains(*shard)
                        && !self.declined.lock().contains(*shard)
                })
                .filter_map(|(shard, _)| bytes_of(shard).map(|bytes| (*shard, bytes)))
                .take(HOT_FETCHES_MAX.saturating_sub(hot.fetching.len()))
                .collect();
            for (shard, _) in &to_pull {
                hot.fetching.insert(*shard);
            }
            // A recorded hot copy that is no longer a cache entry (a peer asked this node to hold
            // it, or the cache kept it as a last copy) is a copy like any other now: forgotten,
            // never dropped here.
            let before = hot.held.len();
            hot.held.retain(|shard| self.local.is_cached(shard.0));
            if hot.held.len() != before {
                self.record_hot(&hot.held);
            }
            let to_drop: Vec<ShardId> = hot
                .held
                .iter()
                .filter(|shard| hot.goals.get(*shard).is_none_or(|goal| !goal.nodes.contains(&me)))
                .copied()
                .collect();
            (to_pull, to_drop)
        };
        for (shard, bytes) in to_pull {
            let shared = Arc::clone(self);
            tokio::spawn(async move {
                let sources = shared.holders(WireKind::Shard, shard.0);
                let outcome = shared.fetch_here(WireKind::Shard, shard.0, bytes, &sources).await;
                match outcome {
                    Ok(()) => shared.keep_hot_copy(shard, bytes),
                    Err(e) => shared.event(format!("could not pull a hot copy of {}: {e}", shard.0.short(12))),
                }
                shared.hot.lock().fetching.remove(&shard);
            });
        }
        if !to_drop.is_empty() {
            let mut victims = Vec::new();
            {
                let mut hot = self.hot.lock();
                for shard in &to_drop {
                    hot.held.remove(shard);
                }
                self.record_hot(&hot.held);
            }
            for shard in to_drop {
                if let Some(bytes) = self.local.holds(WireKind::Shard, shard.0) {
                    self.cache.lock().forget(shard);
                    victims.push((shard, bytes));
                }
            }
            // `evict` keeps a copy the table places here, or one no other node that is up holds
            // as a copy that is not cached.
            self.evict(victims).await;
        }
    }

    /// A hot copy was pulled: it is a read-cache entry, recorded as hot. One the read cache
    /// cannot take stays a copy like any other (never deleted here: the pull may have met a
    /// copy that came otherwise meanwhile); one larger than the cache's bound is not pulled
    /// again.
    fn keep_hot_copy(self: &Arc<Self>, shard: ShardId, bytes: u64) {
        if self.local.is_cached(shard.0) {
            // A reader's cache entry came first: it stays the cache's, not a hot copy.
            return;
        }
        self.local.set_cached(shard.0, true);
        let admitted = self.cache.lock().admit(shard, bytes);
        match admitted {
            Ok((victims, cached)) => {
                if !victims.is_empty() {
                    let shared = Arc::clone(self);
                    tokio::spawn(async move { shared.evict(victims).await });
                }
                if !cached {
                    self.local.set_cached(shard.0, false);
                    self.declined.lock().insert(shard);
                    return;
                }
            }
            Err(e) => {
                self.local.set_cached(shard.0, false);
                self.event(format!("cache evictor failed: {e}"));
                return;
            }
        }
        let mut hot = self.hot.lock();
        hot.held.insert(shard);
        self.record_hot(&hot.held);
    }

    /// Shard `shard` left this node's disk: it is no hot copy any more.
    pub(super) fn forget_hot(&self, shard: ShardId) {
        let mut hot = self.hot.lock();
        if hot.held.remove(&shard) {
            self.record_hot(&hot.held);
        }
    }

    /// Writes the hot copies held to `replication/hot` (not synced: losing it leaves the copies
    /// as read-cache entries, never data lost).
    fn record_hot(&self, held: &BTreeSet<ShardId>) {
        let dir = self.local.paths().root().join("replication");
        let text: String = held.iter().map(|shard| format!("{}\n", shard.0)).collect();
        if let Err(e) = crate::store::replace_file(&dir, &dir.join("hot"), text.as_bytes(), false) {
            self.event(format!("could not record the hot copies: {e}"));
        }
    }
}

/// The status of the hot shards: the most read `HOT_SHOWN` (shard, reads, copies wanted,
/// copies on nodes that are up), how many there are, and the hot copies this node holds.
impl Shared {
    pub(crate) fn hot_status(&self) -> (Vec<super::status::HotShardStatus>, usize, usize) {
        let hot = self.hot.lock();
        let mut shown: Vec<super::status::HotShardStatus> = hot
            .goals
            .iter()
            .map(|(shard, goal)| super::status::HotShardStatus {
                shard: shard.0.short(12),
                reads: goal.reads,
                copies_wanted: goal.nodes.len(),
                copies: self.holders(WireKind::Shard, shard.0).len(),
                synchronous: goal.mode == ReplicationMode::Synchronous,
            })
            .collect();
        shown.sort_by_key(|s| std::cmp::Reverse(s.reads));
        shown.truncate(HOT_SHOWN);
        (shown, hot.goals.len(), hot.held.len())
    }
}
