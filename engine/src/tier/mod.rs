//! The tier: shard extents held in memory that every process of the node shares, filled ahead of
//! the plan. Two kinds behind one `MemoryTier` (`TierKind`): the kernel's page cache (the
//! default, `page_cache.rs`: shard files mapped read-only, extents read in with `WILLNEED` and
//! `MADV_POPULATE_READ`, found in memory with `mincore`), and a memory tier of extent files in a
//! memory file system (this file). The plan's side (what to fill, in which order, what makes
//! room) is the same for both (`fill/`). Beside this file, which keeps the budget and the
//! memory tier's files: `config.rs` (what a tier is asked for), `names.rs` (its file names),
//! `dirs.rs` (which directory may be the tier's), `memory.rs` (the node's memory), `schedule.rs`
//! (the plan as the tier sees it), `reader.rs` (a reader's look-ups), `claim.rs` (the memory
//! tier's fills: claim, read, check, publish).
//!
//! Owns (the memory tier): a directory in a memory file system (`/dev/shm/granary-tier-UID` by
//! default, marked as the tier's by a `.granary-tier` file) holding one file per extent (a run
//! of a shard's data blocks, `extent_bytes` long, the last of a shard shorter), named by the
//! shard's content id, the extent size and the extent's index, so versions that share a shard
//! share its extents and eight ranks of a node hold one copy. Readers map extent files read-only
//! (`TierReader`) and keep no descriptor open; fillers (`fill/`, driven by the loader's plan)
//! claim an extent with a flock'ed `.fill-` file, read it from disk through a backend of their
//! own (`io::read_exact`: O_DIRECT ops of the loader's op size straight into a private file's
//! mapping, injected faults met as the reader meets them), check every block's CRC32C, and publish the private
//! file by linking it under the extent's name (which fails if the name exists). The budget
//! bounds the bytes held and being filled, node-wide: a filler makes room and takes its claim
//! under a flock on the directory, with the directory listed afresh; under memory pressure
//! (MemAvailable, the cgroup's headroom, or the memory file system's own free space below a
//! reserve) the tier shrinks. The page cache tier's budget bounds what this process's plan holds
//! and reads ahead; the kernel may keep more, and takes it back as it needs.
//!
//! Invariants: whatever the kind, every block a record touches is checked as it is copied out
//! (`read/batch.rs`): memory any process of the user can write, or the kernel can read again
//! from disk, is not trusted to stay as it was. An extent file under its final name is complete,
//! exactly as long as its extent, and every block of it passed its checksum on the way in,
//! because only the filler that wrote and checked a private file ever names it (a reader never
//! sees a half-filled extent, and no other process's clean-up can swap one in); a claim's lock
//! goes with its filler, so a dead filler's claim is told apart from a live one and removed; a
//! published extent is never written again, only unlinked (mappings of it stay valid). Only
//! names of the tier's own patterns are listed, counted or removed. The directory is emptied
//! when its last user closes it (each user holds a shared flock on `.users`), so a job's memory
//! goes back when it ends, also after a crash (the next first user empties it).
//! Never: trusts a directory it does not own (another user's, a symlink, or one that holds
//! other files and no marker), touches a file whose name is not the tier's, or touches disk
//! shards except to read them (and to advise the kernel on their pages).

mod claim;
use claim::remove_if_same;
mod config;
mod dirs;
mod fill;
mod memory;
mod names;
mod page_cache;
mod reader;
mod schedule;

use std::collections::HashMap;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

pub use fill::{Coordinator, run_filler};
pub use reader::TierReader;
pub use schedule::{ExtentInfo, TierSchedule};

pub use config::{EXTENT_BYTES_DEFAULT, EXTENTS_MAX, TierConfig, TierKind, default_extent_bytes};
pub use dirs::file_system_of;
use dirs::{current_uid, prepare_dir};
use memory::Memory;

