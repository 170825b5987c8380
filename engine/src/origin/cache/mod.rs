//! The bounded cache of shards that readers of attached datasets fetched from their origins.
//!
//! Owns: fetching a shard a read needs (from a peer of the job through the replication node
//! beside the store when one holds it; else by ranged reads into `origin/incoming/`, the whole
//! file hashed against its id, refetched when it does not match, published into `shards/` by a
//! rename), and keeping the store's cached shards within the bound `origin/cache` sets, with the
//! evictor plugin choosing victims. Cached shards are the attached datasets' shards that no
//! local dataset names; only those are ever evicted. Readers in several processes share one
//! cache: admission and eviction run under an exclusive lock on `origin/LOCK`, against a fresh
//! look at which shards are here, so the bound holds across processes (exceeded at most by the
//! shards being fetched at that moment, which are published only after room was made). A shard
//! already open by a reader stays readable after it is evicted (its file lives until closed;
//! readers close it once no batch they have in flight reads it, and close a fetched shard's
//! file as soon as the plan does not read it again soon, `keeps_open`, so the bound holds for
//! the disk but for those).
//! A store this process cannot write is only read (its cached shards serve; nothing is fetched
//! or evicted). The plan's side (next uses, fetches ahead) is `prefetch.rs`. Invariant: no
//! shard is published before its bytes hashed to its id. Never:
//! takes the store's write lock or writes the catalog (the files are the truth; `granary
//! repair` recatalogs).

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::io::ErrorKind;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

mod prefetch;
use prefetch::Signal;

use super::pace::{PREFETCH_THREADS, Pace};
use super::{FETCH_TRIES, Origin};
use crate::error::{Error, Result};
use crate::id::ShardId;
use crate::policy::{Limits, PolicyHost, ShardCache};
use crate::read::{CacheStats, ShardSource};
use crate::store::attached::{attachments, cache_settings, origin_dir, store_shards};
use crate::store::{StorePaths, sync_dir};

/// Shards of the plan the prefetch thread looks at, soonest first.
const PREFETCH_LOOKAHEAD: usize = 64;
/// How long a shard a read waited for stays pinned at most (the read normally comes at once).
const PIN_FOR: Duration = Duration::from_secs(30);
/// Steps after the evictor chose a shard needed no later than the one it made room for (which
/// then stayed) during which fetches ahead use free room only.
const REGRET_STEPS: u64 = 64;
/// Steps ahead within which a reader keeps the file of a fetched shard the plan reads again
/// open: one read again later is closed once read (`ShardSource::keeps_open`), so that its
/// eviction frees the disk at once; reopening one read again this soon would cost more than its
/// rare eviction (the shards needed last go first).
const KEEP_OPEN_STEPS: u64 = 8;
/// How long an idle prefetch thread waits at most for the reader to move on (a step, a plan)
/// before it looks again (a fetch by another process may have made room meanwhile).
const PREFETCH_IDLE: Duration = Duration::from_millis(100);

/// How long the node beside the store is not asked again after it could not be reached (or
/// failed slowly).
const PEERS_DOWN_FOR: Duration = Duration::from_secs(30);
/// A node's failure that took this long (waiting on the store's write lock, say) leaves it
/// alone for `PEERS_DOWN_FOR` too: the next shard would wait as long.
const PEERS_SLOW: Duration = Duration::from_secs(2);

/// The replication node a cache asks before its origin, and until when it is left alone.
struct Peers {
    node: Arc<dyn ShardSource>,
    down_until: Option<Instant>,
}

