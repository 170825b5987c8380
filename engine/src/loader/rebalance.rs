//! Rebalancing a loader's share of each step: rank weights that follow the ranks' measured
//! speed, switched at deterministic steps, recorded so that a resumed run replays them.
//!
//! Owns: the trainer-side `Meter` (each batch's busy time, the window's measure, the exchange
//! with the other ranks at `lead` steps before each rebalance point), the channel that hands the
//! gathered measures to the reader, the `MeasureExchange` trait and its in-process
//! `LocalExchange`, `RebalanceState` (what a checkpoint saves), the reader-side `Rebalancing`
//! (the weights in force, applied at each point), and the `Grid` both sides count steps on (a
//! point's weights become each rank's records of a step by `plan::rebalanced_step`, arithmetic
//! the policy simulator shares). A rebalance point is a step
//! of an epoch that is a multiple of `every` (never the first, nor the last: the short last
//! step is split by the weights its epoch ran with before it); the reader reads up to it,
//! waits for the point's measures, asks the partitioner for the new weights (every rank asks
//! with the same measures, so every rank gets the same weights) and plans the rest of the epoch
//! with them; or, when the last point kept the weights, it reads on past the point with them
//! and, should the measures tell the ranks apart, reads those steps again while the trainer side
//! drops what it read (`Meter::handing_out`), so a synchronous job's reader keeps its lead. Weights
//! change how a step is split among ranks, never the global order. A point
//! whose measures cannot tell the ranks apart (`tells_ranks_apart`: every rank's window took
//! the same time, as it does under a trainer's per-step barrier) keeps the weights in force:
//! under a barrier each rank's time between hand-outs is the slowest rank's, so records per
//! second would only favour the rank that already holds more (a feedback loop that made
//! synchronous jobs slower).
//! Never: measures the reader apart from the trainer (a step's time is from one `next` call to
//! the next, the trainer's hold and its wait for the batch together, or what it reports), lets
//! a rank pass a point the others have not measured (the exchange waits for all), or hands out
//! a batch past a point that tells the ranks apart cut without that point's weights.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::LoaderConfig;
use super::planner::EpochPlanner;
use crate::error::{Error, Result};
use crate::plan::{Position, World};
use crate::policy::RankMeasure;

/// How the ranks of a job agree on their measures at a rebalance point: every rank calls
/// `all_gather` with the same `(epoch, step)` and gets every rank's measure, in rank order.
/// Implementations: [`LocalExchange`] for ranks in one process; the Python bindings' one over
/// `torch.distributed`.
pub trait MeasureExchange: Send + Sync {
    /// Every rank's measure of the window before the point `step` of `epoch` (blocking until
    /// every rank has given its own).
    fn all_gather(&self, epoch: u64, step: u64, mine: RankMeasure) -> Result<Vec<RankMeasure>>;
}

/// The exchange of ranks that are threads of one process (tests, a single-node job driven from
/// Rust): a table of the points being gathered, with a bound on how long a rank waits.
pub struct LocalExchange {
    world: u32,
    timeout: Duration,
    points: Mutex<HashMap<(u64, u64), Gathering>>,
    changed: Condvar,
}

struct Gathering {
    measures: Vec<Option<RankMeasure>>,
    /// Ranks that have taken the result; the entry goes when all have.
    taken: u32,
}

impl LocalExchange {
    /// An exchange for `world` ranks; a rank waits at most `timeout` for the others.
    pub fn new(world: u32, timeout: Duration) -> Arc<Self> {
        Arc::new(Self { world, timeout, points: Mutex::new(HashMap::new()), changed: Condvar::new() })
    }
}

