//! The origin cache's view of the plan, and its fetches ahead of the reader: each shard's next
//! uses (as the loader tells them, this rank's and the node's other ranks'), Belady's rule for
//! whether a fetch ahead is worth what it would push out, and the prefetch threads.
//!
//! Owns the `OriginCache` methods of the plan (`step`, `reading_at`, `add_plan`, `next_use`, `read_within`,
//! `upcoming`, `worth_fetching`) and of prefetching (`prefetch_one`, `start_prefetch`,
//! `moved`), and the `Signal` idle prefetch threads wait on. Never: evicts for a fetch ahead
//! what the plan needs sooner than it, or keeps the cache alive from an idle thread (it holds
//! only the signal).

use super::*;

/// The reader's moves, counted, and the prefetch threads' wake-up (see `OriginCache::signal`).
pub(super) struct Signal {
    pub(super) moves: Mutex<u64>,
    pub(super) moved: Condvar,
}

impl OriginCache {
    /// The reader's step: batches delivered so far.
    pub fn step(&self) -> u64 {
        self.step.load(Ordering::Acquire)
    }

    /// The first step whose reads the reader has not issued: the step it is at, past the
    /// batches it has issued and not delivered (their files are open: a shard read only by them
    /// needs nothing more from the cache, and evicting it frees its space once they are read).
    /// Eviction and fetches ahead count next uses from here.
    pub fn reading_at(&self) -> u64 {
        self.step() + self.ahead.load(Ordering::Acquire)
    }

    /// Tells the cache which shards are read at steps `first_step`, `first_step + 1`, ... (one
    /// list per batch, as the plan has them; this rank's, and the node's other ranks' in calls
    /// of their own): the evictor gets each access's next use from this, and `upcoming` lists
    /// what to fetch ahead.
    pub fn add_plan(&self, first_step: u64, shards_by_step: &[Vec<ShardId>]) {
        let mut plan = self.plan.lock();
        for (i, shards) in shards_by_step.iter().enumerate() {
            let step = first_step + i as u64;
            for &shard in shards {
                // Kept sorted: the node's other ranks' plans come after this rank's.
                let uses = plan.entry(shard).or_default();
                if uses.back().is_none_or(|&last| last < step) {
                    uses.push_back(step);
                } else if let Err(at) = uses.binary_search(&step) {
                    uses.insert(at, step);
                }
            }
        }
    }

    /// The first step at or after `from` at which shard `id` is read (`u64::MAX`: not in the
    /// plan known so far). Drops the steps delivered (before `step()`): the reader may issue
    /// the batches in flight again (after a repair), so their uses stay until then.
    pub fn next_use(&self, id: ShardId, from: u64) -> u64 {
        let delivered = self.step().min(from);
        let mut plan = self.plan.lock();
        let Some(uses) = plan.get_mut(&id) else { return u64::MAX };
        while uses.front().is_some_and(|&step| step < delivered) {
            uses.pop_front();
        }
        uses.get(uses.partition_point(|&step| step < from)).copied().unwrap_or(u64::MAX)
    }

    /// Whether the plan reads shard `id` at a step in `from..from + steps`; true without a plan
    /// (a reader that is not told one reads anything next). Changes nothing.
    pub fn read_within(&self, id: ShardId, from: u64, steps: u64) -> bool {
        let plan = self.plan.lock();
        if plan.is_empty() {
            return true;
        }
        plan.get(&id).and_then(|uses| uses.iter().find(|&&step| step >= from)).is_some_and(|&step| step - from < steps)
    }

    /// Up to `limit` shards of the plan not yet issued by the reader, soonest next use first,
    /// with that use.
    pub fn upcoming(&self, limit: usize) -> Vec<(ShardId, u64)> {
        let (delivered, now) = (self.step(), self.reading_at());
        let mut plan = self.plan.lock();
        let mut next: Vec<(u64, ShardId)> = Vec::new();
        plan.retain(|&shard, uses| {
            while uses.front().is_some_and(|&step| step < delivered) {
                uses.pop_front();
            }
            if let Some(&step) = uses.get(uses.partition_point(|&step| step < now)) {
                next.push((step, shard));
            }
            !uses.is_empty()
        });
        next.sort_unstable();
        next.truncate(limit);
        next.into_iter().map(|(step, shard)| (shard, step)).collect()
    }