/// The memory this process may use: the node's, or its cgroup's limit when lower.
pub fn memory_bound() -> u64 {
    let memory = Memory::recent();
    memory.cgroup_limit.map_or(memory.total, |limit| limit.min(memory.total))
}
pub use names::ExtentKey;
use names::{claimed_extent, extent_key_of, extent_size_of, is_extent_name, is_old_extent_name, nonce};

use crate::error::{Error, Result};
use crate::io::{MappedFile, WritableMap, flock, fs_space};
use crate::shard::{BLOCK_BYTES_U64, DATA_OFFSET};

/// The file that marks a directory as a memory tier's.
const MARKER: &str = ".granary-tier";

/// Memory kept free for the trainer when the tier shrinks under pressure: a sixteenth of the
/// node's (or the cgroup's) memory, and at least this much (or a quarter, in a small cgroup).
const RESERVE_BYTES_MIN: u64 = 256 << 20;

/// How long a filler waits for the budget lock before it gives up on a fill for now.
const BUDGET_LOCK_WAIT: Duration = Duration::from_secs(1);

/// How long a directory listing is trusted before it is read again (other processes fill and
/// evict too).
const SCAN_TTL: Duration = Duration::from_millis(100);

/// How long the page cache tier's listing (kept up to date by this process's fills, look-ups and
/// evictions) is trusted before `mincore` looks at every mapped shard again, for what the kernel
/// took back or another process read in: a look over 100 GiB of shards takes a fraction of a
/// second.
const PAGE_CACHE_SCAN_TTL: Duration = Duration::from_secs(10);

/// Counters of a tier, for this process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Bytes the tier holds node-wide (at the last directory listing).
    pub bytes_held: u64,
    /// The budget in force (after memory pressure).
    pub budget_bytes: u64,
    /// Extents this process read from disk into the tier.
    pub extents_loaded: u64,
    /// Bytes of those extents.
    pub bytes_loaded: u64,
    /// Extents this process removed from the tier (for room, or under pressure).
    pub extents_evicted: u64,
    /// Fills that failed (a read error or a block that did not check out: the record reads go
    /// to disk and report it there).
    pub fill_failures: u64,
    /// Extents the evictor plugin chose to make room that were removed.
    pub evictor_chosen: u64,
    /// Extents the evictor plugin chose that stayed, because the plan needs them (sooner than
    /// the extent room was made for, or while extents the plan does not hold could go instead).
    pub evictor_refused: u64,
    /// Times the evictor plugin could not be started or answered with an error (the native
    /// order, farthest next use first, chose instead).
    pub evictor_failures: u64,
}

#[derive(Default)]
struct Counters {
    extents_loaded: AtomicU64,
    bytes_loaded: AtomicU64,
    extents_evicted: AtomicU64,
    fill_failures: AtomicU64,
    evictor_chosen: AtomicU64,
    evictor_refused: AtomicU64,
    evictor_failures: AtomicU64,
}

/// A resident extent as this process maps it: a memory tier's extent file, or an extent of a
/// shard file whose pages the page cache holds.
pub struct Mapped {
    map: Arc<MappedFile>,
    offset: usize,
    len: usize,
    /// An extent of a shard file: the kernel may drop its pages at any moment.
    paged: bool,
    /// Set once a listing no longer shows this file under its name (evicted, by any process):
    /// readers drop their mapping, so the memory can go back.
    gone: std::sync::atomic::AtomicBool,
}

impl Mapped {
    fn file(map: MappedFile) -> Self {
        let len = map.len();
        Self { map: Arc::new(map), offset: 0, len, paged: false, gone: false.into() }
    }

    fn paged(map: Arc<MappedFile>, offset: usize, len: usize) -> Self {
        Self { map, offset, len, paged: true, gone: false.into() }
    }

    /// The extent's bytes (checked as they are copied out).
    pub fn as_slice(&self) -> &[u8] {
        &self.map.as_slice()[self.offset..self.offset + self.len]
    }