impl MeasureExchange for LocalExchange {
    fn all_gather(&self, epoch: u64, step: u64, mine: RankMeasure) -> Result<Vec<RankMeasure>> {
        if mine.rank >= self.world {
            return Err(Error::invalid_input(format!("rank {} in an exchange of {} ranks", mine.rank, self.world)));
        }
        let deadline = Instant::now() + self.timeout;
        let mut points = self.points.lock();
        let key = (epoch, step);
        let entry =
            points.entry(key).or_insert_with(|| Gathering { measures: vec![None; self.world as usize], taken: 0 });
        entry.measures[mine.rank as usize] = Some(mine);
        self.changed.notify_all();
        loop {
            let entry = points.get_mut(&key).ok_or_else(|| {
                Error::invalid_input(format!(
                    "rebalance point {step} of epoch {epoch} was abandoned: a rank gave no measure within {:?}",
                    self.timeout
                ))
            })?;
            if entry.measures.iter().all(Option::is_some) {
                let measures: Vec<RankMeasure> = entry.measures.iter().flatten().copied().collect();
                entry.taken += 1;
                if entry.taken == self.world {
                    points.remove(&key);
                }
                return Ok(measures);
            }
            if self.changed.wait_until(&mut points, deadline).timed_out()
                && points.get(&key).is_some_and(|e| e.measures.iter().any(Option::is_none))
            {
                let missing: Vec<String> = points
                    .get(&key)
                    .map(|e| {
                        e.measures.iter().enumerate().filter(|(_, m)| m.is_none()).map(|(r, _)| r.to_string()).collect()
                    })
                    .unwrap_or_default();
                // The point is abandoned: its entry goes (a rank that comes later waits anew),
                // and the other waiters hear it.
                points.remove(&key);
                self.changed.notify_all();
                return Err(Error::invalid_input(format!(
                    "rebalance point {step} of epoch {epoch}: ranks {} gave no measure within {:?}",
                    missing.join(", "),
                    self.timeout
                )));
            }
        }
    }
}

/// How a loader rebalances.
#[derive(Clone)]
pub struct RebalanceConfig {
    /// Steps between rebalance points (a point at every multiple of it in an epoch but 0).
    pub every: u64,
    /// Steps before a point at which the ranks exchange their measures (the hand-out of the
    /// batch of step `point - lead`; the reader, which waits for them at the point, keeps
    /// reading meanwhile); at least 1, less than `every`.
    pub lead: u64,
    /// How the ranks agree on their measures; `None` for a world of one rank.
    pub exchange: Option<Arc<dyn MeasureExchange>>,
    /// The state a checkpoint saved, to resume with (its weights apply when its world size is
    /// this one's; the global order is the same either way).
    pub resume: Option<RebalanceState>,
}

impl std::fmt::Debug for RebalanceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RebalanceConfig")
            .field("every", &self.every)
            .field("lead", &self.lead)
            .field("exchange", &self.exchange.as_ref().map(|_| "..."))
            .field("resume", &self.resume)
            .finish()
    }
}

impl RebalanceConfig {
    /// Rebalance every `every` steps, exchanging `lead` steps ahead (a quarter of `every`, at
    /// least 1), through `exchange`.
    pub fn every(every: u64, exchange: Option<Arc<dyn MeasureExchange>>) -> Self {
        Self { every, lead: (every / 4).max(1), exchange, resume: None }
    }

    /// Keeps of `resume` what fits this run (`world` ranks, on `grid`): the weights when saved on
    /// this world size, the pending measures when they are for a point of the epoch the run
    /// starts in, not yet passed, one per rank.
    pub(super) fn fit_resume(&mut self, world: u32, grid: &Grid) {
        let size = world as usize;
        let Some(state) = &mut self.resume else { return };
        if state.weights.weights.len() != size {
            self.resume = None;
            return;
        }
        let start = grid.start();
        let fits = |(point, measured): &(u64, Vec<RankMeasure>)| {
            state.weights.epoch == start.epoch
                && grid.is_point(start.epoch, *point)
                && *point >= grid.step_at(start)
                && measured.len() == size
        };
        if !state.pending.as_ref().is_some_and(fits) {
            state.pending = None;
        }
    }

    /// Refuses a configuration that cannot run in a world of `world` ranks.
    pub fn check(&self, world: u32) -> Result<()> {
        if self.every < 2 {
            return Err(Error::invalid_input("rebalance every 2 steps or more"));
        }
        if self.lead == 0 || self.lead >= self.every {
            return Err(Error::invalid_input(format!(
                "the rebalance lead ({} steps) must be at least 1 and less than every ({})",
                self.lead, self.every
            )));
        }
        if world > 1 && self.exchange.is_none() {
            return Err(Error::invalid_input(
                "rebalancing a world of more than one rank needs an exchange of the ranks' measures",
            ));
        }
        Ok(())
    }
}

