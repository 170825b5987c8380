//! `Session`: one rank's reading of a dataset as a trainer drives it, epoch after epoch: what it
//! reads (a version or a mixture of versions, as records or as packed windows of tokens), where
//! it is, the short last step `drop_last` skips, a mixture's changes of weights, restarts,
//! seeks and resumes. The Python `granary.Loader` is a session with conversions; a Rust trainer
//! gets the same by making one.
//!
//! A session starts its `Loader` lazily, at the first batch asked for, and keeps it running
//! across epoch ends (the next epoch's first batches are read while the trainer finishes this
//! one); a move of the position (a seek, another epoch, a change of weights, a resumed
//! rebalancing) stops it and the next batch starts a new one from the new position.
//!
//! Invariants: `position` is always normalized by the rank's cut (never inside a step this rank
//! reads nothing of); a batch handed out lies after the position it was handed at and in the
//! epoch being iterated; a session copied into a forked child never joins its parent's threads.
//!
//! Owns `Session`, `SessionConfig`, `Reads` and `PackedStep`, every check of what a loader
//! reads (once, at `Session::new`), and saving and resuming (`save`, `resume`: the state and its
//! checks are `state.rs`'s). Never: reads or verifies a record itself (its `Loader`
//! does), decides an order (the plans do), or knows a caller's language (a binding converts).

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::pack::PackConfig;
use crate::plan::{Order, Position, RankCut};
use crate::read::{Dataset, EpochLength, Mixture};
use crate::store::{StorePaths, VersionSpec};
use crate::tier::TierStats;

#[cfg(feature = "policy")]
use super::RebalanceState;
#[cfg(feature = "policy")]
use super::plan_for_store;
use super::state::{OrderPairs, SavedMixture, SavedState};
use super::{
    LoadedBatch, Loader, LoaderConfig, LoaderStats, PackedBatch, Packer, Packing, PlanSource, StartStage, Target,
    TierSetting, pack_mixture, pack_plan,
};

/// What a session reads.
#[derive(Clone, Debug)]
pub enum Reads {
    /// One dataset version.
    One(VersionSpec),
    /// A mixture of versions with their weights.
    Mixture {
        /// Each version and its weight.
        parts: Vec<(VersionSpec, f64)>,
        /// The epoch's length.
        epoch: EpochLength,
        /// The weights changed, each from its position on.
        changes: Vec<(Position, Vec<f64>)>,
    },
}

/// What a session reads and how.
#[derive(Clone)]
pub struct SessionConfig {
    /// The version or mixture.
    pub reads: Reads,
    /// The plan asked for by name; `None`: the default shuffle (a mixture's blend; for an
    /// attached dataset its cache cannot hold, the default partitioner's windowed plan, see
    /// `Session::plan_options`). With packing, the documents' order (`PlanSource::Native`).
    pub plan: Option<PlanSource>,
    /// Packed windows of tokens instead of records.
    pub pack: Option<PackConfig>,
    /// Stop each epoch before its short last step, so every rank reads as many batches.
    pub drop_last: bool,
    /// The CUDA device batches go to (with `Target::Gpu`); `None`: the current one.
    pub device: Option<u32>,
    /// The epoch the first iteration reads, from its start.
    pub epoch: u64,
    /// The loader's settings (its `plan` is the session's to set, its `epochs` unused: a
    /// session's loader runs until it is stopped).
    pub loader: LoaderConfig,
}

/// What is opened from `Reads`, once.
struct Opened {
    dataset: Arc<Dataset>,
    mixture: Option<Mixture>,
    packing: Option<Packing>,
}

/// A running loader, the process whose threads run it, and the windows of its batches.
struct Running {
    loader: Option<Loader>,
    pid: u32,
    packer: Option<Packer>,
}

