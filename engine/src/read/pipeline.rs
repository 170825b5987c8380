//! The read stream of one `Reader::read_batches` call: the `ReadStream` a backend drives.
//!
//! Owns: `Pipeline` (batch slots planned as they free up, their extents issued in order, each
//! completion routed to its batch, checked on this thread or handed to a verify worker, complete
//! batches handed to the sink in plan order, after closing the files the hook lets go of) and
//! `Replay` (batches to read again after a repair, before the caller's).
//! A shard a batch needs that is not on disk is fetched through the hook as the batch is planned,
//! the batches in flight going on meanwhile.
//! Never: opens a backend, repairs a damaged shard or decides to read again: `Reader` does,
//! around it.

use std::sync::Arc;

use super::batch::Batch;
use super::batch_plan;
use super::stats::publish;
use super::{BatchSlot, Dataset, PublishedStats, ReadStats, ShardSource, Watcher, inode_of, verify};
use crate::error::{Error, Result};
use crate::id::ShardId;
use crate::io::{Dest, FileId, FileOpener, Next, ReadStream};
use crate::staging::StagingPool;
use crate::tier::TierReader;

/// The read stream of a sequence of batches: plans each batch when a slot frees up, issues its
/// extents, routes completions to their batch, and hands complete batches to the sink in order.
pub(super) struct Pipeline<'r, I> {
    pub(super) dataset: &'r Dataset,
    pub(super) files: &'r mut [Option<FileId>],
    /// Per open file: the (device, inode) its path named just before it was opened.
    pub(super) inodes: &'r mut [Option<(u64, u64)>],
    /// Files opened since the backend last closed them all.
    pub(super) opens: &'r mut usize,
    pub(super) watcher: &'r mut Watcher,
    pub(super) slots: &'r mut [BatchSlot],
    pub(super) op_blocks_max: usize,
    pub(super) batches: I,
    pub(super) exhausted: bool,
    /// Slots holding planned batches, oldest first; the last one is the one being issued.
    pub(super) in_order: std::collections::VecDeque<usize>,
    pub(super) free: Vec<usize>,
    /// Ops issued in this stream so far.
    pub(super) issued: u64,
    /// Ops of the batches delivered in this stream so far.
    pub(super) delivered_ops: u64,
    pub(super) sink: &'r mut dyn FnMut(&mut Batch) -> Result<()>,
    pub(super) stats: &'r mut ReadStats,
    pub(super) published: Option<&'r PublishedStats>,
    pub(super) staging: Option<&'r StagingPool>,
    /// Scratch: the shards of a delivered batch, for the repair hook's access accounting.
    pub(super) touched: Vec<ShardId>,
    /// Scratch: the shards whose files a delivered batch lets go of.
    pub(super) letting_go: Vec<usize>,
    pub(super) hook: Option<&'r dyn ShardSource>,
    /// A batch taken from the source whose planning failed.
    pub(super) unplanned: Option<Vec<u64>>,
    /// The shards of the batches read again after a repair (the first `replays_left` the source
    /// gives): their files stay open, gone or not, until those batches are issued (a cache may
    /// have evicted a shard only they read, its reads counted done while they were in flight).
    pub(super) replayed_shards: std::collections::HashSet<usize>,
    pub(super) replays_left: usize,
    pub(super) tier: Option<&'r mut TierReader>,
    /// Verify workers (started at the first op they take), and how many to start.
    pub(super) verify: &'r mut Option<verify::VerifyPool>,
    pub(super) verify_threads: usize,
    pub(super) count_shard_reads: bool,
    /// Set when a missing shard could not be fetched: the read ends with that error, and the
    /// reader does not try the hook again.
    pub(super) fetch_failed: bool,
}

/// Fetches of one missing shard in a row a batch's planning may make: a shard fetched into a shared
/// cache can be evicted again before this reader opens it, and fetching it again is the way on.
const FETCHES_OF_A_SHARD_MAX: u32 = 4;

impl<I> Drop for Pipeline<'_, I> {
    fn drop(&mut self) {
        // Workers may still be reading batches' memory (a read that failed): the batches are not
        // let go, or planned again, before every check is done.
        if let Some(pool) = self.verify.as_mut() {
            pool.wait_all();
        }
    }
}