    /// Whether its first and last pages are still in memory (a memory tier's always are): a
    /// cheap sign that the kernel has not taken it back (checked every second for every extent a
    /// reader maps; a page taken back all the same is read again when touched).
    fn in_memory(&self) -> bool {
        !self.paged || self.map.ends_resident(self.offset, self.len)
    }

    /// Whether the extent has left the tier (its bytes stay valid for this mapping).
    pub fn is_gone(&self) -> bool {
        self.gone.load(Ordering::Relaxed)
    }

    fn mark_gone(&self) {
        self.gone.store(true, Ordering::Relaxed);
    }
}

/// What a look-up found.
pub enum Lookup {
    /// Verified bytes, mapped.
    Resident(Arc<Mapped>),
    /// A live filler (of this process or another) is reading it now.
    Filling,
    /// Not in the tier.
    Absent,
}

/// How a fill ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filled {
    /// Read, checked and published by this call.
    Loaded,
    /// Someone else published it, or is filling it now.
    Elsewhere,
}

/// A node-wide tier, opened by one process: the page cache, or a memory tier's directory. See
/// the module documentation.
pub struct MemoryTier {
    /// The page cache tier's state; `None` for a memory tier.
    page_cache: Option<page_cache::PageCache>,
    /// The memory tier's directory (empty for the page cache tier).
    dir: PathBuf,
    budget_bytes: u64,
    extent_bytes: u64,
    fill_threads: usize,
    keep: bool,
    evictor: Option<String>,
    evictor_options: Vec<(String, String)>,
    /// The process that opened the tier: a child forked from it shares the lock on `users` (it
    /// belongs to the open file, not the process) and must never empty the tier under its
    /// parent.
    pid: u32,
    /// Holds a shared flock while this memory tier is open.
    users: Option<std::fs::File>,
    counters: Counters,
    listing: Mutex<Listing>,
    /// Extents this process has mapped, by name: every loader of the process shares them, so an
    /// extent is mapped (and its pages entered in the page table) once per process.
    maps: Mutex<HashMap<String, Arc<Mapped>>>,
}

/// The last directory listing: extent names with their bytes and inode numbers.
struct Listing {
    at: Option<Instant>,
    extents: HashMap<String, (u64, u64)>,
    bytes: u64,
}

impl Listing {
    /// The budget is kept by `bytes`: it must be what the listed extents add up to, or every
    /// fill decision that follows is made on a wrong figure.
    fn debug_check(&self) {
        debug_assert_eq!(
            self.bytes,
            self.extents.values().map(|&(bytes, _)| bytes).sum::<u64>(),
            "the tier's held bytes drifted from its extents"
        );
    }
}

/// What the tier holds and is filling node-wide, listed under the budget lock.
#[derive(Debug, Default)]
pub struct Holdings {
    /// Extents held, by name, with their bytes.
    pub extents: HashMap<String, u64>,
    /// Bytes of those extents.
    pub held: u64,
    /// Bytes of the fills under way (each the length its claim says: its extent's).
    pub filling: u64,
}