impl Running {
    fn loader(&mut self) -> Result<&mut Loader> {
        self.loader.as_mut().ok_or_else(|| Error::invalid_input("the loader was taken"))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(loader) = self.loader.take()
            && self.pid != std::process::id()
        {
            // A fork's copy: its threads are the parent's, and joining them here would wait
            // forever. The copy is leaked.
            std::mem::forget(loader);
        }
    }
}

/// One rank's reading (see the module documentation).
pub struct Session {
    paths: StorePaths,
    reads: Reads,
    /// Packed windows asked for, and the documents' order.
    pack: Option<(PackConfig, Order)>,
    opened: Option<Opened>,
    config: LoaderConfig,
    device: Option<u32>,
    drop_last: bool,
    /// The plan is the default shuffle, not asked for by name: decided once, by `plan_options`.
    #[cfg_attr(not(feature = "policy"), allow(dead_code, reason = "a partitioner's window needs the policy feature"))]
    windowable: bool,
    /// After the last batch handed out; an epoch's end is the next epoch's start.
    position: Position,
    /// The epoch the current iteration covers.
    iterating: u64,
    /// Where the current (or next) iteration starts: `batches_in_iteration` counts from here.
    len_from: Position,
    running: Option<Running>,
    /// Counters of loaders already stopped.
    before: LoaderStats,
    /// The rank weights of the last batch handed out (rebalancing): the short last step of an
    /// epoch is split by them.
    weights: Option<Vec<u32>>,
}

/// The next batch of packed windows: the documents read, cut into windows by `pack_into`.
pub struct PackedStep<'s> {
    batch: LoadedBatch,
    packer: &'s mut Packer,
    windows: Range<u64>,
}

impl PackedStep<'_> {
    /// The epoch's windows it holds.
    pub fn windows(&self) -> Range<u64> {
        self.windows.clone()
    }

    /// The bytes its windows' tokens take.
    pub fn tokens_bytes(&self) -> usize {
        self.packer.packing().tokens_bytes(self.windows.end - self.windows.start)
    }

    /// The windows, their tokens written into `tokens` (`tokens_bytes()` long).
    pub fn pack_into(self, tokens: &mut [u8]) -> Result<PackedBatch> {
        self.packer.pack_into(&self.batch, tokens)
    }

    /// The windows, with their tokens.
    pub fn pack(self) -> Result<PackedBatch> {
        self.packer.pack(&self.batch)
    }
}

impl Session {
    /// A session of the store at `root`; `config`'s arguments are checked now (the versions
    /// are opened at the first use).
    pub fn new(root: impl Into<PathBuf>, config: SessionConfig) -> Result<Self> {
        let SessionConfig { reads, plan, pack, drop_last, device, epoch, loader } = config;
        check(&reads, plan.as_ref(), pack.as_ref(), &loader)?;
        let mixture = matches!(reads, Reads::Mixture { .. });
        let pack = pack.map(|pack| {
            let order = match &plan {
                Some(PlanSource::Native(order)) => *order,
                _ => Order::Shuffled,
            };
            (pack, order)
        });
        let windowable = !mixture && pack.is_none() && plan.is_none();
        let mut loader = loader;
        loader.plan = plan.unwrap_or(PlanSource::Native(Order::Shuffled));
        loader.epochs = None;
        let start = Position { epoch, cursor: 0 };
        Ok(Self {
            paths: StorePaths::new(root.into()),
            reads,
            pack,
            opened: None,
            config: loader,
            device,
            drop_last,
            windowable,
            position: start,
            iterating: epoch,
            len_from: start,
            running: None,
            before: LoaderStats::default(),
            weights: None,
        })
    }

    /// Whether it reads a mixture.
    pub fn is_mixture(&self) -> bool {
        matches!(self.reads, Reads::Mixture { .. })
    }

    /// Whether it hands out packed windows (`next_packed`) rather than records.
    pub fn is_packed(&self) -> bool {
        self.pack.is_some()
    }

