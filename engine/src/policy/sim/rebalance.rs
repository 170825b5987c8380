//! `granary plugin sim rebalance`: one epoch of a simulated synchronous job whose ranks read at
//! measured speeds, one of them slowed from some step on, planned by a partitioner that
//! rebalances every `every` steps, against the ideal proportional split.
//!
//! Owns the simulation: each rank's time for a step is its records over its throughput, the
//! step waits for the slowest, and the ideal step is the step's records over the ranks' summed
//! throughput. At each rebalance point the ranks' measures of the window (records, busy time)
//! go to the plugin's `rebalance`, the weights it answers split every following step
//! ([`crate::plan::step_shares`]), and the plan is asked again from that point, the way a loader
//! does. Checks every record is read exactly once, and that a run saved at a step and resumed on
//! another world size reads the same global order from there. Never: reads data or sleeps
//! (time is simulated).

use super::super::{EpochSpec, NodeInfo, Partitioner, Plugin, RankInfo, RankMeasure, RebalancePoint, ShardInfo};
use crate::error::{Error, Result};
use crate::plan::step_shares;

/// Records of one simulated epoch at most (the simulation keeps the global order in memory).
pub const RECORDS_MAX: u64 = 1 << 26;

/// One rank slowed from a step on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Straggler {
    /// The rank.
    pub rank: u32,
    /// How many times slower it reads.
    pub factor: f64,
    /// The global step it slows down at.
    pub from_step: u64,
}

/// What to simulate.
#[derive(Clone, Debug, PartialEq)]
pub struct RebalanceSim {
    /// Ranks of the job.
    pub ranks: u32,
    /// Records per rank per step (a step is `ranks x batch` records).
    pub batch: u64,
    /// Steps between rebalance points (0: never rebalance).
    pub every: u64,
    /// The slow rank.
    pub straggler: Option<Straggler>,
    /// Save at this step and resume on `resume_ranks` ranks.
    pub resume_at: Option<u64>,
    /// The world size of the resumed run (default: the same).
    pub resume_ranks: Option<u32>,
}

/// What one simulated epoch did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EpochRun {
    /// Steps of the epoch.
    pub steps: u64,
    /// Rebalance points the plugin answered.
    pub points: u64,
    /// Simulated time (in units of one record at full speed).
    pub time: f64,
    /// The ideal proportional split's time.
    pub ideal: f64,
    /// Each rank's records in the epoch.
    pub records_per_rank: Vec<u64>,
    /// The weights in force at the end.
    pub last_weights: Vec<u32>,
    /// The weights each rebalance point set: (step, one weight per rank).
    pub history: Vec<(u64, Vec<u32>)>,
    /// Whether every record was read exactly once.
    pub exactly_once: bool,
    /// The records in global order (steps concatenated, each rank's slice in rank order).
    order: Vec<u64>,
}

impl EpochRun {
    /// Time against the ideal.
    pub fn vs_ideal(&self) -> f64 {
        if self.ideal == 0.0 { 1.0 } else { self.time / self.ideal }
    }
}

/// The simulation's outcome: the epoch with rebalancing, without, and the resume check.
#[derive(Clone, Debug, PartialEq)]
pub struct RebalanceOutcome {
    /// With rebalancing every `every` steps.
    pub rebalanced: EpochRun,
    /// With the weights never changed.
    pub fixed: EpochRun,
    /// When a resume was asked: whether the resumed run read the same global order from the
    /// saved step on, every record exactly once overall.
    pub resumed_same_order: Option<bool>,
}

