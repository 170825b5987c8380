//! Packed windows of `seq_len + 1` tokens, with their documents' boundaries, cut from the
//! documents a `Loader` reads (a `Session` of packed windows drives it).
//!
//! The loader reads, for each batch of windows, the documents those windows cut (the
//! `PlanSource::Packed` plan: the tier, the prefetch and the origin cache follow it as any
//! plan); this stage cuts the windows out of them (`pack::pack_windows`). Windows are the
//! epoch's positions, so a `Position` resumes on any world size as for records.
//!
//! Owns `Packer` (the windows of each batch a loader of documents hands out),
//! `Packing`, `PackedBatch`, `pack_plan` and `pack_mixture` (a mixture's sources packed each on
//! its own, blended by window) (a dataset's document lengths, from its
//! shards' metadata). Never: reads a document itself (the loader reads and verifies them) or
//! hands out a window from a batch that failed.

use std::ops::Range;
use std::sync::Arc;

use crate::blend::BlendDraws;
use crate::error::{Error, Result};
use crate::pack::{PackConfig, PackEpoch, PackPlan, Packed, PackedBlend, PlacedPasses};
use crate::plan::{EpochPlan, Order, Position, World};
use crate::read::{Dataset, Mixture};
use crate::shard::Layout;

use super::{LoadedBatch, LoaderConfig, PlanSource, Target};

/// The packing of `dataset`'s documents under `config`: each document's tokens from its shard's
/// metadata (every shard's metadata is read, and checked, now: an attached dataset's shards
/// the cache does not hold have theirs read from the origin, without their data). Documents are records of token
/// arrays (`Layout::Arrays`), one-dimensional fixed records, or byte strings (one-byte tokens).
pub fn pack_plan(dataset: &Dataset, config: PackConfig) -> Result<PackPlan> {
    let integer = |dtype: crate::shard::Dtype| !matches!(dtype.name().as_bytes().first(), Some(b'f' | b'b'));
    let dtype = match dataset.layout() {
        Layout::Arrays(dtype) if integer(*dtype) => *dtype,
        Layout::Fixed(fixed) if fixed.dims().len() == 1 && integer(fixed.dtype()) => fixed.dtype(),
        Layout::Bytes => crate::shard::Dtype::U8,
        other => {
            return Err(Error::invalid_input(format!(
                "packing cuts documents of integer tokens (arrays, one-dimensional fixed records or bytes), not {other} records"
            )));
        }
    };
    let token_bytes = dtype.size_bytes() as usize;
    // A token of a signed dtype holds half the range of its bytes: an `eod` of 2**31 on int32
    // tokens would arrive as -2**31 (`PackPlan::new` checks the bytes alone).
    if dtype.name().starts_with('i') {
        let max = (1u64 << (8 * token_bytes - 1)) - 1;
        for (what, token) in [("eod", config.eod), ("pad", Some(config.pad))] {
            if let Some(token) = token.filter(|&token| token > max) {
                return Err(Error::invalid_input(format!(
                    "the {what} token {token} does not fit the dataset's {} tokens (at most {max})",
                    dtype.name()
                )));
            }
        }
    }
    // Each shard's metadata: from its file, or, for a shard of an attached dataset the cache
    // does not hold, from its origin (a few KiB each, checked as at attach), not its data.
    let mut metas: Vec<Option<Arc<crate::shard::ShardMeta>>> = Vec::with_capacity(dataset.n_shards());
    let mut missing = Vec::new();
    for shard in 0..dataset.n_shards() {
        match dataset.shard_meta(shard) {
            Ok(meta) => metas.push(Some(Arc::clone(meta))),
            Err(Error::MissingShard { .. }) if cfg!(feature = "origin") => {
                metas.push(None);
                missing.push((shard, dataset.manifest().entries()[shard]));
            }
            Err(e) => return Err(e),
        }
    }
    #[cfg(feature = "origin")]
    for (shard, meta) in crate::origin::shard_metas_at_origins(dataset.paths(), &missing, dataset.layout())? {
        metas[shard] = Some(Arc::new(meta));
    }
    let mut lengths = Vec::with_capacity(usize::try_from(dataset.n_records()).unwrap_or(0));
    for (shard, meta) in metas.iter().enumerate() {
        let meta = meta
            .as_ref()
            .ok_or_else(|| Error::MissingShard { shard: dataset.shard_id(shard), manifest: dataset.manifest_id() })?;
        for local in 0..meta.n_records() {
            let range = meta.record_range(local);
            lengths.push((range.end - range.start) / token_bytes as u64);
        }
    }
    let documents = lengths.len();
    let tokens: u64 = lengths.iter().sum();
    let plan = PackPlan::new(config, lengths.into(), token_bytes).map_err(Error::invalid_input)?;
    if plan.n_windows() == 0 {
        // Empty epochs without a word would look like a loader that ends at once.
        return Err(Error::invalid_input(format!(
            "a seq_len of {} makes no window of this corpus ({documents} documents, {tokens} tokens{}): choose a \
             shorter seq_len",
            plan.config().seq_len,
            if plan.config().cross_documents { "" } else { ", packed within documents" }
        )));
    }
    Ok(plan)
}