/// The weights in force from a step of an epoch on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightsAt {
    /// The epoch.
    pub epoch: u64,
    /// The step of the epoch they apply from (0: carried over from the previous epoch).
    pub step: u64,
    /// One weight per rank.
    pub weights: Vec<u32>,
}

/// What a checkpoint saves of the rebalancing, beside the `Position`: the weights in force at
/// the position and, when the ranks have already exchanged their measures for the next point,
/// those measures (a resumed run computes the same weights from them instead of measuring
/// again).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RebalanceState {
    /// The weights in force.
    pub weights: WeightsAt,
    /// The next point's gathered measures: (step, every rank's measure).
    pub pending: Option<(u64, Vec<RankMeasure>)>,
}

/// A point's measures, from the trainer side to the reader.
pub(super) struct PointMeasures {
    pub(super) epoch: u64,
    pub(super) step: u64,
    pub(super) measured: Vec<RankMeasure>,
}

/// The steps of epochs as rebalancing counts them: `step_len` positions each, from the start of
/// an epoch, or in the epoch a run resumed in, from the resume cursor's place in its step (a
/// state saved on another world size resumes between this world's steps). Points are the steps
/// that are multiples of `every`, but the first and the last of an epoch.
#[derive(Clone, Copy, Debug)]
pub(super) struct Grid {
    step_len: u64,
    n_records: u64,
    every: u64,
    start: Position,
}

impl Grid {
    /// The grid of a run from `start` (normalized: not at an epoch's end).
    pub(super) fn new(step_len: u64, n_records: u64, every: u64, start: Position) -> Self {
        Self { step_len: step_len.max(1), n_records, every: every.max(1), start }
    }

    /// Where the run starts.
    pub(super) fn start(&self) -> Position {
        self.start
    }

    fn offset(&self, epoch: u64) -> u64 {
        if epoch == self.start.epoch { self.start.cursor % self.step_len } else { 0 }
    }

    /// Steps of `epoch` from its grid's origin.
    fn steps(&self, epoch: u64) -> u64 {
        self.n_records.saturating_sub(self.offset(epoch)).div_ceil(self.step_len)
    }

    /// The (epoch, step) of the batch that ends at `after`.
    pub(super) fn step_of(&self, after: Position) -> (u64, u64) {
        let (epoch, end) = if after.cursor == 0 {
            (after.epoch.saturating_sub(1), self.n_records)
        } else {
            (after.epoch, after.cursor)
        };
        (epoch, end.saturating_sub(1).saturating_sub(self.offset(epoch)) / self.step_len)
    }

    /// The positions of the step that ends at `after`.
    fn step_range(&self, after: Position) -> std::ops::Range<u64> {
        let (epoch, step) = self.step_of(after);
        let end = if after.cursor == 0 { self.n_records } else { after.cursor };
        self.cursor_of(epoch, step).min(end)..end
    }

    /// The step that starts at `from`.
    pub(super) fn step_at(&self, from: Position) -> u64 {
        from.cursor.saturating_sub(self.offset(from.epoch)) / self.step_len
    }

    /// Where step `step` of `epoch` starts.
    pub(super) fn cursor_of(&self, epoch: u64, step: u64) -> u64 {
        self.offset(epoch).saturating_add(step.saturating_mul(self.step_len)).min(self.n_records)
    }

    /// The first point of `epoch` after step `step`, when there is one.
    pub(super) fn next_point(&self, epoch: u64, step: u64) -> Option<u64> {
        let point = (step / self.every + 1).saturating_mul(self.every);
        (point.saturating_add(1) < self.steps(epoch)).then_some(point)
    }

    /// Whether step `step` of `epoch` is a point.
    pub(super) fn is_point(&self, epoch: u64, step: u64) -> bool {
        step > 0 && step.is_multiple_of(self.every) && step.saturating_add(1) < self.steps(epoch)
    }
}