impl MemoryTier {
    /// Opens (creating it if needed) the tier `config` describes; `None` when the budget is 0.
    pub fn open(config: &TierConfig) -> Result<Option<Arc<Self>>> {
        config.validate()?;
        if config.budget_bytes == Some(0) {
            return Ok(None);
        }
        // Half of what is available now (and of the cgroup's headroom).
        let half_available = || {
            let memory = Memory::read();
            memory.available.min(memory.cgroup_headroom.unwrap_or(u64::MAX)) / 2
        };
        let (page_cache, dir, budget_bytes) = match config.kind {
            // Extents are ranges of shard files here, not mappings of their own: no limit on
            // their count. The budget bounds what is read ahead and held for the plan; the
            // kernel may hold more, and takes it back as it needs.
            TierKind::PageCache => (
                Some(page_cache::PageCache::new(config.extent_bytes)),
                PathBuf::new(),
                config.budget_bytes.unwrap_or_else(half_available),
            ),
            TierKind::Memory => {
                let dir = match &config.dir {
                    Some(dir) => dir.clone(),
                    None => {
                        let shm = Path::new("/dev/shm");
                        if !shm.is_dir() {
                            return Err(Error::invalid_input(
                                "the memory tier needs /dev/shm (or a tier directory in a memory file system); \
                                 set the tier budget to 0 to read without it",
                            ));
                        }
                        shm.join(format!("granary-tier-{}", current_uid()))
                    }
                };
                prepare_dir(&dir)?;
                let most = EXTENTS_MAX * config.extent_bytes;
                let budget_bytes = match config.budget_bytes {
                    Some(bytes) if bytes > most => {
                        return Err(Error::invalid_input(format!(
                            "a memory tier of {bytes} bytes in extents of {} bytes would be more than \
                             {EXTENTS_MAX} extents (each one a memory mapping in every reader): choose larger \
                             extents or a smaller tier",
                            config.extent_bytes
                        )));
                    }
                    Some(bytes) => bytes,
                    None => half_available().min(most),
                };
                (None, dir, budget_bytes)
            }
        };
        // A plugin asked for by name that does not load, or refuses its options (at the
        // capacity it will run with), is refused now, not at the first eviction.
        #[cfg(feature = "policy")]
        if let Some(name) = &config.evictor {
            fill::evictor_host()?.evictor(
                Some(name),
                &config.evictor_options,
                (budget_bytes / BLOCK_BYTES_U64).max(1),
            )?;
        }
        let users_path = dir.join(".users");
        let users = match page_cache {
            Some(_) => None,
            None => Some(
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .mode(0o600)
                    .open(&users_path)
                    .map_err(|e| Error::io("open", &users_path, e))?,
            ),
        };
        let tier = Self {
            page_cache,
            dir,
            budget_bytes,
            extent_bytes: config.extent_bytes,
            fill_threads: config.fill_threads,
            keep: config.keep,
            evictor: config.evictor.clone(),
            evictor_options: config.evictor_options.clone(),
            pid: std::process::id(),
            users,
            counters: Counters::default(),
            listing: Mutex::new(Listing { at: None, extents: HashMap::new(), bytes: 0 }),
            maps: Mutex::new(HashMap::new()),
        };
        // The first user of a memory tier empties what a crashed job left behind, then shares
        // the directory.
        if let Some(users) = &tier.users {
            if flock(users, libc::LOCK_EX | libc::LOCK_NB).is_ok() && !tier.keep {
                tier.clear()?;
            }
            flock(users, libc::LOCK_SH).map_err(|e| Error::io("flock", &users_path, e))?;
        }
        Ok(Some(Arc::new(tier)))
    }

    /// Says once per process when the tier's directory is not in a memory file system: its
    /// extents are then disk files, read from disk into the page cache and copied from there
    /// (issue 40: a `GRANARY_TIER_DIR` on a disk was taken in silence). Loaders call it.
    pub fn warn_if_not_in_memory(&self) {
        if self.page_cache.is_some() {
            return;
        }
        static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if let Some((kind, false)) = file_system_of(&self.dir)
            && !WARNED.swap(true, Ordering::Relaxed)
        {
            eprintln!(
                "granary: the memory tier's directory {} is on a {kind} file system, not in memory: its extents \
                 are files on that disk; point GRANARY_TIER_DIR at a tmpfs (/dev/shm), or set GRANARY_TIER_BYTES=0",
                self.dir.display()
            );
        }
    }

    /// Where the tier's memory is.
    pub fn kind(&self) -> TierKind {
        if self.page_cache.is_some() { TierKind::PageCache } else { TierKind::Memory }
    }

    /// The memory tier's directory (`None` for the page cache tier).
    pub fn dir(&self) -> Option<&Path> {
        self.page_cache.is_none().then_some(self.dir.as_path())
    }

