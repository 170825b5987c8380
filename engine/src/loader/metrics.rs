//! A loader's metrics: the counters its stages keep in relaxed atomics (batches, bytes,
//! stalls, the epoch's reads) and what it reports of its reader, staging pool, memory tier
//! and origin cache at a scrape, labelled by rank. Also the skew across the ranks of a
//! process, derived at each scrape from their per-epoch reads, and the reads of each dataset's
//! shards (`DatasetHeat`: the 16 hottest by name, all of them as a distribution).
//!
//! Owns: `LoaderMetrics` (one loader's metrics source), `DatasetHeat` (one per dataset version and
//! registry) and `derive_skew`.
//!
//! Never: takes a lock or allocates on the path of a batch (`next` and the reader stage touch
//! atomics only), or keeps a loader's memory alive after the loader is dropped (the pool, the
//! tier and the cache are let go at `end`, after a last snapshot of their counters).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use crate::metrics::{AtomicHistogram, Samples, Source, Unit};
use crate::read::{CacheStats, Dataset, PublishedStats, ShardSource};
use crate::staging::StagingPool;
use crate::tier::{MemoryTier, TierStats};

/// Upper bounds of the per-step stall histogram, in seconds.
static STALL_BOUNDS: [f64; 12] = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.0];

/// One loader's metrics source.
pub(crate) struct LoaderMetrics {
    rank: String,
    /// The dataset version it reads (`name@version`).
    dataset: String,
    /// The tier's and the cache's counters when the loader started: both outlive loaders and
    /// count for the whole process, so a loader reports what they did since it started.
    baseline: (Option<TierStats>, Option<CacheStats>),
    pub(super) batches: AtomicU64,
    pub(super) records: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) ready: AtomicU64,
    stall_nanos: AtomicU64,
    stall: AtomicHistogram,
    /// The epoch of the last batch handed out, and what this rank read of it.
    epoch: AtomicU64,
    epoch_records: AtomicU64,
    epoch_bytes: AtomicU64,
    /// Batches the reader stage has queued (the queue's depth is this less `batches`).
    pub(super) queued: AtomicU64,
    /// With rebalancing: this rank's weight and records of a full step in force, the points
    /// passed, and the records of a step moved to or from this rank by them.
    weight: AtomicU64,
    step_share: AtomicU64,
    rebalances: AtomicU64,
    rebalances_held: AtomicU64,
    moved: AtomicU64,
    recut: AtomicU64,
    rebalancing: AtomicBool,
    held: Arc<AtomicUsize>,
    read: Arc<PublishedStats>,
    live: Mutex<Option<Live>>,
    /// The tier's and cache's counters as the loader ended.
    last: Mutex<(Option<TierStats>, Option<CacheStats>)>,
    ended: AtomicBool,
}

/// What the loader owns and a scrape asks while it runs.
pub(super) struct Live {
    pub(super) pool: StagingPool,
    pub(super) tier: Option<Arc<MemoryTier>>,
    pub(super) repair: Option<Arc<dyn ShardSource>>,
}

impl LoaderMetrics {
    pub(super) fn new(
        rank: u32,
        dataset: &Dataset,
        held: Arc<AtomicUsize>,
        read: Arc<PublishedStats>,
        live: Live,
    ) -> Self {
        let baseline =
            (live.tier.as_ref().map(|tier| tier.stats()), live.repair.as_ref().and_then(|hook| hook.cache_stats()));
        Self {
            rank: rank.to_string(),
            dataset: dataset_label(dataset),
            baseline,
            batches: AtomicU64::new(0),
            records: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            ready: AtomicU64::new(0),
            stall_nanos: AtomicU64::new(0),
            stall: AtomicHistogram::new(&STALL_BOUNDS),
            epoch: AtomicU64::new(0),
            epoch_records: AtomicU64::new(0),
            epoch_bytes: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            weight: AtomicU64::new(0),
            step_share: AtomicU64::new(0),
            rebalances: AtomicU64::new(0),
            rebalances_held: AtomicU64::new(0),
            recut: AtomicU64::new(0),
            moved: AtomicU64::new(0),
            rebalancing: AtomicBool::new(false),
            held,
            read,
            live: Mutex::new(Some(live)),
            last: Mutex::new((None, None)),
            ended: AtomicBool::new(false),
        }
    }

