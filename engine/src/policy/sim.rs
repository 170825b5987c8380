//! The plugin kit's simulations: what `granary plugin sim` runs and prints.
//!
//! Owns: `evict` (a trace replayed in batches of `EVICT_BATCH`: `EvictionResult`), `partition`
//! (`PartitionResult`, `Mixing`, `Movement`), `replicate` (`ReplicationResult`),
//! `synthetic_shards`, the rebalancing simulation (`sim/rebalance.rs`), and the bounds of what they
//! simulate (`SHARDS_MAX`, `RECORDS_PER_SHARD_MAX`, `RANKS_MAX`, `NODES_MAX`). Never: prints
//! (`cli/plugin.rs` does), reads or writes a file, or touches a store.

mod rebalance;
pub use rebalance::{EpochRun, RECORDS_MAX, RebalanceOutcome, RebalanceSim, Straggler, rebalance};

use std::collections::HashSet;
use std::ops::Range;
use std::time::{Duration, Instant};

use super::trace::Request;
use super::{EpochSpec, Evictor, NodeInfo, Partitioner, Plugin, RankInfo, RankPlan, Replicator, ShardInfo};
use crate::error::{Error, Result};

/// Accesses per evictor call.
pub const EVICT_BATCH: usize = 1024;

/// What an eviction simulation measured.
#[derive(Clone, Debug, PartialEq)]
pub struct EvictionResult {
    /// Requests replayed.
    pub requests: u64,
    /// Misses.
    pub misses: u64,
    /// Wall time of the replay.
    pub elapsed: Duration,
    /// Calls the fallback answered (0 unless the plugin failed).
    pub fallback_calls: u64,
}

impl EvictionResult {
    /// Misses / requests.
    pub fn miss_ratio(&self) -> f64 {
        if self.requests == 0 { 0.0 } else { self.misses as f64 / self.requests as f64 }
    }
}

/// Replays `trace` through `plugin` in batches of 1024. With `ignore_sizes` every object has size
/// 1 and `capacity` counts objects (libCacheSim's `--ignore-obj-size`).
pub fn evict(
    plugin: &Plugin,
    options: &[(String, String)],
    trace: &[Request],
    capacity: u64,
    ignore_sizes: bool,
) -> Result<EvictionResult> {
    let mut evictor = Evictor::new(plugin.clone(), options, None, capacity)?;
    let started = Instant::now();
    let mut misses = 0u64;
    let (mut keys, mut sizes, mut next_uses) = (Vec::new(), Vec::new(), Vec::new());
    for chunk in trace.chunks(EVICT_BATCH) {
        keys.clear();
        sizes.clear();
        next_uses.clear();
        keys.extend(chunk.iter().map(|r| r.key));
        sizes.extend(chunk.iter().map(|r| if ignore_sizes { 1 } else { r.size }));
        next_uses.extend(chunk.iter().map(|r| r.next_use));
        let outcome = evictor.access(&keys, &sizes, &next_uses)?;
        misses += outcome.hits.iter().filter(|&&hit| !hit).count() as u64;
    }
    Ok(EvictionResult {
        requests: trace.len() as u64,
        misses,
        elapsed: started.elapsed(),
        fallback_calls: evictor.status().fallback_calls,
    })
}

/// One world's plan, as the partition simulation reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct PartitionResult {
    /// Ranks in the world.
    pub ranks: u32,
    /// Records each rank reads, by rank id.
    pub records: Vec<u64>,
    /// Ranges (reads) in the plan.
    pub ranges: u64,
    /// The largest relative deviation of a rank's share from its weight's share.
    pub balance_error: f64,
    /// How long `plan` took.
    pub elapsed: Duration,
    /// How well each rank's records are mixed.
    pub mixing: Mixing,
}

/// How well a plan mixes the dataset, over each rank's stream of records, averaged over the
/// ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Mixing {
    /// The mean distance in the dataset between consecutive records of a rank, as a share of its
    /// expectation under a uniform shuffle (a third of the records): about 1 for a full shuffle,
    /// near 0 for a sequential read. A window over a shuffled shard order stays high: the
    /// shards it mixes are any of the dataset's.
    pub spread: f64,
    /// The mean number of shards a batch draws from: how local the reads are (a window of W
    /// shards: at most W + 1).
    pub shards_per_batch: f64,
}