/// Batches to read again after a repair, then the caller's.
pub(super) struct Replay<'a, I> {
    pub(super) replay: &'a mut std::collections::VecDeque<Vec<u64>>,
    pub(super) rest: &'a mut I,
}

/// One batch's indices: replayed (owned) or the caller's.
pub(super) enum Either<B> {
    Replayed(Vec<u64>),
    Fresh(B),
}

impl<B: AsRef<[u64]>> AsRef<[u64]> for Either<B> {
    fn as_ref(&self) -> &[u64] {
        match self {
            Either::Replayed(indices) => indices,
            Either::Fresh(batch) => batch.as_ref(),
        }
    }
}

impl<B, I: Iterator<Item = B>> Iterator for Replay<'_, I> {
    type Item = Either<B>;

    fn next(&mut self) -> Option<Self::Item> {
        match self.replay.pop_front() {
            Some(indices) => Some(Either::Replayed(indices)),
            None => self.rest.next().map(Either::Fresh),
        }
    }
}

impl<B: AsRef<[u64]>, I: Iterator<Item = B>> Pipeline<'_, I> {
    /// Plans batch `indices` into slot `free` and opens the files it reads. A shard it needs that
    /// is not on disk (never fetched into a cache, or evicted since) is fetched through the hook
    /// here, while the batches in flight go on, and the batch planned again: a cold shard is a
    /// cache's normal case, not a failure that stops the stream and reads those batches again.
    /// A fetch that fails, or a shard still missing after `FETCHES_OF_A_SHARD_MAX` fetches in a
    /// row, ends the read (`fetch_failed`).
    fn plan_fetching(&mut self, free: usize, indices: &[u64], opener: &mut dyn FileOpener) -> Result<()> {
        // Fetches of the shard missing now, in a row; and of any shard for this batch.
        let (mut last, mut in_a_row, mut fetches) = (None, 0u32, 0usize);
        loop {
            let (shard, manifest) = match self.plan_and_open(free, indices, opener) {
                Err(Error::MissingShard { shard, manifest }) if self.hook.is_some() => (shard, manifest),
                planned => return planned,
            };
            let missing = Error::MissingShard { shard, manifest };
            let hook = self.hook.expect("matched above");
            in_a_row = if last == Some(shard) { in_a_row + 1 } else { 1 };
            last = Some(shard);
            if in_a_row > FETCHES_OF_A_SHARD_MAX || fetches > indices.len() + self.dataset.n_shards() {
                self.fetch_failed = true;
                return Err(missing);
            }
            if in_a_row > 1 {
                // Evicted again before it could be opened (another loader's or process's cache
                // made room): give that a moment to finish, then fetch it again.
                std::thread::sleep(std::time::Duration::from_millis(10 << in_a_row));
            }
            fetches += 1;
            if let Err(failed) = hook.repair(shard, &missing) {
                // The origin's or the peers' answer says why better than "missing".
                self.fetch_failed = true;
                return Err(failed);
            }
            self.stats.shards_repaired += 1;
            publish(self.published, self.stats);
            if let (Some(tier), Some(index)) = (self.tier.as_deref_mut(), self.dataset.shard_of_error(&missing)) {
                // A page cache tier may still map the file evicted before.
                tier.forget_shard(index, shard);
            }
            self.let_go_of_evicted_files(opener)?;
        }
    }

    /// After a fetch, which may have evicted other shards to make room: closes the files of
    /// shards gone from disk that no batch in flight reads, at once (the watch would see them
    /// only at the next batch's planning, and batches are handed on meanwhile), so the space
    /// the cache freed is free.
    fn let_go_of_evicted_files(&mut self, opener: &mut dyn FileOpener) -> Result<()> {
        let busy: std::collections::HashSet<usize> =
            self.in_order.iter().flat_map(|&slot| self.slots[slot].planner.shards_touched()).collect();
        for s in 0..self.files.len() {
            let replayed = self.replays_left > 0 && self.replayed_shards.contains(&s);
            if self.files[s].is_none() || busy.contains(&s) || replayed || self.dataset.shard_path(s).exists() {
                continue;
            }
            self.inodes[s] = None;
            if let Some(id) = self.files[s].take() {
                opener.close(id)?;
            }
        }
        Ok(())
    }

    /// Plans batch `indices` into slot `free` and opens the files it reads that are not open.
    fn plan_and_open(&mut self, free: usize, indices: &[u64], opener: &mut dyn FileOpener) -> Result<()> {
        let slot = &mut self.slots[free];
        slot.planner.count_reads = self.count_shard_reads;
        slot.planner.plan(
            self.dataset,
            indices,
            self.op_blocks_max,
            &mut slot.batch,
            self.staging,
            self.tier.as_deref_mut(),
        )?;
        for shard in slot.planner.shards_touched() {
            if self.files[shard].is_some() {
                continue;
            }
            let path = self.dataset.shard_path(shard);
            // Watched and looked at before the open: a file replaced in between is seen as
            // replaced at the next look and opened again, never the other way.
            let watched = self.watcher.before_open(&path, shard);
            let inode = inode_of(&path);
            match opener.open(&path) {
                Ok(file) => {
                    if !watched {
                        self.watcher.after_open(&path, shard);
                    }
                    self.files[shard] = Some(file);
                    self.inodes[shard] = Some(inode.unwrap_or((0, 0)));
                    *self.opens += 1;
                }
                // Gone since its metadata was read (evicted, removed): missing, as when the
                // metadata is read.
                Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                    return Err(Error::MissingShard {
                        shard: self.dataset.shard_id(shard),
                        manifest: self.dataset.manifest_id(),
                    });
                }
                Err(e) => return Err(e),
            }
        }
        debug_assert!(
            self.slots[free].planner.shards_touched().all(|shard| self.files[shard].is_some()),
            "every file a planned batch reads is open"
        );
        Ok(())
    }

    /// Hands every complete batch at the front of the queue to the sink and frees its slot,
    /// first closing the files the hook does not keep open (`let_go_of_read_files`); without an
    /// `opener` to close them, such a batch waits for the next `next_op` or the stream's end.
    fn deliver_ready<'o>(&mut self, mut opener: Option<&mut (dyn FileOpener + 'o)>) -> Result<()> {
        while let Some(&front) = self.in_order.front() {
            if !self.slots[front].is_complete() || !self.let_go_of_read_files(front, opener.as_deref_mut())? {
                break;
            }
            let slot = &mut self.slots[front];
            let read_bytes = slot.planner.read_bytes();
            self.stats.records += slot.batch.len() as u64;
            self.stats.batches += 1;
            self.stats.batch_shards += slot.planner.n_batch_shards();
            self.stats.bytes_delivered += slot.batch.data().len() as u64;
            self.stats.ops += slot.planner.n_extents() as u64;
            self.stats.bytes_read += read_bytes;
            self.stats.blocks_verified += read_bytes / crate::shard::BLOCK_BYTES_U64 + slot.planner.tier_blocks_checked;
            self.stats.tier_records += slot.planner.tier_records;
            self.stats.verify_failures += slot.planner.tier_failures;
            self.stats.tier_bytes += slot.planner.tier_bytes;
            self.stats.ops_direct += slot.planner.n_direct() as u64;
            self.stats.ops_offloaded += slot.offloaded;
            self.delivered_ops += slot.planner.n_extents() as u64;
            publish(self.published, self.stats);
            if let Some(published) = self.published {
                published.set_pending_ops(self.issued.saturating_sub(self.delivered_ops));
            }
            if let Some(hook) = self.hook {
                // Out of flight before its step is counted: a cache's view of the reader may
                // lag it for a moment, never run ahead.
                hook.in_flight(self.in_order.len() as u64 - 1);
                self.touched.clear();
                self.touched.extend(slot.planner.shards_touched().map(|s| self.dataset.shard_id(s)));
                hook.accessed(&self.touched);
            }
            (self.sink)(&mut slot.batch)?;
            self.in_order.pop_front();
            self.free.push(front);
        }
        Ok(())
    }
}