/// One batch of packed windows (host memory).
#[derive(Debug)]
pub struct PackedBatch {
    /// The windows, their segments and position ids.
    pub packed: Packed,
    /// Which windows of the epoch (global positions).
    pub windows: Range<u64>,
    /// The epoch.
    pub epoch: u64,
    /// After this batch: resume from here.
    pub position: Position,
}

/// What a packer cuts: one dataset's windows, or a mixture of packed sources.
#[derive(Clone, Debug)]
pub enum Packing {
    /// One dataset's documents in `Order`.
    One(Arc<PackPlan>, Order),
    /// A mixture's sources, each packed (`pack_mixture`).
    Mixture(Arc<PackedBlend>),
}

impl Packing {
    /// Windows' tokens bytes.
    pub fn tokens_bytes(&self, windows: u64) -> usize {
        match self {
            Packing::One(pack, _) => pack.tokens_bytes(windows),
            Packing::Mixture(packed) => packed.packs.first().map_or(0, |pack| pack.tokens_bytes(windows)),
        }
    }

    /// The packing's config (a mixture's sources share it).
    pub fn config(&self) -> Option<&PackConfig> {
        match self {
            Packing::One(pack, _) => Some(pack.config()),
            Packing::Mixture(packed) => packed.packs.first().map(|pack| pack.config()),
        }
    }

    /// Windows in an epoch.
    pub fn n_windows(&self) -> u64 {
        match self {
            Packing::One(pack, _) => pack.n_windows(),
            Packing::Mixture(packed) => packed.blend.epoch_samples(),
        }
    }
}

/// The packing of `mixture`'s sources under `config`, each packed on its own and blended by
/// window with the mixture's weights, changes and epoch length (counted in windows).
pub fn pack_mixture(mixture: &Mixture, config: PackConfig) -> Result<PackedBlend> {
    let all = pack_plan(mixture.dataset(), config.clone())?;
    let mut packs = Vec::new();
    let mut doc_starts = Vec::new();
    for source in mixture.blend().sources() {
        let lengths: Vec<u64> = (source.start..source.start + source.n_records).map(|d| all.length(d)).collect();
        packs.push(Arc::new(
            PackPlan::new(config.clone(), lengths.into(), all.token_bytes()).map_err(Error::invalid_input)?,
        ));
        doc_starts.push(source.start);
    }
    let windows: Vec<u64> = packs.iter().map(|pack| pack.n_windows()).collect();
    if let Some(i) = windows.iter().position(|&w| w == 0) {
        return Err(Error::invalid_input(format!(
            "source {} has no window of {} tokens to pack",
            mixture.sources()[i].label,
            config.seq_len + 1
        )));
    }
    let blend = Arc::new(mixture.reblend(&windows)?);
    Ok(PackedBlend { blend, packs, doc_starts })
}