    /// The dataset read (a mixture's: its sources' records in order), opened at the first call.
    pub fn dataset(&mut self) -> Result<Arc<Dataset>> {
        Ok(Arc::clone(&self.open()?.dataset))
    }

    /// The mixture read, `None` for one dataset.
    pub fn mixture(&mut self) -> Result<Option<&Mixture>> {
        Ok(self.open()?.mixture.as_ref())
    }

    /// The packing, `None` for records.
    pub fn packing(&mut self) -> Result<Option<&Packing>> {
        Ok(self.open()?.packing.as_ref())
    }

    fn open(&mut self) -> Result<&Opened> {
        if self.opened.is_none() {
            let opened = self.opened_now()?;
            self.opened = Some(opened);
        }
        self.opened.as_ref().ok_or_else(|| Error::invalid_input("not opened"))
    }

    /// Opens what it reads; a mixture's parts are pinned to their manifest ids (a name committed
    /// to meanwhile does not change what a restart reads), and the plan becomes the mixture's or
    /// the packing's.
    fn opened_now(&mut self) -> Result<Opened> {
        let (dataset, mixture) = match &mut self.reads {
            Reads::One(spec) => (Dataset::open(&self.paths, spec)?, None),
            Reads::Mixture { parts, epoch, changes } => {
                let mut mixture = Mixture::open(&self.paths, parts, *epoch)?;
                for (at, weights) in changes.iter() {
                    mixture = mixture.with_change(*at, weights)?;
                }
                for ((spec, _), source) in parts.iter_mut().zip(mixture.sources()) {
                    *spec = VersionSpec::Manifest(source.manifest);
                }
                self.config.plan = PlanSource::Mixture(Arc::clone(mixture.blend()));
                (Arc::clone(mixture.dataset()), Some(mixture))
            }
        };
        let packing = match (self.pack.clone(), &mixture) {
            (None, _) => None,
            // A mixture's sources are packed each on its own and blended by window.
            (Some((pack, _)), Some(mixture)) => Some(Packing::Mixture(Arc::new(pack_mixture(mixture, pack)?))),
            (Some((pack, order)), None) => Some(Packing::One(Arc::new(pack_plan(&dataset, pack)?), order)),
        };
        if let Some(packing) = &packing {
            self.config = Packer::loader_config(packing, self.config.clone())?;
        }
        // Refused when opened (a Python loader's construction), not at the first batch.
        super::check_plan_memory(self.config.plan.epoch_len(&dataset), self.config.world, self.config.batch_size)?;
        debug_assert!(self.pack.is_some() == packing.is_some(), "packing opened as asked");
        Ok(Opened { dataset, mixture, packing })
    }

    /// Where it is: after the last batch handed out (an epoch's end is the next one's start).
    pub fn position(&self) -> Position {
        self.position
    }

    /// Starts an iteration over the rest of the current epoch (the next one if the current
    /// one was read to its end); returns the epoch.
    pub fn begin_epoch(&mut self) -> u64 {
        self.iterating = self.position.epoch;
        self.len_from = self.position;
        self.iterating
    }

    /// Makes `epoch` the one the next iteration reads (as `DistributedSampler.set_epoch`): from
    /// its start, unless the session is already inside it (resumed there), when it goes on.
    pub fn set_epoch(&mut self, epoch: u64) {
        if self.position.epoch != epoch {
            self.move_to(Position { epoch, cursor: 0 });
        }
        self.iterating = epoch;
        self.len_from = self.position;
    }

    /// Moves to `position` (a saved one): the next batch is the one after it. A cursor past
    /// the epoch's end is refused.
    pub fn seek(&mut self, position: Position) -> Result<()> {
        let cut = self.cut()?;
        let position = cut.normalized(cut.check(position).map_err(Error::invalid_input)?);
        self.move_to(position);
        self.iterating = position.epoch;
        self.len_from = position;
        Ok(())
    }