impl<B: AsRef<[u64]>, I: Iterator<Item = B>> Pipeline<'_, I> {
    /// Takes the verdicts that are in (all of them, waiting, with `wait`) and counts each
    /// checked op; delivers nothing (the caller does, when no backend holds a slice of a batch).
    /// A failed check is the read's error.
    fn take_verdicts(&mut self, wait: bool) -> Result<()> {
        while let Some(pool) = self.verify.as_mut() {
            let verdict = if wait { pool.take()? } else { pool.try_take() };
            let Some(verdict) = verdict else { break };
            self.apply(verdict)?;
        }
        Ok(())
    }

    /// Marks op `extent` of `slot` completed; an op completed twice is the backend's error.
    fn mark_completed(&mut self, seq: u64, slot: usize, extent: usize) -> Result<()> {
        let done = &mut self.slots[slot].completed[extent];
        if *done {
            return Err(Error::invalid_input(format!("the backend completed op {seq} twice")));
        }
        *done = true;
        Ok(())
    }

    /// Counts a worker's verdict against its op's batch; a failed one is the read's error.
    fn apply(&mut self, verdict: verify::Verdict) -> Result<()> {
        let (slot, extent) = ((verdict.tag >> 32) as usize, (verdict.tag & u64::from(u32::MAX)) as usize);
        let slot = &mut self.slots[slot];
        debug_assert!(slot.remaining > 0 && slot.awaiting_verdicts > 0, "a verdict for an op its batch awaits");
        slot.remaining -= 1;
        slot.awaiting_verdicts -= 1;
        let Err(why) = verdict.outcome else { return Ok(()) };
        let (shard, _) = slot.planner.extent_blocks(extent);
        Err(match why {
            verify::Failure::Mismatch(block, expected, actual) => {
                batch_plan::mismatch(self.dataset, shard, block, expected, actual)
            }
            verify::Failure::Panicked => Error::invalid_input(format!(
                "the check of extent {extent} of shard {} panicked",
                self.dataset.shard_id(shard)
            )),
            verify::Failure::Copy(why) => Error::invalid_input(format!(
                "copying extent {extent} of shard {} into its batch: {why}",
                self.dataset.shard_id(shard)
            )),
        })
    }

    /// The batch slot and extent of op `seq`.
    fn owner(&self, seq: u64) -> Result<(usize, usize)> {
        let slots = &*self.slots;
        let owner = self
            .in_order
            .iter()
            .copied()
            .find(|&s| seq >= slots[s].first_seq && seq < slots[s].first_seq + slots[s].issued as u64)
            .ok_or_else(|| Error::invalid_input(format!("the backend completed op {seq}, which was never issued")))?;
        let extent = usize::try_from(seq - slots[owner].first_seq).expect("fewer extents than memory");
        Ok((owner, extent))
    }

    /// After the backend read the last op: waits for the last checks and delivers the rest
    /// (`opener`: the backend, with nothing in flight).
    pub(super) fn finish(&mut self, opener: &mut dyn FileOpener) -> Result<()> {
        self.take_verdicts(true)?;
        self.deliver_ready(Some(opener))
    }

    /// Closes the files of the batch in `slot` that the hook does not keep open
    /// (`ShardSource::keeps_open`: a fetched shard the plan does not read again soon) and no
    /// other batch in flight reads, before the batch is handed on: the sink may wait long (a
    /// full queue before a slow trainer), and a file the cache evicts meanwhile would hold its
    /// space until the next look. False when there are such files but no `opener`.
    fn let_go_of_read_files(&mut self, slot: usize, opener: Option<&mut (dyn FileOpener + '_)>) -> Result<bool> {
        let Some(hook) = self.hook else { return Ok(true) };
        let mut done = std::mem::take(&mut self.letting_go);
        done.clear();
        done.extend(
            self.slots[slot]
                .planner
                .batch_shards()
                .filter(|&shard| self.files[shard].is_some() && !hook.keeps_open(self.dataset.shard_id(shard))),
        );
        if !done.is_empty() {
            // Not those another batch in flight reads: its ops may be in flight.
            let busy: std::collections::HashSet<usize> = self
                .in_order
                .iter()
                .filter(|&&other| other != slot)
                .flat_map(|&other| self.slots[other].planner.shards_touched())
                .collect();
            done.retain(|shard| !busy.contains(shard));
        }
        let closed = match opener {
            _ if done.is_empty() => true,
            None => false,
            Some(opener) => {
                for &shard in &done {
                    self.inodes[shard] = None;
                    if let Some(id) = self.files[shard].take() {
                        self.watcher.closed(&self.dataset.shard_path(shard), shard);
                        opener.close(id)?;
                    }
                }
                true
            }
        };
        self.letting_go = done;
        Ok(closed)
    }

    /// Closes the open files removed or replaced since they were opened that no batch in flight
    /// reads (the others at a later look), before another batch is planned: a long read (an
    /// epoch through an origin cache) does not hold the space of the shards the cache evicted
    /// until it ends, so the cache's bound holds for the disk (issue 40). A shard read again
    /// later is opened afresh (fetched again when evicted).
    fn let_go_of_gone_files(&mut self, opener: &mut dyn FileOpener) -> Result<()> {
        let gone = super::gone_files(self.watcher, self.dataset, self.files, self.inodes);
        if gone.is_empty() {
            return Ok(());
        }
        let busy: std::collections::HashSet<usize> =
            self.in_order.iter().flat_map(|&slot| self.slots[slot].planner.shards_touched()).collect();
        for s in gone {
            if busy.contains(&s) || (self.replays_left > 0 && self.replayed_shards.contains(&s)) {
                self.watcher.pending.push(s);
                continue;
            }
            self.inodes[s] = None;
            if let Some(id) = self.files[s].take() {
                opener.close(id)?;
            }
        }
        Ok(())
    }

    /// Whether the oldest batch waits for nothing but workers' verdicts (every op of it read).
    fn front_awaits_only_verdicts(&self) -> bool {
        self.in_order.front().is_some_and(|&front| {
            let slot = &self.slots[front];
            slot.issued == slot.planner.n_extents() && slot.remaining > 0 && slot.remaining == slot.awaiting_verdicts
        })
    }
}