    /// Counts a batch handed to the trainer (called by `next`, the only writer of these).
    pub(super) fn handed_out(&self, epoch: u64, records: u64, bytes: u64, stall: Duration, ready: bool) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.records.fetch_add(records, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.ready.fetch_add(u64::from(ready), Ordering::Relaxed);
        self.stall_nanos.fetch_add(stall.as_nanos() as u64, Ordering::Relaxed);
        self.stall.observe(stall.as_secs_f64());
        if self.epoch.load(Ordering::Relaxed) != epoch {
            self.epoch.store(epoch, Ordering::Relaxed);
            self.epoch_records.store(0, Ordering::Relaxed);
            self.epoch_bytes.store(0, Ordering::Relaxed);
        }
        self.epoch_records.fetch_add(records, Ordering::Relaxed);
        self.epoch_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// New weights are in force (rebalancing): this rank's `weight` and `share` of a full
    /// step, `point` (false for the weights a run starts with), `moved` records of a step to or
    /// from this rank.
    #[cfg(feature = "policy")]
    pub(super) fn weights_changed(&self, weight: u32, share: u64, point: bool, moved: u64) {
        self.rebalancing.store(true, Ordering::Relaxed);
        self.weight.store(u64::from(weight), Ordering::Relaxed);
        self.step_share.store(share, Ordering::Relaxed);
        if point {
            self.rebalances.fetch_add(1, Ordering::Relaxed);
            self.moved.fetch_add(moved, Ordering::Relaxed);
        }
    }

    /// `n` rebalance points kept the weights in force: their measures could not tell the ranks
    /// apart (`rebalance::tells_ranks_apart`).
    #[cfg(feature = "policy")]
    pub(super) fn rebalances_held(&self, n: u64) {
        self.rebalancing.store(true, Ordering::Relaxed);
        self.rebalances_held.fetch_add(n, Ordering::Relaxed);
    }

    /// A batch the reader read past a rebalance point before the point's measures came, which
    /// then told the ranks apart, was dropped (its step is read again with the point's weights).
    #[cfg(feature = "policy")]
    pub(super) fn recut(&self) {
        self.queued.fetch_sub(1, Ordering::Relaxed);
        self.recut.fetch_add(1, Ordering::Relaxed);
    }

    /// The loader is being dropped: keeps the last counters of what it owned and lets it go.
    pub(super) fn end(&self) {
        if let Some(live) = self.live.lock().take() {
            *self.last.lock() =
                (live.tier.as_ref().map(|tier| tier.stats()), live.repair.as_ref().and_then(|hook| hook.cache_stats()));
        }
        self.ended.store(true, Ordering::Release);
    }
}

impl Source for LoaderMetrics {
    fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    fn collect(&self, out: &mut Samples) {
        let batches = self.batches.load(Ordering::Relaxed);
        self.collect_handed_out(out, batches);
        if self.rebalancing.load(Ordering::Relaxed) {
            self.collect_rebalancing(out);
        }
        let read = self.read.get();
        self.collect_reads(out, &read);
        let pool = self.collect_tier_and_cache(out, &read);
        if !self.ended() {
            self.collect_live(out, batches, pool);
        }
    }
}

/// `collect`'s parts, a family of samples each.
impl LoaderMetrics {
    /// The samples' labels: this rank and its dataset.
    fn labels(&self) -> crate::metrics::Labels {
        vec![("rank", self.rank.clone()), ("dataset", self.dataset.clone())]
    }

