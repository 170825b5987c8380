//! What a read asks of the world beyond its files: `ShardSource`, where a shard the reader
//! lacks or found damaged comes from (a replication node's peers, an origin cache's origin),
//! told the plan and each batch's shards; and `CacheStats`, a cache's counters.
//!
//! Owns the trait and the counters. Never: implements a repair (the replication and origin
//! modules do) or decides when to call one (the reader does).

use crate::error::{Error, Result};
use crate::id::ShardId;

/// Where shards the reader lacks come from: it replaces a damaged or missing shard with a
/// verified copy from elsewhere (a peer of the replication layer, an origin), so that a read that
/// failed on it can be retried, and a cache of fetched shards learns the plan and each access
/// through it. Implemented by
/// `replication::Node` (in the reading process) and `replication::NodeClient` (a node beside it).
pub trait ShardSource: Send + Sync + std::fmt::Debug {
    /// Makes the file of shard `shard` intact again; `cause` is the error the read met. Returns
    /// once a verified copy is in place (or with the reason there is none).
    fn repair(&self, shard: ShardId, cause: &Error) -> Result<()>;

    /// The reader has `batches` batches issued and not delivered (told as the number changes,
    /// 0 when a read stops): their files are open (fetched when they were missing), so a cache
    /// may count their uses of them as done, for what it evicts and fetches ahead. Cheap.
    fn in_flight(&self, batches: u64) {
        let _ = batches;
    }

    /// The shards a batch just read, for the cache's access accounting (one `in_flight` counted
    /// before, now delivered). Cheap; batched.
    fn accessed(&self, shards: &[ShardId]) {
        let _ = shards;
    }

    /// Whether the hook uses the read plan (a cache that fetches ahead of the reader and tells
    /// its evictor each shard's next use): the loader then calls `plan` once per epoch, ahead.
    fn wants_plan(&self) -> bool {
        false
    }

    /// The shards the reader reads at steps `first_step`, `first_step + 1`, ... (one list per
    /// batch; a step is one delivered batch, counted from the reader's start).
    fn plan(&self, first_step: u64, shards_by_step: &[Vec<ShardId>]) {
        let _ = (first_step, shards_by_step);
    }

    /// Whether the reader keeps the file of `shard` open after a batch that read it, for the
    /// next reads (the default: files stay open from read to read). A cache that evicts fetched
    /// shards says no for one its plan does not read again soon: the reader then closes it
    /// (once no other batch in flight reads it) before it hands that batch on, so that evicting
    /// it frees its space at once, also while the reader waits on a slow consumer (it reads its
    /// notifications only when it plans its next batch).
    fn keeps_open(&self, shard: ShardId) -> bool {
        let _ = shard;
        true
    }

    /// The counters of a hook that is a cache of shards fetched from elsewhere (an origin).
    fn cache_stats(&self) -> Option<CacheStats> {
        None
    }
}

/// Counters of a cache of fetched shards (the origin cache), since it was opened in this process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Shards fetched and published here (by reads and ahead of them), from origins or peers.
    pub shards_fetched: u64,
    /// Bytes of those an origin sent.
    pub bytes_from_origin: u64,
    /// Of the shards fetched, those a peer of the job sent (through the replication node).
    pub shards_from_peers: u64,
    /// Bytes of them.
    pub bytes_from_peers: u64,
    /// Asks of the replication node for a peer's copy that failed other than by no peer
    /// holding the shard (the shard then came from the origin).
    pub peer_failures: u64,
    /// Fetches whose bytes did not hash to the shard's id (dropped and fetched again).
    pub refetches: u64,
    /// Shards evicted (deleted) to keep the bound.
    pub evictions: u64,
    /// Bytes of them.
    pub bytes_evicted: u64,
    /// Shard accesses by reads (one per shard a batch touched).
    pub accesses: u64,
    /// Reads that found their shard missing and waited for it to be fetched (the misses).
    pub waited: u64,
    /// Shards fetched ahead of the reader, from the plan (counted in `shards_fetched` too).
    pub prefetched: u64,
    /// Prefetches that failed (the read that needs the shard tries again, and reports).
    pub prefetch_failures: u64,
    /// Time reads waited for shards that were not here.
    pub fetch_wait: std::time::Duration,
}

/// Counters of several caches (or loaders) of a run, summed.
impl std::ops::AddAssign<&CacheStats> for CacheStats {
    fn add_assign(&mut self, more: &CacheStats) {
        let Self {
            shards_fetched,
            bytes_from_origin,
            shards_from_peers,
            bytes_from_peers,
            peer_failures,
            refetches,
            evictions,
            bytes_evicted,
            accesses,
            waited,
            prefetched,
            prefetch_failures,
            fetch_wait,
        } = more;
        self.shards_fetched += shards_fetched;
        self.bytes_from_origin += bytes_from_origin;
        self.shards_from_peers += shards_from_peers;
        self.bytes_from_peers += bytes_from_peers;
        self.peer_failures += peer_failures;
        self.refetches += refetches;
        self.evictions += evictions;
        self.bytes_evicted += bytes_evicted;
        self.accesses += accesses;
        self.waited += waited;
        self.prefetched += prefetched;
        self.prefetch_failures += prefetch_failures;
        self.fetch_wait += *fetch_wait;
    }
}

impl CacheStats {
    /// The share of shard accesses that found their shard here (0 before any access).
    pub fn hit_ratio(&self) -> f64 {
        if self.accesses == 0 { 0.0 } else { 1.0 - self.waited.min(self.accesses) as f64 / self.accesses as f64 }
    }
}
