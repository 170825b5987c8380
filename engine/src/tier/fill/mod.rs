//! Filling the tier from the plan: which extents to load, in which order, and which to evict.
//!
//! Owns: `TierSchedule` (every extent a loader will read, with the steps at which it reads it:
//! the plan, known in advance), `Coordinator` (the state the loader's reader and its filler
//! threads share: the reader's current step, the extents admitted, the queue, requests the
//! reader is waiting on) and `run_filler` (one filler thread's loop).
//!
//! The policy is Belady's on the node's plan (the loader's schedule holds the reads of every rank
//! of its node, `loader/schedule.rs`) when the extents still to be read fit the budget (after
//! memory pressure): all are admitted and loaded in order of next use, an extent the reader is
//! waiting for first (it waits for any admitted extent rather than read its records from disk), and
//! room is made by evicting what no plan here reads, then what is read farthest ahead, never one
//! needed sooner than the extent it makes room for. When they do not fit, the extents that serve
//! the most records within a horizon (until the plan has touched more extents than fit) are kept,
//! one already held (whoever loaded it) counting its load's cost on top: a uniform shuffle, which
//! reads all extents alike, keeps one set and reads the rest from disk at record granularity,
//! loading nothing for them; a plan that moves on, such as the elastic partitioner's window of
//! shards, is followed, each extent loaded ahead of its reads.
//!
//! The fills go only as far ahead as the reader needs (`FILL_AHEAD` of the trainer's time at
//! the pace it takes batches): a run that stops early has not paid for the far end of its plan. A
//! uniform shuffle reads from nearly every extent at every step, so there every admitted extent
//! is within reach at once; a plan that moves over the data (sequential, a window of shards) is
//! filled as it goes.
//!
//! Which extents make room is the evictor plugin's choice (`TierConfig::evictor`, `plan-aware`
//! by default: Belady on the plan), with the plan's rules over it: the plugin of each process is
//! told what the tier holds node-wide, the plan's reads step by step and each extent's next use,
//! and proposes victims for each fill (it is started before the first fill that needs room,
//! outside the node-wide budget lock); an extent the plan holds (admitted) stays while one it
//! does not hold could go instead, and never goes for a fill needed later than itself. What the
//! plugin leaves short, or everything when it fails, the native order covers: extents the plan
//! does not hold first, then the farthest next use. Under memory pressure the native order alone
//! gives memory back. The plugin's side (starting it, telling it, asking it) is `plugin.rs`.
//! Never: reads records (the `read` module does), or waits without a deadline.

#[cfg(feature = "policy")]
mod plugin;

#[cfg(feature = "policy")]
use plugin::PluginEvictor;
#[cfg(feature = "policy")]
pub(super) use plugin::evictor_host;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::schedule::{HORIZON_STEPS_MIN, NEVER};
use super::{ExtentInfo, ExtentKey, Filled, Holdings, MemoryTier, TierKind, TierSchedule};
use crate::error::Result;
use crate::io::{Fault, FaultIo, IoConfig, LazyIo};

/// Ops of one fill a filler's backend keeps in flight at most.
const FILL_OPS_IN_FLIGHT_MAX: u32 = 8;

/// Steps the reader may advance before the admitted set is computed again.
const REPLAN_STEPS: u64 = 16;

/// The same once the plan's extents all fit and all are loaded (warm epochs): a replan there
/// finds nothing to do (7 % of a warm epoch's CPU at every 16 steps); an extent that left
/// meanwhile is asked for again by the reader that misses it (`wait_for`).
const REPLAN_STEPS_SETTLED: u64 = 256;

// The schedule's horizon covers two replans at least.
const _: () = assert!(HORIZON_STEPS_MIN == 2 * REPLAN_STEPS);