/// Runs the simulation of `sim` over `shards` with `plugin` (its `options`).
pub fn rebalance(
    plugin: &Plugin,
    options: &[(String, String)],
    shards: &[ShardInfo],
    sim: &RebalanceSim,
) -> Result<RebalanceOutcome> {
    let total: u64 = shards.iter().map(|s| s.records).sum();
    if total > RECORDS_MAX {
        return Err(Error::invalid_input(format!("{total} records; the simulation takes at most {RECORDS_MAX}")));
    }
    if sim.ranks == 0
        || sim.ranks > super::RANKS_MAX
        || sim.batch == 0
        || u64::from(sim.ranks.max(sim.resume_ranks.unwrap_or(1)))
            .checked_mul(sim.batch)
            .is_none_or(|step| step > total.max(1))
    {
        return Err(Error::invalid_input(format!(
            "ranks must be in 1..={}, the batch at least 1, and a step (ranks x batch) at most the {total} records",
            super::RANKS_MAX
        )));
    }
    if let Some(s) = sim.straggler
        && (s.rank >= sim.ranks || !(s.factor >= 1.0 && s.factor.is_finite()))
    {
        return Err(Error::invalid_input(format!(
            "the straggler must be a rank below {} slowed by a factor of at least 1",
            sim.ranks
        )));
    }
    let mut partitioner = Partitioner::new(plugin.clone(), options, None)?;
    if sim.every > 0 && !partitioner.can_rebalance() {
        return Err(Error::invalid_input(format!(
            "plugin {} is built against granary:policy@0.1.0, which has no rebalance",
            plugin.name()
        )));
    }
    let fixed = run(&mut partitioner, shards, sim, 0, sim.ranks, Start::default())?;
    let (rebalanced, resumed_same_order) = if sim.every == 0 {
        (fixed.clone(), None)
    } else {
        let rebalanced = run(&mut partitioner, shards, sim, sim.every, sim.ranks, Start::default())?;
        let resumed = match sim.resume_at {
            None => None,
            Some(step) => {
                // The saved state: the global position of the step (what a Position holds).
                let cursor = step.saturating_mul(u64::from(sim.ranks) * sim.batch).min(total);
                let ranks = sim.resume_ranks.unwrap_or(sim.ranks);
                if ranks == 0 || ranks > super::RANKS_MAX {
                    return Err(Error::invalid_input("the resumed world needs 1 or more ranks"));
                }
                let weights = weights_at(&rebalanced, step, ranks);
                let resumed = run(&mut partitioner, shards, sim, sim.every, ranks, Start { cursor, weights })?;
                let mut seen = vec![0u8; total as usize];
                for &record in rebalanced.order[..cursor as usize].iter().chain(&resumed.order) {
                    seen[record as usize] = seen[record as usize].saturating_add(1);
                }
                let once = seen.iter().all(|&n| n == 1);
                Some(once && resumed.order == rebalanced.order[cursor as usize..])
            }
        };
        (rebalanced, resumed)
    };
    Ok(RebalanceOutcome { rebalanced, fixed, resumed_same_order })
}

/// The weights a resumed run starts with: those in force at `step` (saved with the position)
/// on the same world size, equal ones on another (the global order does not depend on them).
fn weights_at(run: &EpochRun, step: u64, ranks: u32) -> Vec<u32> {
    let saved = run.history.iter().rev().find(|(at, _)| *at <= step).map(|(_, weights)| weights.clone());
    match saved {
        Some(weights) if weights.len() == ranks as usize => weights,
        _ => vec![1; ranks as usize],
    }
}

/// Where a run starts: a global position and the weights in force there.
#[derive(Default)]
struct Start {
    cursor: u64,
    weights: Vec<u32>,
}

fn throughput(sim: &RebalanceSim, rank: u32, step: u64) -> f64 {
    match sim.straggler {
        Some(s) if s.rank == rank && step >= s.from_step => 1.0 / s.factor,
        _ => 1.0,
    }
}

