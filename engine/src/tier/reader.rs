//! A reader's view of the tier: the extents one reading thread has mapped, found by shard index
//! and extent index without a system call once mapped, waited for while this loader's fillers
//! read them, and let go of when a copy out of them fails or their shard is repaired.
//!
//! Owns: `TierReader` (its mapped extents and the ones it found absent lately). Never: fills or
//! evicts on its own account (the fillers do, `fill/`; a failed copy's extent is the one it
//! removes), or is shared between threads.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Coordinator, ExtentKey, Lookup, Mapped, MemoryTier, SCAN_TTL};
use crate::id::ShardId;

/// One reader's view of the tier: the extents it has mapped, found by shard index and extent
/// index without a system call once mapped. Not shared between threads.
pub struct TierReader {
    tier: Arc<MemoryTier>,
    coordinator: Option<Arc<Coordinator>>,
    mapped: HashMap<u64, Arc<Mapped>, SlotHash>,
    /// Extents found absent, with the coordinator's generation (fills finished, fills started)
    /// and the time then: looked up again only when it changed or a moment has passed.
    absent: HashMap<u64, (u64, Instant), SlotHash>,
    revalidated: Instant,
    /// Look-ups in a row that found nothing, before the first batch is out (`COLD_START_PROBES`).
    cold_misses: u32,
}

/// Hashes a reader's slot (shard index, extent index, packed in a u64) with one multiply: the
/// look-up runs once per record, and SipHash showed in its profile.
#[derive(Clone, Copy, Default)]
struct SlotHash;

impl std::hash::BuildHasher for SlotHash {
    type Hasher = SlotHasher;

    fn build_hasher(&self) -> SlotHasher {
        SlotHasher(0)
    }
}

struct SlotHasher(u64);

impl std::hash::Hasher for SlotHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(byte)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = (value ^ self.0).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// Look-ups in a row that may find nothing in memory before the first batch is out before the
/// rest of that batch is read from disk without looking: a cold start's first batch touches an
/// extent of nearly every shard, and looking each up maps its shard's file (10 ms of a 40 ms
/// first batch on 256 shards, issue 44), whose inode a cold node reads from disk first (about
/// a millisecond each here). A warm start finds its first extents and goes on looking; one with
/// half the data in memory misses four in a row one time in sixteen, and reads a few batches
/// from disk.
const COLD_START_PROBES: u32 = 4;

/// How long a reader waits for an extent a filler has promised before reading from disk.
const FILL_WAIT_MAX: Duration = Duration::from_secs(10);

impl TierReader {
    /// A reader of `tier`; with a `coordinator` (the loader's fillers), extents they are about
    /// to load are waited for instead of read from disk.
    pub fn new(tier: Arc<MemoryTier>, coordinator: Option<Arc<Coordinator>>) -> Self {
        Self {
            tier,
            coordinator,
            mapped: HashMap::with_hasher(SlotHash),
            absent: HashMap::with_hasher(SlotHash),
            revalidated: Instant::now(),
            cold_misses: 0,
        }
    }

    /// The tier.
    pub fn tier(&self) -> &Arc<MemoryTier> {
        &self.tier
    }

    /// Bytes per extent.
    pub fn extent_bytes(&self) -> u64 {
        self.tier.extent_bytes
    }