/// What loading an extent is worth in records read from disk instead, per MiB of extent: a 4
/// MiB extent loads in one sequential read, which takes about as long as 100 random reads of 4
/// KiB on the build VM (3.85 GB/s against 90k reads/s), 25 per MiB; 16 leaves room for faster
/// random reads (an extent of less than a MiB counts as one). An extent read from the
/// tier replaces one held only when it serves this many more records within the horizon, so a
/// uniform shuffle (all extents read alike) keeps one set and a plan that moves on (a window
/// sliding over the shards) is followed.
const LOAD_RECORDS_PER_MIB: u64 = 16;

/// How far ahead of the reader the fills go, in the trainer's time at its measured pace: an
/// extent is filled once the reader is this close to its first read of it (issue 44: a run
/// that stops early does not pay for the plan's far end). Two seconds is many fills (a 4 MiB
/// extent takes a few milliseconds) and a few steps of a slow trainer; a reader that speeds up
/// past the fills waits for the extent it needs, moved to the front.
const FILL_AHEAD: Duration = Duration::from_secs(2);

/// Steps ahead of the reader the fills go at least, and until the pace is measured.
const FILL_AHEAD_STEPS_MIN: u64 = 4;

/// Weight of the newest step in the moving average of the trainer's pace.
const PACE_WEIGHT: f64 = 0.2;

/// How long the fills wait for the reader's first batch before they start anyway.
const FIRST_BATCH_HEAD_START: Duration = Duration::from_millis(200);

/// How often an idle filler looks at memory pressure.
const IDLE_CHECK: Duration = Duration::from_millis(100);

/// The state a loader's reader and its fillers share. See the module documentation.
pub struct Coordinator {
    tier: Arc<MemoryTier>,
    state: Mutex<State>,
    changed: Condvar,
    /// Fills finished (loaded, failed or found elsewhere) so far.
    published: AtomicU64,
    /// The reader delivered its first batch: the fills may start (they do not compete with it
    /// for the disk and the cores, issue 44).
    started: std::sync::atomic::AtomicBool,
    created: Instant,
    /// When an idle filler last looked at memory pressure (milliseconds after `created`).
    pressure_checked: AtomicU64,
    /// Faults injected into the fills (`Fault::FailFill`, tests and drills), and the fills
    /// started so far, which they are aimed by.
    fill_faults: Vec<Fault>,
    /// How each filler builds its backend, at its first fill.
    fill_io: IoConfig,
    fills_started: AtomicU64,
    /// The evictor plugin, started before the first fill that may need room (most loaders never
    /// evict).
    #[cfg(feature = "policy")]
    evictor: Mutex<PluginEvictor>,
}

#[derive(Default)]
struct State {
    schedule: TierSchedule,
    by_name: HashMap<String, usize>,
    /// The step the reader is planning.
    step: u64,
    /// The step the admitted set was computed at; `None`: compute it.
    planned_at: Option<u64>,
    admitted: Vec<bool>,
    loaded: Vec<bool>,
    busy: Vec<bool>,
    failed: Vec<bool>,
    queue: VecDeque<usize>,
    urgent: VecDeque<usize>,
    /// A schedule is being computed (the reader reads from disk meanwhile).
    pending: bool,
    /// Seconds per step of the trainer (moving average of the time between the batches it
    /// takes; 0 until it took two), and when it last took one.
    step_secs: f64,
    consumed_at: Option<Instant>,
    /// A filler is waiting for the reader to come within `FILL_AHEAD` of the next extent.
    held_back: bool,
    /// Every extent the schedule reads fits the budget (all are admitted); otherwise the
    /// admitted ones are chosen within a horizon. Either way the reader waits for an admitted
    /// extent being filled rather than read its records from disk.
    fits: bool,
    stop: bool,
}

impl Coordinator {
    /// A coordinator over `tier`, with an empty schedule.
    pub fn new(tier: Arc<MemoryTier>) -> Arc<Self> {
        Self::with_faults(tier, Vec::new(), &IoConfig::default())
    }

