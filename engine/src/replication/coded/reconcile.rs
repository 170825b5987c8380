//! The reconciler's coded pass: missing fragments rebuilt and placed by each shard's
//! coordinator, whole copies turned into cache entries once every fragment is placed, two
//! fragments one node ended up with undone, and the fragments of a coding no goal names dropped
//! once the goal that replaced it is met.
//!
//! Owns: `reconcile_coded`, `drop_duplicate_fragments`, `drop_stale_fragments`,
//! `keep_as_cache_entry`. Never: drops the last fragments of a shard no other goal has placed.

use super::{FragmentHolders, rendezvous, rendezvous_of};
use crate::erasure::{Coding, fragment_id};
use crate::id::ShardId;
use crate::replication::frame::WireKind;
use crate::replication::shared::Shared;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

impl Shared {
    /// The reconciler's pass over coded goals: for each shard, a second copy of a fragment here
    /// is dropped when another node keeps it; the fragments no node that is up holds are
    /// rebuilt and placed by the shard's coordinator (among the nodes that are up and hold the
    /// whole shard, else a fragment of it, the first by rendezvous hash), at most `budget`
    /// shards per pass; a whole copy here of a shard whose every fragment is placed becomes a cache entry.
    /// Returns (shards below their goal with their bytes, shards that cannot be read).
    pub(in crate::replication) async fn reconcile_coded(
        self: &Arc<Self>,
        coded: &BTreeMap<Coding, BTreeMap<ShardId, u64>>,
        budget: usize,
    ) -> (Vec<(ShardId, u64)>, usize) {
        let own = self.hello.node_id;
        let up: BTreeSet<u32> = self.peers.up().into_iter().map(|(id, _)| id).chain(std::iter::once(own)).collect();
        let mut under = Vec::new();
        let mut unreadable = 0;
        let mut started = 0;
        for (&coding, shards) in coded {
            let placement = match self.placement(self.node_infos(), coding.n() as u32).await {
                Ok(placement) => placement,
                Err(e) => {
                    self.event(format!("the replicator's placement failed: {e}"));
                    continue;
                }
            };
            for (&shard, &bytes) in shards {
                let holders = self.fragment_holders(shard, coding);
                let whole = self.holders(WireKind::Shard, shard.0);
                if holders.present() < usize::from(coding.k()) && whole.is_empty() {
                    unreadable += 1;
                }
                self.drop_duplicate_fragments(shard, &holders).await;
                let missing = holders.missing();
                if missing.is_empty() {
                    if self.local.holds(WireKind::Shard, shard.0).is_some()
                        && !self.local.is_cached(shard.0)
                        && !self.is_placed_here(shard).await
                    {
                        self.keep_as_cache_entry(shard);
                    }
                    continue;
                }
                under.push((shard, bytes));
                // A node with the whole shard encodes it; else one with a fragment rebuilds it,
                // chosen per shard by rendezvous hashing so the rebuilds spread over the nodes.
                let candidates: Vec<u32> =
                    if whole.is_empty() { holders.nodes().into_iter().collect() } else { whole.clone() };
                let coordinator = candidates.into_iter().min_by_key(|&node| rendezvous(shard, node));
                if coordinator != Some(own) || started >= budget || self.coding_work.lock().contains(&shard) {
                    continue;
                }
                let targets = self.fragment_targets(&placement, shard, &holders, &up);
                if missing.iter().all(|&i| targets[usize::from(i)].is_none()) {
                    // No node is free for any of them: they wait for one to join.
                    continue;
                }
                started += 1;
                let shared = Arc::clone(self);
                tokio::spawn(async move {
                    let (made, errors) = shared.place_fragments(shard, bytes, coding, &targets).await;
                    if made > 0 {
                        shared.event(format!("rebuilt {made} fragments of shard {}", shard.0.short(12)));
                    }
                    for e in errors {
                        shared.event(format!("rebuilding fragments: {e}"));
                    }
                    shared.wake.notify_one();
                });
            }
        }
        (under, unreadable)
    }

    /// Drops this node's copy of a fragment of `shard` that another node that is up also holds,
    /// when this node holds two or more of the shard's fragments (it knows its own holdings
    /// for sure), or holds one and the rendezvous hash prefers another holder. Only while at
    /// least `k + 2` fragments are up: should two nodes' views disagree and both drop their
    /// copy, the shard keeps `k + 1`, and the lost index is rebuilt.
    async fn drop_duplicate_fragments(self: &Arc<Self>, shard: ShardId, holders: &FragmentHolders) {
        let own = self.hello.node_id;
        let coding = holders.coding;
        if holders.present() < usize::from(coding.k()) + 2 {
            return;
        }
        let mut own_count = (0..coding.n())
            .filter(|&i| self.local.holds(WireKind::Fragment, fragment_id(shard, coding, i as u8)).is_some())
            .count();
        for (index, nodes) in holders.by_index.iter().enumerate() {
            if nodes.len() < 2 || !nodes.contains(&own) {
                continue;
            }
            let keeper = nodes.iter().copied().min_by_key(|&node| rendezvous_of(shard, index as u8, node));
            if own_count < 2 && keeper == Some(own) {
                continue;
            }
            let id = fragment_id(shard, coding, index as u8);
            let shared = Arc::clone(self);
            match tokio::task::spawn_blocking(move || shared.local.remove(WireKind::Fragment, id)).await {
                Ok(Ok(())) => {
                    own_count -= 1;
                    self.event(format!(
                        "dropped a second copy of fragment {index} of shard {} (another node holds it)",
                        shard.0.short(12)
                    ));
                }
                Ok(Err(e)) => self.event(format!("could not drop fragment {}: {e}", id.short(12))),
                Err(e) => self.event(format!("could not drop fragment {}: {e}", id.short(12))),
            }
        }
    }