/// One epoch from `start` on `n_ranks` ranks, rebalancing every `every` steps (0: never).
fn run(
    partitioner: &mut Partitioner,
    shards: &[ShardInfo],
    sim: &RebalanceSim,
    every: u64,
    n_ranks: u32,
    start: Start,
) -> Result<EpochRun> {
    let total: u64 = shards.iter().map(|s| s.records).sum();
    let step_len = u64::from(n_ranks) * sim.batch;
    // As a loader: weights are the records of a full step each rank reads, bounded to 1..2 x
    // the batch (equal ones when the saved ones do not fit this world).
    let bounded = |weights: &[u32]| crate::plan::rebalanced_step(weights, n_ranks, sim.batch);
    let mut weights = bounded(&start.weights)
        .or_else(|| bounded(&vec![1; n_ranks as usize]))
        .ok_or_else(|| Error::invalid_input("no split of a step fits the ranks"))?;
    let nodes = [NodeInfo { id: 0, weight: 1, failure_domain: 0, up: true }];
    let mut out = EpochRun { records_per_rank: vec![0; n_ranks as usize], ..EpochRun::default() };
    let mut seen = vec![false; total as usize];
    let mut duplicate = false;
    let mut cursor = start.cursor.min(total);
    let mut window = vec![RankMeasure::default(); n_ranks as usize];
    // Steps count from the resume cursor's place in its step, as a loader's grid does; the last
    // step is never a point.
    let offset = cursor % step_len;
    let steps = (total - offset).div_ceil(step_len);
    let mut step = (cursor - offset) / step_len;
    while cursor < total {
        // A segment: from this step to the next rebalance point (or the epoch's end).
        let is_point = every > 0 && step > 0 && step.is_multiple_of(every) && step + 1 < steps;
        if is_point && window.iter().any(|m| m.records > 0) {
            let point = RebalancePoint {
                step,
                weights: (0..n_ranks).map(|r| (r, weights[r as usize])).collect(),
                measured: window.iter().enumerate().map(|(r, m)| RankMeasure { rank: r as u32, ..*m }).collect(),
            };
            let answer = partitioner.rebalance(&point)?;
            for (rank, weight) in answer {
                weights[rank as usize] = weight;
            }
            weights = bounded(&weights).ok_or_else(|| Error::invalid_input("no split of a step fits the ranks"))?;
            out.points += 1;
            out.history.push((step, weights.clone()));
            window.fill(RankMeasure::default());
        }
        let segment_end = step.checked_div(every).map_or(u64::MAX, |points| (points + 1) * every);
        let ranks: Vec<RankInfo> =
            (0..n_ranks).map(|id| RankInfo { id, node: 0, weight: weights[id as usize], up: true }).collect();
        let plans = partitioner.plan(
            shards,
            &ranks,
            &nodes,
            EpochSpec { seed: 7, epoch: 0, batch_size: sim.batch, start: cursor },
        )?;
        let mut reads: Vec<Box<dyn Iterator<Item = u64> + '_>> = (0..n_ranks)
            .map(|r| match plans.iter().find(|p| p.rank == r) {
                Some(plan) => Box::new(plan.records()) as Box<dyn Iterator<Item = u64>>,
                None => Box::new(std::iter::empty()),
            })
            .collect();
        while cursor < total && step < segment_end {
            let len = step_len.min(total - cursor);
            let shares = step_shares(len, &weights);
            let (mut slowest, mut capacity) = (0.0f64, 0.0f64);
            for rank in 0..n_ranks {
                let share = shares[rank as usize];
                let speed = throughput(sim, rank, step);
                capacity += speed;
                for _ in 0..share {
                    let record = reads[rank as usize].next().ok_or_else(|| {
                        Error::invalid_input(format!(
                            "the plan of rank {rank} is not cut in steps by the weights (it ends at step {step})"
                        ))
                    })?;
                    let slot = seen.get_mut(record as usize).ok_or_else(|| {
                        Error::invalid_input(format!("the plan reads record {record}, past the last"))
                    })?;
                    duplicate |= std::mem::replace(slot, true);
                    out.order.push(record);
                }
                let busy = share as f64 / speed;
                slowest = slowest.max(busy);
                out.records_per_rank[rank as usize] += share;
                let measure = &mut window[rank as usize];
                measure.records += share;
                measure.busy_nanos += (busy * 1e3).round() as u64;
            }
            out.time += slowest;
            out.ideal += len as f64 / capacity;
            cursor += len;
            step += 1;
            out.steps += 1;
        }
    }
    out.last_weights = weights;
    let first = usize::try_from(start.cursor.min(total)).unwrap_or(usize::MAX);
    let read = out.order.len();
    out.exactly_once = !duplicate && read == total as usize - first;
    Ok(out)
}