/// The windows of one rank's batches, cut from the documents its loader reads: which windows
/// each batch holds (its step, from the positions the batches report) and their tokens. Made
/// anew whenever the loader is (a seek, a restart), from the same start.
pub struct Packer {
    packing: Packing,
    seed: u64,
    world: World,
    batch_size: u64,
    /// The epoch whose documents are placed, and where each begins (one dataset).
    epoch: Option<(u64, PackEpoch)>,
    /// A mixture's draws of the current epoch, and the sources' placed passes.
    draws: Option<(u64, BlendDraws)>,
    passes: PlacedPasses,
    /// Where this rank's next step starts.
    next_step: Position,
}

impl Packer {
    /// The packer of a loader of `config` (its seed, world and batch size) started at `start`.
    pub fn new(packing: Packing, config: &LoaderConfig, start: Position) -> Self {
        let n = packing.n_windows();
        let next_step = if n > 0 && start.cursor >= n { Position { epoch: start.epoch + 1, cursor: 0 } } else { start };
        Self {
            packing,
            seed: config.seed,
            world: config.world,
            batch_size: config.batch_size,
            epoch: None,
            draws: None,
            passes: PlacedPasses::default(),
            next_step,
        }
    }

    /// `config` made to read the documents of packed windows: the packing's plan, batches as
    /// large as a batch of windows' documents can be, host memory.
    pub fn loader_config(packing: &Packing, mut config: LoaderConfig) -> Result<LoaderConfig> {
        if config.target == Target::Gpu {
            return Err(Error::invalid_input(
                "packed windows are built in host memory: load them with the host target",
            ));
        }
        config.target = Target::Host;
        let windows = config.batch_positions_max();
        let span = match packing {
            Packing::One(pack, order) => {
                config.plan = PlanSource::Packed(Arc::clone(pack), *order);
                pack.span_bytes_max(windows)
            }
            Packing::Mixture(packed) => {
                config.plan = PlanSource::PackedMixture(Arc::clone(packed));
                packed.span_bytes_max(windows)
            }
        };
        // A batch reads its windows' documents: their tokens and, at the edges, whole documents.
        config.batch_bytes_max =
            Some(usize::try_from(span).map_err(|_| Error::invalid_input("a batch larger than memory"))?);
        Ok(config)
    }

    /// What it cuts.
    pub fn packing(&self) -> &Packing {
        &self.packing
    }

    /// The windows of `batch`, the loader's next batch (batches in order, none skipped).
    pub fn pack(&mut self, batch: &LoadedBatch) -> Result<PackedBatch> {
        let windows = self.step(batch);
        let mut tokens = vec![0u8; self.packing.tokens_bytes(windows.end - windows.start)];
        let mut packed = self.pack_into(batch, &mut tokens)?;
        packed.packed.tokens = tokens;
        Ok(packed)
    }

    /// The windows `batch` holds, once it is the next one: its tokens take
    /// `packing().tokens_bytes(len)`. Call `pack_into` with the same batch next.
    pub fn step(&self, batch: &LoadedBatch) -> Range<u64> {
        let after = batch.position();
        let epoch = if after.cursor == 0 { after.epoch.saturating_sub(1) } else { after.epoch };
        // A rank with no share of an epoch's short last step gets no batch of it: a batch of a
        // later epoch than the step expected begins that epoch.
        let step = if epoch == self.next_step.epoch { self.next_step.cursor } else { 0 };
        let steps = EpochPlan::new(self.packing.n_windows(), self.seed, epoch, Order::Sequential);
        // Rebalanced, the step is split by the weights it was cut with, as the plan split it.
        #[cfg(feature = "policy")]
        if let Some(weights) = batch.weights() {
            return steps.weighted_rank_positions(step, self.world, self.batch_size, &weights.weights);
        }
        steps.rank_positions(step, self.world, self.batch_size)
    }

