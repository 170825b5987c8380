//! Hot shards: the reads of each shard over a window, summed over the nodes, turned by the
//! replicator's `adapt` into extra copies of the shards read most, and dropped again when they
//! cool.
//!
//! Owns: `HeatWindow` (this node's reads per shard: the window being counted and the one
//! before; fed by in-process readers through `accessed` and by readers beside the node through
//! `Accessed` frames), the `Heat` answer to peers, and the reconciler's hot pass
//! (`adapt_hot`): it asks the peers that are up for their heat, sums it with its own, asks the
//! replicator per replication factor, and acts for this node alone: it pulls a copy of each
//! shard a goal names it for and it lacks, and lets go of the hot copies it holds that no goal
//! names it for any more. Hot copies are read-cache entries, recorded in `replication/hot` so a
//! restart still knows them. Never: drops a copy the placement table puts here or one that is
//! not a hot copy, or deletes one unless a node that is up holds a copy that is not cached (the
//! read cache's `evict` rule: a shard never falls below its factor); starts more than
//! `HOT_FETCHES_MAX` pulls at once.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::frame::{Frame, HEAT_ENTRIES_MAX, WireKind};
use super::shared::Shared;
use crate::error::{Error, Result, TransportError};
use crate::id::{ObjectId, ShardId};
use crate::policy::{NodeSpace, ReplicationMode, ShardHeat, shard_key};

/// Distinct shards counted in a window at most (others read in it are not counted).
const HEAT_SHARDS_MAX: usize = 1 << 16;
/// Hot copies being pulled at once by this node.
const HOT_FETCHES_MAX: usize = 4;
/// How long the hot pass waits for a peer's heat.
const HEAT_ASK_TIMEOUT: Duration = Duration::from_secs(2);
/// Hot shards named in the status report at most.
pub(crate) const HOT_SHOWN: usize = 16;

/// This node's reads per shard: the window being counted and the one before it.
pub(crate) struct HeatWindow {
    window: Duration,
    started: Instant,
    current: HashMap<ObjectId, u64>,
    previous: HashMap<ObjectId, u64>,
}

impl HeatWindow {
    pub(crate) fn new(window: Duration) -> Self {
        Self { window, started: Instant::now(), current: HashMap::new(), previous: HashMap::new() }
    }

    fn roll(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.started);
        if elapsed >= self.window {
            // Two windows or more without a roll: the one before is empty too.
            self.previous = if elapsed >= self.window.saturating_mul(2) {
                HashMap::new()
            } else {
                std::mem::take(&mut self.current)
            };
            self.current.clear();
            self.started = now;
        }
    }

    /// Counts `reads` of shard `id`.
    pub(crate) fn add(&mut self, id: ObjectId, reads: u64) {
        self.roll(Instant::now());
        let room = self.current.len() < HEAT_SHARDS_MAX;
        match self.current.get_mut(&id) {
            Some(count) => *count = count.saturating_add(reads),
            None if room => {
                self.current.insert(id, reads);
            }
            None => {}
        }
    }

    /// Reads per shard over the last window and the current one, the `HEAT_ENTRIES_MAX` most
    /// read, in id order.
    pub(crate) fn report(&mut self) -> Vec<(ObjectId, u64)> {
        self.roll(Instant::now());
        let mut sums: HashMap<ObjectId, u64> = self.previous.clone();
        for (&id, &reads) in &self.current {
            let sum = sums.entry(id).or_default();
            *sum = sum.saturating_add(reads);
        }
        let mut entries: Vec<(ObjectId, u64)> = sums.into_iter().filter(|&(_, reads)| reads > 0).collect();
        if entries.len() > HEAT_ENTRIES_MAX {
            entries.sort_unstable_by_key(|&(id, reads)| (std::cmp::Reverse(reads), id));
            entries.truncate(HEAT_ENTRIES_MAX);
        }
        entries.sort_unstable();
        entries
    }
}

/// A hot shard as the last hot pass saw it: its reads over the nodes, the nodes its goal names
/// and how its copies are confirmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HotShard {
    pub(crate) reads: u64,
    pub(crate) nodes: Vec<u32>,
    pub(crate) mode: ReplicationMode,
}

/// What the hot pass keeps between passes.
#[derive(Default)]
pub(crate) struct HotState {
    /// The goals of the last pass, by shard.
    pub(crate) goals: BTreeMap<ShardId, HotShard>,
    /// Hot copies this node holds (recorded in `replication/hot`).
    pub(crate) held: BTreeSet<ShardId>,
    /// Hot copies being pulled.
    pub(crate) fetching: HashSet<ShardId>,
    /// When the last pass ran.
    pub(crate) last_pass: Option<Instant>,
}

impl HotState {
    /// The hot copies recorded under `root` by an earlier run.
    pub(crate) fn load(root: &std::path::Path) -> Self {
        let path = root.join("replication").join("hot");
        let held = std::fs::read_to_string(path)
            .map(|text| text.lines().filter_map(|line| ObjectId::parse_hex(line.trim()).map(ShardId)).collect())
            .unwrap_or_default();
        Self { held, ..Self::default() }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_counts_the_last_two_windows_and_keeps_the_most_read() {
        let mut heat = HeatWindow::new(Duration::from_millis(40));
        let (a, b) = (ObjectId::of(b"a"), ObjectId::of(b"b"));
        heat.add(a, 3);
        heat.add(b, 1);
        heat.add(a, 2);
        let mut expected = vec![(a, 5), (b, 1)];
        expected.sort_unstable();
        assert_eq!(heat.report(), expected);
        std::thread::sleep(Duration::from_millis(50));
        heat.add(b, 4);
        // The window before still counts.
        let mut expected = vec![(a, 5), (b, 5)];
        expected.sort_unstable();
        assert_eq!(heat.report(), expected);
        // Two windows later nothing is left.
        std::thread::sleep(Duration::from_millis(90));
        assert_eq!(heat.report(), Vec::new());
        // The report keeps the most read when it must cut.
        for i in 0..(HEAT_ENTRIES_MAX as u64 + 10) {
            heat.add(ObjectId::of(&i.to_le_bytes()), i + 1);
        }
        let report = heat.report();
        assert_eq!(report.len(), HEAT_ENTRIES_MAX);
        assert!(report.iter().all(|&(_, reads)| reads > 10));
        assert!(report.windows(2).all(|w| w[0].0 < w[1].0));
    }
}
