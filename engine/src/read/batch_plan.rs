//! Batch planning: which blocks to read for a list of records, and where each
//! verified byte goes.
//!
//! An extent whose blocks are exactly a run of the batch's bytes (whole, block-aligned records
//! back to back: fixed records of 4 KiB multiples in a sequential or block-shuffled plan), 64 KiB
//! or longer, is read straight into the batch's memory and checked there; the others are
//! read into a buffer, checked, and their records' bytes copied out: long ones (64 KiB or more,
//! when the reader has verify workers) into the batch slot's own scratch memory, which a worker
//! checks and gathers from, the rest into the backend's buffers, on the reaping thread. While a
//! batch's ops are in flight its memory is written and read only through raw pointers to the
//! disjoint ranges each op owns (`BatchMemory`): the kernel, verify workers and copies work on
//! it at once.
//!
//! Everything here reuses its vectors from batch to batch: after warm-up, planning a batch
//! allocates nothing.
//!
//! Owns: `Planner` (each batch's extents, pieces, direct and scratch ranges, ops and checks, and the
//! copies from the memory tier). Never: submits a read or opens a file: `pipeline.rs` opens the
//! shards and hands the planner's ops to the backend.

use super::Dataset;
use super::batch::{Batch, BatchMemory, to_usize};
use crate::error::{Error, Result};
use crate::io::{FileId, ReadOp, copy_crc32c};
use crate::shard::{BLOCK_BYTES, BLOCK_BYTES_U64, DATA_OFFSET};
use crate::staging::StagingPool;
use crate::tier::TierReader;
use std::ops::Range;

/// One record of the batch: its shard and byte range there, and its offset in the batch.
#[derive(Clone, Copy, Debug)]
struct Request {
    shard: u32,
    start: u64,
    end: u64,
    dst: u64,
}

/// A run of consecutive blocks of one shard, read by one op.
#[derive(Clone, Copy, Debug)]
struct Extent {
    shard: u32,
    first_block: u64,
    n_blocks: u32,
}

impl Extent {
    fn bytes(&self) -> Range<u64> {
        self.first_block * BLOCK_BYTES_U64..(self.first_block + u64::from(self.n_blocks)) * BLOCK_BYTES_U64
    }
}

/// A copy from an extent's bytes into the batch.
#[derive(Clone, Copy, Debug)]
pub(super) struct Piece {
    extent: u32,
    src: u32,
    dst: u64,
    len: u32,
}

/// Extents shorter than this are read into the backend's (registered) buffers and copied even
/// when they could go straight into the batch: an op into unregistered memory pins its pages on
/// every read, which costs more than copying a few KiB (random 4 KiB records read in place made
/// the random row 0.80 of the bare reader at twice its cores, against 0.9 with the copy).
const DIRECT_BYTES_MIN: u64 = 64 << 10;

/// Planning scratch, reused across batches.
#[derive(Default)]
pub(super) struct Planner {
    requests: Vec<Request>,
    order: Vec<u32>,
    extents: Vec<Extent>,
    unsorted_pieces: Vec<Piece>,
    /// Pieces grouped by extent: extent `e`'s are `pieces[piece_starts[e]..piece_starts[e + 1]]`.
    pieces: Vec<Piece>,
    piece_starts: Vec<u32>,
    next_piece: Vec<u32>,
    shards: Vec<usize>,
    /// Whether request `r` was copied from the memory tier while planning (nothing to read).
    from_tier: Vec<bool>,
    /// Per extent: where in the batch it is read straight into, when its blocks are exactly a run
    /// of the batch's bytes (its pieces back to back from its first byte, block-aligned).
    direct: Vec<Option<u64>>,
    /// Per extent: where in the slot's scratch memory it is read, for a worker to check and
    /// gather (`plan_scratch`); `None` for extents read straight into the batch or into the
    /// backend's buffers.
    scratch: Vec<Option<u64>>,
    /// Per request copied from the tier: the first block whose check failed there.
    tier_bad: Vec<Option<u64>>,
    /// The distinct shards of the batch's records.
    batch_shards: Vec<u32>,
    /// Records and bytes of the plan served by the memory tier.
    pub(super) tier_records: u64,
    pub(super) tier_bytes: u64,
    /// Records whose blocks in the tier failed their check (read from disk instead).
    pub(super) tier_failures: u64,
    /// Blocks the copies from the tier checked.
    pub(super) tier_blocks_checked: u64,
    /// Whether `plan` counts the batch's reads per shard (`Dataset::shard_reads`).
    pub(super) count_reads: bool,
}