/// What a fetch found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fetch {
    /// This call fetched and published the shard.
    Fetched,
    /// The shard was here already, or another reader published it meanwhile.
    Present,
    /// Another process is fetching it (asked not to wait).
    Elsewhere,
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
    /// The steps (batches of this process's reader, counted from its start) at which each
    /// shard is read, as far as the loader has told (`add_plan`); past steps are dropped.
    plan: Mutex<HashMap<ShardId, VecDeque<u64>>>,
    /// Batches delivered so far: the step the reader is at.
    step: AtomicU64,
    /// Batches the reader has issued and not delivered yet (`ShardSource::in_flight`): their
    /// files are open, so their reads need nothing more from the cache. `reading_at` counts
    /// the plan's uses from after them.
    ahead: AtomicU64,
    /// This cache, for the prefetch thread (which holds it only while it works, so the cache
    /// goes, and the thread ends, when its last reader does).
    me: std::sync::Weak<Self>,
    prefetching: std::sync::Once,
    /// Counts the reader's moves (steps, plans); idle prefetch threads wait on it to change, so
    /// a shard is fetched as soon as the reader's progress makes it worth it. Shared with the
    /// threads apart from the cache: an idle thread holds only this, so the cache goes when its
    /// last reader does (and its drop wakes the threads to end), not after one more round of
    /// fetches for a plan nobody reads, evicting what another loader just fetched (issue 40).
    signal: Arc<Signal>,
    /// The step at which the evictor last chose a shard needed no later than the one it made
    /// room for (an evictor that does not follow the plan, LRU say): for `REGRET_STEPS` steps
    /// from then, fetches ahead use free room only, so prefetch and eviction cannot chase each
    /// other.
    regret_at: AtomicU64,
    /// The shards of each delivered batch, when asked for (`record_trace`).
    trace: Mutex<Option<Vec<Vec<ShardId>>>>,
    /// Shards a read of this process waited for and has not read yet: never evicted before it
    /// has (or `PIN_FOR` passed), even when that keeps the cache over its bound for a moment.
    pinned: Mutex<HashMap<ShardId, Instant>>,
    /// The replication node asked for a shard before its origin (a peer of the job that holds
    /// it is nearer and cheaper), and until when it is not asked after it could not be reached.
    peers: Mutex<Option<Peers>>,
    pace: Mutex<Pace>,
    /// Whether this process may write the store (else it only reads the shards here).
    writable: bool,
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
    super::lock_exclusive(&origin_dir(paths), "LOCK")
}

impl OriginCache {
    /// The cache of the store at `paths`, or `None` when nothing is attached there. `evictor`
    /// names the evictor plugin (a built-in name or a file); `None`: the store's (`attach
    /// --evictor`), else `plan-aware`.
    pub fn open(paths: &StorePaths, evictor: Option<&str>, options: &[(String, String)]) -> Result<Option<Arc<Self>>> {
        Self::open_with(paths, evictor, options, &[])
    }

    /// `open`, reaching the origins whose URLs `given` has through those (a wrapper that adds
    /// latency or faults, in benchmarks and tests) instead of opening them afresh.
    pub fn open_with(
        paths: &StorePaths,
        evictor: Option<&str>,
        options: &[(String, String)],
        given: &[Arc<Origin>],
    ) -> Result<Option<Arc<Self>>> {
        if attachments(paths)?.is_empty() {
            return Ok(None);
        }
        let shards = store_shards(paths)?;
        let mut origins: Vec<Arc<Origin>> = Vec::new();
        let mut fetchable = HashMap::new();
        for (&id, (bytes, url)) in &shards.attached {
            let at = match origins.iter().position(|o| o.url() == url) {
                Some(at) => at,
                None => {
                    let origin = match given.iter().find(|o| o.url() == url) {
                        Some(origin) => Arc::clone(origin),
                        None => Arc::new(Origin::open(url)?),
                    };
                    origins.push(origin);
                    origins.len() - 1
                }
            };
            fetchable.insert(id, (*bytes, at));
        }
        let local = shards.local;
        let settings = cache_settings(paths)?;
        let bound = settings.bytes;
        let host = PolicyHost::new(Limits::default(), None)?;
        // The one asked for, else the store's, else the one that follows the plan.
        let evictor = evictor.or(settings.evictor.as_deref()).unwrap_or("plan-aware");
        let evictor = ShardCache::new(&host, Some(evictor), options, bound)?;
        let incoming = origin_dir(paths).join("incoming");
        // A store this process cannot write (a read-only mount, another user's) is read as it
        // is: the shards here serve, nothing is fetched or evicted.
        // The directory may exist already: opening the cache's lock file for writing is the
        // probe.
        let lock = origin_dir(paths).join("LOCK");
        let refused =
            |e: &std::io::Error| matches!(e.kind(), ErrorKind::ReadOnlyFilesystem | ErrorKind::PermissionDenied);
        let writable = match std::fs::create_dir_all(&incoming) {
            Ok(()) => match std::fs::OpenOptions::new().write(true).create(true).truncate(false).open(&lock) {
                Ok(_) => true,
                Err(e) if refused(&e) => false,
                Err(e) => return Err(Error::io("create", &lock, e)),
            },
            Err(e) if refused(&e) => false,
            Err(e) => return Err(Error::io("create directory", &incoming, e)),
        };
        if writable {
            sweep_incoming(&incoming)?;
        }
        let peers = node_beside(paths)?;
        Ok(Some(Arc::new_cyclic(|me| Self {
            paths: paths.clone(),
            bound,
            origins,
            fetchable,
            local,
            evictor: Mutex::new(evictor),
            flying: Mutex::new(HashSet::new()),
            landed: Condvar::new(),
            stats: Mutex::new(CacheStats::default()),
            plan: Mutex::new(HashMap::new()),
            step: AtomicU64::new(0),
            ahead: AtomicU64::new(0),
            me: me.clone(),
            prefetching: std::sync::Once::new(),
            signal: Arc::new(Signal { moves: Mutex::new(0), moved: Condvar::new() }),
            regret_at: AtomicU64::new(u64::MAX),
            trace: Mutex::new(None),
            pinned: Mutex::new(HashMap::new()),
            peers: Mutex::new(peers),
            pace: Mutex::new(Pace::default()),
            writable,
        })))
    }