    /// What was handed to the trainer, and its waits.
    fn collect_handed_out(&self, out: &mut Samples, batches: u64) {
        out.counter(
            "granary_loader_batches",
            "Batches handed to the trainer.",
            Unit::None,
            self.labels(),
            batches as f64,
        );
        out.counter(
            "granary_loader_records",
            "Records handed to the trainer.",
            Unit::None,
            self.labels(),
            get(&self.records),
        );
        out.counter(
            "granary_loader_delivered",
            "Record bytes handed to the trainer.",
            Unit::Bytes,
            self.labels(),
            get(&self.bytes),
        );
        out.counter(
            "granary_loader_ready_batches",
            "Batches that were ready when the trainer asked (no wait).",
            Unit::None,
            self.labels(),
            get(&self.ready),
        );
        out.counter(
            "granary_loader_stall",
            "Time the trainer waited for data.",
            Unit::Seconds,
            self.labels(),
            self.stall_nanos.load(Ordering::Relaxed) as f64 / 1e9,
        );
        out.histogram(
            "granary_loader_step_stall",
            "The trainer's wait for each batch.",
            Unit::Seconds,
            self.labels(),
            self.stall.value(),
        );
    }

    /// The weights in force and the rebalance points passed.
    fn collect_rebalancing(&self, out: &mut Samples) {
        out.gauge(
            "granary_loader_weight",
            "This rank's weight in force (its share of a step is its weight over the ranks' total).",
            Unit::None,
            self.labels(),
            get(&self.weight),
        );
        out.gauge(
            "granary_loader_step_records",
            "Records of a full step this rank reads under the weights in force.",
            Unit::None,
            self.labels(),
            get(&self.step_share),
        );
        out.counter(
            "granary_loader_rebalances",
            "Rebalance points passed.",
            Unit::None,
            self.labels(),
            get(&self.rebalances),
        );
        out.counter(
            "granary_loader_rebalances_held",
            "Rebalance points that kept the weights in force because every rank's window took the same time \
             (a per-step barrier hides the slow rank: report_busy tells it).",
            Unit::None,
            self.labels(),
            get(&self.rebalances_held),
        );
        out.counter(
            "granary_loader_rebalance_moved_records",
            "Records of a step moved to or from this rank by rebalance points, summed over the points.",
            Unit::None,
            self.labels(),
            get(&self.moved),
        );
        out.counter(
            "granary_loader_rebalance_recut_batches",
            "Batches read past a rebalance point before its measures came, dropped when those told the \
             ranks apart, and read again with the point's weights.",
            Unit::None,
            self.labels(),
            get(&self.recut),
        );
    }

    /// The reader's counters.
    fn collect_reads(&self, out: &mut Samples, read: &crate::read::ReadStats) {
        out.counter(
            "granary_read",
            "Bytes read from shard files (whole blocks).",
            Unit::Bytes,
            self.labels(),
            read.bytes_read as f64,
        );
        out.counter(
            "granary_read_ops",
            "Read operations issued to the disk.",
            Unit::None,
            self.labels(),
            read.ops as f64,
        );
        out.counter(
            "granary_read_blocks_verified",
            "Blocks whose CRC32C was checked on reads from disk.",
            Unit::None,
            self.labels(),
            read.blocks_verified as f64,
        );
        out.counter(
            "granary_read_verify_failures",
            "Reads that found damaged bytes (each repaired or reported).",
            Unit::None,
            self.labels(),
            read.verify_failures as f64,
        );
        out.counter(
            "granary_read_shards_repaired",
            "Shards replaced through the repair hook (a peer's or the origin's copy).",
            Unit::None,
            self.labels(),
            read.shards_repaired as f64,
        );
        out.counter(
            "granary_read_tier",
            "Record bytes copied from the memory tier.",
            Unit::Bytes,
            self.labels(),
            read.tier_bytes as f64,
        );
        out.counter(
            "granary_read_batch_shards",
            "Distinct shards each batch drew its records from, summed over the batches (over granary_loader_batches: \
             how well the plan mixes).",
            Unit::None,
            self.labels(),
            read.batch_shards as f64,
        );
    }