impl Planner {
    /// Shards the planned batch draws its records from.
    pub(super) fn n_batch_shards(&self) -> u64 {
        self.batch_shards.len() as u64
    }

    /// The shards the planned batch draws its records from, read from their files or copied
    /// from the tier (`shards_touched`: those its ops read).
    pub(super) fn batch_shards(&self) -> impl Iterator<Item = usize> + '_ {
        self.batch_shards.iter().map(|&s| s as usize)
    }

    /// Plans reading `indices`; sizes `batch` for them (indices and ends final, data to be filled).
    pub(super) fn plan(
        &mut self,
        dataset: &Dataset,
        indices: &[u64],
        op_blocks_max: usize,
        batch: &mut Batch,
        staging: Option<&StagingPool>,
        tier: Option<&mut TierReader>,
    ) -> Result<()> {
        debug_assert!(op_blocks_max > 0, "checked by the reader");
        // The bytes are kept: every byte of the new batch is overwritten before it is returned,
        // and zeroing hundreds of megabytes per batch would cost as much as reading them.
        batch.indices.clear();
        batch.ends.clear();
        self.requests.clear();
        let mut dst = 0u64;
        // Reads per shard, counted once per run of records from one shard.
        let mut run: Option<(usize, u64)> = None;
        for &index in indices {
            let (shard, local) = dataset.locate(index)?;
            run = match run {
                Some((same, n)) if same == shard => Some((same, n + 1)),
                Some((other, n)) => {
                    if self.count_reads {
                        dataset.count_reads(other, n);
                    }
                    Some((shard, 1))
                }
                None => Some((shard, 1)),
            };
            let range = dataset.shard_meta(shard)?.record_range(local);
            let shard = u32::try_from(shard).map_err(|_| Error::invalid_input("more than 2^32 shards"))?;
            self.requests.push(Request { shard, start: range.start, end: range.end, dst });
            dst += range.end - range.start;
            batch.ends.push(dst);
        }
        if let Some((shard, n)) = run
            && self.count_reads
        {
            dataset.count_reads(shard, n);
        }
        // How many shards the batch draws from (a plan's mixing, `ReadStats::batch_shards`).
        self.batch_shards.clear();
        self.batch_shards.extend(self.requests.iter().map(|r| r.shard));
        self.batch_shards.sort_unstable();
        self.batch_shards.dedup();
        batch.indices.extend_from_slice(indices);
        let total = usize::try_from(dst).map_err(|_| Error::invalid_input("a batch larger than memory"))?;
        batch.data.set_len(total, staging)?;
        debug_assert_eq!(batch.ends.len(), batch.indices.len());

        // Records whose extents are in the memory tier are copied now, every block they touch
        // checked as it is copied (the tier's memory can change after its fill checked it: a
        // process of the user writes it, a bit flips); a record whose check fails is read from
        // disk instead, and the extent leaves the tier.
        self.from_tier.clear();
        self.from_tier.resize(self.requests.len(), false);
        (self.tier_records, self.tier_bytes, self.tier_failures, self.tier_blocks_checked) = (0, 0, 0, 0);
        if let Some(tier) = tier {
            tier.revalidate();
            for (r, request) in self.requests.iter().enumerate() {
                if request.end > request.start && tier_holds(tier, dataset, request) {
                    self.from_tier[r] = true;
                    self.tier_records += 1;
                    self.tier_bytes += request.end - request.start;
                }
            }
            if self.tier_records > 0 {
                self.tier_bad.clear();
                self.tier_bad.resize(self.requests.len(), None);
                let copy = TierCopy { tier, dataset, extent_bytes: tier.extent_bytes() };
                copy.run(&self.requests, &self.from_tier, &mut self.tier_bad, batch.data.as_mut_slice(), 0);
                // Blocks checked by the copies (a block two records share, twice).
                self.tier_blocks_checked = self
                    .requests
                    .iter()
                    .zip(&self.from_tier)
                    .filter(|(_, hit)| **hit)
                    .map(|(r, _)| r.end.div_ceil(BLOCK_BYTES_U64) - r.start / BLOCK_BYTES_U64)
                    .sum();
                for (r, bad) in self.tier_bad.iter().enumerate() {
                    let Some(block) = *bad else { continue };
                    let request = self.requests[r];
                    self.from_tier[r] = false;
                    debug_assert!(self.tier_records > 0 && self.tier_bytes >= request.end - request.start);
                    self.tier_records -= 1;
                    self.tier_bytes -= request.end - request.start;
                    self.tier_failures += 1;
                    let extent = u32::try_from(block * BLOCK_BYTES_U64 / tier.extent_bytes())
                        .expect("tier_holds found the extent by a u32 index");
                    tier.discard(request.shard, dataset.shard_id(request.shard as usize), extent);
                }
            }
        }

        self.order.clear();
        let requests = &self.requests;
        let from_tier = &self.from_tier;
        self.order.extend(
            (0..requests.len() as u32)
                .filter(|&r| requests[r as usize].end > requests[r as usize].start && !from_tier[r as usize]),
        );
        self.order.sort_unstable_by_key(|&r| (requests[r as usize].shard, requests[r as usize].start));

        self.plan_extents(op_blocks_max);
        self.plan_pieces();
        self.plan_direct();
        self.scratch.clear();
        self.scratch.resize(self.extents.len(), None);
        self.shards.clear();
        self.shards.extend(self.extents.iter().map(|e| e.shard as usize));
        self.shards.dedup();
        Ok(())
    }

    /// Merges the block ranges of the sorted requests into runs and cuts the runs into extents.
    /// A run is also cut where a block-aligned record follows the previous one in the file but
    /// not in the batch (two chunks of a block-shuffled plan that happen to be neighbours): no
    /// block is read twice for it, and each side can be read straight into the batch.
    fn plan_extents(&mut self, op_blocks_max: usize) {
        self.extents.clear();
        let mut run: Option<(u32, u64, u64)> = None;
        // The previous request's end in its shard and in the batch.
        let mut previous: Option<(u64, u64)> = None;
        for &r in &self.order {
            let request = self.requests[r as usize];
            let (first, end) = (request.start / BLOCK_BYTES_U64, request.end.div_ceil(BLOCK_BYTES_U64));
            let elsewhere_in_batch = request.start.is_multiple_of(BLOCK_BYTES_U64)
                && previous.is_some_and(|(file_end, batch_end)| file_end == request.start && batch_end != request.dst);
            previous = Some((request.end, request.dst + (request.end - request.start)));
            match &mut run {
                Some((shard, _, run_end)) if *shard == request.shard && first <= *run_end && !elsewhere_in_batch => {
                    *run_end = (*run_end).max(end)
                }
                _ => {
                    if let Some(done) = run.replace((request.shard, first, end)) {
                        push_extents(&mut self.extents, done, op_blocks_max);
                    }
                }
            }
        }
        if let Some(done) = run {
            push_extents(&mut self.extents, done, op_blocks_max);
        }
    }

    /// Cuts every request into pieces, one per extent it overlaps, grouped by extent.
    fn plan_pieces(&mut self) {
        self.unsorted_pieces.clear();
        for &r in &self.order {
            let request = self.requests[r as usize];
            let first_block = request.start / BLOCK_BYTES_U64;
            let mut e = self
                .extents
                .partition_point(|x| (x.shard, x.first_block + u64::from(x.n_blocks)) <= (request.shard, first_block));
            while let Some(extent) = self.extents.get(e).filter(|x| x.shard == request.shard) {
                let bytes = extent.bytes();
                if bytes.start >= request.end {
                    break;
                }
                let (start, end) = (bytes.start.max(request.start), bytes.end.min(request.end));
                self.unsorted_pieces.push(Piece {
                    extent: e as u32,
                    src: u32::try_from(start - bytes.start).expect("an extent is at most an op"),
                    dst: request.dst + (start - request.start),
                    len: u32::try_from(end - start).expect("an extent is at most an op"),
                });
                e += 1;
            }
        }
        // Counting sort by extent.
        self.piece_starts.clear();
        self.piece_starts.resize(self.extents.len() + 1, 0);
        for piece in &self.unsorted_pieces {
            self.piece_starts[piece.extent as usize + 1] += 1;
        }
        for e in 0..self.extents.len() {
            self.piece_starts[e + 1] += self.piece_starts[e];
        }
        self.next_piece.clear();
        self.next_piece.extend_from_slice(&self.piece_starts[..self.extents.len()]);
        self.pieces.clear();
        self.pieces.resize(self.unsorted_pieces.len(), Piece { extent: 0, src: 0, dst: 0, len: 0 });
        for piece in &self.unsorted_pieces {
            let slot = &mut self.next_piece[piece.extent as usize];
            self.pieces[*slot as usize] = *piece;
            *slot += 1;
        }
    }

    /// Finds the extents read straight into the batch: their pieces follow one another from the
    /// extent's first byte to its last, in the extent and in the batch, from a block-aligned
    /// place in the batch.
    fn plan_direct(&mut self) {
        self.direct.clear();
        for (e, extent) in self.extents.iter().enumerate() {
            let pieces = &self.pieces[self.piece_starts[e] as usize..self.piece_starts[e + 1] as usize];
            let Some(first) = pieces.first() else {
                self.direct.push(None);
                continue;
            };
            let mut at = 0u64;
            let contiguous = pieces.iter().all(|piece| {
                let follows = u64::from(piece.src) == at && piece.dst == first.dst + at;
                at += u64::from(piece.len);
                follows
            });
            let whole = at == u64::from(extent.n_blocks) * BLOCK_BYTES_U64 && at >= DIRECT_BYTES_MIN;
            self.direct.push((contiguous && whole && first.dst.is_multiple_of(BLOCK_BYTES_U64)).then_some(first.dst));
        }
    }

    /// Where extent `e` is read straight into the batch, if it is.
    pub(super) fn direct(&self, e: usize) -> Option<u64> {
        self.direct[e]
    }

    /// Gives every extent that is not read straight into the batch and is at least `min_bytes`
    /// long a place in scratch memory, back to back (block-aligned: extents are whole blocks);
    /// returns the scratch bytes the plan needs. Without a call, no extent has one.
    pub(super) fn plan_scratch(&mut self, min_bytes: usize) -> u64 {
        let mut total = 0;
        for (e, extent) in self.extents.iter().enumerate() {
            let len = u64::from(extent.n_blocks) * BLOCK_BYTES_U64;
            self.scratch[e] = None;
            if self.direct[e].is_none() && len >= min_bytes as u64 {
                self.scratch[e] = Some(total);
                total += len;
            }
        }
        total
    }

    /// Where extent `e` is read in the slot's scratch memory, if it is.
    pub(super) fn scratch(&self, e: usize) -> Option<u64> {
        self.scratch[e]
    }

    /// Extent `e`'s copies into the batch. The slice stays as it is until the plan is made again.
    pub(super) fn pieces(&self, e: usize) -> &[Piece] {
        &self.pieces[self.piece_starts[e] as usize..self.piece_starts[e + 1] as usize]
    }

    /// Extents of the plan read straight into the batch.
    pub(super) fn n_direct(&self) -> usize {
        self.direct.iter().filter(|d| d.is_some()).count()
    }

    /// Bytes extent `e` reads.
    pub(super) fn extent_len(&self, e: usize) -> usize {
        self.extents[e].n_blocks as usize * BLOCK_BYTES
    }

    /// The shard and first block of extent `e`.
    pub(super) fn extent_blocks(&self, e: usize) -> (usize, u64) {
        let extent = self.extents[e];
        (extent.shard as usize, extent.first_block)
    }

    /// The shards the planned extents read, ascending.
    pub(super) fn shards_touched(&self) -> impl Iterator<Item = usize> + '_ {
        self.shards.iter().copied()
    }

    /// Extents (ops) in the plan.
    pub(super) fn n_extents(&self) -> usize {
        self.extents.len()
    }

    /// Bytes the plan reads (whole blocks).
    pub(super) fn read_bytes(&self) -> u64 {
        self.extents.iter().map(|extent| u64::from(extent.n_blocks) * BLOCK_BYTES_U64).sum()
    }

    /// The op of extent `e`; its shard must have a file in `files`.
    pub(super) fn op(&self, e: usize, files: &[Option<FileId>]) -> ReadOp {
        let extent = self.extents[e];
        ReadOp {
            file: files[extent.shard as usize].expect("touched shards are opened when their batch is planned"),
            offset: DATA_OFFSET + extent.first_block * BLOCK_BYTES_U64,
            len: extent.n_blocks * BLOCK_BYTES as u32,
        }
    }

    /// Checks extent `e`'s blocks in `bytes` (a backend's buffer, or the batch's own memory for
    /// an extent read straight into it).
    pub(super) fn check(&self, dataset: &Dataset, e: usize, bytes: &[u8]) -> Result<()> {
        let extent = self.extents[e];
        if bytes.len() != extent.n_blocks as usize * BLOCK_BYTES {
            return Err(Error::invalid_input(format!(
                "the backend returned {} bytes for an op of {}",
                bytes.len(),
                extent.n_blocks as usize * BLOCK_BYTES
            )));
        }
        let shard = extent.shard as usize;
        let meta = dataset.shard_meta(shard)?;
        meta.check_blocks(extent.first_block, bytes)
            .map_err(|(block, expected, actual)| mismatch(dataset, shard, block, expected, actual))
    }

    /// Checks extent `e`'s blocks, then copies its pieces into the batch's bytes.
    ///
    /// # Safety
    ///
    /// `memory` is the memory of the batch this plan is for, and no op in flight or worker
    /// works on the ranges of this extent's pieces (only extents read straight into the batch
    /// are, and their ranges are theirs alone).
    #[allow(unsafe_code, reason = "copies into a batch that others work on")]
    pub(super) unsafe fn deliver(&self, dataset: &Dataset, e: usize, bytes: &[u8], memory: BatchMemory) -> Result<()> {
        self.check(dataset, e, bytes)?;
        // SAFETY: the caller's promise.
        unsafe { gather(self.pieces(e), bytes, memory) }
    }
}

