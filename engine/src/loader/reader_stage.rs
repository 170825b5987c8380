//! The reader stage: the thread that plans each epoch, reads its batches through the `Reader`
//! (from disk or the tier) into staging leases and queues them for the trainer.
//!
//! Owns `ReaderStage` and its epoch loop (`run_epochs`; an epoch's rebalance points,
//! `read_epoch`; a segment's reads, `Lent::read`): the schedule of the tier's fills, the
//! rebalance points, the origin cache's plan, each batch's position. Never: copies to the device
//! (`device.rs`) or hands a batch to the trainer (`Loader::next`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(feature = "policy")]
use std::sync::mpsc::Receiver;
use std::sync::mpsc::SyncSender;

use super::config::*;
use super::metrics::LoaderMetrics;
use super::planner::{EpochBatches, EpochPlanner, PlanConfig, shards_by_step};
#[cfg(feature = "policy")]
use super::rebalance::{self, Rebalancing};
use super::schedule::{NextBatches, ScheduleRequest, Scheduler};
use super::start::{StartClock, StartStage};
use super::{Message, Tag};
use crate::error::Error;
use crate::io::Io;
use crate::plan::{Position, World};
use crate::read::{Dataset, PublishedStats, Reader};
use crate::staging::StagingPool;
use crate::tier::{Coordinator, TierReader};

pub(super) struct ReaderStage {
    pub(super) coordinator: Option<Arc<Coordinator>>,
    pub(super) dataset: Arc<Dataset>,
    pub(super) io: Box<dyn Io>,
    pub(super) pool: StagingPool,
    pub(super) config: LoaderConfig,
    /// The other ranks of this node, whose reads the tier's schedule includes.
    pub(super) peers: Vec<World>,
    pub(super) start: Position,
    pub(super) clock: Arc<StartClock>,
    /// The measures of each rebalance point, from the trainer side.
    #[cfg(feature = "policy")]
    pub(super) from_meter: Option<Receiver<rebalance::PointMeasures>>,
    pub(super) out: SyncSender<Message>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) stats: Arc<PublishedStats>,
    pub(super) metrics: Option<Arc<LoaderMetrics>>,
}

impl ReaderStage {
    pub(super) fn run(self) {
        #[cfg(feature = "policy")]
        let ReaderStage {
            coordinator,
            dataset,
            io,
            pool,
            config,
            peers,
            start,
            clock,
            from_meter,
            out,
            stop,
            stats,
            metrics,
        } = self;
        #[cfg(not(feature = "policy"))]
        let ReaderStage { coordinator, dataset, io, pool, config, peers, start, clock, out, stop, stats, metrics } =
            self;
        let mut reader = Reader::new(Arc::clone(&dataset), io);
        if let Some(threads) = config.verify_threads {
            reader.set_verify_threads(threads);
        }
        reader.set_staging(pool);
        if let Some(coordinator) = &coordinator {
            reader.set_tier(TierReader::new(Arc::clone(coordinator.tier()), Some(Arc::clone(coordinator))));
        }
        reader.publish_stats(Arc::clone(&stats));
        if let Some(hook) = &config.repair {
            reader.set_repair(Arc::clone(hook));
        }
        let node = Node {
            coordinator: coordinator.as_ref(),
            peers,
            #[cfg(feature = "policy")]
            from_meter: from_meter.as_ref(),
        };
        reader.set_count_shard_reads(metrics.is_some());
        let queue = Queue { sender: &out, queued: metrics.as_ref().map(|m| &m.queued), clock: &clock };
        let outcome = run_epochs(&mut reader, &dataset, &config, start, queue, &stop, node);
        if let Some(coordinator) = &coordinator {
            coordinator.stop();
        }
        let _ = match outcome {
            Ok(()) => out.send(Message::End),
            Err(Some(error)) => out.send(Message::Failed(error)),
            Err(None) => Ok(()),
        };
    }
}

/// Where the reader stage puts batches, its count of them (for the queue's depth), and the
/// start's clock (the reader marks its stages up to the first batch queued).
struct Queue<'a> {
    sender: &'a SyncSender<Message>,
    queued: Option<&'a AtomicU64>,
    clock: &'a StartClock,
}