    /// The memory tier's and the origin cache's counters since the loader began, and the hit
    /// ratio; the staging pool's figures while the loader lives.
    fn collect_tier_and_cache(
        &self,
        out: &mut Samples,
        read: &crate::read::ReadStats,
    ) -> Option<crate::staging::PoolStats> {
        let (tier, cache, pool) = match &*self.live.lock() {
            Some(live) => (
                live.tier.as_ref().map(|tier| tier.stats()),
                live.repair.as_ref().and_then(|hook| hook.cache_stats()),
                Some(live.pool.stats()),
            ),
            None => {
                let last = self.last.lock();
                (last.0, last.1, None)
            }
        };
        let tier = tier.map(|now| tier_since(now, self.baseline.0.unwrap_or_default()));
        let cache = cache.map(|now| cache_since(now, self.baseline.1.unwrap_or_default()));
        if let Some(tier) = tier {
            out.counter(
                "granary_tier_loaded",
                "Bytes this process read from disk into the memory tier.",
                Unit::Bytes,
                self.labels(),
                tier.bytes_loaded as f64,
            );
            out.counter(
                "granary_tier_evicted_extents",
                "Extents this process removed from the memory tier.",
                Unit::None,
                self.labels(),
                tier.extents_evicted as f64,
            );
            out.counter(
                "granary_tier_fill_failures",
                "Memory tier fills that failed (their reads went to disk).",
                Unit::None,
                self.labels(),
                tier.fill_failures as f64,
            );
        }
        if let Some(cache) = cache {
            out.counter(
                "granary_cache_accesses",
                "Shard accesses through the origin cache.",
                Unit::None,
                self.labels(),
                cache.accesses as f64,
            );
            out.counter(
                "granary_cache_misses",
                "Shard accesses that waited for the shard to be fetched.",
                Unit::None,
                self.labels(),
                cache.waited as f64,
            );
            out.counter(
                "granary_cache_from_origin",
                "Bytes fetched from the object-store origin.",
                Unit::Bytes,
                self.labels(),
                cache.bytes_from_origin as f64,
            );
            out.counter(
                "granary_cache_from_peers",
                "Bytes fetched from the job's peers.",
                Unit::Bytes,
                self.labels(),
                cache.bytes_from_peers as f64,
            );
        }
        // The hit ratio: of the memory tier when there is one (records from memory), else of
        // the origin cache (shard accesses that found their shard).
        let hit_ratio = match (tier, cache) {
            // The two counters are published one after the other: a scrape between them could
            // see a batch's tier records before its records.
            (Some(_), _) if read.records > 0 => Some((read.tier_records as f64 / read.records as f64).min(1.0)),
            (None, Some(cache)) if cache.accesses > 0 => {
                Some(1.0 - (cache.waited as f64 / cache.accesses as f64).min(1.0))
            }
            _ => None,
        };
        if let Some(ratio) = hit_ratio {
            out.gauge(
                "granary_loader_cache_hit",
                "Share of reads served from memory or the local cache.",
                Unit::Ratio,
                self.labels(),
                ratio,
            );
        }
        pool
    }