    /// Bytes per extent.
    pub fn extent_bytes(&self) -> u64 {
        self.extent_bytes
    }

    /// The configured budget.
    pub fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    /// Threads that fill this tier for a loader.
    pub fn fill_threads(&self) -> usize {
        self.fill_threads
    }

    /// Bytes the tier held at the last directory listing.
    pub fn held_bytes(&self) -> u64 {
        self.listing.lock().bytes
    }

    /// The evictor plugin asked for (`None`: `plan-aware`) and its options.
    pub fn evictor(&self) -> (Option<&str>, &[(String, String)]) {
        (self.evictor.as_deref(), &self.evictor_options)
    }

    /// Blocks per extent.
    pub fn extent_blocks(&self) -> u64 {
        self.extent_bytes / BLOCK_BYTES_U64
    }

    /// The extents of a shard whose data region is `n_data_blocks` long.
    pub fn n_extents(&self, n_data_blocks: u64) -> u64 {
        n_data_blocks.div_ceil(self.extent_blocks())
    }

    /// The bytes of extent `extent` of a shard whose data region is `n_data_blocks` long (0 past
    /// its end): exactly what its file holds.
    pub fn extent_len(&self, extent: u32, n_data_blocks: u64) -> u64 {
        let first = u64::from(extent) * self.extent_blocks();
        n_data_blocks.saturating_sub(first).min(self.extent_blocks()) * BLOCK_BYTES_U64
    }

    /// The file name of extent `key`: its shard, this tier's extent size (processes that cut
    /// shards into other extents never take each other's files) and its index.
    pub fn extent_name(&self, key: &ExtentKey) -> String {
        format!("{}.{}k.{:06}", key.shard, self.extent_bytes >> 10, key.extent)
    }

    /// Counters so far.
    pub fn stats(&self) -> TierStats {
        // The page cache's listing is kept by this process's fills, look-ups and evictions, and
        // looked at whole now and then.
        self.look_at_page_cache();
        let bytes_held = self.listing.lock().bytes;
        TierStats {
            bytes_held,
            budget_bytes: self.effective_budget(bytes_held),
            extents_loaded: self.counters.extents_loaded.load(Ordering::Relaxed),
            bytes_loaded: self.counters.bytes_loaded.load(Ordering::Relaxed),
            extents_evicted: self.counters.extents_evicted.load(Ordering::Relaxed),
            fill_failures: self.counters.fill_failures.load(Ordering::Relaxed),
            evictor_chosen: self.counters.evictor_chosen.load(Ordering::Relaxed),
            evictor_refused: self.counters.evictor_refused.load(Ordering::Relaxed),
            evictor_failures: self.counters.evictor_failures.load(Ordering::Relaxed),
        }
    }

    /// The budget after memory pressure: never more than the configured one, small enough that
    /// the node (and this process's cgroup) keeps a reserve free, counting the `held` bytes of
    /// the tier as its own to give back, and no more than the memory file system has room for
    /// (a tmpfs has a size of its own: half the memory unless mounted otherwise).
    pub fn effective_budget(&self, held: u64) -> u64 {
        let memory = Memory::recent();
        let headroom = memory.available.min(memory.cgroup_headroom.unwrap_or(u64::MAX));
        let limit = memory.cgroup_limit.unwrap_or(memory.total);
        let reserve = RESERVE_BYTES_MIN.min(limit / 4).max(limit / 16);
        if self.page_cache.is_some() {
            // The page cache's pages count as available already (the kernel can drop them).
            return self.budget_bytes.min(headroom.saturating_sub(reserve));
        }
        let allowed = held.saturating_add(headroom).saturating_sub(reserve);
        let room = fs_space(&self.dir).map_or(u64::MAX, |(_, free)| held.saturating_add(free));
        self.budget_bytes.min(allowed).min(room)
    }