    /// A coordinator whose fills meet `faults` (the `Fault::FailFill` among them), their reads
    /// through backends like `io` (its kind and op size; O_DIRECT, an extent's ops in flight).
    pub fn with_faults(tier: Arc<MemoryTier>, faults: Vec<Fault>, io: &IoConfig) -> Arc<Self> {
        let ops_per_extent = tier.extent_bytes().div_ceil(io.op_bytes_max as u64);
        let fill_io = IoConfig {
            backend: io.backend,
            queue_depth: u32::try_from(ops_per_extent).unwrap_or(u32::MAX).clamp(1, FILL_OPS_IN_FLIGHT_MAX),
            op_bytes_max: io.op_bytes_max,
            direct: true,
        };
        Arc::new(Self {
            tier,
            fill_io,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            published: AtomicU64::new(0),
            started: false.into(),
            created: Instant::now(),
            pressure_checked: AtomicU64::new(0),
            fill_faults: faults.into_iter().filter(|f| matches!(f, Fault::FailFill { .. })).collect(),
            fills_started: AtomicU64::new(0),
            #[cfg(feature = "policy")]
            evictor: Mutex::new(PluginEvictor::default()),
        })
    }

    /// The reader delivered a batch: the fills start if they had not (once; cheap after).
    pub fn delivered(&self) {
        if !self.started.swap(true, Ordering::AcqRel) {
            self.changed.notify_all();
        }
    }

    /// Whether the reader has delivered its first batch.
    pub fn first_batch_out(&self) -> bool {
        self.started.load(Ordering::Acquire)
    }

    /// Waits until the fills may run (`may_fill`), or the fillers are stopped.
    pub fn wait_until_started(&self) {
        let mut state = self.lock();
        while !self.may_fill() && !state.stop {
            let _ = self.changed.wait_for(&mut state, self.head_start_left());
        }
    }

    /// Whether the fills may run: the first batch was delivered, or is taking long (a reader
    /// held up elsewhere does not hold the fills back for more than `FIRST_BATCH_HEAD_START`).
    fn may_fill(&self) -> bool {
        self.started.load(Ordering::Acquire) || self.created.elapsed() >= FIRST_BATCH_HEAD_START
    }

    /// What is left of the first batch's head start (`delivered` wakes the waiters before it
    /// ends): the fills do not poll while the reader works on it.
    fn head_start_left(&self) -> Duration {
        FIRST_BATCH_HEAD_START.saturating_sub(self.created.elapsed()).max(Duration::from_millis(1))
    }

