//! Batch planning and assembly: which blocks to read for a list of records, and where each
//! verified byte goes.
//!
//! Everything here reuses its vectors from batch to batch: after warm-up, planning a batch
//! allocates nothing.

use std::ops::Range;

use super::Dataset;
use crate::error::{Error, Result};
use crate::io::{AlignedBuf, FileId, ReadOp};
use crate::shard::{BLOCK_BYTES, BLOCK_BYTES_U64, DATA_OFFSET};
use crate::staging::{Lease, StagingPool};
use crate::tier::TierReader;

/// Records read together: their bytes back to back in request order, and where each ends.
///
/// The bytes live in page-aligned memory (huge pages when large), reused from batch to batch:
/// it is what a device copy wants, and it keeps TLB misses off the copy into the batch. A reader
/// with a staging pool puts them in a lease of the pool instead (page-locked when the loader
/// copies to a GPU), which the batch holds until it is dropped or the lease is taken.
#[derive(Debug, Default)]
pub struct Batch {
    indices: Vec<u64>,
    ends: Vec<u64>,
    data: BatchBytes,
}

/// A page-aligned byte buffer whose contents need not survive growth: owned and growable, or a
/// staging lease of fixed capacity.
#[derive(Debug, Default)]
struct BatchBytes {
    storage: Storage,
    len: usize,
}

#[derive(Debug, Default)]
enum Storage {
    #[default]
    Empty,
    Owned(AlignedBuf),
    Leased(Lease),
}

impl BatchBytes {
    fn as_slice(&self) -> &[u8] {
        match &self.storage {
            Storage::Empty => &[],
            Storage::Owned(buf) => &buf.as_slice()[..self.len],
            Storage::Leased(lease) => lease.as_slice(),
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.storage {
            Storage::Empty => &mut [],
            Storage::Owned(buf) => &mut buf.as_mut_slice()[..self.len],
            Storage::Leased(lease) => lease.as_mut_slice(),
        }
    }

    /// Sets the length; growing past the capacity allocates afresh (or leases from `staging`,
    /// waiting for a buffer to come back) and does not keep the bytes (every byte of a batch is
    /// written before it is read).
    fn set_len(&mut self, len: usize, staging: Option<&StagingPool>) -> Result<()> {
        match (staging, &mut self.storage) {
            (Some(_), Storage::Leased(lease)) if lease.capacity() >= len => lease.set_len(len)?,
            (Some(pool), _) => {
                if len > pool.buffer_bytes() {
                    return Err(Error::invalid_input(format!(
                        "a batch of {len} bytes does not fit a staging buffer of {} bytes",
                        pool.buffer_bytes()
                    )));
                }
                self.storage = Storage::Empty;
                let mut lease = pool.acquire();
                lease.set_len(len)?;
                self.storage = Storage::Leased(lease);
            }
            (None, Storage::Owned(buf)) if buf.len() >= len => {}
            (None, _) => {
                self.storage = Storage::Empty;
                self.storage = Storage::Owned(AlignedBuf::new(len.next_power_of_two())?);
            }
        }
        self.len = len;
        Ok(())
    }
}

impl Batch {
    /// Records in the batch.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// Whether the batch has no records.
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// The dataset indices of the records, in batch order.
    pub fn indices(&self) -> &[u64] {
        &self.indices
    }

    /// Every record's bytes back to back: for fixed-size records, one dense `len x shape` array.
    pub fn data(&self) -> &[u8] {
        self.data.as_slice()
    }

    /// Where each record ends in `data`.
    pub fn ends(&self) -> &[u64] {
        &self.ends
    }

    /// The bytes of record `i` of the batch.
    pub fn record(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.data.as_slice()[to_usize(start)..to_usize(self.ends[i])]
    }

    /// Every record's bytes, in batch order.
    pub fn records(&self) -> impl Iterator<Item = &[u8]> {
        (0..self.len()).map(|i| self.record(i))
    }

    /// The staging lease holding the bytes, if a staging pool provided them (page-locked when
    /// CUDA is present: what a device copy reads).
    pub fn lease(&self) -> Option<&Lease> {
        match &self.data.storage {
            Storage::Leased(lease) => Some(lease),
            _ => None,
        }
    }

    /// Takes the staging lease out of the batch (its bytes go with it; `data` is then empty).
    pub(crate) fn take_lease(&mut self) -> Option<Lease> {
        match std::mem::take(&mut self.data.storage) {
            Storage::Leased(lease) => {
                self.data.len = 0;
                Some(lease)
            }
            other => {
                self.data.storage = other;
                None
            }
        }
    }

    pub(super) fn clear(&mut self) {
        self.indices.clear();
        self.ends.clear();
        self.data.len = 0;
        if let Storage::Leased(lease) = &mut self.data.storage {
            lease.set_len(0).expect("0 bytes fit");
        }
    }