    /// The gauges of a loader still running: its queue, holds, epoch and staging pool.
    fn collect_live(&self, out: &mut Samples, batches: u64, pool: Option<crate::staging::PoolStats>) {
        out.gauge(
            "granary_loader_queued_batches",
            "Batches read and waiting for the trainer (the prefetch queue).",
            Unit::None,
            self.labels(),
            self.queued.load(Ordering::Relaxed).saturating_sub(batches) as f64,
        );
        out.gauge(
            "granary_read_pending_ops",
            "Read operations issued whose batch is not delivered yet (in flight, or done and waiting for an earlier batch).",
            Unit::None,
            self.labels(),
            self.read.pending_ops() as f64,
        );
        out.gauge(
            "granary_loader_held_batches",
            "Batches the trainer holds.",
            Unit::None,
            self.labels(),
            self.held.load(Ordering::Relaxed) as f64,
        );
        out.gauge(
            "granary_loader_epoch",
            "The epoch of the last batch handed out.",
            Unit::None,
            self.labels(),
            get(&self.epoch),
        );
        out.gauge(
            "granary_loader_epoch_records",
            "Records this rank read in the current epoch.",
            Unit::None,
            self.labels(),
            get(&self.epoch_records),
        );
        out.gauge(
            "granary_loader_epoch_read",
            "Record bytes this rank read in the current epoch.",
            Unit::Bytes,
            self.labels(),
            get(&self.epoch_bytes),
        );
        if let Some(pool) = pool {
            out.gauge(
                "granary_staging_buffers_leased",
                "Staging buffers in use.",
                Unit::None,
                self.labels(),
                pool.leased as f64,
            );
            out.gauge(
                "granary_staging_buffers",
                "Staging buffers in the pool.",
                Unit::None,
                self.labels(),
                pool.buffers as f64,
            );
            let pinned = if pool.pinned { pool.buffers * pool.buffer_bytes } else { 0 };
            out.gauge(
                "granary_staging_pinned",
                "Page-locked staging memory.",
                Unit::Bytes,
                self.labels(),
                pinned as f64,
            );
        }
    }
}

/// A counter's value as a sample's.
fn get(value: &AtomicU64) -> f64 {
    value.load(Ordering::Relaxed) as f64
}

/// The skew of this process's ranks, per dataset: the most any rank read this epoch against
/// the mean, in records and in bytes (1 when they read the same; absent with no rank).
pub(crate) fn derive_skew(samples: &mut Samples) {
    for (from, to, help) in [
        (
            "granary_loader_epoch_records",
            "granary_skew_records",
            "Most records a rank read this epoch over the mean of the process's ranks.",
        ),
        (
            "granary_loader_epoch_read",
            "granary_skew_bytes",
            "Most bytes a rank read this epoch over the mean of the process's ranks.",
        ),
    ] {
        // Ranks are compared within an epoch, and only when all of a dataset's are in the same
        // one (a rank that finished an epoch before the others starts the next one at zero:
        // compared then, it would look slow, and alone, it would hide the others).
        let epochs: std::collections::BTreeMap<&crate::metrics::Labels, f64> =
            samples.values("granary_loader_epoch").collect();
        let dataset_of = |labels: &crate::metrics::Labels| {
            labels.iter().find(|(k, _)| *k == "dataset").map_or(String::new(), |(_, v)| v.clone())
        };
        let mut latest: std::collections::BTreeMap<String, f64> = std::collections::BTreeMap::new();
        for (labels, &epoch) in &epochs {
            let entry = latest.entry(dataset_of(labels)).or_insert(epoch);
            *entry = entry.max(epoch);
        }
        let mut by_dataset: std::collections::BTreeMap<String, Vec<f64>> = std::collections::BTreeMap::new();
        let mut behind: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
        for (labels, value) in samples.values(from) {
            let dataset = dataset_of(labels);
            if epochs.get(labels).copied() == latest.get(&dataset).copied() {
                by_dataset.entry(dataset).or_default().push(value);
            } else {
                behind.insert(dataset);
            }
        }
        by_dataset.retain(|dataset, _| !behind.contains(dataset));
        for (dataset, values) in by_dataset {
            let mean = values.iter().sum::<f64>() / values.len().max(1) as f64;
            if mean > 0.0 {
                let max = values.iter().copied().fold(0.0, f64::max);
                samples.gauge(to, help, Unit::Ratio, vec![("dataset", dataset)], max / mean);
            }
        }
    }
}

/// A dataset version as the metrics name it: `name@version`, or its manifest id's first digits.
fn dataset_label(dataset: &Dataset) -> String {
    match dataset.version() {
        Some((name, version)) => format!("{name}@{version}"),
        None => dataset.manifest_id().0.short(12),
    }
}

/// The counters of a tier since `before` (the ones the metrics report).
fn tier_since(now: TierStats, before: TierStats) -> TierStats {
    TierStats {
        bytes_loaded: now.bytes_loaded.saturating_sub(before.bytes_loaded),
        extents_evicted: now.extents_evicted.saturating_sub(before.extents_evicted),
        fill_failures: now.fill_failures.saturating_sub(before.fill_failures),
        ..now
    }
}

/// The counters of a cache since `before` (the ones the metrics report).
fn cache_since(now: CacheStats, before: CacheStats) -> CacheStats {
    CacheStats {
        accesses: now.accesses.saturating_sub(before.accesses),
        waited: now.waited.saturating_sub(before.waited),
        bytes_from_origin: now.bytes_from_origin.saturating_sub(before.bytes_from_origin),
        bytes_from_peers: now.bytes_from_peers.saturating_sub(before.bytes_from_peers),
        ..now
    }
}

/// Shards labelled in the hot-shard gauge.
const HOT_SHARDS: usize = 16;
/// Upper bounds of the shards-by-reads distribution.
const READS_BOUNDS: [u64; 10] = [0, 1, 4, 16, 64, 256, 1024, 4096, 16384, 65536];

/// The reads of one dataset version's shards in this process: the hottest by name, the rest as
/// a distribution. Registered once per version and registry (`DatasetHeat::key`); ends when
/// the last `Dataset` of the version in the process is dropped.
pub(crate) struct DatasetHeat {
    reads: Weak<[AtomicU64]>,
    shards: Vec<crate::id::ShardId>,
    name: String,
}

impl DatasetHeat {
    pub(super) fn key(dataset: &Dataset) -> String {
        format!("dataset-heat {}", dataset.manifest_id())
    }