    /// The tier.
    pub fn tier(&self) -> &Arc<MemoryTier> {
        &self.tier
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// A schedule is on its way: until it comes, `wait_for` waits for it.
    pub fn expect_schedule(&self) {
        self.lock().pending = true;
    }

    /// Replaces the schedule (at an epoch's start: this epoch's reads and the next one's).
    pub fn set_schedule(&self, schedule: TierSchedule) {
        // What the tier holds already counts as loaded: the policy keeps a loaded extent over an
        // equal one, so the tier does not churn at each epoch's start.
        let names: Vec<String> = schedule.extents.iter().map(|info| self.tier.extent_name(&info.key)).collect();
        let resident = self.tier.resident().map(|(resident, _)| resident).unwrap_or_default();
        let loaded = names.iter().map(|name| resident.contains_key(name)).collect();
        let mut state = self.lock();
        state.pending = false;
        let n = schedule.len();
        state.by_name = names.into_iter().enumerate().map(|(i, name)| (name, i)).collect();
        state.schedule = schedule;
        state.admitted = vec![false; n];
        state.loaded = loaded;
        state.busy = vec![false; n];
        state.failed = vec![false; n];
        state.queue.clear();
        state.urgent.clear();
        state.planned_at = None;
        drop(state);
        self.changed.notify_all();
    }

    /// The reader is planning step `step`: fillers waiting for it to come near are woken.
    pub fn advance(&self, step: u64) {
        let mut state = self.lock();
        state.step = step;
        let settled = state.fits && state.queue.is_empty() && state.urgent.is_empty();
        let every = if settled { REPLAN_STEPS_SETTLED } else { REPLAN_STEPS };
        let replan = state.planned_at.is_none_or(|at| step >= at + every);
        if replan {
            state.planned_at = None;
        }
        if replan || std::mem::take(&mut state.held_back) {
            drop(state);
            self.changed.notify_all();
        }
    }

    /// The trainer took a batch: the pace the fills keep ahead of is measured here, where the
    /// trainer sets it (the reader plans in bursts until its queue is full).
    pub fn consumed(&self) {
        let now = Instant::now();
        let mut state = self.lock();
        if let Some(at) = state.consumed_at.replace(now) {
            let secs = now.duration_since(at).as_secs_f64();
            state.step_secs =
                if state.step_secs == 0.0 { secs } else { state.step_secs + PACE_WEIGHT * (secs - state.step_secs) };
        }
    }

    /// The last step the fills work for now: `FILL_AHEAD` of the trainer's time at its measured
    /// pace past the step the reader plans, at least `FILL_AHEAD_STEPS_MIN` steps.
    fn fill_ahead_to(state: &State) -> u64 {
        let paced = if state.step_secs > 0.0 {
            // A float to integer cast saturates: a reader too fast to time reaches every step.
            (FILL_AHEAD.as_secs_f64() / state.step_secs) as u64
        } else {
            0
        };
        state.step.saturating_add(paced.max(FILL_AHEAD_STEPS_MIN))
    }

    /// Ends the fillers.
    pub fn stop(&self) {
        self.lock().stop = true;
        self.changed.notify_all();
    }

    /// Whether the fillers were ended (nothing this loader promised will come any more).
    pub fn is_stopped(&self) -> bool {
        self.lock().stop
    }

    /// Fills finished so far.
    pub fn published(&self) -> u64 {
        self.published.load(Ordering::Acquire)
    }

    /// Changes since the loader started that make an extent found absent worth looking up
    /// again: the fills finished, and whether the fills have started (before the first batch is
    /// out an absent extent is not waited for; after, it is).
    pub fn generation(&self) -> u64 {
        self.published() | u64::from(self.started.load(Ordering::Acquire)) << 63
    }

    /// Waits until a fill finishes after `seen` fills had, or `timeout` passes.
    pub fn wait_for_publish(&self, seen: u64, timeout: Duration) {
        let mut state = self.lock();
        if self.published() == seen {
            let _ = self.changed.wait_for(&mut state, timeout);
        }
    }

    /// Waits for extent `key` when this loader's fillers have admitted it: it goes to the front
    /// of their queue. True once a fill of it finished (the caller looks it up again); false
    /// when it is not admitted, its fill failed, or `deadline` passed. Until the reader has
    /// delivered its first batch, and while the schedule is being worked out, only an extent a
    /// filler is reading now is waited for: the first batch of a cold run needs an extent of
    /// nearly every shard and would otherwise wait for all of them (issue 44); its records come
    /// from disk while the fills start behind it.
    pub fn wait_for(&self, key: &ExtentKey, deadline: Instant) -> bool {
        let mut state = self.lock();
        // Before the first batch is out, the schedule is not waited for (nothing is being
        // filled yet); after, it is, as a fill that serves this record and later ones.
        if state.pending && !self.started.load(Ordering::Acquire) {
            return false;
        }
        while state.pending && !state.stop && Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            self.changed.wait_for(&mut state, left);
        }
        if state.planned_at.is_none() {
            self.replan(&mut state);
        }
        let Some(&extent) = state.schedule.index.get(key) else { return false };
        if !state.admitted[extent] || state.failed[extent] {
            return false;
        }
        // Loaded earlier but not there now: evicted by another process. Load it again.
        if state.loaded[extent] {
            state.loaded[extent] = false;
            if !state.busy[extent] {
                state.urgent.push_front(extent);
            }
            self.changed.notify_all();
        }
        if !state.busy[extent] {
            // Before the first batch is out, nothing is waited for that is not being read now.
            if !self.started.load(Ordering::Acquire) {
                return false;
            }
            // To the front of the queue, and waited for: one large read serves this record and
            // the later reads of the extent.
            state.urgent.push_front(extent);
            self.changed.notify_all();
        }
        loop {
            if state.loaded[extent] {
                return true;
            }
            let now = Instant::now();
            if state.failed[extent] || !state.admitted[extent] || state.stop || now >= deadline {
                return false;
            }
            self.changed.wait_for(&mut state, deadline - now);
        }
    }