/// Records of each rank that `mixing` looks at, at most.
const MIXING_RECORDS_MAX: usize = 1 << 22;

/// `Mixing` of `plans` over `shards`, in batches of `batch_size`.
fn mixing(plans: &[RankPlan], shards: &[ShardInfo], batch_size: u64) -> Mixing {
    let total: u64 = shards.iter().map(|s| s.records).sum();
    let starts: Vec<u64> = shards.iter().scan(0u64, |at, s| Some(std::mem::replace(at, *at + s.records))).collect();
    let shard_of = |record: u64| starts.partition_point(|&start| start <= record);
    let (mut distance, mut pairs, mut shards_seen, mut batches) = (0f64, 0u64, 0u64, 0u64);
    let mut in_batch: Vec<usize> = Vec::new();
    let mut close_batch = |in_batch: &mut Vec<usize>| {
        in_batch.sort_unstable();
        in_batch.dedup();
        shards_seen += in_batch.len() as u64;
        batches += 1;
        in_batch.clear();
    };
    for plan in plans {
        // The first MIXING_RECORDS_MAX records of each rank tell how it mixes; a plan of more
        // is not walked whole.
        let mut previous = None;
        for record in plan.records().take(MIXING_RECORDS_MAX) {
            if let Some(previous) = previous {
                distance += record.abs_diff(previous) as f64;
                pairs += 1;
            }
            previous = Some(record);
            in_batch.push(shard_of(record));
            if in_batch.len() as u64 >= batch_size.max(1) {
                close_batch(&mut in_batch);
            }
        }
        if !in_batch.is_empty() {
            close_batch(&mut in_batch);
        }
    }
    let expected = total as f64 / 3.0;
    Mixing {
        spread: if pairs == 0 || expected == 0.0 { 0.0 } else { distance / pairs as f64 / expected },
        shards_per_batch: if batches == 0 { 0.0 } else { shards_seen as f64 / batches as f64 },
    }
}

/// The membership change between two worlds.
#[derive(Clone, Debug, PartialEq)]
pub struct Movement {
    /// Fraction of the records (or copies) whose owner changed.
    pub moved: f64,
    /// Whether every move went to or came from a node (rank) that was added or removed.
    pub only_changed_members: bool,
}

/// Shards of a synthetic dataset.
pub const SHARDS_MAX: u64 = 1 << 20;
/// Records of one synthetic shard (each counted as 4 KiB).
pub const RECORDS_PER_SHARD_MAX: u64 = 1 << 32;
/// Ranks of a simulated world (the host checks a plan against every rank).
pub const RANKS_MAX: u32 = 1 << 14;
/// Nodes of a simulated cluster.
pub const NODES_MAX: u32 = 1 << 12;

fn check_count(what: &str, n: u64, min: u64, max: u64) -> Result<()> {
    if n < min || n > max {
        return Err(Error::invalid_input(format!("{what} must be in {min}..={max}, not {n}")));
    }
    Ok(())
}

/// A synthetic dataset of `n_shards` shards (1..=`SHARDS_MAX`) of `records_per_shard` records
/// (1..=`RECORDS_PER_SHARD_MAX`).
pub fn synthetic_shards(n_shards: u64, records_per_shard: u64) -> Result<Vec<ShardInfo>> {
    check_count("the number of shards", n_shards, 1, SHARDS_MAX)?;
    check_count("the records per shard", records_per_shard, 1, RECORDS_PER_SHARD_MAX)?;
    Ok((0..n_shards)
        .map(|i| {
            let id = *blake3::hash(&i.to_le_bytes()).as_bytes();
            ShardInfo {
                id,
                bytes: records_per_shard * 4096,
                records: records_per_shard,
                replicas: vec![(i % 8) as u32],
            }
        })
        .collect())
}