    fn move_to(&mut self, position: Position) {
        if self.position != position || self.running.is_none() {
            self.stop();
        }
        self.position = position;
    }

    /// How this rank's epochs are cut.
    fn cut(&mut self) -> Result<RankCut> {
        let dataset = self.dataset()?;
        Ok(RankCut {
            n_records: self.config.plan.epoch_len(&dataset),
            world: self.config.world,
            batch_size: self.config.batch_size,
            drop_last: self.drop_last,
            weights: self.weights.clone(),
        })
    }

    /// Batches the current iteration yields from its start (the next iteration's, between
    /// two): a whole epoch, or after a resume mid-epoch what is left of it.
    pub fn batches_in_iteration(&mut self) -> Result<u64> {
        let cut = self.cut()?;
        Ok(cut.batches_from(cut.normalized(self.len_from).cursor))
    }

    /// Batches this rank reads per epoch.
    pub fn batches_per_epoch(&mut self) -> Result<u64> {
        Ok(self.cut()?.batches_per_epoch())
    }

    /// The next batch of records of the epoch being iterated, `None` at its end.
    pub fn next_records(&mut self) -> Result<Option<LoadedBatch>> {
        if self.is_packed() {
            return Err(Error::invalid_input("a session of packed windows hands them out through next_packed"));
        }
        self.next_loaded()
    }