/// Window times closer than this ratio (the longest over the shortest) say nothing about which
/// rank is slower: under a per-step barrier they are equal whatever the ranks' speeds (a step's
/// time includes the wait for the batch and the barrier both), and two free-running ranks this
/// close are balanced already. `python/bench/rebalance_barrier.py` (BENCHMARKS.md) runs the
/// barrier case in processes.
pub const TIME_SPREAD_MIN: f64 = 1.10;

/// Whether a point's measures tell the ranks apart: at least two ranks measured time, and their
/// window times differ by `TIME_SPREAD_MIN` or more. A rank's window covers the same steps as
/// every other rank's, so equal times mean either equal speeds or a barrier that hides them;
/// in both cases moving records cannot shorten a step. A pure function of the measures, so every
/// rank (and a run resumed with the saved measures) decides the same.
pub fn tells_ranks_apart(measured: &[RankMeasure]) -> bool {
    let times = measured.iter().filter(|m| m.records > 0 && m.busy_nanos > 0).map(|m| m.busy_nanos);
    let (n, shortest, longest) = times.fold((0usize, u64::MAX, 0u64), |(n, lo, hi), t| (n + 1, lo.min(t), hi.max(t)));
    n >= 2 && longest as f64 >= shortest as f64 * TIME_SPREAD_MIN
}

/// The trainer side: busy time per batch, the window's measure, the exchange.
pub(super) struct Meter {
    rank: u32,
    /// Ranks of the world.
    world: u32,
    lead: u64,
    grid: Grid,
    exchange: Option<Arc<dyn MeasureExchange>>,
    to_reader: Sender<PointMeasures>,
    window: RankMeasure,
    /// The last batch handed out: when its `next` was called, and its records.
    last: Option<(Instant, u64)>,
    /// How much of the last hand-out's wait for the other ranks' measures is left out of its
    /// step's time: what it took beyond one of this rank's steps (`step_mean`). A rank whose
    /// trainer runs free of the others waits there for the ranks steps behind it, which is not
    /// its speed; under a per-step barrier every rank's steps end together, and the wait is
    /// shorter than a step and counted whole, the same on every rank (left out, it differed
    /// by which rank came first: jitter of a few milliseconds that told equal ranks apart).
    exchanging: Duration,
    /// This rank's mean step over the last window exchanged.
    step_mean: Duration,
    /// Steps timed in the current window.
    window_steps: u64,
    /// The trainer's own account of its time on the last batch, when it gives one.
    reported: Option<Duration>,
    /// The (epoch, step) of the last point exchanged.
    exchanged: Option<(u64, u64)>,
    /// Whether the trainer reported its busy time in the current window.
    reported_in_window: bool,
    pending: Option<(u64, u64, Vec<RankMeasure>)>,
    /// The last points (epoch, step) whose measures told the ranks apart, the latest last (at
    /// most two: the exchange runs at most one point ahead of the batches handed out). A batch
    /// of a step at or past one of them must have been cut with the weights decided there.
    deciding: [Option<(u64, u64)>; 2],
    /// Points whose measures could not tell the ranks apart (the weights were kept), not yet
    /// counted in the loader's metrics (`take_held`).
    held: u64,
    /// Whether a held point was said on stderr (once per loader: one at which this rank did
    /// not report its own busy time, the sign of a synchronous trainer whose barrier hides the
    /// slow rank).
    said: bool,
}

impl Meter {
    /// The meter of `rank` on `grid`; `config.resume` is already checked to fit this run.
    pub(super) fn new(world: World, config: &RebalanceConfig, grid: Grid, to_reader: Sender<PointMeasures>) -> Self {
        let rank = world.rank();
        let pending = config
            .resume
            .as_ref()
            .and_then(|s| s.pending.as_ref().map(|(step, m)| (s.weights.epoch, *step, m.clone())));
        let deciding = pending
            .as_ref()
            .filter(|(_, _, measured)| tells_ranks_apart(measured))
            .map(|(epoch, step, _)| (*epoch, *step));
        Self {
            rank,
            world: world.size(),
            lead: config.lead,
            grid,
            exchange: config.exchange.clone(),
            to_reader,
            window: RankMeasure { rank, ..RankMeasure::default() },
            last: None,
            exchanging: Duration::ZERO,
            step_mean: Duration::MAX,
            window_steps: 0,
            reported: None,
            exchanged: pending.as_ref().map(|(epoch, step, _)| (*epoch, *step)),
            pending,
            deciding: [None, deciding],
            held: 0,
            said: false,
            reported_in_window: false,
        }
    }