    /// The bytes of extent `extent` of shard `shard_idx` (id `shard`, `n_data_blocks` data
    /// blocks long, its file at `path()`), if the tier has it or a filler is about to; `None`
    /// sends the read to disk.
    pub fn extent(
        &mut self,
        shard_idx: u32,
        shard: ShardId,
        extent: u32,
        n_data_blocks: u64,
        path: impl FnOnce() -> PathBuf,
    ) -> Option<&[u8]> {
        let slot = u64::from(shard_idx) << 32 | u64::from(extent);
        if !self.mapped.contains_key(&slot) {
            let key = ExtentKey { shard, extent };
            let len = self.tier.extent_len(extent, n_data_blocks);
            let published = self.coordinator.as_ref().map_or(0, |c| c.generation());
            if len == 0
                || self.absent.get(&slot).is_some_and(|&(seen, at)| seen == published && at.elapsed() < SCAN_TTL)
            {
                return None;
            }
            let before_first_batch = self.coordinator.as_ref().is_some_and(|c| !c.first_batch_out());
            if before_first_batch && self.cold_misses >= COLD_START_PROBES {
                return None;
            }
            let path = path();
            let deadline = Instant::now() + FILL_WAIT_MAX;
            let stopped = |c: &Option<Arc<Coordinator>>| c.as_ref().is_some_and(|c| c.is_stopped());
            // A fill waited for that ends without the extent usable here (taken back at once, or
            // refused by the look-up) is not waited for again: the record goes to disk.
            let mut waited = false;
            let mapped = loop {
                match self.tier.lookup(&key, len, Some((&path, n_data_blocks))) {
                    Ok(Lookup::Resident(mapped)) => break Some(mapped),
                    Ok(Lookup::Filling) if Instant::now() < deadline && !stopped(&self.coordinator) => {
                        // A filler is at it (this process's, or another's, whose publish this
                        // process does not hear of): wait a little, then look again.
                        match &self.coordinator {
                            Some(coordinator) => {
                                coordinator.wait_for_publish(coordinator.published(), Duration::from_millis(1))
                            }
                            None => std::thread::sleep(Duration::from_micros(500)),
                        }
                        continue;
                    }
                    Ok(Lookup::Absent) if Instant::now() < deadline && !waited => {
                        // Promised by this process's fillers: ask for it first and wait.
                        if self.coordinator.as_ref().is_some_and(|c| c.wait_for(&key, deadline)) {
                            waited = true;
                            continue;
                        }
                        break None;
                    }
                    _ => break None,
                }
            };
            match mapped {
                Some(mapped) => {
                    self.cold_misses = 0;
                    self.absent.remove(&slot);
                    self.mapped.insert(slot, mapped);
                }
                None => {
                    self.cold_misses += u32::from(before_first_batch);
                    self.absent.insert(slot, (published, Instant::now()));
                    return None;
                }
            }
        }
        self.mapped.get(&slot).map(|m| m.as_slice())
    }

    /// The bytes of an extent `extent` has already found (no look-up, no wait).
    pub fn mapped(&self, shard_idx: u32, extent: u32) -> Option<&[u8]> {
        self.mapped.get(&(u64::from(shard_idx) << 32 | u64::from(extent))).map(|m| m.as_slice())
    }

    /// Lets go of extent `extent` of shard `shard_idx` (id `shard`) after a block of it failed
    /// its check as it was copied out: the mapping is dropped and the extent removed from the
    /// tier, so the next read of it goes to disk (and a filler may load it again, checked).
    pub fn discard(&mut self, shard_idx: u32, shard: ShardId, extent: u32) {
        let slot = u64::from(shard_idx) << 32 | u64::from(extent);
        self.mapped.remove(&slot);
        let name = self.tier.extent_name(&ExtentKey { shard, extent });
        // A tier that cannot remove it (another user's file, a read-only directory) keeps it;
        // every later copy of it is checked again and fails again, and goes to disk.
        let _ = self.tier.evict(&name);
        // Its file may be replaced by a repair: mapped again from its name when next read.
        self.forget_shard(shard_idx as usize, shard);
        // Not looked up again for a moment (its records go to disk, which reports them).
        let published = self.coordinator.as_ref().map_or(0, |c| c.generation());
        self.absent.insert(slot, (published, Instant::now()));
    }

    /// Forgets what this reader (and, for the page cache tier, this process) mapped of shard
    /// `shard_idx` (id `shard`), after its file was replaced (a repair) or a copy out of it
    /// failed: the page cache tier maps the file under the shard's name again when it is next
    /// read, not the old one. A memory tier's extents are of the shard's content, whichever
    /// file: they stay.
    pub fn forget_shard(&mut self, shard_idx: usize, shard: ShardId) {
        let Some(page_cache) = &self.tier.page_cache else { return };
        page_cache.forget_shard(shard);
        let Ok(shard_idx) = u32::try_from(shard_idx) else { return };
        self.mapped.retain(|slot, _| (slot >> 32) as u32 != shard_idx);
        self.absent.retain(|slot, _| (slot >> 32) as u32 != shard_idx);
    }

    /// Drops the mappings of extents that were evicted (by any process), so their memory goes
    /// back, and of extents of the page cache some of whose pages the kernel dropped (their
    /// records are read from disk until a fill brings them back, not page by page through
    /// faults); cheap to call often, it does the work about once a second.
    pub fn revalidate(&mut self) {
        if self.revalidated.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.revalidated = Instant::now();
        self.mapped.retain(|_, mapped| !mapped.is_gone() && mapped.in_memory());
    }
}

impl std::fmt::Debug for TierReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierReader").field("tier", &self.tier).field("mapped", &self.mapped.len()).finish()
    }
}