    /// The next batch of packed windows of the epoch being iterated, `None` at its end.
    pub fn next_packed(&mut self) -> Result<Option<PackedStep<'_>>> {
        if !self.is_packed() {
            return Err(Error::invalid_input("this session does not pack: give it a PackConfig"));
        }
        let Some(batch) = self.next_loaded()? else { return Ok(None) };
        let packer = self
            .running
            .as_mut()
            .and_then(|running| running.packer.as_mut())
            .ok_or_else(|| Error::invalid_input("the packer starts with the loader"))?;
        let windows = packer.step(&batch);
        Ok(Some(PackedStep { batch, packer, windows }))
    }

    /// The loader's next batch of the epoch being iterated (`drop_last`'s short step skipped),
    /// the position moved past it.
    fn next_loaded(&mut self) -> Result<Option<LoadedBatch>> {
        if self.position.epoch > self.iterating {
            self.len_from = self.position;
            return Ok(None);
        }
        #[cfg_attr(not(feature = "policy"), allow(unused_mut, reason = "rebalancing's weights change it"))]
        let mut cut = self.cut()?;
        if cut.batches_per_epoch() == 0 {
            // Nothing for this rank in any epoch (fewer records than ranks, or with
            // `drop_last` fewer than one step): each epoch ends at once.
            self.position = Position { epoch: self.iterating + 1, cursor: 0 };
            return Ok(None);
        }
        self.start()?;
        loop {
            let Some(running) = self.running.as_mut() else { return Err(Error::invalid_input("no loader runs")) };
            let loader = running.loader()?;
            let batch = match loader.next() {
                // The loader ran out: the dataset is empty (it runs epochs without end).
                None => return Ok(None),
                Some(Err(e)) => {
                    if loader.is_finished() {
                        self.stop();
                    }
                    return Err(e);
                }
                Some(Ok(batch)) => batch,
            };
            let after = batch.position();
            if epoch_of(after) < self.position.epoch || cut.dropped(after) {
                // The short last step of an epoch (`drop_last`).
                continue;
            }
            #[cfg(feature = "policy")]
            if let Some(weights) = batch.weights()
                && self.weights.as_deref() != Some(weights.weights.as_slice())
            {
                // The weights change at rebalance points only: copied then, not per batch.
                self.weights = Some(weights.weights.clone());
                cut.weights.clone_from(&self.weights);
            }
            let position = cut.normalized(after);
            debug_assert!(
                (position.epoch, position.cursor) > (self.position.epoch, self.position.cursor),
                "a batch moves the position on: {position:?} after {:?}",
                self.position
            );
            self.position = position;
            return Ok(Some(batch));
        }
    }

    /// Starts the loader at the position, unless one runs.
    fn start(&mut self) -> Result<()> {
        if self.running.is_some() {
            return Ok(());
        }
        if let Some(ordinal) = self.device {
            crate::staging::cuda::Cuda::select(ordinal)?;
        }
        let dataset = self.dataset()?;
        // The tier is opened once, by the first start, and kept across restarts (a close, a
        // seek), so they find it full: only the last user's close empties it.
        if !matches!(self.config.tier, TierSetting::Shared(_) | TierSetting::Off) {
            self.config.tier = match self.config.tier.open()? {
                Some(tier) => TierSetting::Shared(tier),
                None => TierSetting::Off,
            };
        }
        let packer = self.opened.as_ref().and_then(|o| o.packing.clone());
        let packer = packer.map(|packing| Packer::new(packing, &self.config, self.position));
        let loader = Loader::new(dataset, self.config.clone(), self.position)?;
        self.running = Some(Running { loader: Some(loader), pid: std::process::id(), packer });
        Ok(())
    }

    /// Stops the loader, keeping its counters and, when it rebalances, its weights (the next
    /// loader resumes with them).
    pub fn stop(&mut self) {
        if let Some(running) = self.running.take() {
            let loader = running.loader.as_ref();
            self.before += &loader.map(Loader::stats).unwrap_or_default();
            #[cfg(feature = "policy")]
            if let (Some(rebalance), Some(resumed)) =
                (&mut self.config.rebalance, loader.and_then(Loader::rebalance_state))
            {
                rebalance.resume = Some(resumed);
            }
        }
    }

    /// The process whose threads run its loader, `None` while none runs.
    pub fn started_in(&self) -> Option<u32> {
        self.running.as_ref().map(|running| running.pid)
    }

    /// The running loader, `None` while none runs.
    pub fn loader(&self) -> Option<&Loader> {
        self.running.as_ref().and_then(|running| running.loader.as_ref())
    }

    /// The CUDA device asked for, `None` for the host or the current device.
    pub fn device(&self) -> Option<u32> {
        self.device
    }

    /// Loads to host memory instead of the device asked for (records a GPU cannot take), before
    /// the first batch.
    pub fn load_to_host(&mut self) -> Result<()> {
        if self.running.is_some() {
            return Err(Error::invalid_input("the loader runs already: load_to_host before the first batch"));
        }
        self.config.target = Target::Host;
        self.device = None;
        Ok(())
    }

    /// Reads up to `batches` batches of the epoch being iterated, dropping each at once: the
    /// loader's own rate. Returns the batches, records, bytes and the seconds they took (from
    /// a started loader).
    pub fn drain(&mut self, batches: u64) -> Result<(u64, u64, u64, f64)> {
        if self.cut()?.batches_per_epoch() > 0 {
            self.start()?;
        }
        let clock = Instant::now();
        let (mut n, mut records, mut bytes) = (0, 0, 0);
        while n < batches {
            let Some(batch) = self.next_loaded()? else { break };
            n += 1;
            records += batch.len() as u64;
            bytes += batch.data().len() as u64;
        }
        Ok((n, records, bytes, clock.elapsed().as_secs_f64()))
    }

    /// The counters of every loader it ran.
    pub fn stats(&self) -> LoaderStats {
        let mut stats = self.before;
        if let Some(loader) = self.loader() {
            stats += &loader.stats();
        }
        stats
    }

    /// The running loader's start: when each stage ended, from its construction.
    pub fn start_stages(&self) -> Vec<(StartStage, Duration)> {
        self.loader().map(Loader::start_stages).unwrap_or_default()
    }

    /// The memory tier's counters, once one is open.
    pub fn tier_stats(&self) -> Option<TierStats> {
        match &self.config.tier {
            TierSetting::Shared(tier) => Some(tier.stats()),
            _ => None,
        }
    }

    /// The partitioner options it reads with: the ones given and the window an attached
    /// dataset's cache asks for (fixed from now on, so a state saved now names the order it
    /// follows); `None` for a native order, a mixture or packing. Without a plan asked for, an
    /// attached dataset the cache cannot hold reads the default partitioner's windowed plan
    /// (decided here, once) instead of the native shuffle.
    #[cfg(feature = "policy")]
    pub fn plan_options(&mut self) -> Result<Option<Vec<(String, String)>>> {
        let dataset = self.dataset()?;
        if std::mem::take(&mut self.windowable) {
            let default = PlanSource::Partitioner { plugin: None, options: Vec::new() };
            let windowed = plan_for_store(&dataset, default)?;
            if matches!(&windowed, PlanSource::Partitioner { options, .. } if !options.is_empty()) {
                self.config.plan = windowed;
            }
        }
        let plan = plan_for_store(&dataset, self.config.plan.clone())?;
        self.config.plan = plan.clone();
        Ok(match plan {
            PlanSource::Partitioner { options, .. } => Some(options),
            PlanSource::Native(_) | PlanSource::Mixture(_) | PlanSource::Packed(..) | PlanSource::PackedMixture(_) => {
                None
            }
        })
    }

    /// The mixture's changes of weights (none for one dataset).
    pub fn changes(&self) -> Option<&[(Position, Vec<f64>)]> {
        match &self.reads {
            Reads::Mixture { changes, .. } => Some(changes),
            Reads::One(_) => None,
        }
    }

    /// Replaces the mixture's changes of weights (as a saved state records them) and applies
    /// them from the next batch. Refused (a change past the epoch, weights of the wrong count)
    /// with the old ones kept.
    pub fn set_changes(&mut self, new: Vec<(Position, Vec<f64>)>) -> Result<()> {
        if !self.is_mixture() {
            return Err(Error::invalid_input("weights change in a mixture; this session reads one dataset"));
        }
        self.stop();
        let Reads::Mixture { changes, .. } = &mut self.reads else { return Ok(()) };
        let old = std::mem::replace(changes, new);
        self.opened = None;
        match self.open() {
            Ok(_) => Ok(()),
            Err(e) => {
                self.restore(old)?;
                Err(e)
            }
        }
    }

    fn restore(&mut self, old: Vec<(Position, Vec<f64>)>) -> Result<()> {
        if let Reads::Mixture { changes, .. } = &mut self.reads {
            *changes = old;
        }
        self.opened = None;
        self.open().map(|_| ())
    }

    /// Puts a saved state's changes of weights in force when they give the mixture `id` it
    /// saved (a digest of the versions, weights, changes and epoch length); otherwise the
    /// state was altered after its save, and it is refused with the session unchanged.
    /// `saved` as the mixture lists them (`Blend::changes`: the weights given first, at the
    /// epoch's start, which are the mixture's own and not a change).
    pub fn resume_changes(&mut self, saved: Vec<(Position, Vec<f64>)>, id: &str) -> Result<()> {
        let old = self.changes().map(<[_]>::to_vec).unwrap_or_default();
        self.set_changes(saved.into_iter().filter(|(at, _)| *at != Position::default()).collect())?;
        let now = self.mixture()?.map(Mixture::id).unwrap_or_default();
        if now != id {
            self.restore(old)?;
            return Err(Error::invalid_input(format!(
                "the state's mixture id {id:?} is not that of its sources, weights and changes ({now}): the state \
                 was altered after it was saved; not resumed"
            )));
        }
        Ok(())
    }

    /// Changes the mixture's weights from the current position on (a curriculum's step); the
    /// change is one of `changes`, so a saved state repeats it.
    pub fn change_weights(&mut self, weights: Vec<f64>) -> Result<()> {
        let at = self.cut()?.normalized(self.position);
        let mut changes = self
            .changes()
            .map(<[_]>::to_vec)
            .ok_or_else(|| Error::invalid_input("weights change in a mixture; this session reads one dataset"))?;
        changes.retain(|(when, _)| (when.epoch, when.cursor) < (at.epoch, at.cursor));
        changes.push((at, weights));
        self.set_changes(changes)?;
        self.position = at;
        Ok(())
    }

    /// The trainer's own time on the last batch, for rebalancing.
    #[cfg(feature = "policy")]
    pub fn report_busy(&mut self, busy: Duration) {
        if let Some(loader) = self.running.as_mut().and_then(|running| running.loader.as_mut()) {
            loader.report_busy(busy);
        }
    }

    /// The rebalancing state to save with the position, `None` without rebalancing.
    #[cfg(feature = "policy")]
    pub fn rebalance_state(&self) -> Option<RebalanceState> {
        self.loader()
            .and_then(Loader::rebalance_state)
            .or_else(|| self.config.rebalance.as_ref().and_then(|r| r.resume.clone()))
    }

    /// Resumes the rebalancing from a saved state (`None`: equal weights); applies from the
    /// next batch. Without rebalancing, nothing.
    #[cfg(feature = "policy")]
    pub fn set_rebalance_state(&mut self, resume: Option<RebalanceState>) {
        if self.config.rebalance.is_none() {
            return;
        }
        self.stop();
        // The split the loader will cut the steps with (its bounds applied), so that the short
        // last step is placed as the loader places it.
        let (world, batch) = (self.config.world.size(), self.config.batch_size);
        let equal = vec![1; world as usize];
        let weights = resume.as_ref().map_or(&equal, |r| &r.weights.weights);
        self.weights = crate::plan::rebalanced_step(weights, world, batch)
            .or_else(|| crate::plan::rebalanced_step(&equal, world, batch));
        if let Some(rebalance) = &mut self.config.rebalance {
            rebalance.resume = resume;
        }
    }
}