    /// The next extent to fill, marked busy; `None` when stopped.
    fn next_job(&self) -> Option<(usize, ExtentInfo, u64)> {
        let mut state = self.lock();
        loop {
            if state.stop {
                return None;
            }
            if !self.may_fill() {
                let _ = self.changed.wait_for(&mut state, self.head_start_left());
                continue;
            }
            if state.planned_at.is_none() {
                self.replan(&mut state);
            }
            let ready = |s: &State, e: usize| s.admitted[e] && !s.loaded[e] && !s.busy[e] && !s.failed[e];
            let mut job = None;
            while let Some(e) = state.urgent.pop_front() {
                if ready(&state, e) {
                    job = Some(e);
                    break;
                }
            }
            if job.is_none() {
                // In order of next use: once the front is beyond the fills' reach, so is the rest.
                let reach = Self::fill_ahead_to(&state);
                while let Some(&e) = state.queue.front() {
                    if !ready(&state, e) {
                        state.queue.pop_front();
                    } else if state.schedule.next_use(e, state.step) > reach {
                        state.held_back = true;
                        break;
                    } else {
                        state.queue.pop_front();
                        job = Some(e);
                        break;
                    }
                }
            }
            if let Some(e) = job {
                state.busy[e] = true;
                let next_use = state.schedule.next_use(e, state.step);
                return Some((e, state.schedule.extents[e].clone(), next_use));
            }
            let waited = self.changed.wait_for(&mut state, IDLE_CHECK);
            if waited.timed_out() && !state.stop {
                // Nothing to load: give memory back if the node needs it.
                drop(state);
                let _ = self.shrink_under_pressure();
                state = self.lock();
            }
        }
    }

    /// Decides what the tier should hold from here on, and queues what it lacks, soonest needed
    /// first. When every extent still to be read fits the budget, all are admitted (Belady
    /// without evictions). Otherwise the extents that serve the most records within the horizon
    /// are admitted, one already held counting what its load would cost on top
    /// (`LOAD_RECORDS_PER_MIB`): under a uniform shuffle every extent is read about as often,
    /// so the tier settles on a set and reads the rest from disk instead of churning; when the
    /// plan moves on (a window over the shards), what it reads next displaces what it is done
    /// with, loaded ahead of its reads.
    fn replan(&self, state: &mut State) {
        let step = state.step;
        let schedule = &state.schedule;
        let ahead: Vec<(u64, usize)> = (0..schedule.len())
            .filter_map(|e| {
                let next = schedule.next_use(e, step);
                (next != NEVER).then_some((next, e))
            })
            .collect();
        // What the tier holds now counts as loaded, whoever loaded it: the ranks of a node, each
        // with the node's schedule, then weigh the same extents the same and keep one set.
        let (resident, held) = self.tier.resident().unwrap_or_default();
        state.loaded.iter_mut().for_each(|loaded| *loaded = false);
        for name in resident.keys() {
            if let Some(&e) = state.by_name.get(name) {
                state.loaded[e] = true;
            }
        }
        let budget = self.tier.effective_budget(held);
        let needed: u64 = ahead.iter().map(|&(_, e)| schedule.bytes(e)).sum();
        state.fits = needed <= budget;
        let mut ranked: Vec<(u64, u64, usize)> = ahead.iter().map(|&(next, e)| (next, 0, e)).collect();
        if !state.fits {
            let fit = budget / self.tier.extent_bytes().max(1);
            let horizon = schedule.horizon(&ahead, step, fit);
            let load_cost = (self.tier.extent_bytes() >> 20).max(1) * LOAD_RECORDS_PER_MIB;
            let loaded = &state.loaded;
            for (_, reads, e) in &mut ranked {
                let ahead = schedule.reads_between(*e, step, horizon);
                // Nothing to keep for if it is not read within the horizon.
                *reads = if loaded[*e] && ahead > 0 { ahead + load_cost } else { ahead };
            }
            ranked.sort_unstable_by_key(|&(next, uses, e)| (std::cmp::Reverse(uses), next, e));
        }
        state.admitted.iter_mut().for_each(|a| *a = false);
        let mut admitted_bytes = 0;
        let mut admitted = Vec::new();
        for (next, reads, e) in ranked {
            if reads == 0 && !state.fits {
                // Not read within the horizon: holding it now only keeps out what is.
                continue;
            }
            let bytes = state.schedule.bytes(e);
            if admitted_bytes + bytes > budget {
                continue;
            }
            admitted_bytes += bytes;
            state.admitted[e] = true;
            if !state.loaded[e] {
                admitted.push((next, e));
            }
        }
        admitted.sort_unstable();
        state.queue = admitted.into_iter().map(|(_, e)| e).collect();
        state.planned_at = Some(step);
    }

