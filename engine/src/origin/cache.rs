//! The bounded cache of shards that readers of attached datasets fetched from their origins.
//!
//! Owns: fetching a shard a read needs (ranged reads into `origin/incoming/`, the whole file
//! hashed against its id, refetched when it does not match, published into `shards/` by a
//! rename), and keeping the store's cached shards within the bound `origin/cache` sets, with the
//! evictor plugin choosing victims. Cached shards are the attached datasets' shards that no
//! local dataset names; only those are ever evicted. Readers in several processes share one
//! cache: admission and eviction run under an exclusive lock on `origin/LOCK`, against a fresh
//! look at which shards are here, so the bound holds across processes (exceeded at most by the
//! shards being fetched at that moment, which are published only after room was made). A shard
//! already open by a reader stays readable after it is evicted (its file lives until closed).
//! Invariant: no shard is published before its bytes hashed to its id. Never: takes the store's
//! write lock or writes the catalog (the files are the truth; `granary repair` recatalogs).

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::attach::{attachments, cache_bound, origin_dir};
use super::{FETCH_TRIES, Origin};
use crate::error::{Error, Result};
use crate::id::ShardId;
use crate::policy::{Limits, PolicyHost};
use crate::read::ShardRepair;
use crate::replication::cache::ShardCache;
use crate::store::{StorePaths, sync_dir};

/// Counters of one process's cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Shards fetched from an origin and published here.
    pub shards_fetched: u64,
    /// Bytes of them.
    pub bytes_from_origin: u64,
    /// Fetches whose bytes did not hash to the shard's id (dropped and fetched again).
    pub refetches: u64,
    /// Shards evicted (deleted) to keep the bound, and their bytes.
    pub evictions: u64,
    /// Bytes of them.
    pub bytes_evicted: u64,
    /// Shard accesses by reads (one per shard a batch touched).
    pub accesses: u64,
    /// Time reads waited for fetches.
    pub fetch_wait: Duration,
}

/// The cache of one store, over all its attachments. Shared by a process's readers.
pub struct OriginCache {
    paths: StorePaths,
    bound: u64,
    origins: Vec<Arc<Origin>>,
    /// Every shard an attached dataset names: its bytes and which origin has it.
    fetchable: HashMap<ShardId, (u64, usize)>,
    /// Shards a local (not attached) dataset names: never evicted.
    local: HashSet<ShardId>,
    evictor: Mutex<ShardCache>,
    /// Shards this process is fetching; readers that need one wait for it on `landed`.
    flying: Mutex<HashSet<ShardId>>,
    landed: Condvar,
    stats: Mutex<CacheStats>,
}

impl std::fmt::Debug for OriginCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OriginCache")
            .field("root", &self.paths.root())
            .field("bound", &self.bound)
            .field("origins", &self.origins)
            .finish_non_exhaustive()
    }
}

/// Takes the cache's exclusive lock (blocking; held for a listing, a few deletions and a rename).
pub(crate) fn lock_cache(paths: &StorePaths) -> Result<File> {
    let dir = origin_dir(paths);
    std::fs::create_dir_all(&dir).map_err(|e| Error::io("create directory", &dir, e))?;
    let path = dir.join("LOCK");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io("open", &path, e))?;
    crate::io::flock(&file, libc::LOCK_EX).map_err(|e| Error::io("lock", &path, e))?;
    Ok(file)
}

impl OriginCache {
    /// The cache of the store at `paths`, or `None` when nothing is attached there. `evictor`
    /// names the evictor plugin (a built-in name or a file; the built-in default when `None`).
    pub fn open(paths: &StorePaths, evictor: Option<&str>, options: &[(String, String)]) -> Result<Option<Arc<Self>>> {
        let attached = attachments(paths)?;
        if attached.is_empty() {
            return Ok(None);
        }
        let mut origins: Vec<Arc<Origin>> = Vec::new();
        let mut fetchable = HashMap::new();
        for attachment in &attached {
            let at = match origins.iter().position(|o| o.url() == attachment.url) {
                Some(at) => at,
                None => {
                    origins.push(Arc::new(Origin::open(&attachment.url)?));
                    origins.len() - 1
                }
            };
            let log = match paths.read_ref(&attachment.name) {
                Ok(log) => log,
                // An attach cut short before its ref: nothing to read yet.
                Err(Error::NotFound { .. }) => continue,
                Err(e) => return Err(e),
            };
            for version in log.versions() {
                for entry in paths.read_manifest(version.manifest)?.entries() {
                    fetchable.insert(entry.shard, (entry.file_bytes, at));
                }
            }
        }
        let mut local = HashSet::new();
        for name in paths.list_refs()? {
            if attached.iter().any(|a| a.name == name) {
                continue;
            }
            for version in paths.read_ref(&name)?.versions() {
                local.extend(paths.read_manifest(version.manifest)?.entries().iter().map(|e| e.shard));
            }
        }
        let bound = cache_bound(paths)?;
        let host = PolicyHost::new(Limits::default(), None)?;
        let evictor = ShardCache::new(&host, evictor, options, bound)?;
        let incoming = origin_dir(paths).join("incoming");
        std::fs::create_dir_all(&incoming).map_err(|e| Error::io("create directory", &incoming, e))?;
        Ok(Some(Arc::new(Self {
            paths: paths.clone(),
            bound,
            origins,
            fetchable,
            local,
            evictor: Mutex::new(evictor),
            flying: Mutex::new(HashSet::new()),
            landed: Condvar::new(),
            stats: Mutex::new(CacheStats::default()),
        })))
    }