impl Session {
    /// Its state, to resume from (on any world size): the position, what decides the order,
    /// and their digest.
    pub fn save(&mut self) -> Result<SavedState> {
        let mut saved = self.state_now()?;
        saved.digest = Some(saved.digest());
        debug_assert!(saved.check_digest().is_ok(), "a state checks against its own digest");
        Ok(saved)
    }

    /// Resumes at `saved`'s position, the mixture's changes of weights and the rebalancing it
    /// carries put back in force: the next batches are exactly the samples not yet read, split
    /// over this session's world. Refused whole, the session unchanged, when the state was
    /// altered after its save, was saved under another seed, order, version or mixture, or
    /// names a cursor past the epoch.
    pub fn resume(&mut self, saved: &SavedState) -> Result<()> {
        saved.check_digest()?;
        saved.check_same_order(&self.state_now()?)?;
        self.cut()?.check(saved.position).map_err(Error::invalid_input)?;
        if let Some(mixture) = &saved.mixture {
            self.resume_changes(mixture.changes.clone(), &mixture.id)?;
        }
        // The weights first: the position's place in the epoch's short last step depends on them.
        #[cfg(feature = "policy")]
        self.set_rebalance_state(saved.rebalance.clone());
        self.seek(saved.position)?;
        // Normalized: the saved position, or the next epoch's start when this rank reads no more of its epoch.
        debug_assert!(
            (self.position.epoch, self.position.cursor) >= (saved.position.epoch, saved.position.cursor),
            "resumed at {:?}, saved at {:?}",
            self.position,
            saved.position
        );
        Ok(())
    }

