//! The elastic partitioner: which records each rank reads in an epoch, in which order.
//!
//! Records are cut into chunks of `chunk-records` consecutive records of one shard (default 1:
//! a full record-level shuffle; larger chunks make a block shuffle whose reads stay sequential
//! within a chunk while the chunk order mixes all shards).
//!
//! - `mode=global` (default): the chunks are put in a seeded order that depends only on the
//!   dataset, the seed and the epoch, never on the world. Steps of `ranks x batch-size`
//!   positions of that order are cut into one contiguous slice per rank that is up, in rank
//!   order, so concatenating the ranks' reads step by step gives the global order for any world
//!   size and any weights, and planning from a global position `start` covers exactly the rest
//!   of the epoch. A step is split by the ranks' weights (`step_shares`: equal weights give each
//!   rank `batch-size`, and a short last step as evenly as possible); the order itself never
//!   depends on them.
//!   With `window-shards=W` (W >= 1; default 0, off) the order is windowed for a cache that
//!   holds about W shards: the shards are put in a seeded order, and each chunk of the shard at
//!   position `p` of it gets a seeded key in `[p, p + W)`; the chunks are read in key order. A
//!   window of W shards slides over the shard order, chunks of the shards in it are mixed, and a
//!   shard is read only while it is in the window: at any point at most W + 1 shards are begun
//!   and not finished, where a full shuffle keeps every shard open all epoch. Still one global
//!   order for any world size.
//! - `mode=affinity`: every chunk is owned by one rank chosen by weighted rendezvous hashing,
//!   so shares follow the rank weights and a change of membership moves only the chunks of the
//!   ranks that came or went. With `locality=true`, a chunk goes to a rank whose node holds a
//!   replica of its shard when one is up. Each rank reads its chunks in a seeded order.
//!
//! `rebalance` (global mode) turns each rank's measured throughput (records over busy time)
//! into weights proportional to it, bounded: a rank's share of a step changes by at most the
//! factor `max-change` (default 2) per rebalance point, so one bad window cannot starve a rank.
//! A rank that measured nothing keeps its share. No rank's share falls below `min-share`
//! (default 0.1) of an equal share, so every rank keeps reading in every step.

use granary_policy_sdk::hash::{Permutation, key_of, mix, rendezvous_score};
use granary_policy_sdk::partition::{
    Epoch, Node, Partitioner, Rank, RankPlan, RebalancePoint, Shard, WEIGHT_MAX, step_shares,
};
use granary_policy_sdk::{Error, Options};

/// The elastic partitioner.
pub struct Elastic;

/// A run of consecutive records of one shard.
#[derive(Clone, Copy)]
struct Chunk {
    first: u64,
    len: u64,
    shard: u32,
    /// The chunk's index within its shard.
    index: u64,
}

fn chunks(shards: &[Shard], chunk_records: u64) -> Result<Vec<Chunk>, Error> {
    let mut out = Vec::new();
    let mut first = 0u64;
    for (s, shard) in shards.iter().enumerate() {
        let mut offset = 0;
        let mut index = 0;
        while offset < shard.records {
            let len = chunk_records.min(shard.records - offset);
            out.push(Chunk { first: first + offset, len, shard: s as u32, index });
            offset += len;
            index += 1;
        }
        first = first.checked_add(shard.records).ok_or_else(|| Error::InvalidInput("more than 2^64 records".into()))?;
    }
    Ok(out)
}

impl Partitioner for Elastic {
    fn plan(
        shards: &[Shard],
        ranks: &[Rank],
        nodes: &[Node],
        epoch: Epoch,
        options: &Options,
    ) -> Result<Vec<RankPlan>, Error> {
        options.allow_only(OPTIONS)?;
        let chunk_records: u64 = options.parse("chunk-records", 1)?;
        let locality: bool = options.parse("locality", false)?;
        let window: u64 = options.parse("window-shards", 0)?;
        if chunk_records == 0 {
            return Err(Error::InvalidInput("chunk-records must be at least 1".into()));
        }
        let mut up: Vec<Rank> = ranks.iter().copied().filter(|r| r.up).collect();
        up.sort_by_key(|r| r.id);
        if up.is_empty() {
            return Err(Error::InvalidInput("no rank is up".into()));
        }
        let chunks = chunks(shards, chunk_records)?;
        match options.get("mode").unwrap_or("global") {
            "global" if window == 0 => Ok(global(&shuffled(&chunks, &epoch), &up, epoch)),
            "global" => Ok(global(&windowed(&chunks, shards.len(), window, &epoch), &up, epoch)),
            "affinity" if window > 0 => {
                Err(Error::InvalidInput("window-shards orders a global plan (mode=global), not mode=affinity".into()))
            }
            "affinity" => affinity(&chunks, shards, &up, nodes, epoch, locality),
            other => Err(Error::InvalidInput(format!("unknown mode {other:?} (global or affinity)"))),
        }
    }