/// What a reader shares with the other ranks of its node.
struct Node<'a> {
    /// The memory tier's coordinator, when the loader uses the tier.
    coordinator: Option<&'a Arc<Coordinator>>,
    /// The node's other ranks (whose reads the tier's schedule and an origin cache's plan
    /// include); empty when this rank is alone or the node is not known.
    peers: Vec<World>,
    /// The trainer side's measures of each rebalance point, when the loader rebalances.
    #[cfg(feature = "policy")]
    from_meter: Option<&'a Receiver<rebalance::PointMeasures>>,
}

/// Reads epochs from `start`; `Err(None)` when stopped, `Err(Some(e))` on a failure.
fn run_epochs(
    reader: &mut Reader,
    dataset: &Arc<Dataset>,
    config: &LoaderConfig,
    start: Position,
    out: Queue<'_>,
    stop: &AtomicBool,
    node: Node<'_>,
) -> std::result::Result<(), Option<Error>> {
    #[cfg(feature = "policy")]
    let Node { coordinator, peers: node_peers, from_meter } = node;
    #[cfg(not(feature = "policy"))]
    let Node { coordinator, peers: node_peers } = node;
    let n_records = config.plan.epoch_len(dataset);
    let mut planner = EpochPlanner::new(&PlanConfig::of(config), dataset).map_err(Some)?;
    out.clock.mark(StartStage::PlannerReady);
    let mut position = normalized(start, n_records);
    #[cfg(feature = "policy")]
    let mut rebalancing = match (&config.rebalance, from_meter) {
        (Some(rebalance), Some(from_meter)) => {
            Some(Rebalancing::start(rebalance, from_meter, &mut planner, config, position))
        }
        _ => None,
    };
    let end_epoch = config.epochs.map(|epochs| start.epoch.saturating_add(epochs));
    // Steps count this loader's batches across epochs: the tier's schedule is in them.
    let mut step = 0u64;
    let mut next_epoch: Option<Arc<EpochBatches>> = None;
    // The next epoch as the schedule's thread planned it, when the reader left it to that thread.
    let mut next_slot: Option<Arc<std::sync::OnceLock<Arc<EpochBatches>>>> = None;
    // The tier's schedule is computed on a thread of its own, off the path to the first batch.
    let scheduler =
        coordinator.map(|c| Scheduler::start(dataset, c, config, node_peers.clone())).transpose().map_err(Some)?;
    // An origin cache hears this rank's plan from here and the node's other ranks' from a thread.
    let node_plan = match config.repair.as_ref().filter(|hook| hook.wants_plan()) {
        Some(hook) => super::node_plan::NodePlan::start(dataset, config, Arc::clone(hook), node_peers).map_err(Some)?,
        None => None,
    };
    while end_epoch.is_none_or(|end| position.epoch < end) {
        if n_records == 0 {
            return Ok(());
        }
        #[cfg(feature = "policy")]
        let fresh = rebalancing.is_some();
        #[cfg(not(feature = "policy"))]
        let fresh = false;
        let planned_ahead = next_epoch.take().or_else(|| next_slot.take().and_then(|slot| slot.get().cloned()));
        let batches = match planned_ahead {
            // With rebalancing the next epoch was planned before this one's points changed the
            // weights: it is planned again with the weights now in force.
            Some(batches) if !fresh => batches,
            _ => Arc::new(planner.epoch(position).map_err(Some)?),
        };
        out.clock.mark(StartStage::EpochPlanned);
        let hook = config.repair.as_ref().filter(|hook| hook.wants_plan());
        let following = Position { epoch: position.epoch + 1, cursor: 0 };
        // The fillers (and an origin cache's prefetch) see this epoch's reads and the next
        // one's, so they keep (and load ahead) what the epoch after this needs first. The tier's
        // alone can wait: its schedule's thread plans it after the first batch (issue 44), unless
        // the plan changes with rebalancing (planned here, with the weights in force).
        let has_next = end_epoch.is_none_or(|end| following.epoch < end);
        if has_next && (hook.is_some() || (scheduler.is_some() && fresh)) {
            next_epoch = Some(Arc::new(planner.epoch(following).map_err(Some)?));
            out.clock.mark(StartStage::NextEpochPlanned);
        }
        if let Some(hook) = hook {
            // The first epoch's plan, then each following one's a whole epoch ahead.
            if step == 0 {
                hook.plan(step, &shards_by_step(dataset, &batches));
                if let Some(node_plan) = &node_plan {
                    node_plan.request(step, position);
                }
            }
            if let Some(next) = &next_epoch {
                hook.plan(step + batches.len() as u64, &shards_by_step(dataset, next));
                if let Some(node_plan) = &node_plan {
                    node_plan.request(step + batches.len() as u64, following);
                }
            }
        }
        if let Some(scheduler) = &scheduler {
            let next = match &next_epoch {
                Some(next) => Some((following, NextBatches::Planned(Arc::clone(next)))),
                None if has_next => {
                    let slot = Arc::new(std::sync::OnceLock::new());
                    next_slot = Some(Arc::clone(&slot));
                    Some((following, NextBatches::ToPlan(slot)))
                }
                None => None,
            };
            scheduler.request(ScheduleRequest { step, from: position, batches: Arc::clone(&batches), next });
        }
        let mut lent = Lent { reader: &mut *reader, config, out: &out, stop, coordinator, step: &mut step };
        #[cfg(feature = "policy")]
        read_epoch(&mut lent, &mut planner, rebalancing.as_mut(), batches, position)?;
        #[cfg(not(feature = "policy"))]
        lent.read(&batches, &mut |after| Some(Tag { after }))?;
        position = Position { epoch: position.epoch + 1, cursor: 0 };
    }
    Ok(())
}