    /// Looks `key` up, an extent of `len` bytes: mapped if resident, `Filling` if a live filler
    /// holds its claim. A file under its name of another length is not the extent (damaged, or
    /// written by hand): it is removed, so the extent can be filled again.
    ///
    /// In the page cache tier, `at` (the shard's file and its data blocks) maps a shard this
    /// process has not mapped yet; an extent any of whose pages is not in memory is `Absent`.
    pub fn lookup(&self, key: &ExtentKey, len: u64, at: Option<(&Path, u64)>) -> Result<Lookup> {
        if let Some(page_cache) = &self.page_cache {
            return Ok(match page_cache.lookup(key, at)? {
                Some(mapped) if mapped.len as u64 == len => {
                    // Found in memory (read in by another process, or before): listed as held.
                    let mut listing = self.listing.lock();
                    if listing.extents.insert(self.extent_name(key), (len, 0)).is_none() {
                        listing.bytes += len;
                    }
                    Lookup::Resident(mapped)
                }
                _ => Lookup::Absent,
            });
        }
        let name = self.extent_name(key);
        let mut maps = self.maps.lock();
        if let Some(mapped) = maps.get(&name) {
            if !mapped.is_gone() {
                return Ok(Lookup::Resident(Arc::clone(mapped)));
            }
            maps.remove(&name);
        }
        let path = self.dir.join(&name);
        match std::fs::File::open(&path) {
            Ok(file) => {
                let found = file.metadata().map_err(|e| Error::io("stat", &path, e))?.len();
                if found != len || len == 0 {
                    drop((file, maps));
                    self.evict(&name)?;
                    return Ok(Lookup::Absent);
                }
                let mapped = Arc::new(Mapped::file(MappedFile::new(file, &path)?));
                maps.insert(name, Arc::clone(&mapped));
                return Ok(Lookup::Resident(mapped));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("open", &path, e)),
        }
        drop(maps);
        Ok(if self.claim_is_live(&name) { Lookup::Filling } else { Lookup::Absent })
    }

    /// Whether extent `name` is in the tier now.
    pub fn is_resident(&self, key: &ExtentKey) -> bool {
        if let Some(page_cache) = &self.page_cache {
            return page_cache.is_resident(key);
        }
        self.dir.join(self.extent_name(key)).exists()
    }

    /// Whether a live filler holds the claim on extent `name`. A claim whose lock is free was
    /// left by a filler that died: it is removed.
    fn claim_is_live(&self, name: &str) -> bool {
        self.live_claim_bytes(name).is_some()
    }

    /// The bytes a live filler's claim on extent `name` says it is filling (its claim file's
    /// length: a sparse file, no memory; a claim that says nothing counts as a whole extent of
    /// the size its name says); `None` when no live filler holds it (a stale claim is removed).
    fn live_claim_bytes(&self, name: &str) -> Option<u64> {
        let claim = self.dir.join(format!(".fill-{name}"));
        let file = std::fs::File::open(&claim).ok()?;
        if flock(&file, libc::LOCK_EX | libc::LOCK_NB).is_err() {
            let said = file.metadata().map_or(0, |meta| meta.len());
            return Some(if said > 0 { said } else { extent_size_of(name).unwrap_or(self.extent_bytes) });
        }
        remove_if_same(&claim, &file);
        None
    }

    /// Counts a fill that failed before it reached the tier (a fault injected by a loader).
    pub(crate) fn count_fill_failure(&self) {
        self.counters.fill_failures.fetch_add(1, Ordering::Relaxed);
    }