    fn rebalance(point: &RebalancePoint, options: &Options) -> Result<Vec<(u32, u32)>, Error> {
        Self::rebalance_weights(point, options)
    }
}

const OPTIONS: &[&str] = &["mode", "chunk-records", "locality", "window-shards", "max-change", "min-share"];

/// The weight of the heaviest rank after a rebalance: weights are relative, and this scale
/// leaves room for a 2^16 : 1 spread with integer weights.
const WEIGHT_SCALE: f64 = 65_536.0;

impl Elastic {
    /// See the module documentation.
    fn rebalance_weights(point: &RebalancePoint, options: &Options) -> Result<Vec<(u32, u32)>, Error> {
        options.allow_only(OPTIONS)?;
        if options.get("mode").unwrap_or("global") != "global" {
            return Err(Error::Unsupported("rebalancing splits the steps of mode=global by weight".into()));
        }
        let max_change: f64 = options.parse("max-change", 2.0)?;
        if !(1.0..=1e6).contains(&max_change) {
            return Err(Error::InvalidInput("max-change must be a factor in 1..=1000000".into()));
        }
        let min_share: f64 = options.parse("min-share", 0.1)?;
        if !(0.0..=1.0).contains(&min_share) {
            return Err(Error::InvalidInput("min-share must be a fraction of an equal share in 0..=1".into()));
        }
        let total: f64 = point.weights.iter().map(|&(_, w)| f64::from(w)).sum();
        if total <= 0.0 {
            return Err(Error::InvalidInput("every weight is 0".into()));
        }
        let rate = |rank: u32| {
            point
                .measured
                .iter()
                .find(|m| m.rank == rank && m.records > 0 && m.busy_nanos > 0)
                .map(|m| m.records as f64 / m.busy_nanos as f64)
        };
        // Shares now; the measured ranks' total share is spread over them by throughput.
        let share: Vec<f64> = point.weights.iter().map(|&(_, w)| f64::from(w) / total).collect();
        let (mut measured_share, mut measured_rate) = (0.0, 0.0);
        for (i, &(rank, _)) in point.weights.iter().enumerate() {
            if let Some(r) = rate(rank) {
                measured_share += share[i];
                measured_rate += r;
            }
        }
        // Each weight moves by at most sqrt(max-change): after renormalising, a share moves by
        // at most max-change.
        let bound = max_change.sqrt();
        let raw: Vec<f64> = point
            .weights
            .iter()
            .enumerate()
            .map(|(i, &(rank, _))| match rate(rank) {
                Some(r) if measured_rate > 0.0 => {
                    let target = measured_share * r / measured_rate;
                    share[i] * (target / share[i]).clamp(1.0 / bound, bound)
                }
                _ => share[i],
            })
            .collect();
        // The floor: shares below it are raised to it, the others scaled down to make room.
        let floor = min_share / raw.len() as f64;
        let sum: f64 = raw.iter().sum();
        let mut raw: Vec<f64> = raw.iter().map(|w| w / sum).collect();
        let low: f64 = raw.iter().filter(|&&w| w < floor).count() as f64 * floor;
        let high: f64 = raw.iter().filter(|&&w| w >= floor).sum();
        if low > 0.0 && high > 0.0 {
            let scale = (1.0 - low) / high;
            for w in &mut raw {
                *w = if *w < floor { floor } else { *w * scale };
            }
        }
        let heaviest = raw.iter().copied().fold(0.0, f64::max);
        Ok(point
            .weights
            .iter()
            .zip(raw)
            .map(|(&(rank, _), w)| (rank, ((w / heaviest * WEIGHT_SCALE).round() as u32).clamp(1, WEIGHT_MAX)))
            .collect())
    }
}

fn epoch_seed(epoch: &Epoch) -> u64 {
    mix(epoch.seed ^ mix(epoch.epoch.wrapping_add(0x6a09_e667_f3bc_c909)))
}