    /// Asks `node` (a replication node: `replication::Node` in this process, or a
    /// `NodeClient` of one beside it) for each shard before its origin; it pulls the shard from
    /// a peer that holds it, verified, or refuses at once when none does. `open` sets this
    /// itself when `GRANARY_CLUSTER_KEY` is set and a `granary serve` serves the store. `node`
    /// must not fetch through an origin cache of this store: it would wait on this one's claim.
    pub fn set_peers(&self, node: Arc<dyn ShardSource>) {
        *self.peers.lock() = Some(Peers { node, down_until: None });
    }

    /// The bound in bytes (0: none).
    pub fn bound(&self) -> u64 {
        self.bound
    }

    /// The counters so far.
    pub fn stats(&self) -> CacheStats {
        *self.stats.lock()
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
    /// is (or another reader is fetching it, in this process or another, which this one then
    /// waits for).
    pub fn fetch(&self, id: ShardId) -> Result<()> {
        self.fetch_counted(id, true).map(|_| ())
    }

    /// `fetch`; says whether this call fetched it. With `wait` false, a shard another process
    /// is fetching is left to it (`Fetch::Elsewhere`) instead of waited for.
    fn fetch_counted(&self, id: ShardId, wait: bool) -> Result<Fetch> {
        let Some(&(bytes, at)) = self.fetchable.get(&id) else {
            return Err(Error::NotFound { what: format!("shard {id} in the datasets attached here") });
        };
        if !self.writable {
            if self.paths.shard(id).exists() {
                return Ok(Fetch::Present);
            }
            return Err(Error::Unavailable {
                what: format!("shard {id}"),
                detail: format!(
                    "it is not cached in {} and the store cannot be written here (read-only or another user's), so it \
                     cannot be fetched from {}",
                    self.paths.root().display(),
                    self.origins[at].url()
                ),
            });
        }
        {
            let mut flying = self.flying.lock();
            while flying.contains(&id) {
                self.landed.wait(&mut flying);
            }
            if self.paths.shard(id).exists() {
                return Ok(Fetch::Present);
            }
            flying.insert(id);
        }
        let result = self.claim_and_fetch(id, bytes, &self.origins[at], wait);
        self.flying.lock().remove(&id);
        self.landed.notify_all();
        self.moved();
        result
    }

    /// Fetches shard `id` under its claim, `origin/incoming/<id>.claim` (flock'd, exclusive),
    /// so that the processes sharing this store fetch each shard once: one that finds it
    /// claimed waits for the claim (or, with `wait` false, leaves the shard to its holder),
    /// then finds the shard published.
    fn claim_and_fetch(&self, id: ShardId, bytes: u64, origin: &Origin, wait: bool) -> Result<Fetch> {
        let path = origin_dir(&self.paths).join("incoming").join(format!("{id}.claim"));
        let claim = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::io("create", &path, e))?;
        let operation = if wait { libc::LOCK_EX } else { libc::LOCK_EX | libc::LOCK_NB };
        match crate::io::flock(&claim, operation) {
            Ok(()) => {}
            Err(e) if !wait && e.kind() == std::io::ErrorKind::WouldBlock => return Ok(Fetch::Elsewhere),
            Err(e) => return Err(Error::io("lock", &path, e)),
        }
        // Removed while held, whatever comes of it: a process that opened it before waits on
        // this file's lock and then finds the shard; one that comes later makes a new claim (and
        // finds the shard).
        let fetched = if self.paths.shard(id).exists() {
            Ok(Fetch::Present)
        } else {
            match self.fetch_from_peers(id, bytes) {
                Ok(true) => Ok(Fetch::Fetched),
                Ok(false) => self.fetch_flying(id, bytes, origin).map(|()| Fetch::Fetched),
                Err(e) => Err(e),
            }
        };
        let _ = std::fs::remove_file(&path);
        fetched
    }