    /// The positions rank `rank`'s batch ending at `after` covers: its share of the step under
    /// `weights` (equal shares without). The unit a step is split in, so the unit of a rank's
    /// rate: for packed windows a batch's records are documents, and two ranks' windows may
    /// hold very different counts of them.
    fn positions(&self, after: Position, weights: Option<&WeightsAt>) -> u64 {
        let step = self.grid.step_range(after);
        let len = step.end - step.start;
        let rank = self.rank as usize;
        match weights {
            Some(weights) => crate::plan::step_shares(len, &weights.weights).get(rank).copied().unwrap_or(0),
            None => {
                let size = u64::from(self.world);
                len / size + u64::from((rank as u64) < len % size)
            }
        }
    }

    /// A batch ending at `after` is being handed out by a `next` called at `called`. Unless the trainer reported its own time (`report_busy`), the time from the
    /// previous `next` call to this one is the previous batch's: the trainer's hold of it and
    /// its wait for it, less any exchange of measures in between. The wait counts: under a
    /// per-step barrier every rank's step is then as long as every other's, whatever the ranks'
    /// speeds, and nothing moves (`tells_ranks_apart`); without it a rank that waited for its
    /// loader looked faster and was given more to read, so it waited longer (the feedback loop
    /// of issue 40). When this batch is the first at or past `lead` steps before a point, the
    /// window closes and the ranks exchange it.
    ///
    /// Whether the batch may be handed out (cut with `weights`): not when the reader cut it
    /// past a point whose measures tell the ranks apart before it knew that point's weights
    /// (it read on rather than wait for them; it reads the steps again once it knows them).
    /// The batch is then dropped, and the next `handing_out` of the same `next` call is the
    /// step's again.
    pub(super) fn handing_out(
        &mut self,
        after: Position,
        weights: Option<&WeightsAt>,
        called: Instant,
    ) -> Result<bool> {
        if let Some((previous_call, previous)) = self.last.take() {
            let reported = self.reported.take();
            self.reported_in_window |= reported.is_some();
            let step = called.saturating_duration_since(previous_call).saturating_sub(self.exchanging);
            let busy = reported.unwrap_or(step);
            self.window.records += previous;
            self.window.busy_nanos += u64::try_from(busy.as_nanos()).unwrap_or(u64::MAX);
            self.window_steps += 1;
            self.exchanging = Duration::ZERO;
        }
        let exchange_started = Instant::now();
        let outcome = self.exchange_if_due(after);
        self.exchanging += exchange_started.elapsed().saturating_sub(self.step_mean);
        outcome?;
        if weights.is_some_and(|weights| self.cut_before_decision(after, weights)) {
            return Ok(false);
        }
        self.last = Some((called, self.positions(after, weights)));
        Ok(true)
    }

    /// Whether the batch ending at `after` was cut with `weights` in force from before the last
    /// point at or before its step whose measures tell the ranks apart.
    fn cut_before_decision(&self, after: Position, weights: &WeightsAt) -> bool {
        let (epoch, step) = self.grid.step_of(after);
        let point = self.deciding.iter().flatten().filter(|(e, p)| *e == epoch && *p <= step).map(|(_, p)| *p).max();
        point.is_some_and(|point| (weights.epoch, weights.step) < (epoch, point))
    }