/// Every chunk in a seeded order (a full shuffle of the chunks).
fn shuffled(chunks: &[Chunk], epoch: &Epoch) -> Vec<Chunk> {
    let permutation = Permutation::new(chunks.len() as u64, epoch_seed(epoch));
    (0..chunks.len() as u64).map(|j| chunks[permutation.apply(j) as usize]).collect()
}

/// Every chunk in the order of a window of `window` shards sliding over a seeded order of the
/// shards (see the module documentation): the shard at position `p` gives each of its chunks a
/// key in `[p, p + window)`, in units of 2^32, and the chunks are sorted by key.
fn windowed(chunks: &[Chunk], n_shards: usize, window: u64, epoch: &Epoch) -> Vec<Chunk> {
    let seed = epoch_seed(epoch);
    let shard_order = Permutation::new(n_shards as u64, seed ^ 0x3c6e_f372_fe94_f82b);
    let mut position = vec![0u64; n_shards];
    for p in 0..n_shards as u64 {
        position[shard_order.apply(p) as usize] = p;
    }
    let span = u128::from(window) << 32;
    let mut keyed: Vec<(u128, u64, Chunk)> = chunks
        .iter()
        .map(|chunk| {
            let offset = u128::from(mix(seed ^ mix(chunk.first.wrapping_add(0xbb67_ae85_84ca_a73b)))) % span;
            ((u128::from(position[chunk.shard as usize]) << 32) + offset, chunk.first, *chunk)
        })
        .collect();
    keyed.sort_unstable_by_key(|&(key, first, _)| (key, first));
    keyed.into_iter().map(|(_, _, chunk)| chunk).collect()
}

/// Cuts `order` into steps of `ranks x batch size` positions from `epoch.start`, one slice per
/// rank that is up.
fn global(order: &[Chunk], up: &[Rank], epoch: Epoch) -> Vec<RankPlan> {
    // ends[j]: the global position just past chunk j of the order.
    let mut ends = Vec::with_capacity(order.len());
    let mut total = 0u64;
    for chunk in order {
        total += chunk.len;
        ends.push(total);
    }
    let mut plans: Vec<RankPlan> = up.iter().map(|r| RankPlan { rank: r.id, ranges: Vec::new() }).collect();
    let world = up.len() as u64;
    let batch = epoch.batch_size.max(1);
    let weights: Vec<u32> = up.iter().map(|r| r.weight).collect();
    let full_shares = step_shares(world * batch, &weights);
    let mut cursor = epoch.start.min(total);
    let mut j = ends.partition_point(|&end| end <= cursor);
    while cursor < total {
        let step = (world * batch).min(total - cursor);
        let short_shares = if step < world * batch { step_shares(step, &weights) } else { Vec::new() };
        let shares = if step < world * batch { &short_shares } else { &full_shares };
        for (r, plan) in plans.iter_mut().enumerate() {
            let len = shares[r];
            let (mut from, to) = (cursor, cursor + len);
            cursor = to;
            while from < to {
                let chunk = order[j];
                let chunk_start = ends[j] - chunk.len;
                let end = to.min(ends[j]);
                plan.push(chunk.first + (from - chunk_start), chunk.first + (end - chunk_start));
                from = end;
                if from == ends[j] {
                    j += 1;
                }
            }
        }
    }
    plans
}