    /// Asks the replication node, if there is one, for shard `id` from a peer; returns whether
    /// it is here now (published by the node, which checked its bytes against the id; the
    /// reader checks each block as it reads). The node's refusal (no peer holds it, or none
    /// sent it whole) leaves the shard to the origin; a node that cannot be reached, or took
    /// `PEERS_SLOW` to fail, is not asked again for `PEERS_DOWN_FOR`.
    fn fetch_from_peers(&self, id: ShardId, bytes: u64) -> Result<bool> {
        let node = {
            let peers = self.peers.lock();
            match &*peers {
                Some(Peers { node, down_until }) if down_until.is_none_or(|until| Instant::now() >= until) => {
                    Arc::clone(node)
                }
                _ => return Ok(false),
            }
        };
        // Room first, as for a fetch from the origin (the node publishes the shard itself).
        {
            let _lock = lock_cache(&self.paths)?;
            self.make_room(id, bytes)?;
        }
        let cause = Error::NotFound { what: format!("shard {id} in the cache") };
        let asked = Instant::now();
        match node.repair(id, &cause) {
            Ok(()) if self.paths.shard(id).exists() => {}
            Ok(()) => return Ok(false),
            Err(e) => {
                // No peer holding it is the common answer; anything else is counted.
                let none_holds = matches!(&e, Error::Unavailable { .. } | Error::NotFound { .. })
                    || matches!(&e, Error::PeerRefused { code, .. } if code == "unavailable" || code == "not found");
                if !none_holds {
                    self.stats.lock().peer_failures += 1;
                }
                warn_refused_key(&e);
                let unreachable = matches!(e, Error::Transport { .. } | Error::Io { .. });
                if (unreachable || asked.elapsed() >= PEERS_SLOW)
                    && let Some(peers) = &mut *self.peers.lock()
                {
                    peers.down_until = Some(Instant::now() + PEERS_DOWN_FOR);
                }
                return Ok(false);
            }
        }
        // Another process may have filled the room meanwhile: the bound is kept now.
        {
            let _lock = lock_cache(&self.paths)?;
            self.make_room(id, bytes)?;
        }
        let mut stats = self.stats.lock();
        stats.shards_fetched += 1;
        stats.shards_from_peers += 1;
        stats.bytes_from_peers += bytes;
        Ok(true)
    }