    /// Drops the fragments held here of a coding no goal names for their shard any more (the
    /// dataset went back to copies, or to another coding) once the goal that replaced it is met
    /// on the nodes that are up: `R` copies that are not cache entries, or every fragment of the
    /// new coding. Fragments of shards no goal names are left to gc.
    pub(in crate::replication) async fn drop_stale_fragments(
        self: &Arc<Self>,
        goals: &BTreeMap<crate::store::DatasetName, crate::replication::frame::Goal>,
    ) {
        let ids = self.local.fragment_ids();
        if ids.is_empty() {
            return;
        }
        // A shard two datasets share answers to both goals.
        let mut goals_of: BTreeMap<ShardId, Vec<crate::replication::frame::Goal>> = BTreeMap::new();
        for (name, &goal) in goals {
            if let Ok(shards) = self.shards_of(name) {
                for shard in shards.into_keys() {
                    goals_of.entry(shard).or_default().push(goal);
                }
            }
        }
        for id in ids {
            let known = self.fragment_headers.lock().get(&id).copied();
            let (shard, coding) = match known {
                Some(known) => known,
                None => {
                    let path = self.local.object_path(WireKind::Fragment, id);
                    let opened =
                        tokio::task::spawn_blocking(move || crate::erasure::FragmentFile::open(&path, id)).await;
                    let Ok(Ok(file)) = opened else { continue };
                    let known = (file.header().shard, file.header().coding);
                    self.fragment_headers.lock().insert(id, known);
                    known
                }
            };
            let Some(goals) = goals_of.get(&shard) else { continue };
            let met = |goal: &crate::replication::frame::Goal| match *goal {
                crate::replication::frame::Goal::Coded(current) => {
                    current != coding && self.fragment_holders(shard, current).missing().is_empty()
                }
                crate::replication::frame::Goal::Replicas(replicas) => {
                    let here = usize::from(
                        self.local.holds(WireKind::Shard, shard.0).is_some() && !self.local.is_cached(shard.0),
                    );
                    here + self.peers.durable_holders(shard.0) >= replicas as usize
                }
            };
            if !goals.iter().all(met) {
                continue;
            }
            let shared = Arc::clone(self);
            match tokio::task::spawn_blocking(move || shared.local.remove(WireKind::Fragment, id)).await {
                Ok(Ok(())) => {
                    self.fragment_headers.lock().remove(&id);
                    self.event(format!(
                        "dropped fragment {} of shard {} ({coding}): its dataset's goal changed and is met",
                        id.short(12),
                        shard.0.short(12)
                    ));
                }
                Ok(Err(e)) => self.event(format!("could not drop fragment {}: {e}", id.short(12))),
                Err(e) => self.event(format!("could not drop fragment {}: {e}", id.short(12))),
            }
        }
    }

    /// A whole copy of a coded shard, every fragment of which is placed: a cache entry from now
    /// on (it serves reads until the read cache needs its room), or, on a node without a read
    /// cache bound (`serve --cache-bytes`, none by default), gone at once: the disk the coding
    /// saves is the point of it (issue 40: six nodes held 51.3 MB for 16.2 MB coded 4+2).
    /// A copy larger than the whole cache goes too. `evict` keeps it where a copies goal places
    /// it here, or where no copy that is not cached is up and the fragments would not be enough.
    fn keep_as_cache_entry(self: &Arc<Self>, shard: ShardId) {
        let Some(bytes) = self.local.holds(WireKind::Shard, shard.0) else { return };
        if self.declined.lock().contains(&shard) {
            return;
        }
        self.local.set_cached(shard.0, true);
        if self.config.cache_bytes_max == 0 {
            let shared = Arc::clone(self);
            tokio::spawn(async move { shared.evict(vec![(shard, bytes)]).await });
            return;
        }
        let admitted = self.cache.lock().admit(shard, bytes);
        match admitted {
            Ok((victims, cached)) => {
                let mut victims = victims;
                if !cached {
                    // Larger than the whole cache: it goes as with no cache (`evict` keeps it if
                    // the fragments would not be enough), and is not offered again. Kept, a
                    // node with a small cache held every whole shard it coded (issue 53: 25 MB
                    // beside a 4 MiB cache reporting 0 B).
                    self.local.set_cached(shard.0, false);
                    self.declined.lock().insert(shard);
                    victims.push((shard, bytes));
                }
                if !victims.is_empty() {
                    let shared = Arc::clone(self);
                    tokio::spawn(async move { shared.evict(victims).await });
                }
            }
            Err(e) => {
                self.local.set_cached(shard.0, false);
                self.event(format!("cache evictor failed: {e}"));
            }
        }
    }
}