/// Weights cycle over the ids: some must be above zero, or no share is defined.
fn check_weights(weights: &[u32]) -> Result<()> {
    if !weights.is_empty() && weights.iter().all(|&w| w == 0) {
        return Err(Error::invalid_input("every weight is 0: at least one must be above 0"));
    }
    Ok(())
}

fn world(n_ranks: u32, weights: &[u32]) -> (Vec<RankInfo>, Vec<NodeInfo>) {
    let weight = |i: u32| if weights.is_empty() { 1 } else { weights[i as usize % weights.len()] };
    let ranks = (0..n_ranks).map(|id| RankInfo { id, node: id % 8, weight: weight(id), up: true }).collect();
    let nodes = (0..8).map(|id| NodeInfo { id, weight: 1, failure_domain: id, up: true }).collect();
    (ranks, nodes)
}

/// Plans one epoch for each world size in `worlds` (each 1..=`RANKS_MAX`) and measures balance
/// and the movement of record ownership between consecutive worlds.
pub fn partition(
    plugin: &Plugin,
    options: &[(String, String)],
    shards: &[ShardInfo],
    worlds: &[u32],
    weights: &[u32],
    batch_size: u64,
) -> Result<(Vec<PartitionResult>, Vec<Movement>)> {
    if worlds.is_empty() {
        return Err(Error::invalid_input("no world size to simulate"));
    }
    for &n in worlds {
        check_count("a world size (ranks)", u64::from(n), 1, u64::from(RANKS_MAX))?;
    }
    check_count("the batch size", batch_size, 1, u64::MAX)?;
    check_weights(weights)?;
    let mut partitioner = Partitioner::new(plugin.clone(), options, None)?;
    let total: u64 = shards.iter().map(|s| s.records).sum();
    let mut results = Vec::new();
    let mut owners: Vec<Vec<(Range<u64>, u32)>> = Vec::new();
    for &n in worlds {
        let (ranks, nodes) = world(n, weights);
        let started = Instant::now();
        let plans = partitioner.plan(shards, &ranks, &nodes, EpochSpec { seed: 7, epoch: 0, batch_size, start: 0 })?;
        let elapsed = started.elapsed();
        let mut records = vec![0u64; n as usize];
        for plan in &plans {
            records[plan.rank as usize] = plan.n_records();
        }
        let weight_total: u64 = ranks.iter().map(|r| u64::from(r.weight)).sum();
        let balance_error = ranks
            .iter()
            .map(|r| {
                let want = total as f64 * f64::from(r.weight) / weight_total as f64;
                if want == 0.0 { 0.0 } else { (records[r.id as usize] as f64 - want).abs() / want }
            })
            .fold(0.0, f64::max);
        results.push(PartitionResult {
            ranks: n,
            records,
            ranges: plans.iter().map(|p| p.ranges.len() as u64).sum(),
            balance_error,
            elapsed,
            mixing: mixing(&plans, shards, batch_size),
        });
        owners.push(ownership(&plans));
    }
    let movements = owners
        .windows(2)
        .zip(worlds.windows(2))
        .map(|(pair, sizes)| movement(&pair[0], &pair[1], total, sizes[0].min(sizes[1])))
        .collect();
    Ok((results, movements))
}

fn ownership(plans: &[RankPlan]) -> Vec<(Range<u64>, u32)> {
    let mut owned: Vec<(Range<u64>, u32)> =
        plans.iter().flat_map(|p| p.ranges.iter().map(move |r| (r.clone(), p.rank))).collect();
    owned.sort_unstable_by_key(|(r, _)| r.start);
    owned
}

/// Records whose owner differs between two ownership maps; a move is "to or from a changed
/// member" when it involves a rank id at or past `common` (the ranks both worlds share).
fn movement(a: &[(Range<u64>, u32)], b: &[(Range<u64>, u32)], total: u64, common: u32) -> Movement {
    let (mut i, mut j, mut moved, mut only_changed) = (0, 0, 0u64, true);
    while i < a.len() && j < b.len() {
        let (ra, oa) = (&a[i].0, a[i].1);
        let (rb, ob) = (&b[j].0, b[j].1);
        let start = ra.start.max(rb.start);
        let end = ra.end.min(rb.end);
        if start < end && oa != ob {
            moved += end - start;
            only_changed &= oa >= common || ob >= common;
        }
        if ra.end <= rb.end { i += 1 } else { j += 1 }
    }
    Movement { moved: if total == 0 { 0.0 } else { moved as f64 / total as f64 }, only_changed_members: only_changed }
}