    /// What it would save now, without the digest.
    fn state_now(&mut self) -> Result<SavedState> {
        // The default plan of an attached dataset (a window the cache chose) is decided first.
        #[cfg(feature = "policy")]
        self.plan_options()?;
        let manifest = self.dataset()?.manifest_id().to_string();
        let mixture = self.mixture()?.map(|mixture| SavedMixture {
            id: mixture.id(),
            sources: mixture.sources().iter().map(|source| (source.manifest.to_string(), source.weight)).collect(),
            epoch_samples: mixture.blend().epoch_samples(),
            changes: mixture.blend().changes(),
        });
        Ok(SavedState {
            position: self.position,
            seed: self.config.seed,
            order: self.order_pairs(),
            manifest,
            mixture,
            #[cfg(feature = "policy")]
            rebalance: self.rebalance_state(),
            digest: None,
        })
    }

    /// What decides the order besides the seed (`OrderPairs`).
    pub fn order_pairs(&self) -> OrderPairs {
        let pair = |key: &str, value: String| (key.to_owned(), value);
        let name = |order: Order| match order {
            Order::Sequential => "sequential".to_owned(),
            Order::Shuffled => "shuffled".to_owned(),
        };
        if let Some((pack, order)) = &self.pack {
            return vec![
                pair("pack.seq_len", pack.seq_len.to_string()),
                pair("pack.eod", pack.eod.map_or_else(|| "none".to_owned(), |eod| eod.to_string())),
                pair("pack.pad", pack.pad.to_string()),
                pair("pack.within_documents", (!pack.cross_documents).to_string()),
                pair("pack.order", name(*order)),
            ];
        }
        match &self.config.plan {
            PlanSource::Native(order) => vec![pair("order", name(*order))],
            #[cfg(feature = "policy")]
            PlanSource::Partitioner { plugin, options } => {
                let mut pairs = vec![pair("partitioner", plugin.clone().unwrap_or_else(|| "default".to_owned()))];
                pairs.extend(options.iter().map(|(key, value)| (format!("option:{key}"), value.clone())));
                pairs
            }
            PlanSource::Mixture(_) | PlanSource::PackedMixture(_) => vec![pair("mixture", "weights".to_owned())],
            // Packing is `self.pack`'s (above); its plan is made from it.
            PlanSource::Packed(_, order) => vec![pair("pack.order", name(*order))],
        }
    }
}