    pub(super) fn new(dataset: &Dataset) -> Self {
        let name = dataset_label(dataset);
        let shards = (0..dataset.n_shards()).map(|s| dataset.shard_id(s)).collect();
        Self { reads: Arc::downgrade(dataset.shard_read_counts()), shards, name }
    }
}

impl Source for DatasetHeat {
    fn ended(&self) -> bool {
        self.reads.strong_count() == 0
    }

    fn collect(&self, out: &mut Samples) {
        let Some(counts) = self.reads.upgrade() else { return };
        let reads: Vec<u64> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        let mut hottest: Vec<usize> = (0..reads.len()).filter(|&s| reads[s] > 0).collect();
        hottest.sort_unstable_by_key(|&s| std::cmp::Reverse(reads[s]));
        for &shard in hottest.iter().take(HOT_SHARDS) {
            let Some(id) = self.shards.get(shard) else { continue };
            out.gauge(
                "granary_shard_reads",
                "Records read from each of the 16 most read shards of a dataset (this process).",
                Unit::None,
                vec![("dataset", self.name.clone()), ("shard", id.0.short(12))],
                reads[shard] as f64,
            );
        }
        for bound in READS_BOUNDS.iter().map(|&b| Some(b)).chain([None]) {
            let shards = reads.iter().filter(|&&r| bound.is_none_or(|b| r <= b)).count();
            let le = bound.map_or_else(|| "+Inf".to_owned(), |b| b.to_string());
            out.gauge(
                "granary_shards_by_reads",
                "Shards of a dataset read at most `reads_at_most` times by this process (cumulative).",
                Unit::None,
                vec![("dataset", self.name.clone()), ("reads_at_most", le)],
                shards as f64,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(out: &mut Samples, rank: &str, epoch: f64, records: f64) {
        let labels = || vec![("rank", rank.to_owned()), ("dataset", "d@1".to_owned())];
        out.gauge("granary_loader_epoch", "", Unit::None, labels(), epoch);
        out.gauge("granary_loader_epoch_records", "", Unit::None, labels(), records);
        out.gauge("granary_loader_epoch_read", "", Unit::Bytes, labels(), records * 4096.0);
    }

    #[test]
    fn skew_compares_ranks_in_one_epoch_only() {
        let mut same = Samples::default();
        rank(&mut same, "0", 2.0, 120.0);
        rank(&mut same, "1", 2.0, 80.0);
        derive_skew(&mut same);
        assert_eq!(same.value("granary_skew_records", &[("dataset", "d@1")]), Some(1.2));
        assert_eq!(same.value("granary_skew_bytes", &[("dataset", "d@1")]), Some(1.2));

        // Rank 0 has started epoch 3: no comparison until rank 1 has too.
        let mut apart = Samples::default();
        rank(&mut apart, "0", 3.0, 10.0);
        rank(&mut apart, "1", 2.0, 190.0);
        derive_skew(&mut apart);
        assert_eq!(apart.value("granary_skew_records", &[("dataset", "d@1")]), None);
    }
}