    /// The bound in bytes (0: none).
    pub fn bound(&self) -> u64 {
        self.bound
    }

    /// The counters so far.
    pub fn stats(&self) -> CacheStats {
        *self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bytes of the cached shards here now (every process's).
    pub fn held_bytes(&self) -> u64 {
        self.present(None).iter().map(|&(_, bytes)| bytes).sum()
    }

    /// Whether shard `id` can be fetched from an origin by this cache.
    pub fn can_fetch(&self, id: ShardId) -> bool {
        self.fetchable.contains_key(&id)
    }

    /// Makes shard `id` present here: fetched from its origin and published, unless it already
    /// is (or another reader of this process is fetching it, which this one then waits for).
    pub fn fetch(&self, id: ShardId) -> Result<()> {
        let started = Instant::now();
        let result = self.fetch_once(id);
        self.stats.lock().unwrap_or_else(PoisonError::into_inner).fetch_wait += started.elapsed();
        result
    }

    fn fetch_once(&self, id: ShardId) -> Result<()> {
        let Some(&(bytes, at)) = self.fetchable.get(&id) else {
            return Err(Error::NotFound { what: format!("shard {id} in the datasets attached here") });
        };
        {
            let mut flying = self.flying.lock().unwrap_or_else(PoisonError::into_inner);
            while flying.contains(&id) {
                flying = self.landed.wait(flying).unwrap_or_else(PoisonError::into_inner);
            }
            if self.paths.shard(id).exists() {
                return Ok(());
            }
            flying.insert(id);
        }
        let result = self.fetch_flying(id, bytes, &self.origins[at]);
        self.flying.lock().unwrap_or_else(PoisonError::into_inner).remove(&id);
        self.landed.notify_all();
        result
    }

    fn fetch_flying(&self, id: ShardId, bytes: u64, origin: &Origin) -> Result<()> {
        static PARTS: AtomicU64 = AtomicU64::new(0);
        let incoming = origin_dir(&self.paths).join("incoming");
        for _ in 0..FETCH_TRIES {
            let part = incoming.join(format!("{}-{}.part", std::process::id(), PARTS.fetch_add(1, Ordering::Relaxed)));
            match origin.fetch_shard(id, bytes, &part) {
                Ok(()) => {
                    let published = self.publish(id, bytes, &part);
                    if published.is_err() {
                        let _ = std::fs::remove_file(&part);
                    }
                    return published;
                }
                Err(Error::HashMismatch { .. }) => {
                    let _ = std::fs::remove_file(&part);
                    self.stats.lock().unwrap_or_else(PoisonError::into_inner).refetches += 1;
                }
                Err(e) => {
                    let _ = std::fs::remove_file(&part);
                    return Err(e);
                }
            }
        }
        Err(Error::Origin {
            origin: origin.url().to_owned(),
            op: "fetch",
            detail: format!(
                "shard {id}: its bytes did not hash to its id in {FETCH_TRIES} tries (damaged at the origin or on \
                 the way); none of them was used"
            ),
        })
    }

    /// Makes room for shard `id` and renames its verified file into place, under the lock.
    fn publish(&self, id: ShardId, bytes: u64, part: &std::path::Path) -> Result<()> {
        let _lock = lock_cache(&self.paths)?;
        self.make_room(id, bytes)?;
        let target = self.paths.shard(id);
        let fan = target.parent().expect("shards live in a fan-out directory");
        std::fs::create_dir_all(fan).map_err(|e| Error::io("create directory", fan, e))?;
        std::fs::rename(part, &target).map_err(|e| Error::io("rename", &target, e))?;
        sync_dir(fan)?;
        sync_dir(fan.parent().expect("the fan-out directory has a parent"))?;
        let mut stats = self.stats.lock().unwrap_or_else(PoisonError::into_inner);
        stats.shards_fetched += 1;
        stats.bytes_from_origin += bytes;
        Ok(())
    }

    /// The cached (evictable) shards here now and their bytes, without `except`.
    fn present(&self, except: Option<ShardId>) -> Vec<(ShardId, u64)> {
        let mut present: Vec<(ShardId, u64)> = self
            .fetchable
            .iter()
            .filter(|(id, _)| Some(**id) != except && !self.local.contains(id) && self.paths.shard(**id).exists())
            .map(|(&id, &(bytes, _))| (id, bytes))
            .collect();
        present.sort();
        present
    }

    /// Evicts until shard `id` of `bytes` fits within the bound; the caller holds the lock.
    /// The evictor chooses, after it has been told of what other processes fetched (and what
    /// they evicted); when its choice still leaves the cache over the bound (a plugin that keeps
    /// more than it is allowed), the oldest shards go.
    fn make_room(&self, id: ShardId, bytes: u64) -> Result<()> {
        if self.bound == 0 {
            return Ok(());
        }
        let present = self.present(Some(id));
        let mut victims = Vec::new();
        {
            let mut evictor = self.evictor.lock().unwrap_or_else(PoisonError::into_inner);
            let here: HashSet<ShardId> = present.iter().map(|&(id, _)| id).collect();
            let gone: Vec<ShardId> =
                self.fetchable.keys().copied().filter(|s| !here.contains(s) && evictor.holds(*s)).collect();
            for shard in gone {
                evictor.forget(shard);
            }
            for &(shard, shard_bytes) in &present {
                if !evictor.holds(shard) {
                    victims.extend(evictor.admit(shard, shard_bytes)?.0);
                }
            }
            victims.extend(evictor.admit(id, bytes)?.0);
        }
        for (victim, victim_bytes) in victims {
            if victim != id {
                self.evict(victim, victim_bytes)?;
            }
        }
        let mut present = self.present(Some(id));
        let mut used: u64 = present.iter().map(|&(_, b)| b).sum();
        if used + bytes > self.bound {
            present
                .sort_by_key(|&(shard, _)| std::fs::metadata(self.paths.shard(shard)).and_then(|m| m.modified()).ok());
            for (shard, shard_bytes) in present {
                if used + bytes <= self.bound {
                    break;
                }
                self.evictor.lock().unwrap_or_else(PoisonError::into_inner).forget(shard);
                self.evict(shard, shard_bytes)?;
                used -= shard_bytes;
            }
        }
        Ok(())
    }

    fn evict(&self, id: ShardId, bytes: u64) -> Result<()> {
        let path = self.paths.shard(id);
        match std::fs::remove_file(&path) {
            Ok(()) => {
                let mut stats = self.stats.lock().unwrap_or_else(PoisonError::into_inner);
                stats.evictions += 1;
                stats.bytes_evicted += bytes;
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove", &path, e)),
        }
    }

    /// The damaged copy of shard `id` goes to `quarantine/` (a rename: no lock needed).
    fn quarantine(&self, id: ShardId) -> Result<()> {
        let path = self.paths.shard(id);
        if path.exists() {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            self.paths.move_to_quarantine(&path, &name)?;
        }
        Ok(())
    }

    /// Where a shard of the attached datasets lives here (present or not).
    pub fn shard_path(&self, id: ShardId) -> PathBuf {
        self.paths.shard(id)
    }
}

impl crate::engine::ShardFetcher for OriginCache {
    fn can_fetch(&self, id: ShardId) -> bool {
        OriginCache::can_fetch(self, id)
    }

    fn fetch(&self, id: ShardId) -> Result<()> {
        OriginCache::fetch(self, id)
    }
}

impl ShardRepair for OriginCache {
    fn repair(&self, shard: ShardId, cause: &Error) -> Result<()> {
        if !self.can_fetch(shard) {
            return Err(Error::NotFound {
                what: format!("shard {shard} at an origin (it is not an attached dataset's)"),
            });
        }
        if cause.is_corruption() {
            self.quarantine(shard)?;
        }
        self.fetch(shard)
    }

    fn accessed(&self, shards: &[ShardId]) {
        self.stats.lock().unwrap_or_else(PoisonError::into_inner).accesses += shards.len() as u64;
        if self.bound == 0 {
            return;
        }
        let victims = self.evictor.lock().unwrap_or_else(PoisonError::into_inner).touch(shards);
        // A plugin that changed its mind about what fits: its victims go now, under the lock.
        if let Ok(victims) = victims
            && !victims.is_empty()
            && let Ok(_lock) = lock_cache(&self.paths)
        {
            for (victim, bytes) in victims {
                let _ = self.evict(victim, bytes);
            }
        }
    }
}