    /// The windows of `batch` (the next one), their tokens written into `tokens`; the batch
    /// returned holds no tokens of its own.
    pub fn pack_into(&mut self, batch: &LoadedBatch, tokens: &mut [u8]) -> Result<PackedBatch> {
        let windows = self.step(batch);
        debug_assert!(windows.start <= windows.end && windows.end <= self.packing.n_windows(), "{windows:?}");
        let after = batch.position();
        let epoch = if after.cursor == 0 { after.epoch.saturating_sub(1) } else { after.epoch };
        self.next_step = after;
        let documents: Vec<&[u8]> = (0..batch.len()).map(|i| batch.record(i)).collect();
        let mismatch = |need: &[u64]| {
            Error::invalid_input(format!(
                "the batch before position {after:?} holds documents {:?}, its windows {windows:?} need {need:?}",
                batch.indices()
            ))
        };
        let packed = match &self.packing {
            Packing::One(pack, order) => {
                if self.epoch.as_ref().is_none_or(|(e, _)| *e != epoch) {
                    self.epoch = Some((epoch, pack.epoch(self.seed, epoch, *order)));
                }
                let (_, placed) = self.epoch.as_ref().ok_or_else(|| Error::invalid_input("no epoch placed"))?;
                let span = placed.span(pack, windows.clone());
                if span.records != batch.indices() {
                    return Err(mismatch(&span.records));
                }
                crate::pack::pack_windows_into(pack, placed, &span, &documents, tokens).map_err(Error::invalid_input)?
            }
            Packing::Mixture(mixed) => {
                let behind = self.draws.as_ref().is_none_or(|(e, d)| *e != epoch || d.at() > windows.start);
                if behind {
                    let draws =
                        mixed.blend.epoch(self.seed, epoch).map_err(Error::invalid_input)?.draws_from(windows.start);
                    self.draws = Some((epoch, draws));
                }
                let (_, draws) = self.draws.as_mut().ok_or_else(|| Error::invalid_input("no draws"))?;
                while draws.at() < windows.start {
                    draws.next();
                }
                let width = self.packing.tokens_bytes(1);
                let mut out = Packed { windows: 0, cu_seqlens: vec![0], ..Packed::default() };
                let mut at = 0usize;
                for (i, _) in windows.clone().enumerate() {
                    let drawn = draws.next().ok_or_else(|| Error::invalid_input("the epoch's draws ended early"))?;
                    let (span, placed) = mixed.window(&mut self.passes, self.seed, drawn);
                    let start = mixed.doc_starts[drawn.source];
                    let k = span.records.len();
                    let given = batch.indices().get(at..at + k).unwrap_or_default();
                    if given.iter().zip(&span.records).any(|(g, r)| *g != r + start) || given.len() != k {
                        return Err(mismatch(&span.records.iter().map(|r| r + start).collect::<Vec<_>>()));
                    }
                    let one = crate::pack::pack_windows_into(
                        &mixed.packs[drawn.source],
                        placed,
                        &span,
                        &documents[at..at + k],
                        &mut tokens[i * width..(i + 1) * width],
                    )
                    .map_err(Error::invalid_input)?;
                    let base = out.cu_seqlens.last().copied().unwrap_or(0);
                    out.cu_seqlens.extend(one.cu_seqlens.iter().skip(1).map(|c| c + base));
                    out.position_ids.extend(one.position_ids);
                    out.real_tokens.extend(one.real_tokens);
                    out.windows += 1;
                    at += k;
                }
                if at != batch.len() {
                    return Err(mismatch(&[]));
                }
                debug_assert_eq!(out.windows as u64, windows.end - windows.start, "one window a draw");
                out
            }
        };
        // cu_seqlens: from 0, never down, ending at the tokens placed.
        debug_assert!(
            packed.cu_seqlens.first() == Some(&0) && packed.cu_seqlens.windows(2).all(|w| w[0] <= w[1]),
            "cu_seqlens {:?}",
            packed.cu_seqlens
        );
        Ok(PackedBatch { packed, windows, epoch, position: after })
    }
}