    fn fetch_flying(&self, id: ShardId, bytes: u64, origin: &Origin) -> Result<()> {
        static PARTS: AtomicU64 = AtomicU64::new(0);
        let incoming = origin_dir(&self.paths).join("incoming");
        for _ in 0..FETCH_TRIES {
            let part = incoming.join(format!("{}-{}.part", std::process::id(), PARTS.fetch_add(1, Ordering::Relaxed)));
            let started = Instant::now();
            match origin.fetch_shard(id, bytes, &part) {
                // Locked until it is under `shards/` (or removed).
                Ok(_locked) => {
                    let rate = bytes as f64 / started.elapsed().as_secs_f64().max(1e-6);
                    let mut pace = self.pace.lock();
                    pace.fetch_rate = Pace::average(pace.fetch_rate, rate);
                    drop(pace);
                    let published = self.publish(id, bytes, &part);
                    if published.is_err() {
                        let _ = std::fs::remove_file(&part);
                    }
                    return published;
                }
                Err(Error::HashMismatch { .. }) => {
                    let _ = std::fs::remove_file(&part);
                    self.stats.lock().refetches += 1;
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
        let mut stats = self.stats.lock();
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
    /// they evicted), except that a pinned shard or one the plan needs before `id` is never
    /// evicted for it; when its choice still leaves the cache over the bound (a plugin that
    /// keeps more than it is allowed, or a choice refused), the shards needed last go.
    fn make_room(&self, id: ShardId, bytes: u64) -> Result<()> {
        if self.bound == 0 {
            return Ok(());
        }
        let present = self.present(Some(id));
        let mut victims = Vec::new();
        {
            let mut evictor = self.evictor.lock();
            let here: HashSet<ShardId> = present.iter().map(|&(id, _)| id).collect();
            let gone: Vec<ShardId> =
                self.fetchable.keys().copied().filter(|s| !here.contains(s) && evictor.holds(*s)).collect();
            for shard in gone {
                evictor.forget(shard);
            }
            let now = self.reading_at();
            for &(shard, shard_bytes) in &present {
                if !evictor.holds(shard) {
                    victims.extend(evictor.admit_next(shard, shard_bytes, self.next_use(shard, now))?.0);
                }
            }
            victims.extend(evictor.admit_next(id, bytes, self.next_use(id, now))?.0);
        }
        let now = self.reading_at();
        let wanted = self.next_use(id, now);
        for (victim, victim_bytes) in victims {
            if victim == id || self.is_pinned(victim) {
                continue;
            }
            // A shard needed before the one admitted, or by the same batch, stays, whatever the
            // evictor chose (it would be fetched again before this one is read, or for the same
            // read): the shards next used last make the room instead, and fetches ahead use free
            // room only for a while. Without a plan (every next use unknown) the evictor decides.
            let victim_next = self.next_use(victim, now);
            if victim_next < wanted || (victim_next == wanted && wanted != u64::MAX) {
                self.regret_at.store(now, Ordering::Release);
                continue;
            }
            self.evict(victim, victim_bytes)?;
        }
        self.shrink(Some(id), bytes)
    }

    /// Evicts the shards next used last (pinned ones kept) until those here, `except` aside,
    /// leave `room` bytes within the bound; the caller holds the lock.
    fn shrink(&self, except: Option<ShardId>, room: u64) -> Result<()> {
        let mut present = self.present(except);
        let mut used: u64 = present.iter().map(|&(_, b)| b).sum();
        if used + room <= self.bound {
            return Ok(());
        }
        let now = self.reading_at();
        present.sort_by_key(|&(shard, _)| std::cmp::Reverse(self.next_use(shard, now)));
        let mut pinned_kept = 0;
        for (shard, shard_bytes) in present {
            if used + room <= self.bound {
                break;
            }
            if self.is_pinned(shard) {
                pinned_kept += 1;
                continue;
            }
            self.evictor.lock().forget(shard);
            self.evict(shard, shard_bytes)?;
            used -= shard_bytes;
        }
        // The bound is exceeded only by shards pinned for a waiting read.
        debug_assert!(used + room <= self.bound || pinned_kept > 0, "{used} + {room} bytes over {}", self.bound);
        Ok(())
    }

    fn evict(&self, id: ShardId, bytes: u64) -> Result<()> {
        let path = self.paths.shard(id);
        match std::fs::remove_file(&path) {
            Ok(()) => {
                let mut stats = self.stats.lock();
                stats.evictions += 1;
                stats.bytes_evicted += bytes;
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove", &path, e)),
        }
    }

    fn is_pinned(&self, id: ShardId) -> bool {
        let mut pinned = self.pinned.lock();
        pinned.retain(|_, since| since.elapsed() < PIN_FOR);
        pinned.contains_key(&id)
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

    /// Records the shards of every batch delivered from now on (benchmarks: the access trace
    /// Belady's minimum is computed on).
    pub fn record_trace(&self) {
        *self.trace.lock() = Some(Vec::new());
    }

    /// The trace recorded so far.
    pub fn trace(&self) -> Vec<Vec<ShardId>> {
        self.trace.lock().clone().unwrap_or_default()
    }

    /// The bytes of shard `id`, when an attached dataset names it.
    pub fn shard_bytes(&self, id: ShardId) -> Option<u64> {
        self.fetchable.get(&id).map(|&(bytes, _)| bytes)
    }

    /// Where a shard of the attached datasets lives here (present or not).
    pub fn shard_path(&self, id: ShardId) -> PathBuf {
        self.paths.shard(id)
    }
}

impl Drop for OriginCache {
    fn drop(&mut self) {
        // Idle prefetch threads wake, find the cache gone, and end.
        *self.signal.moves.lock() += 1;
        self.signal.moved.notify_all();
    }
}

/// Says once per process, on stderr, that the node refused this process's cluster key (a
/// failed handshake): the trainer goes on with the origin, but should be told why its peers
/// never serve it (the counter `origin_peer_failures` alone went unseen).
fn warn_refused_key(error: &Error) {
    use crate::error::TransportError;
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let refused =
        matches!(error, Error::Transport { source: TransportError::Handshake { .. } | TransportError::Decrypt, .. });
    if refused && !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        eprintln!(
            "granary: the replication node refused this process's cluster key ({error}): shards come from \
             the origin instead of peers; give the trainer the job's key (GRANARY_CLUSTER_KEY: the secret, or \
             its file's path)"
        );
    }
}

/// A client of the `granary serve` that serves the store at `paths`, when `GRANARY_CLUSTER_KEY`
/// is set and one records where it listens there.
fn node_beside(paths: &StorePaths) -> Result<Option<Peers>> {
    let client = crate::replication::NodeClient::beside(paths.root())?;
    Ok(client.map(|client| Peers { node: Arc::new(client), down_until: None }))
}

/// Removes from `incoming` the files of fetches (and attaches) that were killed mid-way. Each
/// part is named `<pid>-...` and locked (flock) by its writer while it lives: it goes when no
/// process of this PID runs here and nobody holds its lock (the lock covers writers in another
/// PID namespace; the PID, the moment between a file's creation and its lock). A claim
/// (`<id>.claim`) nobody holds goes too (at worst a process that was about to take it fetches
/// its shard a second time).
fn sweep_incoming(incoming: &std::path::Path) -> Result<()> {
    let entries = std::fs::read_dir(incoming).map_err(|e| Error::io("list", incoming, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("list", incoming, e))?;
        let name = entry.file_name();
        let claim = name.to_str().is_some_and(|n| n.ends_with(".claim"));
        let pid = name.to_str().and_then(|n| n.split_once('-')).and_then(|(pid, _)| pid.parse::<u32>().ok());
        match pid {
            _ if claim => {}
            Some(pid) if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() => {}
            _ => continue,
        }
        let path = entry.path();
        let Ok(file) = File::open(&path) else { continue };
        if crate::io::flock(&file, libc::LOCK_EX | libc::LOCK_NB).is_err() {
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("remove", &path, e)),
        }
    }
    Ok(())
}

impl crate::engine::ShardFetcher for OriginCache {
    fn can_fetch(&self, id: ShardId) -> bool {
        OriginCache::can_fetch(self, id)
    }

    fn fetch(&self, id: ShardId) -> Result<()> {
        OriginCache::fetch(self, id)
    }
}

impl ShardSource for OriginCache {
    fn repair(&self, shard: ShardId, cause: &Error) -> Result<()> {
        if !self.can_fetch(shard) {
            return Err(Error::NotFound {
                what: format!("shard {shard} at an origin (it is not an attached dataset's)"),
            });
        }
        if !self.writable {
            return Err(Error::Unavailable {
                what: format!("shard {shard}"),
                detail: format!(
                    "{cause}; the store at {} cannot be written here (read-only or another user's), so it cannot \
                     be fetched from its origin",
                    self.paths.root().display()
                ),
            });
        }
        if cause.is_corruption() {
            self.quarantine(shard)?;
        }
        let started = Instant::now();
        self.stats.lock().waited += 1;
        // Pinned from before the fetch (another reader's fetch may publish it first) until
        // this read has it.
        self.pinned.lock().insert(shard, Instant::now());
        let fetched = self.fetch(shard);
        self.stats.lock().fetch_wait += started.elapsed();
        fetched
    }

    fn wants_plan(&self) -> bool {
        true
    }

    fn cache_stats(&self) -> Option<CacheStats> {
        Some(self.stats())
    }

    fn plan(&self, first_step: u64, shards_by_step: &[Vec<ShardId>]) {
        self.add_plan(first_step, shards_by_step);
        self.start_prefetch();
        self.moved();
    }

    fn keeps_open(&self, shard: ShardId) -> bool {
        if self.bound == 0 || !self.writable || self.local.contains(&shard) || !self.fetchable.contains_key(&shard) {
            return true;
        }
        // Called as the batch of step `step()` is handed on: its next reads come after it.
        self.read_within(shard, self.step() + 1, KEEP_OPEN_STEPS)
    }

    fn in_flight(&self, batches: u64) {
        self.ahead.store(batches, Ordering::Release);
    }

    fn accessed(&self, shards: &[ShardId]) {
        self.stats.lock().accesses += shards.len() as u64;
        if let Some(trace) = self.trace.lock().as_mut() {
            trace.push(shards.to_vec());
        }
        let now = self.step.fetch_add(1, Ordering::AcqRel) + 1;
        {
            let mut pace = self.pace.lock();
            let stepped = Instant::now();
            if let Some(last) = pace.last_step.replace(stepped) {
                pace.step_secs = Pace::average(pace.step_secs, (stepped - last).as_secs_f64());
            }
        }
        self.moved();
        let unpinned = {
            let mut pinned = self.pinned.lock();
            let before = pinned.len();
            for shard in shards {
                pinned.remove(shard);
            }
            pinned.len() < before
        };
        if self.bound == 0 || !self.writable {
            return;
        }
        // Pins may have held the cache over its bound (a batch that needs more than fits):
        // once read, the extra shards go (the reader keeps the files it has open).
        if unpinned && let Ok(_lock) = lock_cache(&self.paths) {
            let _ = self.shrink(None, 0);
        }
        let victims = self.evictor.lock().touch_next(shards, &mut |shard| self.next_use(shard, now));
        // A plugin that changed its mind about what fits: its victims go now, under the lock.
        if let Ok(victims) = victims
            && !victims.is_empty()
            && let Ok(_lock) = lock_cache(&self.paths)
        {
            // Not one a read is waiting on: it goes once read, if still over the bound.
            for (victim, bytes) in victims {
                if !self.is_pinned(victim) {
                    let _ = self.evict(victim, bytes);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_removes_only_parts_nobody_holds() {
        let dir = tempfile::tempdir().unwrap();
        // No process has this PID: a killed fetch's part, and one written by a process of
        // another PID namespace, which still holds its lock.
        let killed = dir.path().join("4294000000-1.part");
        let elsewhere = dir.path().join("4294000000-2.part");
        let mine = dir.path().join(format!("{}-3.part", std::process::id()));
        let stray = dir.path().join("notes.txt");
        let claim = dir.path().join("ab12.claim");
        for file in [&killed, &mine, &stray, &claim] {
            std::fs::write(file, b"x").unwrap();
        }
        let held = super::super::create_locked(&elsewhere).unwrap();
        sweep_incoming(dir.path()).unwrap();
        assert!(!killed.exists() && !claim.exists(), "a part or claim nobody holds stays");
        assert!(elsewhere.exists() && mine.exists() && stray.exists(), "a held or live part was removed");
        drop(held);
        sweep_incoming(dir.path()).unwrap();
        assert!(!elsewhere.exists(), "a part released by its writer stays");
    }
}