/// One topology's placement, as the replication simulation reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplicationResult {
    /// Nodes up.
    pub nodes: u32,
    /// Copies per node id (index), over all buckets.
    pub copies: Vec<u64>,
    /// The largest relative deviation of a node's share from its weight's share.
    pub balance_error: f64,
    /// How long `place` took.
    pub elapsed: Duration,
}

/// Places for `n` nodes (2..=`NODES_MAX`), then for `n + 1` (one added) and `n - 1` (the last
/// removed); returns the three placements and the movements from the first to each of the
/// others.
pub fn replicate(
    plugin: &Plugin,
    options: &[(String, String)],
    n: u32,
    replicas: u32,
    weights: &[u32],
    domains: u32,
) -> Result<(Vec<ReplicationResult>, Vec<Movement>)> {
    // One node is added and one removed, so there is a node left.
    check_count("the number of nodes", u64::from(n), 2, u64::from(NODES_MAX))?;
    check_count("the number of replicas", u64::from(replicas), 1, u64::from(NODES_MAX))?;
    check_count("the number of failure domains", u64::from(domains), 1, u64::from(NODES_MAX))?;
    check_weights(weights)?;
    let mut replicator = Replicator::new(plugin.clone(), options, None)?;
    let node = |id: u32| NodeInfo {
        id,
        weight: if weights.is_empty() { 1 } else { weights[id as usize % weights.len()] },
        failure_domain: id % domains.max(1),
        up: true,
    };
    let mut results = Vec::new();
    let mut tables = Vec::new();
    for count in [n, n + 1, n.saturating_sub(1).max(1)] {
        let nodes: Vec<NodeInfo> = (0..count).map(node).collect();
        let started = Instant::now();
        let placement = replicator.place(&nodes, replicas)?;
        let elapsed = started.elapsed();
        let mut copies = vec![0u64; (n + 1) as usize];
        for bucket in &placement.buckets {
            for &id in bucket {
                copies[id as usize] += 1;
            }
        }
        let total: u64 = copies.iter().sum();
        let weight_total: u64 = nodes.iter().map(|n| u64::from(n.weight)).sum();
        let balance_error = nodes
            .iter()
            .map(|n| {
                let want = total as f64 * f64::from(n.weight) / weight_total as f64;
                (copies[n.id as usize] as f64 - want).abs() / want
            })
            .fold(0.0, f64::max);
        results.push(ReplicationResult { nodes: count, copies, balance_error, elapsed });
        tables.push(placement.buckets);
    }
    // A move is a copy that leaves a node or arrives at one. Adding node `n`, every copy that
    // moves should move to it; removing node `n - 1`, every copy that moves should come from it.
    let movement = |from: &[Vec<u32>], to: &[Vec<u32>], changed: u32, adding: bool| {
        let total: usize = from.iter().map(Vec::len).sum();
        let (mut moved, mut only_changed) = (0usize, true);
        for (a, b) in from.iter().zip(to) {
            let (a, b): (HashSet<&u32>, HashSet<&u32>) = (a.iter().collect(), b.iter().collect());
            if adding {
                for came in b.difference(&a) {
                    moved += 1;
                    only_changed &= **came == changed;
                }
            } else {
                for gone in a.difference(&b) {
                    moved += 1;
                    only_changed &= **gone == changed;
                }
            }
        }
        Movement { moved: moved as f64 / total.max(1) as f64, only_changed_members: only_changed }
    };
    let added = movement(&tables[0], &tables[1], n, true);
    let removed = movement(&tables[0], &tables[2], n - 1, false);
    Ok((results, vec![added, removed]))
}