fn affinity(
    chunks: &[Chunk],
    shards: &[Shard],
    up: &[Rank],
    nodes: &[Node],
    epoch: Epoch,
    locality: bool,
) -> Result<Vec<RankPlan>, Error> {
    if epoch.start != 0 {
        return Err(Error::Unsupported("mode=affinity plans whole epochs (start must be 0)".into()));
    }
    let node_up = |id: u32| nodes.iter().any(|n| n.id == id && n.up);
    let equal_weights = up.iter().all(|r| r.weight == up[0].weight && r.weight > 0);
    let max_id = up.iter().map(|r| r.id).max().unwrap_or(0);
    let rank_keys: Vec<u64> = (0..=u64::from(max_id)).map(|id| mix(id.wrapping_add(0x9e37_79b9_7f4a_7c15))).collect();
    let mut owned: Vec<Vec<Chunk>> = vec![Vec::new(); up.len()];
    for chunk in chunks {
        let shard = &shards[chunk.shard as usize];
        let key = mix(key_of(&shard.id) ^ mix(chunk.index));
        let local = |r: &Rank| shard.replicas.contains(&r.node) && node_up(r.node);
        let any_local = locality && up.iter().any(local);
        let candidates = up.iter().enumerate().filter(|(_, r)| !any_local || local(r));
        // With equal weights the rendezvous order is the order of the raw hashes: no logarithm
        // per (chunk, rank) pair, which is most of the cost of a large plan.
        let owner = if equal_weights {
            candidates.max_by_key(|(_, r)| mix(key ^ rank_keys[r.id as usize])).map(|(i, _)| i)
        } else {
            candidates
                .max_by(|(_, a), (_, b)| {
                    let score = |r: &Rank| rendezvous_score(key, u64::from(r.id), r.weight);
                    score(a).total_cmp(&score(b))
                })
                .map(|(i, _)| i)
        }
        .ok_or_else(|| Error::InvalidInput("no rank is up".into()))?;
        owned[owner].push(*chunk);
    }
    Ok(up
        .iter()
        .zip(owned)
        .map(|(rank, chunks)| {
            let permutation = Permutation::new(chunks.len() as u64, epoch_seed(&epoch) ^ mix(u64::from(rank.id)));
            let mut plan = RankPlan { rank: rank.id, ranges: Vec::new() };
            for j in 0..chunks.len() as u64 {
                let chunk = chunks[permutation.apply(j) as usize];
                plan.push(chunk.first, chunk.first + chunk.len);
            }
            plan
        })
        .collect())
}

#[cfg(target_arch = "wasm32")]
granary_policy_sdk::export_partitioner!(Elastic);

#[cfg(test)]
mod tests {
    use granary_policy_sdk::partition::RankMeasure;

    use super::*;

    fn point(weights: &[u32], nanos_per_record: &[u64]) -> RebalancePoint {
        RebalancePoint {
            step: 10,
            weights: weights.iter().enumerate().map(|(r, &w)| (r as u32, w)).collect(),
            measured: nanos_per_record
                .iter()
                .enumerate()
                .map(|(r, &n)| RankMeasure { rank: r as u32, records: 100, busy_nanos: 100 * n })
                .collect(),
        }
    }

    fn shares(weights: &[(u32, u32)]) -> Vec<f64> {
        let total: f64 = weights.iter().map(|&(_, w)| f64::from(w)).sum();
        weights.iter().map(|&(_, w)| f64::from(w) / total).collect()
    }

    #[test]
    fn weights_follow_throughput_within_the_bound_and_above_the_floor() {
        let options = Options::default();
        // Already proportional: unchanged shares.
        let same = Elastic::rebalance_weights(&point(&[1, 1, 1], &[10, 10, 10]), &options).unwrap();
        assert_eq!(shares(&same), vec![1.0 / 3.0; 3]);
        // A rank 3 x slower moves towards a share of 1/7 in steps of at most 2 x.
        let mut weights: Vec<u32> = vec![1, 1, 1];
        let mut previous = shares(&[(0, 1), (1, 1), (2, 1)]);
        for _ in 0..6 {
            let answer = Elastic::rebalance_weights(&point(&weights, &[10, 10, 30]), &options).unwrap();
            let now = shares(&answer);
            for (a, b) in now.iter().zip(&previous) {
                assert!(a / b <= 2.0001 && b / a <= 2.0001, "{now:?} after {previous:?}");
            }
            weights = answer.iter().map(|&(_, w)| w).collect();
            previous = now;
        }
        assert!((previous[2] - 1.0 / 7.0).abs() < 0.01, "{previous:?}");
        // A rank a million times slower stops at the floor, a tenth of an equal share.
        let mut weights: Vec<u32> = vec![1, 1];
        for _ in 0..40 {
            let answer = Elastic::rebalance_weights(&point(&weights, &[1, 1_000_000]), &options).unwrap();
            weights = answer.iter().map(|&(_, w)| w).collect();
        }
        let last = shares(&[(0, weights[0]), (1, weights[1])]);
        assert!((last[1] - 0.05).abs() < 0.001, "{last:?}");
        // A rank that measured nothing keeps its share; bad options are refused.
        let mut unmeasured = point(&[1, 3], &[10, 10]);
        unmeasured.measured[1].records = 0;
        let kept = Elastic::rebalance_weights(&unmeasured, &options).unwrap();
        assert!((shares(&kept)[1] - 0.75).abs() < 1e-3);
        let bad = Options(vec![("max-change".into(), "0.5".into())]);
        assert!(Elastic::rebalance_weights(&point(&[1, 1], &[1, 1]), &bad).is_err());
    }
}