    /// Closes the window and exchanges it when the batch ending at `after` is the first at or
    /// past `lead` steps before a point.
    fn exchange_if_due(&mut self, after: Position) -> Result<()> {
        let (epoch, step) = self.grid.step_of(after);
        let Some(point) = self.grid.next_point(epoch, step) else { return Ok(()) };
        if step.saturating_add(self.lead) < point || self.exchanged == Some((epoch, point)) {
            return Ok(());
        }
        let mine = std::mem::replace(&mut self.window, RankMeasure { rank: self.rank, ..RankMeasure::default() });
        if self.window_steps > 0 {
            self.step_mean = Duration::from_nanos(mine.busy_nanos / std::mem::take(&mut self.window_steps));
        }
        let measured = match &self.exchange {
            Some(exchange) => exchange.all_gather(epoch, point, mine)?,
            None => vec![mine],
        };
        self.exchanged = Some((epoch, point));
        if tells_ranks_apart(&measured) {
            self.deciding = [self.deciding[1], Some((epoch, point))];
        } else {
            self.held += 1;
            if !self.reported_in_window && !std::mem::replace(&mut self.said, true) {
                // Once per loader: the default that keeps a job from getting slower, said where
                // a user of either binding sees it.
                eprintln!(
                    "granary: rebalancing kept the ranks' shares at step {point} of epoch {epoch}: every rank's \
                         steps took the same time, as under a synchronous trainer's per-step barrier, which hides \
                         the slow rank; call report_busy(seconds) with each step's own compute time to let \
                         rebalancing see it"
                );
            }
        }
        self.reported_in_window = false;
        self.pending = Some((epoch, point, measured.clone()));
        // A reader that is gone has ended the stream; the trainer hears it from the queue.
        let _ = self.to_reader.send(PointMeasures { epoch, step: point, measured });
        Ok(())
    }

    /// Points held since the last call (for the loader's metrics).
    pub(super) fn take_held(&mut self) -> u64 {
        std::mem::take(&mut self.held)
    }

    /// The trainer's time on the last batch handed out, as it measured it (its compute, without
    /// the waits for other ranks a synchronous step has): used instead of the time between
    /// hand-outs.
    pub(super) fn report_busy(&mut self, busy: Duration) {
        self.reported = Some(self.reported.unwrap_or_default() + busy);
    }

    /// The measures exchanged for a point whose step the batch ending at `after` has not
    /// reached (the point itself included: a run resumed there applies them first).
    pub(super) fn pending(&self, after: Position) -> Option<(u64, Vec<RankMeasure>)> {
        let (epoch, step) = self.grid.step_of(after);
        match &self.pending {
            Some((e, point, measured)) if *e == epoch && step < *point => Some((*point, measured.clone())),
            _ => None,
        }
    }
}

/// The reader side: waits for a point's measures (checking `stop` while it waits).
pub(super) fn wait_for_point(
    from_meter: &Receiver<PointMeasures>,
    epoch: u64,
    step: u64,
    stop: &std::sync::atomic::AtomicBool,
) -> std::result::Result<Vec<RankMeasure>, Option<Error>> {
    loop {
        if stop.load(std::sync::atomic::Ordering::Acquire) {
            return Err(None);
        }
        match from_meter.recv_timeout(Duration::from_millis(50)) {
            Ok(point) if point.epoch == epoch && point.step == step => return Ok(point.measured),
            // A point of a position the reader has passed (a resume's, already applied).
            Ok(_) => {}
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return Err(None),
        }
    }
}

/// The reader side of rebalancing: the weights in force, and where the next ones come from.
pub(super) struct Rebalancing<'a> {
    /// The steps and points, as the trainer side counts them.
    pub(super) grid: Grid,
    from_meter: &'a Receiver<PointMeasures>,
    /// A resumed run's measures of a point already exchanged: (epoch, step, measures).
    resumed: Option<(u64, u64, Vec<crate::policy::RankMeasure>)>,
    pub(super) current: Arc<WeightsAt>,
    /// Whether the last point decided kept the weights (or none was decided yet): the reader
    /// then reads on past the next point before its measures come (`reads_on`).
    held: bool,
}

