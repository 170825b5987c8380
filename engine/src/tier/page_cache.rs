//! The page cache as the tier: shard files mapped read-only, their extents read into the
//! kernel's page cache ahead of the plan, and copied out of the mapping once `mincore` finds them
//! in memory.
//!
//! Owns: one read-only mapping per shard file this process reads from the tier (shared by its
//! loaders), which extents of them are in memory (`mincore`, node-wide: the page cache is the
//! node's), filling an extent (`POSIX_FADV_WILLNEED` starts the large reads at once, then
//! `MADV_POPULATE_READ` waits for them and enters the pages in the mapping) and letting one go
//! (its page-table entries, then `POSIX_FADV_DONTNEED`). What it holds is the kernel's: every
//! process of the node shares it, it outlives loaders, processes and restarts, the kernel takes
//! it back under pressure (it is never memory nothing will free), and it uses the file system's
//! large folios where it has them.
//!
//! Invariants: nothing here is trusted to stay as it was (another path may write the file, the
//! kernel may read a page again at any moment), so nothing is checked when it is filled: every
//! block a record touches is checked as it is copied out (`read/batch.rs`), and a block that
//! fails there is read from disk, reported once by that read; its shard's mapping is dropped
//! (`forget_shard`: a repair replaces the file) and mapped again at the next look-up. A fill that
//! cannot read its pages marks its extent failed: not used from memory until the shard is mapped
//! again. An extent is used only when every one of its pages was just found in memory, and only
//! within the file's length as mapped.
//! Never: writes or truncates a shard file, keeps a descriptor open (a mapping holds its file),
//! or counts on a page staying in memory (a page the kernel dropped is read again on touch).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::{ExtentInfo, ExtentKey, Filled, Mapped};
use crate::error::{Error, Result};
use crate::id::ShardId;
use crate::io::{Advice, MappedFile, advise};
use crate::shard::{BLOCK_BYTES_U64, DATA_OFFSET};

/// A shard file mapped whole, with what the tier needs to cut it into extents.
struct ShardMap {
    map: Arc<MappedFile>,
    path: PathBuf,
    n_data_blocks: u64,
}

/// The page cache tier's state in one process.
pub(super) struct PageCache {
    extent_bytes: u64,
    shards: Mutex<HashMap<ShardId, Arc<ShardMap>>>,
    /// Extents whose fill could not read their pages: not used from memory while their shard's
    /// mapping lasts.
    failed: Mutex<HashSet<ExtentKey>>,
    /// Bytes of fills under way in this process.
    filling: AtomicU64,
}

impl PageCache {
    pub(super) fn new(extent_bytes: u64) -> Self {
        Self {
            extent_bytes,
            shards: Mutex::new(HashMap::new()),
            failed: Mutex::new(HashSet::new()),
            filling: AtomicU64::new(0),
        }
    }

    /// The mapping of `shard`, mapped now from `at` (its file and its data blocks) if this
    /// process has not yet; `None` when not mapped and no file is given.
    fn shard(&self, shard: ShardId, at: Option<(&Path, u64)>) -> Result<Option<Arc<ShardMap>>> {
        if let Some(map) = self.shards.lock().get(&shard) {
            return Ok(Some(Arc::clone(map)));
        }
        let Some((path, n_data_blocks)) = at else { return Ok(None) };
        let map =
            Arc::new(ShardMap { map: Arc::new(MappedFile::open_lazy(path)?), path: path.to_owned(), n_data_blocks });
        // Two threads may map it at once: the first one in is kept.
        Ok(Some(Arc::clone(self.shards.lock().entry(shard).or_insert(map))))
    }

    /// Where extent `extent` lies in its shard's file, and its length (0 past the data region).
    fn range(&self, extent: u32, n_data_blocks: u64) -> (usize, usize) {
        let extent_blocks = self.extent_bytes / BLOCK_BYTES_U64;
        let first = u64::from(extent) * extent_blocks;
        let len = n_data_blocks.saturating_sub(first).min(extent_blocks) * BLOCK_BYTES_U64;
        (to_usize(DATA_OFFSET + first * BLOCK_BYTES_U64), to_usize(len))
    }

    /// Extent `key`'s bytes, if every page of it is in memory now (mapping its shard from `at`
    /// first if need be).
    pub(super) fn lookup(&self, key: &ExtentKey, at: Option<(&Path, u64)>) -> Result<Option<Arc<Mapped>>> {
        let Some(shard) = self.shard(key.shard, at)? else { return Ok(None) };
        if self.failed.lock().contains(key) {
            return Ok(None);
        }
        let (offset, len) = self.range(key.extent, shard.n_data_blocks);
        // A file shorter than its metadata says is not read from here: the disk read reports it.
        if len == 0 || offset + len > shard.map.len() || !shard.map.is_resident(offset, len) {
            return Ok(None);
        }
        // Its pages are entered in this mapping as the copies first touch them (64 KiB a
        // fault): entering a whole extent here would hold up the batch that first asks for it
        // (a new loader's first batch asks for an extent of nearly every shard).
        Ok(Some(Arc::new(Mapped::paged(Arc::clone(&shard.map), offset, len))))
    }