/// Copies each of an extent's pieces from `bytes` (its checked blocks) into the batch.
///
/// # Safety
///
/// `memory` is the memory of the batch the pieces were planned for, and no op in flight, worker
/// or other copy works on the pieces' ranges of it while this runs.
#[allow(unsafe_code, reason = "copies into a batch that others work on")]
pub(super) unsafe fn gather(pieces: &[Piece], bytes: &[u8], memory: BatchMemory) -> Result<()> {
    for piece in pieces {
        let (start, len) = (piece.src as usize, piece.len as usize);
        let src = bytes.get(start..start + len).ok_or_else(|| {
            Error::invalid_input(format!("a piece at {start}..+{len} lies past an op of {} bytes", bytes.len()))
        })?;
        // SAFETY: the caller's promise; the pieces of one request do not overlap in the batch,
        // and each request lies in one range of it.
        unsafe { memory.write(piece.dst, src)? };
    }
    Ok(())
}

/// The error of block `block` of shard `shard` not matching its checksum.
pub(super) fn mismatch(dataset: &Dataset, shard: usize, block: u64, expected: u32, actual: u32) -> Error {
    Error::ChecksumMismatch { shard: dataset.shard_id(shard), block, expected, actual }
}

/// Whether the memory tier holds every extent `request` spans (mapping them as needed; the tier
/// maps only files exactly as long as their extent).
fn tier_holds(tier: &mut TierReader, dataset: &Dataset, request: &Request) -> bool {
    let extent_bytes = tier.extent_bytes();
    let shard = dataset.shard_id(request.shard as usize);
    let Ok(meta) = dataset.shard_meta(request.shard as usize) else { return false };
    let n_data_blocks = meta.n_data_blocks();
    let (first, last) = (request.start / extent_bytes, (request.end - 1) / extent_bytes);
    (first..=last).all(|extent| {
        let Ok(index) = u32::try_from(extent) else { return false };
        // The copy slices up to here: a record past its shard's data region is read from disk,
        // which reports it.
        let needed = request.end.min((extent + 1) * extent_bytes) - extent * extent_bytes;
        tier.extent(request.shard, shard, index, n_data_blocks, || dataset.shard_path(request.shard as usize))
            .is_some_and(|bytes| bytes.len() as u64 >= needed)
    })
}