    fn fill_page_cache(&self, info: &ExtentInfo) -> Result<Filled> {
        let Some(page_cache) = &self.page_cache else { return Err(Error::invalid_input("not a page cache tier")) };
        let outcome = page_cache.fill(info);
        match &outcome {
            Ok(Filled::Loaded) => {
                let bytes = info.n_blocks * BLOCK_BYTES_U64;
                self.counters.extents_loaded.fetch_add(1, Ordering::Relaxed);
                self.counters.bytes_loaded.fetch_add(bytes, Ordering::Relaxed);
                let mut listing = self.listing.lock();
                if listing.extents.insert(self.extent_name(&info.key), (bytes, 0)).is_none() {
                    listing.bytes += bytes;
                }
            }
            Ok(Filled::Elsewhere) => {}
            Err(_) => {
                self.counters.fill_failures.fetch_add(1, Ordering::Relaxed);
            }
        }
        outcome
    }

    /// Removes extent `name` from the tier (mappings of it stay valid until dropped).
    pub fn evict(&self, name: &str) -> Result<()> {
        if !is_extent_name(name) {
            return Err(Error::invalid_input(format!("{name:?} is not the name of a memory tier extent")));
        }
        if let Some(page_cache) = &self.page_cache {
            let key = extent_key_of(name, self.extent_bytes)
                .ok_or_else(|| Error::invalid_input(format!("{name:?} is not an extent of this tier's size")))?;
            page_cache.evict(&key)?;
            self.counters.extents_evicted.fetch_add(1, Ordering::Relaxed);
            let mut listing = self.listing.lock();
            if let Some((bytes, _)) = listing.extents.remove(name) {
                debug_assert!(listing.bytes >= bytes, "the listing's bytes are its extents'");
                listing.bytes -= bytes;
            }
            return Ok(());
        }
        let path = self.dir.join(name);
        match std::fs::remove_file(&path) {
            Ok(()) => {
                self.counters.extents_evicted.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("remove", &path, e)),
        }
        if let Some(mapped) = self.maps.lock().remove(name) {
            mapped.mark_gone();
        }
        let mut listing = self.listing.lock();
        if let Some((bytes, _)) = listing.extents.remove(name) {
            debug_assert!(listing.bytes >= bytes, "the listing's bytes are its extents'");
            listing.bytes -= bytes;
        }
        Ok(())
    }

    /// The extents held node-wide (name and bytes), listed again when the last listing is older
    /// than a moment. Only files named as extents count.
    pub fn resident(&self) -> Result<(HashMap<String, u64>, u64)> {
        self.look_at_page_cache();
        let mut listing = self.listing.lock();
        if self.page_cache.is_none() && listing.at.is_none_or(|at| at.elapsed() > SCAN_TTL) {
            self.list(&mut listing)?;
        }
        listing.debug_check();
        Ok((listing.extents.iter().map(|(name, &(bytes, _))| (name.clone(), bytes)).collect(), listing.bytes))
    }

    /// The page cache tier's look at what every mapped shard has in memory, when one is due
    /// (`PAGE_CACHE_SCAN_TTL`). It runs without the listing's lock (readers take it when they
    /// find an extent in memory), one look at a time, marked as begun first.
    fn look_at_page_cache(&self) {
        let Some(page_cache) = &self.page_cache else { return };
        {
            let mut listing = self.listing.lock();
            if listing.at.is_some_and(|at| at.elapsed() <= PAGE_CACHE_SCAN_TTL) {
                return;
            }
            listing.at = Some(Instant::now());
        }
        let (extents, bytes) = page_cache.resident(|key| self.extent_name(key));
        let extents = extents.into_iter().map(|(name, bytes)| (name, (bytes, 0))).collect();
        *self.listing.lock() = Listing { at: Some(Instant::now()), extents, bytes };
    }