    /// Evicts extents until `bytes` more fit the budget beside what `holdings` lists. For a fill
    /// (`fill`: the extent and its next use) the evictor plugin proposes first; an extent the
    /// plan holds (admitted) that it proposes stays while one the plan does not hold is still
    /// there, and always when it is used no later than the fill. Then the native order: those
    /// not admitted (extents of other datasets, never used here, first; then the farthest next
    /// use), then admitted ones by farthest next use, but for a fill never one used no later
    /// than it. Under memory pressure (`None`) anything goes, in the native order. False when no
    /// room can be made that way.
    fn make_room(&self, holdings: Holdings, fill: Option<(ExtentKey, u64)>, bytes: u64) -> Result<bool> {
        let Holdings { extents: resident, mut held, filling } = holdings;
        let budget = self.tier.effective_budget(held);
        let fits = |held: u64| held.saturating_add(filling).saturating_add(bytes) <= budget;
        if fits(held) {
            return Ok(true);
        }
        let mut victims: Vec<(bool, u64, String, u64)> = {
            let state = self.lock();
            resident
                .into_iter()
                .map(|(name, size)| match state.by_name.get(&name) {
                    Some(&e) => (state.admitted[e], state.schedule.next_use(e, state.step), name, size),
                    None => (false, NEVER, name, size),
                })
                .collect()
        };
        victims.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)).then_with(|| a.2.cmp(&b.2)));
        let mine = fill.map(|(_, next)| next);
        let mut gone = vec![false; victims.len()];
        #[cfg(feature = "policy")]
        if let Some((key, next)) = fill {
            // The plugin's capacity is the whole budget: the room it makes for the fill also covers
            // the fills under way and what memory pressure takes off the budget.
            let room = bytes.saturating_add(filling).saturating_add(self.tier.budget_bytes().saturating_sub(budget));
            let chosen = self.plugin_victims(&victims, key, next, room);
            held = self.evict_chosen(&chosen, &victims, &mut gone, held, next, &fits)?;
        }
        for i in 0..victims.len() {
            if fits(held) {
                break;
            }
            let (admitted, next, ..) = victims[i];
            if gone[i] {
                continue;
            }
            if admitted && mine.is_some_and(|mine| next <= mine) {
                return Ok(false);
            }
            self.evict(&victims[i].2)?;
            held = held.saturating_sub(victims[i].3);
            gone[i] = true;
        }
        Ok(fits(held))
    }

    /// Removes extent `name` from the tier; this loader loads it again if the plan still wants it.
    fn evict(&self, name: &str) -> Result<()> {
        self.tier.evict(name)?;
        let mut state = self.lock();
        if let Some(&e) = state.by_name.get(name) {
            state.loaded[e] = false;
        }
        Ok(())
    }

    /// The error a fault aims at the fill starting now, if one does (the fill is numbered here).
    fn injected_fill_fault(&self) -> Option<i32> {
        if self.fill_faults.is_empty() {
            return None;
        }
        let number = self.fills_started.fetch_add(1, Ordering::Relaxed);
        self.fill_faults.iter().find_map(|fault| match *fault {
            Fault::FailFill { fill, errno } if fill == number => Some(errno),
            _ => None,
        })
    }

    /// Gives memory back when the node needs it (the tier's holdings as last listed). The idle
    /// fillers of a loader look once per `IDLE_CHECK` between them, and list the holdings only
    /// when what the tier holds is over the budget that memory pressure leaves.
    fn shrink_under_pressure(&self) -> Result<()> {
        let now = u64::try_from(self.created.elapsed().as_millis()).unwrap_or(u64::MAX);
        let last = self.pressure_checked.load(Ordering::Relaxed);
        let due = now.saturating_sub(last) >= u64::try_from(IDLE_CHECK.as_millis()).unwrap_or(0);
        if !due || self.pressure_checked.compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return Ok(());
        }
        let held = self.tier.held_bytes();
        if held <= self.tier.effective_budget(held) {
            return Ok(());
        }
        let (extents, held) = self.tier.resident()?;
        self.make_room(Holdings { extents, held, filling: 0 }, None, 0).map(drop)
    }

    fn finish(&self, extent: usize, outcome: &Result<Option<Filled>>) {
        let mut state = self.lock();
        state.busy[extent] = false;
        match outcome {
            Ok(Some(_)) => state.loaded[extent] = true,
            // No room without evicting something needed sooner: not admitted until replanned.
            Ok(None) => state.admitted[extent] = false,
            Err(_) => state.failed[extent] = true,
        }
        self.published.fetch_add(1, Ordering::AcqRel);
        drop(state);
        self.changed.notify_all();
    }
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator").field("tier", &self.tier).finish()
    }
}