    /// Whether every page of extent `key` is in memory now and usable (false for a shard not
    /// mapped here, and for an extent whose fill failed: as `lookup` says, so a
    /// filler does not take for loaded what a reader will not use).
    pub(super) fn is_resident(&self, key: &ExtentKey) -> bool {
        if self.failed.lock().contains(key) {
            return false;
        }
        let Some(shard) = self.shards.lock().get(&key.shard).cloned() else { return false };
        let (offset, len) = self.range(key.extent, shard.n_data_blocks);
        len > 0 && offset + len <= shard.map.len() && shard.map.is_resident(offset, len)
    }

    /// Reads extent `info` into the page cache: the reads are started in large requests
    /// (`WILLNEED`), then waited for as its pages are entered in this process's mapping (its
    /// blocks are checked as readers copy them). `Elsewhere` when it was in memory already.
    pub(super) fn fill(&self, info: &ExtentInfo) -> Result<Filled> {
        let shard = self
            .shard(info.key.shard, Some((&info.path, info.meta.n_data_blocks())))?
            .ok_or_else(|| Error::invalid_input("a shard mapped with its path"))?;
        let (offset, len) = self.range(info.key.extent, shard.n_data_blocks);
        if len == 0 || offset + len > shard.map.len() {
            return Err(Error::Format {
                path: info.path.clone(),
                source: crate::error::FormatError::Truncated {
                    region: "shard data region",
                    detail: format!("the file ends before extent {} of it", info.key.extent),
                },
            });
        }
        let resident = shard.map.is_resident(offset, len);
        self.filling.fetch_add(len as u64, Ordering::Relaxed);
        let outcome = (|| {
            if !resident {
                let file = std::fs::File::open(&info.path).map_err(|e| Error::io("open", &info.path, e))?;
                // Advice only: a kernel that ignores it still reads the pages as they are populated.
                let _ = advise(&file, offset as u64, len as u64, Advice::WillNeed);
                drop(file);
            }
            // Checking the blocks here would be a second check of every byte a reader copies
            // (and of bytes no reader copies): 7 % of a cold run's CPU (issue 44).
            shard.map.populate(offset, len).map_err(|e| Error::io("read", &info.path, e))
        })();
        self.filling.fetch_sub(len as u64, Ordering::Relaxed);
        if outcome.is_err() {
            self.failed.lock().insert(info.key);
        }
        outcome.map(|()| if resident { Filled::Elsewhere } else { Filled::Loaded })
    }

    /// Bytes of fills under way in this process.
    pub(super) fn filling(&self) -> u64 {
        self.filling.load(Ordering::Relaxed)
    }

    /// Lets extent `key` go: this process's page-table entries for it, then its pages in the
    /// page cache (those no other process maps; the kernel keeps those).
    pub(super) fn evict(&self, key: &ExtentKey) -> Result<()> {
        let Some(shard) = self.shards.lock().get(&key.shard).cloned() else { return Ok(()) };
        let (offset, len) = self.range(key.extent, shard.n_data_blocks);
        shard.map.unmap_pages(offset, len);
        let file = std::fs::File::open(&shard.path).map_err(|e| Error::io("open", &shard.path, e))?;
        advise(&file, offset as u64, len as u64, Advice::DontNeed).map_err(|e| Error::io("fadvise", &shard.path, e))
    }

    /// The extents of the shards mapped here that are wholly in memory, named by `name`, with
    /// their bytes; and the bytes in memory of every extent of them (whole or in part).
    pub(super) fn resident(&self, name: impl Fn(&ExtentKey) -> String) -> (HashMap<String, u64>, u64) {
        let shards: Vec<(ShardId, Arc<ShardMap>)> =
            self.shards.lock().iter().map(|(id, map)| (*id, Arc::clone(map))).collect();
        let mut extents = HashMap::new();
        let mut bytes = 0;
        let extent_blocks = self.extent_bytes / BLOCK_BYTES_U64;
        for (id, shard) in shards {
            for extent in 0..shard.n_data_blocks.div_ceil(extent_blocks) {
                let Ok(extent) = u32::try_from(extent) else { break };
                let (offset, len) = self.range(extent, shard.n_data_blocks);
                let held = shard.map.resident_bytes(offset, len);
                bytes += held;
                if held == len as u64 && len > 0 {
                    extents.insert(name(&ExtentKey { shard: id, extent }), held);
                }
            }
        }
        (extents, bytes)
    }

    /// Drops this process's mappings (the page cache keeps the pages; `clear` of a page cache
    /// tier has nothing else to give back).
    pub(super) fn forget(&self) {
        self.shards.lock().clear();
        self.failed.lock().clear();
    }

    /// Drops this process's mapping of `shard` (mapped again, from whatever file is under its
    /// name then, at its next look-up) and what its fills could not read: a copy out of it failed
    /// its check, and a repair replaces a damaged file.
    pub(super) fn forget_shard(&self, shard: ShardId) {
        self.shards.lock().remove(&shard);
        self.failed.lock().retain(|key| key.shard != shard);
    }
}

fn to_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}