    pub(super) fn data_mut(&mut self) -> &mut [u8] {
        self.data.as_mut_slice()
    }
}

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
struct Piece {
    extent: u32,
    src: u32,
    dst: u64,
    len: u32,
}

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
    /// Records and bytes of the plan served by the memory tier.
    pub(super) tier_records: u64,
    pub(super) tier_bytes: u64,
}

impl Planner {
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
        for &index in indices {
            let (shard, local) = dataset.locate(index)?;
            let range = dataset.shard_meta(shard)?.record_range(local);
            let shard = u32::try_from(shard).map_err(|_| Error::invalid_input("more than 2^32 shards"))?;
            self.requests.push(Request { shard, start: range.start, end: range.end, dst });
            dst += range.end - range.start;
            batch.ends.push(dst);
        }
        batch.indices.extend_from_slice(indices);
        let total = usize::try_from(dst).map_err(|_| Error::invalid_input("a batch larger than memory"))?;
        batch.data.set_len(total, staging)?;
        debug_assert_eq!(batch.ends.len(), batch.indices.len());

        // Records whose extents are in the memory tier are copied now (their blocks were checked
        // on the way into the tier); the rest are read from disk.
        self.from_tier.clear();
        self.from_tier.resize(self.requests.len(), false);
        (self.tier_records, self.tier_bytes) = (0, 0);
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
                copy_from_tier(tier, &self.requests, &self.from_tier, batch.data.as_mut_slice(), 0);
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
        self.shards.clear();
        self.shards.extend(self.extents.iter().map(|e| e.shard as usize));
        self.shards.dedup();
        Ok(())
    }

    /// Merges the block ranges of the sorted requests into runs and cuts the runs into extents.
    fn plan_extents(&mut self, op_blocks_max: usize) {
        self.extents.clear();
        let mut run: Option<(u32, u64, u64)> = None;
        for &r in &self.order {
            let request = self.requests[r as usize];
            let (first, end) = (request.start / BLOCK_BYTES_U64, request.end.div_ceil(BLOCK_BYTES_U64));
            match &mut run {
                Some((shard, _, run_end)) if *shard == request.shard && first <= *run_end => {
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

    /// Checks extent `e`'s blocks, then copies its pieces into the batch's bytes.
    pub(super) fn deliver(&self, dataset: &Dataset, e: usize, bytes: &[u8], data: &mut [u8]) -> Result<()> {
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
        meta.check_blocks(extent.first_block, bytes).map_err(|(block, expected, actual)| Error::ChecksumMismatch {
            shard: dataset.shard_id(shard),
            block,
            expected,
            actual,
        })?;
        let pieces = &self.pieces[self.piece_starts[e] as usize..self.piece_starts[e + 1] as usize];
        for piece in pieces {
            let src = &bytes[piece.src as usize..piece.src as usize + piece.len as usize];
            data[to_usize(piece.dst)..to_usize(piece.dst) + piece.len as usize].copy_from_slice(src);
        }
        Ok(())
    }
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
        tier.extent(request.shard, shard, index, n_data_blocks).is_some_and(|bytes| bytes.len() as u64 >= needed)
    })
}

/// Batches at least this large have their copies from the tier split across the cores.
const PARALLEL_COPY_BYTES: usize = 256 << 10;

/// Copies the requests marked in `hits` from the tier into `data`, which holds the batch's bytes
/// from offset `base` on. `tier_holds` checked every extent first. Large batches are split in two
/// at a request boundary (requests lie back to back in `data`, in order) and the halves copied on
/// two threads: a memory copy is what bounds a warm epoch.
fn copy_from_tier(tier: &TierReader, requests: &[Request], hits: &[bool], data: &mut [u8], base: u64) {
    if requests.len() > 1 && data.len() >= PARALLEL_COPY_BYTES {
        let mid = requests.len() / 2;
        let (left, right) = data.split_at_mut(to_usize(requests[mid].dst - base));
        rayon::join(
            || copy_from_tier(tier, &requests[..mid], &hits[..mid], left, base),
            || copy_from_tier(tier, &requests[mid..], &hits[mid..], right, requests[mid].dst),
        );
        return;
    }
    let extent_bytes = tier.extent_bytes();
    for (request, _) in requests.iter().zip(hits).filter(|(_, hit)| **hit) {
        for extent in request.start / extent_bytes..=(request.end - 1) / extent_bytes {
            let bytes = tier.mapped(request.shard, extent as u32).expect("checked by tier_holds");
            let at = extent * extent_bytes;
            let (start, end) = (request.start.max(at), request.end.min(at + extent_bytes));
            let src = &bytes[to_usize(start - at)..to_usize(end - at)];
            let dst = to_usize(request.dst + (start - request.start) - base);
            data[dst..dst + src.len()].copy_from_slice(src);
        }
    }
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

fn to_usize(offset: u64) -> usize {
    usize::try_from(offset).expect("batch offsets fit in memory: the batch was allocated")
}