/// Refuses what a session cannot read: a mixture with a plan of its own, packing with a
/// partitioner or to a GPU, a `seq_len` of 0, an empty batch or mixture.
fn check(reads: &Reads, plan: Option<&PlanSource>, pack: Option<&PackConfig>, loader: &LoaderConfig) -> Result<()> {
    if loader.batch_size == 0 {
        return Err(Error::invalid_input("batch_size must be at least 1"));
    }
    if let Reads::Mixture { parts, .. } = reads {
        if parts.is_empty() {
            return Err(Error::invalid_input("a mixture needs at least one (name, weight) pair"));
        }
        if plan.is_some() {
            return Err(Error::invalid_input(
                "a mixture is ordered by its weights (each source shuffled): drop order and partitioner",
            ));
        }
    }
    if let Some(pack) = pack {
        #[cfg(feature = "policy")]
        if matches!(plan, Some(PlanSource::Partitioner { .. })) {
            return Err(Error::invalid_input(
                "packed windows are cut by their own plan: drop partitioner and partitioner_options",
            ));
        }
        if pack.seq_len == 0 {
            return Err(Error::invalid_input("seq_len must be at least 1"));
        }
        if loader.target == Target::Gpu {
            return Err(Error::invalid_input(
                "packed windows are built in host memory: load them with the host target",
            ));
        }
    }
    #[cfg(feature = "policy")]
    if let Some(rebalance) = &loader.rebalance {
        // Refused here rather than at the first batch.
        rebalance.check(loader.world.size())?;
    }
    Ok(())
}

/// The epoch of a batch, from the position after it (the last batch of epoch `e` reports the
/// start of `e + 1`; no other batch ends at a cursor of 0).
fn epoch_of(after: Position) -> u64 {
    if after.cursor == 0 { after.epoch.saturating_sub(1) } else { after.epoch }
}