impl<'a> Rebalancing<'a> {
    /// Starts at `position` (normalized) with the resumed weights (`config.resume`, already
    /// fitted to this run; bounded as a point's are) or equal ones.
    pub(super) fn start(
        config: &RebalanceConfig,
        from_meter: &'a Receiver<PointMeasures>,
        planner: &mut EpochPlanner,
        loader: &LoaderConfig,
        position: Position,
    ) -> Self {
        let size = loader.world.size() as usize;
        let step_len = u64::from(loader.world.size()).saturating_mul(loader.batch_size);
        let resumed = config.resume.as_ref();
        // As records of a full step, as every point's weights are (equal ones cut as before).
        let weights = resumed
            .and_then(|state| planner.bounded(&state.weights.weights))
            .or_else(|| planner.bounded(&vec![1; size]))
            .unwrap_or_else(|| vec![1; size]);
        planner.set_weights(weights.clone());
        // Weights saved in an earlier epoch are that epoch's: here they are in force from step 0.
        let step = resumed.filter(|state| state.weights.epoch == position.epoch).map_or(0, |state| state.weights.step);
        Self {
            grid: Grid::new(step_len, planner.n_records, config.every, position),
            from_meter,
            resumed: resumed
                .and_then(|state| state.pending.clone().map(|(step, measured)| (position.epoch, step, measured))),
            current: Arc::new(WeightsAt { epoch: position.epoch, step, weights }),
            held: true,
        }
    }