    /// What the tier holds and is filling node-wide, listed now: the extents, and each fill under
    /// way at its claim's length (a live claim; a dead filler's is removed).
    fn holdings_now(&self) -> Result<Holdings> {
        if let Some(page_cache) = &self.page_cache {
            let (extents, held) = self.resident()?;
            return Ok(Holdings { extents, held, filling: page_cache.filling() });
        }
        let mut listing = self.listing.lock();
        let claims = self.list(&mut listing)?;
        listing.debug_check();
        let extents = listing.extents.iter().map(|(name, &(bytes, _))| (name.clone(), bytes)).collect();
        let held = listing.bytes;
        drop(listing);
        // A fill is counted at the length its claim says (a shard's last extent is shorter, and
        // a shard smaller than one extent is all last extent).
        let filling = claims.iter().filter_map(|extent| self.live_claim_bytes(extent)).sum();
        Ok(Holdings { extents, held, filling })
    }

    /// Lists the directory into `listing` (an extent whose name and inode were listed before
    /// keeps its size: extents are never written again) and returns the extents claimed.
    fn list(&self, listing: &mut Listing) -> Result<Vec<String>> {
        use std::os::unix::fs::DirEntryExt;
        let mut extents = HashMap::new();
        let mut claims = Vec::new();
        let mut bytes = 0;
        let entries = std::fs::read_dir(&self.dir).map_err(|e| Error::io("list", &self.dir, e))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(".fill-")
                && let Some(extent) = claimed_extent(&name)
            {
                claims.push(extent.to_owned());
                continue;
            }
            if !is_extent_name(&name) {
                continue;
            }
            let ino = entry.ino();
            let size = match listing.extents.get(&name) {
                Some(&(size, listed)) if listed == ino => Some(size),
                // The entry's own metadata: a symlink is not an extent.
                _ => entry.metadata().ok().filter(std::fs::Metadata::is_file).map(|meta| meta.len()),
            };
            if let Some(size) = size {
                bytes += size;
                extents.insert(name, (size, ino));
            }
        }
        // Mappings of extents another process evicted (or replaced) go, so their memory can.
        self.maps.lock().retain(|name, mapped| {
            let listed = extents.get(name).is_some_and(|&(_, ino)| ino == mapped.map.ino());
            if !listed {
                mapped.mark_gone();
            }
            listed
        });
        *listing = Listing { at: Some(Instant::now()), extents, bytes };
        Ok(claims)
    }

    /// Removes every extent, every stale claim and every private file of a filler that died;
    /// files of other names are left alone.
    ///
    /// A page cache tier forgets its mappings only: the kernel holds the pages, and takes them
    /// back as it needs.
    pub fn clear(&self) -> Result<()> {
        if let Some(page_cache) = &self.page_cache {
            page_cache.forget();
            *self.listing.lock() = Listing { at: None, extents: HashMap::new(), bytes: 0 };
            return Ok(());
        }
        let entries = std::fs::read_dir(&self.dir).map_err(|e| Error::io("list", &self.dir, e))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let remove = if is_extent_name(&name) || is_old_extent_name(&name) {
                true
            } else if let Some(extent) = claimed_extent(&name) {
                // A live filler's claim and private file stay; a dead one's go (the claim
                // itself is removed by the check).
                !self.claim_is_live(extent) && !name.starts_with(".fill-")
            } else {
                false
            };
            if remove {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        *self.listing.lock() = Listing { at: None, extents: HashMap::new(), bytes: 0 };
        for (_, mapped) in self.maps.lock().drain() {
            mapped.mark_gone();
        }
        Ok(())
    }
}

impl Drop for MemoryTier {
    fn drop(&mut self) {
        // The last user empties the directory, so the job's memory goes back when it ends. A
        // forked child holds its parent's lock, not one of its own: it leaves the tier alone.
        if let Some(users) = &self.users
            && !self.keep
            && std::process::id() == self.pid
            && flock(users, libc::LOCK_EX | libc::LOCK_NB).is_ok()
        {
            let _ = self.clear();
        }
    }
}

impl std::fmt::Debug for MemoryTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryTier")
            .field("kind", &self.kind())
            .field("dir", &self.dir)
            .field("budget_bytes", &self.budget_bytes)
            .field("extent_bytes", &self.extent_bytes)
            .finish()
    }
}

#[cfg(test)]
mod tests;