/// `start`, or the next epoch's start when `start` is at the end of its epoch.
pub(super) fn normalized(start: Position, n_records: u64) -> Position {
    if start.cursor >= n_records { Position { epoch: start.epoch + 1, cursor: 0 } } else { start }
}

/// Reads the batches of epoch `position.epoch` planned as `batches` (from `position`), with
/// rebalancing when the loader rebalances: the batches up to each point, then the point's
/// weights and the rest of the epoch planned with them.
///
/// A point the reader has read past with the weights in force before it, its measures not here
/// yet: rather than wait for them (the trainer would then wait at the steps after it), the
/// reader reads on when the last point kept the weights (`Rebalancing::reads_on`). A point whose
/// measures keep them (always under a per-step barrier without `report_busy`) then costs
/// nothing; one whose measures tell the ranks apart has the steps past it read again with its
/// weights, and the trainer side drops the ones read before (`Meter::handing_out`). At most one
/// point is open: the reader waits for it at the next.
#[cfg(feature = "policy")]
fn read_epoch(
    lent: &mut Lent<'_, '_>,
    planner: &mut EpochPlanner,
    rebalancing: Option<&mut Rebalancing<'_>>,
    batches: Arc<EpochBatches>,
    position: Position,
) -> std::result::Result<(), Option<Error>> {
    let Some(rebalancing) = rebalancing else {
        lent.read(&batches, &mut |after| Some(Tag { after, weights: None }))?;
        return Ok(());
    };
    let mut segment = batches;
    // Where in `segment` the batches still to read begin (a point that kept the weights goes on
    // in the same plan), and where the steps the next point is counted from begin.
    let mut offset = 0usize;
    let mut from = position;
    let epoch = position.epoch;
    rebalancing.new_epoch(epoch);
    // A run resumed right at a point whose measures were saved applies them first.
    if rebalancing.apply_resumed_at(planner, from, lent.stop)? {
        segment = Arc::new(planner.epoch(from).map_err(Some)?);
    }
    let mut open: Option<u64> = None;
    loop {
        let point = rebalancing.next_point(from);
        let take = match point {
            Some(point) => rebalancing.before_point(&segment[offset..], epoch, point),
            None => segment.len() - offset,
        };
        // The open point's measures when they came during the read and tell the ranks apart
        // (the read stopped: what it would read is read again with the point's weights).
        let mut apart: Option<Vec<crate::policy::RankMeasure>> = None;
        let sent = lent.read(&segment[offset..offset + take], &mut |after| {
            if let Some(point) = open
                && let Some(measured) = rebalancing.measures_now(epoch, point)
            {
                if rebalance::tells_ranks_apart(&measured) {
                    apart = Some(measured);
                    return None;
                }
                rebalancing.hold(epoch, point);
                open = None;
            }
            Some(Tag { after, weights: Some(Arc::clone(&rebalancing.current)) })
        })?;
        offset += sent;
        if let Some(passed) = open.take() {
            // Read up to the next point (or the epoch's end) past an open point, or stopped by
            // its measures: its weights now, from its measures.
            let measured = match apart.take() {
                Some(measured) => measured,
                None => rebalancing.measures(epoch, passed, lent.stop)?,
            };
            if rebalance::tells_ranks_apart(&measured) {
                rebalancing.decide(planner, epoch, passed, measured)?;
                // What the trainer side now asks of every batch past the point (`Meter`).
                debug_assert_eq!((rebalancing.current.epoch, rebalancing.current.step), (epoch, passed));
                from = Position { epoch, cursor: rebalancing.grid.cursor_of(epoch, passed) };
                segment = Arc::new(planner.epoch(from).map_err(Some)?);
                offset = 0;
            } else {
                rebalancing.hold(epoch, passed);
            }
            continue;
        }
        let Some(point) = point else { return Ok(()) };
        from = Position { epoch, cursor: rebalancing.grid.cursor_of(epoch, point) };
        let measured = match rebalancing.measures_now(epoch, point) {
            Some(measured) => measured,
            None if rebalancing.reads_on() => {
                open = Some(point);
                continue;
            }
            None => rebalancing.measures(epoch, point, lent.stop)?,
        };
        if rebalancing.decide(planner, epoch, point, measured)? {
            segment = Arc::new(planner.epoch(from).map_err(Some)?);
            offset = 0;
        }
        // Otherwise the same weights plan the same batches: no plugin call.
    }
}