/// One filler thread: loads extents as `coordinator` hands them out until it is stopped. A
/// failed fill is recorded (the reader then reads those records from disk, where a damaged
/// block is reported as any other).
pub fn run_filler(coordinator: &Coordinator) -> Result<()> {
    let config = coordinator.fill_io;
    // Built at the first fill that reads (a page cache tier's never do).
    let mut io = FaultIo::new(Box::new(LazyIo::new(config, Box::new(move || config.build()))), Vec::new());
    while let Some((extent, info, next_use)) = coordinator.next_job() {
        // Held already (another process loaded it, or the schedule came after its fill): no
        // room is made for it.
        if coordinator.tier.is_resident(&info.key) {
            coordinator.finish(extent, &Ok(Some(Filled::Elsewhere)));
            continue;
        }
        let bytes = info.n_blocks * crate::shard::BLOCK_BYTES_U64;
        // Room may be needed (what is held, this fill and as many more under way as there are
        // fillers come near the budget): the evictor plugin is started now, outside the budget
        // lock.
        #[cfg(feature = "policy")]
        {
            let tier = &coordinator.tier;
            let under_way = (tier.fill_threads() as u64).saturating_mul(tier.extent_bytes());
            if tier.held_bytes().saturating_add(bytes).saturating_add(under_way) > tier.budget_bytes() {
                coordinator.start_evictor();
            }
        }
        let fault = coordinator.injected_fill_fault();
        let outcome = match fault {
            // A page cache tier's fill maps the shard and has the kernel read it ahead: no op
            // of a backend to fail, so the fill fails here, as a disk error under it would.
            Some(errno) if coordinator.tier.kind() == TierKind::PageCache => {
                coordinator.tier.count_fill_failure();
                Err(crate::error::Error::io("fill", &info.path, std::io::Error::from_raw_os_error(errno)))
            }
            _ => {
                // Aimed at the fill's first read op (or the next fill's, when this one reads
                // nothing): the fill meets it as it would meet the disk's.
                if let Some(errno) = fault {
                    io.add_fault(Fault::FailRead { op: io.ops_issued(), errno });
                }
                coordinator.tier.fill_within_budget(&info, &mut io, |holdings| {
                    coordinator.make_room(holdings, Some((info.key, next_use)), bytes)
                })
            }
        };
        coordinator.finish(extent, &outcome);
    }
    Ok(())
}