/// Copies from the tier into a batch, checking every block a record touches as it goes.
struct TierCopy<'a> {
    tier: &'a TierReader,
    dataset: &'a Dataset,
    extent_bytes: u64,
}

impl TierCopy<'_> {
    /// Copies the requests marked in `hits` from the tier into `data`, which holds the batch's
    /// bytes from offset `base` on, and marks in `bad` the first block of each whose check failed
    /// (its bytes in the batch are then not to be used). `tier_holds` found every extent first.
    /// One thread copies: splitting a batch across the cores raised a warm epoch's rate by about
    /// a seventh for a third more CPU, taken from the trainer's own threads (issue 39).
    fn run(&self, requests: &[Request], hits: &[bool], bad: &mut [Option<u64>], data: &mut [u8], base: u64) {
        let extent_bytes = self.extent_bytes;
        for ((request, _), bad) in requests.iter().zip(hits).zip(bad.iter_mut()).filter(|((_, hit), _)| **hit) {
            let Ok(meta) = self.dataset.shard_meta(request.shard as usize) else {
                // tier_holds read the same metadata: not reached; the disk read reports it.
                *bad = Some(request.start / BLOCK_BYTES_U64);
                continue;
            };
            for extent in request.start / extent_bytes..=(request.end - 1) / extent_bytes {
                let bytes = self.tier.mapped(request.shard, extent as u32).expect("checked by tier_holds");
                let at = extent * extent_bytes;
                let (start, end) = (request.start.max(at), request.end.min(at + extent_bytes));
                let dst = to_usize(request.dst + (start - request.start) - base);
                let dst = &mut data[dst..dst + to_usize(end - start)];
                if let Err(block) = copy_checked(meta, bytes, at, start..end, dst) {
                    *bad = Some(block);
                    break;
                }
            }
        }
    }
}