impl<B: AsRef<[u64]>, I: Iterator<Item = B>> ReadStream for Pipeline<'_, I> {
    fn next_op(&mut self, opener: &mut dyn FileOpener) -> Result<Next> {
        self.take_verdicts(false)?;
        self.deliver_ready(Some(&mut *opener))?;
        loop {
            if let Some(&current) = self.in_order.back() {
                let slot = &mut self.slots[current];
                if slot.issued < slot.planner.n_extents() {
                    let e = slot.issued;
                    let op = slot.planner.op(e, self.files);
                    let next = match (slot.planner.direct(e), slot.planner.scratch(e)) {
                        (Some(dst), _) => {
                            let at = slot.batch.memory().range(dst, op.len as usize)?;
                            #[allow(unsafe_code, reason = "an op into the batch's own memory")]
                            // SAFETY: `at` is a block-aligned range of the batch's page-aligned
                            // memory that only this extent covers (`plan_direct`). The batch is
                            // not planned again, delivered or dropped while the op is in flight:
                            // its slot is busy until every extent completed, and after a failure
                            // the backend returns only once no op is in flight.
                            let dest = unsafe { Dest::new(at) };
                            Next::Into(op, dest)
                        }
                        (None, Some(scratch)) => {
                            let at = slot.scratch_range(scratch, op.len as usize)?;
                            #[allow(unsafe_code, reason = "an op into the slot's scratch memory")]
                            // SAFETY: `at` is a block-aligned range (extents are whole blocks, back
                            // to back from offset 0) of the slot's page-aligned scratch memory
                            // that only this extent covers (`plan_scratch`). The scratch is not
                            // grown or dropped while the op is in flight: it is replaced only
                            // when the slot is planned again, after every extent completed, and
                            // after a failure the backend returns only once no op is in flight.
                            let dest = unsafe { Dest::new(at) };
                            Next::Into(op, dest)
                        }
                        (None, None) => Next::Op(op),
                    };
                    slot.issued += 1;
                    self.issued += 1;
                    return Ok(next);
                }
            }
            if self.exhausted {
                return Ok(Next::Done);
            }
            let Some(&free) = self.free.last() else {
                // Every batch slot is taken: nothing can be issued until one is delivered. When
                // the oldest batch waits only for checks on workers, waiting for those here frees
                // its slot as soon as they are done, not at the disk's next completion; when it
                // waits for the disk, the backend waits for the disk.
                if self.front_awaits_only_verdicts() {
                    let pool = self.verify.as_mut().expect("verdicts are awaited from the pool");
                    if let Some(verdict) = pool.take()? {
                        self.apply(verdict)?;
                        self.take_verdicts(false)?;
                        self.deliver_ready(Some(&mut *opener))?;
                        continue;
                    }
                }
                return Ok(Next::Wait);
            };
            self.let_go_of_gone_files(opener)?;
            let Some(indices) = self.batches.next() else {
                self.exhausted = true;
                return Ok(Next::Done);
            };
            let mut planned = self.plan_fetching(free, indices.as_ref(), opener);
            if planned.is_ok() && self.verify_threads > 0 {
                // Long ops not read straight into the batch go to the slot's scratch memory, for
                // a worker to check and copy from. The slot is free: nothing works on its scratch.
                let slot = &mut self.slots[free];
                planned = usize::try_from(slot.planner.plan_scratch(verify::OFFLOAD_BYTES_MIN))
                    .map_err(|_| Error::invalid_input("a batch larger than memory"))
                    .and_then(|needed| {
                        if needed > 0 && slot.scratch.as_ref().is_none_or(|scratch| scratch.len() < needed) {
                            slot.scratch = None;
                            slot.scratch = Some(crate::io::AlignedBuf::new(needed.next_power_of_two())?);
                        }
                        Ok(())
                    });
            }
            if let Err(e) = planned {
                // Kept so that the batch can be read again after a repair.
                self.unplanned = Some(indices.as_ref().to_vec());
                return Err(e);
            }
            self.free.pop();
            let slot = &mut self.slots[free];
            slot.first_seq = self.issued;
            slot.issued = 0;
            slot.remaining = slot.planner.n_extents();
            slot.offloaded = 0;
            slot.awaiting_verdicts = 0;
            slot.completed.clear();
            slot.completed.resize(slot.planner.n_extents(), false);
            self.in_order.push_back(free);
            self.replays_left = self.replays_left.saturating_sub(1);
            if let Some(hook) = self.hook {
                hook.in_flight(self.in_order.len() as u64);
            }
            // A batch with nothing to read (no records, or only empty ones) is complete already.
            self.deliver_ready(Some(&mut *opener))?;
        }
    }

    fn complete(&mut self, seq: u64, bytes: &[u8]) -> Result<()> {
        let (owner, extent) = self.owner(seq)?;
        self.mark_completed(seq, owner, extent)?;
        let slot = &mut self.slots[owner];
        if slot.planner.direct(extent).is_some() || slot.planner.scratch(extent).is_some() {
            return Err(Error::invalid_input(format!(
                "op {seq} was to be read into the reader's memory, not a buffer"
            )));
        }
        let memory = slot.batch.memory();
        #[allow(unsafe_code, reason = "copies into a batch others may work on")]
        // SAFETY: `memory` is this slot's batch, planned for this plan; the extent is not one
        // read straight into the batch, so no op or worker works on its pieces' ranges.
        unsafe {
            slot.planner.deliver(self.dataset, extent, bytes, memory)?
        };
        debug_assert!(slot.remaining > 0, "an op its batch awaits");
        slot.remaining -= 1;
        // The bytes are a backend's buffer, not a batch: delivering here touches no memory the
        // caller holds (a batch with files to let go waits for `next_op`, which has the files).
        self.take_verdicts(false)?;
        self.deliver_ready(None)
    }

    fn complete_into(&mut self, seq: u64, bytes: &mut [u8]) -> Result<()> {
        let (owner, extent) = self.owner(seq)?;
        self.mark_completed(seq, owner, extent)?;
        let slot = &mut self.slots[owner];
        let len = slot.planner.extent_len(extent);
        let (expected, scratch) = match (slot.planner.direct(extent), slot.planner.scratch(extent)) {
            (Some(dst), _) => (slot.batch.memory().range(dst, len)?, false),
            (None, Some(at)) => (slot.scratch_range(at, len)?, true),
            (None, None) => return Err(Error::invalid_input(format!("op {seq} was to be read into a buffer"))),
        };
        if bytes.as_ptr() != expected.as_ptr().cast_const() || bytes.len() != len {
            return Err(Error::invalid_input(format!(
                "op {seq} completed into {} bytes other than its {len} bytes of the reader's memory",
                bytes.len(),
            )));
        }
        let offload = self.verify_threads > 0 && bytes.len() >= verify::OFFLOAD_BYTES_MIN;
        if offload {
            if self.verify.is_none() {
                *self.verify = Some(verify::VerifyPool::new(self.verify_threads)?);
            }
            let (shard, first_block) = slot.planner.extent_blocks(extent);
            let meta = Arc::clone(self.dataset.shard_meta(shard)?);
            let pool = self.verify.as_mut().expect("started above");
            let tag = (u64::try_from(owner).expect("a slot index") << 32) | extent as u64;
            let gather = scratch.then(|| {
                let pieces = slot.planner.pieces(extent);
                verify::Gather { pieces: pieces.as_ptr(), n: pieces.len(), memory: slot.batch.memory() }
            });
            #[allow(unsafe_code, reason = "a worker checks the reader's memory and copies into the batch")]
            // SAFETY: the bytes are this extent's range of the batch or of the slot's scratch,
            // which is neither written (the read completed; no other op or copy covers the range)
            // nor let go until the verdict is taken: the slot waits for this verdict before it is
            // delivered or planned again (which is when its plan, its scratch or its batch could
            // change), and `Pipeline::drop` waits for all verdicts. The same holds for the plan's
            // pieces and for their ranges of the batch, which no other op, copy or job covers.
            // The pointer comes from `bytes`.
            unsafe {
                pool.submit(meta, first_block, (bytes.as_ptr(), bytes.len()), gather, tag)
            };
            slot.offloaded += 1;
            slot.awaiting_verdicts += 1;
        } else if scratch {
            // Not taken while scratch is planned only with workers, for ops of the same minimum
            // length; kept so that an op read into scratch is never left unchecked or uncopied.
            let memory = slot.batch.memory();
            #[allow(unsafe_code, reason = "copies into a batch others may work on")]
            // SAFETY: `memory` is this slot's batch, planned for this plan; no op or worker works
            // on the ranges of this extent's pieces, which are its own.
            unsafe {
                slot.planner.deliver(self.dataset, extent, bytes, memory)?
            };
            debug_assert!(slot.remaining > 0, "an op its batch awaits");
            slot.remaining -= 1;
        } else {
            slot.planner.check(self.dataset, extent, bytes)?;
            debug_assert!(slot.remaining > 0, "an op its batch awaits");
            slot.remaining -= 1;
        }
        // `bytes` is part of a batch and the caller holds it until this returns: no batch is
        // delivered (handed to the sink, which may drop it) here, only at the next `next_op`,
        // `idle` or the end of the stream.
        self.take_verdicts(false)
    }

    fn idle(&mut self) -> Result<bool> {
        // A complete batch waits for files to be let go: the next `next_op` delivers it.
        if self.in_order.front().is_some_and(|&front| self.slots[front].is_complete()) {
            return Ok(true);
        }
        if self.verify.as_ref().is_none_or(|pool| pool.pending() == 0) {
            return Ok(false);
        }
        // Nothing is in flight and every batch slot waits on checks: wait for one.
        let pool = self.verify.as_mut().expect("checked above");
        let Some(verdict) = pool.take()? else { return Ok(false) };
        self.apply(verdict)?;
        self.take_verdicts(false)?;
        self.deliver_ready(None)?;
        Ok(true)
    }
}