    /// Whether fetching shard `id`, next used at step `next_use`, is worth it now: it fits in
    /// the free room, or some cached shard is next used later than it (so keeping that one
    /// instead would cost more misses: Belady's rule).
    pub fn worth_fetching(&self, id: ShardId, next_use: u64) -> bool {
        if self.paths.shard(id).exists() {
            return false;
        }
        if self.bound == 0 {
            return true;
        }
        let Some(&(bytes, _)) = self.fetchable.get(&id) else { return false };
        let present = self.present(Some(id));
        // Shards on their way here take room too.
        let (flying_bytes, flying_count): (u64, usize) = {
            let flying = self.flying.lock();
            (flying.iter().filter_map(|s| self.fetchable.get(s)).map(|&(b, _)| b).sum(), flying.len())
        };
        let used: u64 = present.iter().map(|&(_, b)| b).sum::<u64>() + flying_bytes;
        if used + bytes <= self.bound {
            return true;
        }
        // Each fetch under way will push out one of the shards needed later than it: there
        // must be one more of those for this fetch.
        let now = self.reading_at();
        let later = present.iter().filter(|&&(shard, _)| self.next_use(shard, now) > next_use).count();
        let regret = self.regret_at.load(Ordering::Acquire);
        let regretted = regret != u64::MAX && now < regret.saturating_add(REGRET_STEPS);
        !regretted && later > flying_count
    }

    /// Fetches the first shard of the plan that is not here, when it is worth it (see
    /// `worth_fetching`). Returns whether it fetched one.
    pub(super) fn prefetch_one(&self) -> bool {
        let missing: Vec<(ShardId, u64, u64)> = self
            .upcoming(PREFETCH_LOOKAHEAD)
            .into_iter()
            .filter(|&(shard, _)| !self.paths.shard(shard).exists())
            .filter_map(|(shard, next_use)| self.fetchable.get(&shard).map(|&(bytes, _)| (shard, next_use, bytes)))
            .collect();
        let wanted = self.pace.lock().fetches_wanted(self.reading_at(), &missing);
        for (shard, next_use, _) in missing {
            {
                let flying = self.flying.lock();
                if flying.contains(&shard) {
                    continue;
                }
                // Enough under way for the pace the reader and the origin keep.
                if flying.len() >= wanted {
                    return false;
                }
            }
            if !self.worth_fetching(shard, next_use) {
                return false;
            }
            // Another thread may take the shard after this one.
            self.moved();
            let fetched = self.fetch_counted(shard, false);
            let mut stats = self.stats.lock();
            match fetched {
                Ok(Fetch::Fetched) => {
                    stats.prefetched += 1;
                    return true;
                }
                Ok(Fetch::Present) => return true,
                // Another process of this store is fetching it: on to the next.
                Ok(Fetch::Elsewhere) => {}
                // The reader meets the same failure when it gets there, and reports it.
                Err(_) => {
                    stats.prefetch_failures += 1;
                    return false;
                }
            }
        }
        false
    }

    /// Starts the threads that fetch ahead of the reader in plan order, once: several, so that
    /// the origin's latency per request is paid in parallel.
    pub(super) fn start_prefetch(&self) {
        if !self.writable {
            return;
        }
        self.prefetching.call_once(|| {
            for _ in 0..PREFETCH_THREADS {
                let me = self.me.clone();
                let signal = Arc::clone(&self.signal);
                let started = std::thread::Builder::new().name("granary-prefetch".into()).spawn(move || {
                    // Idle, a thread waits for the reader to move (or a fetch to land): a
                    // cache that holds what the plan needs costs next to nothing, and one that
                    // can take the next shard fetches it at once. It holds the cache only while
                    // it works.
                    loop {
                        let seen = *signal.moves.lock();
                        let worked = match me.upgrade() {
                            Some(cache) => cache.prefetch_one(),
                            None => return,
                        };
                        if !worked {
                            let mut moves = signal.moves.lock();
                            if *moves == seen && me.strong_count() > 0 {
                                let _ = signal.moved.wait_for(&mut moves, PREFETCH_IDLE);
                            }
                        }
                    }
                });
                // Without the threads, reads still fetch what they miss.
                if started.is_err() {
                    self.stats.lock().prefetch_failures += 1;
                }
            }
        });
    }

    /// Wakes an idle prefetch thread: the reader moved, a plan came, a fetch landed or began
    /// (one thread looks, and wakes the next when it found work: a step costs one look, not
    /// one per thread).
    pub(super) fn moved(&self) {
        *self.signal.moves.lock() += 1;
        self.signal.moved.notify_one();
    }
}