/// Copies data-region bytes `range` from `extent` (the tier's bytes of the data region from
/// offset `at`, whole blocks) into `dst`, and checks every block the range touches: a whole
/// block where it lies in the batch, right after its copy (`copy_crc32c`),
/// a block the range covers in part where the part lies in the batch, with the block's other
/// bytes where they came from. Returns the first bad block.
fn copy_checked(
    meta: &crate::shard::ShardMeta,
    extent: &[u8],
    at: u64,
    range: Range<u64>,
    dst: &mut [u8],
) -> std::result::Result<(), u64> {
    debug_assert_eq!(dst.len() as u64, range.end - range.start);
    let mut pos = range.start;
    while pos < range.end {
        let block = pos / BLOCK_BYTES_U64;
        let block_start = block * BLOCK_BYTES_U64;
        let block_end = block_start + BLOCK_BYTES_U64;
        let into = to_usize(pos - range.start);
        let Some(source) = extent.get(to_usize(block_start - at)..to_usize(block_end - at)) else {
            return Err(block);
        };
        if pos == block_start && range.end >= block_end {
            // A whole block: copied, then checked while the copy is in the cache (`copy_crc32c`).
            let expected = meta.expected_bytes_crc(block).ok_or(block)?;
            if copy_crc32c(source, &mut dst[into..into + BLOCK_BYTES]) != expected {
                return Err(block);
            }
            pos = block_end;
        } else {
            // A block the range covers in part: the part copied, then checked where it lies in
            // the batch, with the rest of the block from the tier.
            let end = range.end.min(block_end);
            let (from, to) = (to_usize(pos - block_start), to_usize(end - block_start));
            dst[into..into + (to - from)].copy_from_slice(&source[from..to]);
            let body = &dst[into..into + (to - from)];
            meta.check_block_parts(block, [&source[..from], body, &source[to..]]).map_err(|_| block)?;
            pos = end;
        }
    }
    Ok(())
}

/// Cuts the run `(shard, first_block, end_block)` into extents of at most `op_blocks_max` blocks.
fn push_extents(extents: &mut Vec<Extent>, (shard, first, end): (u32, u64, u64), op_blocks_max: usize) {
    let mut block = first;
    while block < end {
        let n_blocks = (end - block).min(op_blocks_max as u64);
        extents.push(Extent { shard, first_block: block, n_blocks: n_blocks as u32 });
        block += n_blocks;
    }
}

#[cfg(test)]
#[path = "batch_plan_tests.rs"]
mod tests;