/// What reading a segment of batches borrows from the reader stage: `step` counts this
/// loader's batches (the tier's schedule is in them).
struct Lent<'a, 'q> {
    reader: &'a mut Reader,
    config: &'a LoaderConfig,
    out: &'a Queue<'q>,
    stop: &'a AtomicBool,
    coordinator: Option<&'a Arc<Coordinator>>,
    step: &'a mut u64,
}

impl Lent<'_, '_> {
    /// Reads `batches` and queues them, each tagged by `tag` with the position after it, until
    /// `tag` gives none (the batch it was asked for, read, is dropped); how many were queued.
    fn read(
        &mut self,
        batches: &[(Vec<u64>, Position)],
        tag: &mut dyn FnMut(Position) -> Option<Tag>,
    ) -> std::result::Result<usize, Option<Error>> {
        let Lent { reader, config, out, stop, coordinator, step } = self;
        let coordinator = *coordinator;
        let positions = std::cell::RefCell::new(std::collections::VecDeque::new());
        let mut stopped = false;
        let mut cut = false;
        let mut sent = 0usize;
        let mut planned_count = 0usize;
        let planned = batches.iter().inspect(|(_, after)| {
            positions.borrow_mut().push_back(*after);
            planned_count += 1;
            if let Some(coordinator) = coordinator {
                coordinator.advance(**step);
            }
            **step += 1;
        });
        let outcome = reader.read_batches(planned.map(|(records, _)| records), config.read_depth, &mut |batch| {
            let Some(after) = positions.borrow_mut().pop_front() else {
                return Err(Error::invalid_input("a batch read that was not planned"));
            };
            if stop.load(Ordering::Acquire) {
                stopped = true;
                return Err(Error::invalid_input("stopped"));
            }
            let Some(tag) = tag(after) else {
                cut = true;
                return Err(Error::invalid_input("cut short"));
            };
            if let Some(coordinator) = coordinator {
                coordinator.delivered();
            }
            let batch = Box::new(std::mem::take(batch));
            // Before it is sent: the trainer may take it at once.
            out.clock.mark(StartStage::FirstBatchRead);
            if out.sender.send(Message::Batch(batch, tag)).is_err() {
                stopped = true;
                return Err(Error::invalid_input("stopped"));
            }
            sent += 1;
            if let Some(queued) = out.queued {
                queued.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        });
        debug_assert!(
            sent <= planned_count && planned_count <= batches.len(),
            "{sent} sent of {planned_count} planned"
        );
        if stopped {
            return Err(None);
        }
        if cut {
            // The batches planned and not queued count again when they are read again (the
            // tier's schedule has already heard of them: it only fills ahead a little early).
            debug_assert!(sent <= planned_count && **step >= (planned_count - sent) as u64);
            **step -= (planned_count - sent) as u64;
            return Ok(sent);
        }
        outcome.map_err(Some)?;
        Ok(sent)
    }
}