    /// Applies the resumed measures of the point `from` starts at, if there are: whether it did.
    pub(super) fn apply_resumed_at(
        &mut self,
        planner: &mut EpochPlanner,
        from: Position,
        stop: &AtomicBool,
    ) -> std::result::Result<bool, Option<Error>> {
        let step = self.grid.step_at(from);
        match &self.resumed {
            Some((epoch, point, _)) if *epoch == from.epoch && *point == step => {
                self.apply(planner, from.epoch, step, stop)?;
                // Planned again whatever the answer: the segment in hand was planned before the
                // resumed weights were set.
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// How many of `segment`'s batches come before step `point` of `epoch`.
    pub(super) fn before_point(&self, segment: &[(Vec<u64>, Position)], epoch: u64, point: u64) -> usize {
        segment
            .iter()
            .take_while(|(_, after)| {
                let (e, step) = self.grid.step_of(*after);
                e == epoch && step < point
            })
            .count()
    }

    /// The weights carry over into a new epoch, from its step 0.
    pub(super) fn new_epoch(&mut self, epoch: u64) {
        if self.current.epoch != epoch {
            self.current = Arc::new(WeightsAt { epoch, step: 0, weights: self.current.weights.clone() });
        }
    }

    /// The next rebalance point after `from`, when the epoch has one.
    pub(super) fn next_point(&self, from: Position) -> Option<u64> {
        self.grid.next_point(from.epoch, self.grid.step_at(from))
    }

    /// Waits for the point's measures, asks for the new weights and plans with them; whether
    /// the weights changed (a point whose measures cannot tell the ranks apart keeps them).
    pub(super) fn apply(
        &mut self,
        planner: &mut EpochPlanner,
        epoch: u64,
        point: u64,
        stop: &AtomicBool,
    ) -> std::result::Result<bool, Option<Error>> {
        let measured = self.measures(epoch, point, stop)?;
        self.decide(planner, epoch, point, measured)
    }

    /// The point's measures, waited for (a resumed run's saved ones first).
    pub(super) fn measures(
        &mut self,
        epoch: u64,
        point: u64,
        stop: &AtomicBool,
    ) -> std::result::Result<Vec<RankMeasure>, Option<Error>> {
        match self.resumed.take() {
            Some((e, step, measured)) if e == epoch && step == point => Ok(measured),
            _ => wait_for_point(self.from_meter, epoch, point, stop),
        }
    }

    /// The point's measures when they are here already (a resumed run's saved ones, or the
    /// trainer side's), without waiting.
    pub(super) fn measures_now(&mut self, epoch: u64, point: u64) -> Option<Vec<RankMeasure>> {
        if matches!(&self.resumed, Some((e, step, _)) if *e == epoch && *step == point) {
            return self.resumed.take().map(|(_, _, measured)| measured);
        }
        // Measures of a point already passed (a resume's, applied from the saved state) are
        // let go, as `wait_for_point` does.
        while let Ok(measures) = self.from_meter.try_recv() {
            if measures.epoch == epoch && measures.step == point {
                return Some(measures.measured);
            }
        }
        None
    }

    /// The point's weights from its measures: the partitioner's answer, or, when the measures
    /// cannot tell the ranks apart, the weights in force (`hold`). Whether they changed.
    pub(super) fn decide(
        &mut self,
        planner: &mut EpochPlanner,
        epoch: u64,
        point: u64,
        measured: Vec<RankMeasure>,
    ) -> std::result::Result<bool, Option<Error>> {
        if !tells_ranks_apart(&measured) {
            // Nothing tells the ranks apart: the point passes with the weights in force (the
            // trainer side counts it as held and says why).
            self.hold(epoch, point);
            return Ok(false);
        }
        let weights = planner.rebalance(point, &self.current.weights, measured).map_err(Some)?;
        debug_assert_eq!(weights.len(), self.current.weights.len(), "a weight per rank");
        self.held = false;
        let moved = weights != self.current.weights;
        self.current = Arc::new(WeightsAt { epoch, step: point, weights });
        Ok(moved)
    }

    /// The point passes with the weights in force.
    pub(super) fn hold(&mut self, epoch: u64, point: u64) {
        self.held = true;
        self.current = Arc::new(WeightsAt { epoch, step: point, weights: self.current.weights.clone() });
    }

    /// Whether the reader reads on past a point whose measures have not come, with the weights
    /// in force: when the last point kept them. Under a per-step barrier (without
    /// `report_busy`) every point does, and the reader keeps its lead; where points tell the
    /// ranks apart, what it read on would be read again at each, so it waits for them (its
    /// read-ahead was at most a segment of `every` steps).
    pub(super) fn reads_on(&self) -> bool {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_counts_steps_from_the_resume_cursor_in_its_epoch_and_from_0_after() {
        // Steps of 48 over 1536 records, resumed at 224 (a 32-record step's end).
        let grid = Grid::new(48, 1536, 4, Position { epoch: 2, cursor: 224 });
        assert_eq!(grid.step_at(Position { epoch: 2, cursor: 224 }), 4);
        assert_eq!(grid.cursor_of(2, 4), 224);
        assert_eq!(grid.cursor_of(2, 8), 32 + 8 * 48);
        assert_eq!(grid.step_of(Position { epoch: 2, cursor: 272 }), (2, 4));
        assert_eq!(grid.next_point(2, 4), Some(8));
        // The last step (31 of steps 0..31 from offset 32) is never a point.
        assert!(!grid.is_point(2, 31) && grid.is_point(2, 28));
        // The next epoch starts at 0; its end is reported as the next epoch's start.
        assert_eq!(grid.step_at(Position { epoch: 3, cursor: 0 }), 0);
        assert_eq!(grid.step_of(Position { epoch: 4, cursor: 0 }), (3, 31));
        assert_eq!(grid.next_point(3, 27), Some(28));
        assert_eq!(grid.next_point(3, 28), None);
    }

    #[test]
    fn a_rank_is_measured_in_the_positions_its_share_of_a_step_holds() {
        // Two ranks, steps of 8 over 50 positions: the last step holds 2.
        let grid = Grid::new(8, 50, 5, Position::default());
        let (to_reader, _from_meter) = std::sync::mpsc::channel();
        let config = RebalanceConfig::every(5, None);
        let meter = Meter::new(World::new(1, 2).expect("a world"), &config, grid, to_reader);
        let weights = WeightsAt { epoch: 0, step: 0, weights: vec![5, 3] };
        assert_eq!(meter.positions(Position { epoch: 0, cursor: 8 }, Some(&weights)), 3);
        assert_eq!(meter.positions(Position { epoch: 0, cursor: 16 }, None), 4);
        // The last step, reported at the next epoch's start: its share of 2 positions.
        let last = crate::plan::step_shares(2, &[5, 3])[1];
        assert_eq!(meter.positions(Position { epoch: 1, cursor: 0 }, Some(&weights)), last);
        assert_eq!(meter.positions(Position { epoch: 1, cursor: 0 }, None), 1);
    }
}
