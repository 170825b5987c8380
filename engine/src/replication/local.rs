//! The node's own store: what it holds (and which of its shards the store's origin cache owns:
//! listed as cache entries, never taken by the node's cache), its replication goals and
//! incarnation, and the short write sessions through which objects that arrived from peers are
//! published.
//!
//! Owns: `LocalStore`: the inventory of published objects (with its generation) and which shards
//! are cache entries; the files under `replication/` (`NODE.lock`, `incarnation`, `goals/NAME`,
//! `cached`, `listen`, `metrics-listen`); the partial transfers in `incoming/` (stale ones removed
//! at start); and the write session (`with_granary`, `release_if_idle`).
//!
//! The node does not hold the store's write lock for its lifetime: `granary ingest` must be able
//! to run beside `granary serve`. It opens a `Granary` (lock and catalog) for each publication,
//! waiting a bounded time when another writer holds the lock, and keeps its partial transfers in
//! `incoming/`, which no other writer touches. Invariants: the inventory lists only objects whose
//! files are complete (published); the node lock (`replication/NODE.lock`) keeps two nodes off one
//! store. Never: reads or writes shard bytes on behalf of a transfer (`pull` and `server` do).

use std::collections::{BTreeMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::frame::{Goal, InventoryEntry, WireKind};
use crate::engine::Granary;
use crate::error::{Error, Result};
use crate::id::ObjectId;
use crate::store::{DatasetName, ObjectKind, RefLog, StorePaths, replace_file};

/// A partial transfer untouched for this long is removed when the node starts.
const PARTIAL_AGE_MAX: Duration = Duration::from_secs(24 * 3600);

/// A store as one node sees it.
pub(crate) struct LocalStore {
    paths: StorePaths,
    incoming: PathBuf,
    goals_dir: PathBuf,
    /// Every published object: (kind, id) -> bytes.
    inventory: RwLock<BTreeMap<(WireKind, ObjectId), u64>>,
    /// The shards held only as cache entries (evictable); peers see the flag.
    cached: RwLock<HashSet<ObjectId>>,
    /// The shards of attached datasets that no local dataset names: the store's origin cache
    /// owns them (it fetches and evicts them, in the readers' processes). Peers see them flagged
    /// as cache entries; this node's own cache never takes them. Refreshed by `rescan`.
    origin_cached: RwLock<HashSet<ObjectId>>,
    /// Bumped on every change of the inventory, so peers refetch it only when it changed.
    generation: AtomicU64,
    /// The open write session, if any: kept open between publications that follow each other,
    /// closed once idle (`release_if_idle`) so an ingest can take the store. Also serialises
    /// this process's writes (the store lock is per open file).
    writer: Mutex<Option<(Granary, Instant)>>,
    lock_wait: Duration,
    /// Held for its `Drop`, which releases the node lock.
    _node_lock: File,
    incarnation: u64,
}

impl LocalStore {
    /// Opens the node's view of the store at `root`: takes the node lock, counts this start as a
    /// new incarnation, and lists what is stored.
    pub(crate) fn open(root: &Path, lock_wait: Duration) -> Result<Self> {
        let paths = StorePaths::new(root);
        paths.check()?;
        let dir = root.join("replication");
        let incoming = root.join("incoming");
        let goals_dir = dir.join("goals");
        for d in [&dir, &incoming, &goals_dir] {
            fs::create_dir_all(d).map_err(|e| Error::io("create directory", d, e))?;
        }
        let lock_path = dir.join("NODE.lock");
        let node_lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| Error::io("open", &lock_path, e))?;
        node_lock.try_lock().map_err(|e| match e {
            fs::TryLockError::WouldBlock => Error::invalid_input(format!(
                "another granary node already serves the store {} ({} is locked)",
                root.display(),
                lock_path.display()
            )),
            fs::TryLockError::Error(e) => Error::io("lock", &lock_path, e),
        })?;
        let incarnation = next_incarnation(&dir)?;
        let store = Self {
            paths,
            incoming,
            goals_dir,
            inventory: RwLock::new(BTreeMap::new()),
            cached: RwLock::new(HashSet::new()),
            origin_cached: RwLock::new(HashSet::new()),
            generation: AtomicU64::new(1),
            writer: Mutex::new(None),
            lock_wait,
            _node_lock: node_lock,
            incarnation,
        };
        store.rescan()?;
        store.drop_stale_partials()?;
        store.load_cached()?;
        Ok(store)
    }

    /// Removes partial transfers of objects that are now held (a transfer that finished
    /// elsewhere, or an ingest of the same content), and those untouched for a day (nothing
    /// wanted them since); the others stay, to be resumed.
    fn drop_stale_partials(&self) -> Result<()> {
        let entries = match fs::read_dir(&self.incoming) {
            Ok(entries) => entries,
            Err(e) => return Err(Error::io("read directory", &self.incoming, e)),
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let mut parts = name.splitn(3, '.');
            let (Some(hex), Some(kind), Some(last)) = (parts.next(), parts.next(), parts.next()) else { continue };
            // A fragment or rebuilt shard a killed node was publishing: never resumed.
            if last.starts_with("new-") || last.starts_with("rebuilt-") {
                let path = entry.path();
                fs::remove_file(&path).map_err(|e| Error::io("remove", &path, e))?;
                continue;
            }
            if last != "part" {
                continue;
            }
            let kind = match kind {
                "shard" => WireKind::Shard,
                "manifest" => WireKind::Manifest,
                "fragment" => WireKind::Fragment,
                _ => continue,
            };
            let stale = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > PARTIAL_AGE_MAX);
            if stale || ObjectId::parse_hex(hex).is_some_and(|id| self.holds(kind, id).is_some()) {
                let path = entry.path();
                fs::remove_file(&path).map_err(|e| Error::io("remove", &path, e))?;
            }
        }
        Ok(())
    }

    /// Reads `replication/cached`, keeping the shards still held.
    fn load_cached(&self) -> Result<()> {
        let path = self.paths.root().join("replication").join("cached");
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(Error::io("read", &path, e)),
        };
        let mut cached = self.cached.write();
        for line in text.lines() {
            if let Some(id) = ObjectId::parse_hex(line.trim())
                && self.holds(WireKind::Shard, id).is_some()
            {
                cached.insert(id);
            }
        }
        Ok(())
    }

    pub(crate) fn paths(&self) -> &StorePaths {
        &self.paths
    }

    /// This start's incarnation: greater than every earlier one of this store's node.
    pub(crate) fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The inventory's generation.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Re-lists the store (objects another process published, or removed). Returns whether the
    /// inventory changed.
    pub(crate) fn rescan(&self) -> Result<bool> {
        let mut fresh = BTreeMap::new();
        for (kind, wire) in [
            (ObjectKind::Shard, WireKind::Shard),
            (ObjectKind::Manifest, WireKind::Manifest),
            (ObjectKind::Fragment, WireKind::Fragment),
        ] {
            for (id, path) in self.paths.list_objects(kind)? {
                // A file removed between the listing and the stat is simply not held.
                if let Ok(meta) = fs::metadata(&path) {
                    fresh.insert((wire, id), meta.len());
                }
            }
        }
        let owned_changed = self.refresh_origin_cached();
        let mut inventory = self.inventory.write();
        if *inventory == fresh && !owned_changed {
            return Ok(false);
        }
        *inventory = fresh;
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(true)
    }

    /// Re-reads which shards the store's origin cache owns; returns whether that changed. A
    /// store whose attachments cannot be read keeps the last set (and says so on stderr).
    #[cfg(feature = "origin")]
    fn refresh_origin_cached(&self) -> bool {
        let fresh: HashSet<ObjectId> = match crate::store::attached::store_shards(&self.paths) {
            Ok(shards) => shards.cached().into_iter().map(|id| id.0).collect(),
            Err(e) => {
                eprintln!("granary node: could not read the store's attachments: {e}");
                return false;
            }
        };
        let mut owned = self.origin_cached.write();
        if *owned == fresh {
            return false;
        }
        *owned = fresh;
        true
    }

    #[cfg(not(feature = "origin"))]
    fn refresh_origin_cached(&self) -> bool {
        false
    }

    /// Whether shard `id` belongs to the store's origin cache (as of the last `rescan`, or now
    /// when `refresh`).
    pub(crate) fn is_origin_cached(&self, id: ObjectId, refresh: bool) -> bool {
        // Peers refetch the inventory when the set changed (its flags did).
        if refresh && self.refresh_origin_cached() {
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
        self.origin_cached.read().contains(&id)
    }

    /// The length of object `id`, if it is held.
    pub(crate) fn holds(&self, kind: WireKind, id: ObjectId) -> Option<u64> {
        self.inventory.read().get(&(kind, id)).copied()
    }

    /// How many objects are held.
    pub(crate) fn len(&self) -> usize {
        self.inventory.read().len()
    }

    /// Whether shard `id` is held only as a cache entry.
    pub(crate) fn is_cached(&self, id: ObjectId) -> bool {
        self.cached.read().contains(&id)
    }

    /// Forgets a listed object whose file is gone.
    pub(crate) fn note_missing(&self, kind: WireKind, id: ObjectId) {
        self.note_removed(kind, id);
    }

    /// Marks shard `id` as held only as a cache entry (or no longer). The set is kept in
    /// `replication/cached`, so a restart does not turn cache entries into copies that are
    /// never evicted.
    pub(crate) fn set_cached(&self, id: ObjectId, is_cached: bool) {
        let mut cached = self.cached.write();
        let changed = if is_cached { cached.insert(id) } else { cached.remove(&id) };
        if changed {
            self.generation.fetch_add(1, Ordering::AcqRel);
            let mut ids: Vec<String> = cached.iter().map(ToString::to_string).collect();
            ids.sort();
            let dir = self.paths.root().join("replication");
            let text: String = ids.into_iter().map(|id| id + "\n").collect();
            // Not synced: this is on a read's path, and losing the file (a crash before the
            // kernel wrote it) only makes its entries copies that are kept, never data lost.
            if let Err(e) = replace_file(&dir, &dir.join("cached"), text.as_bytes(), false) {
                eprintln!("granary node: could not record the cache entries: {e}");
            }
        }
    }

    /// The ids of the fragments held here.
    pub(crate) fn fragment_ids(&self) -> Vec<ObjectId> {
        let inventory = self.inventory.read();
        inventory.keys().filter(|(kind, _)| *kind == WireKind::Fragment).map(|&(_, id)| id).collect()
    }

    /// The shards held as this node's cache entries, with their lengths (at start, to rebuild
    /// the cache; the origin cache's are not among them).
    pub(crate) fn cached_entries(&self) -> Vec<(ObjectId, u64)> {
        // The order every reader that holds more than one of these locks takes them in
        // (writers hold one at a time): a waiting writer blocks new readers, so two readers
        // taking them in different orders could wait on each other through writers.
        let inventory = self.inventory.read();
        let cached = self.cached.read();
        let owned = self.origin_cached.read();
        let mut out: Vec<(ObjectId, u64)> = cached
            .iter()
            .filter(|id| !owned.contains(id))
            .filter_map(|&id| inventory.get(&(WireKind::Shard, id)).map(|&bytes| (id, bytes)))
            .collect();
        out.sort();
        out
    }

    /// Up to `max` entries after `after`, and whether more follow.
    pub(crate) fn page(&self, after: Option<(WireKind, ObjectId)>, max: usize) -> (Vec<InventoryEntry>, bool) {
        use std::ops::Bound;
        let inventory = self.inventory.read();
        let start = match after {
            None => Bound::Unbounded,
            Some(key) => Bound::Excluded(key),
        };
        let cached = self.cached.read();
        let mut iter = inventory.range((start, Bound::Unbounded));
        let page: Vec<InventoryEntry> = iter
            .by_ref()
            .take(max)
            .map(|(&(kind, id), &bytes)| InventoryEntry { kind, id, bytes, cached: cached.contains(&id) })
            .collect();
        (page, iter.next().is_some())
    }

    /// Where object `id` lives when held.
    pub(crate) fn object_path(&self, kind: WireKind, id: ObjectId) -> PathBuf {
        self.paths.object(kind.object_kind(), id)
    }

    /// Where a transfer of object `id` keeps its bytes until they are verified.
    pub(crate) fn incoming_path(&self, kind: WireKind, id: ObjectId) -> PathBuf {
        let suffix = match kind {
            WireKind::Shard => "shard",
            WireKind::Manifest => "manifest",
            WireKind::Fragment => "fragment",
        };
        self.incoming.join(format!("{id}.{suffix}.part"))
    }

    /// Runs `f` in a write session: the store lock and the catalog, waiting up to the lock wait
    /// for another writer (an ingest) to finish. Blocking.
    pub(crate) fn with_granary<R>(&self, f: impl FnOnce(&mut Granary) -> Result<R>) -> Result<R> {
        let mut writer = self.writer.lock();
        if writer.is_none() {
            *writer = Some((Granary::open_waiting(self.paths.root(), false, self.lock_wait)?, Instant::now()));
        }
        let (granary, last_used) = writer.as_mut().expect("opened above");
        *last_used = Instant::now();
        f(granary)
    }

    /// Closes the write session if it has been idle for `idle` (it never waits for it).
    pub(crate) fn release_if_idle(&self, idle: Duration) {
        if let Some(mut writer) = self.writer.try_lock()
            && writer.as_ref().is_some_and(|(_, last_used)| last_used.elapsed() >= idle)
        {
            *writer = None;
        }
    }

    /// Publishes a verified file from `incoming/` as object `id` (see `Granary::adopt_object`).
    /// Blocking.
    pub(crate) fn adopt(&self, kind: WireKind, id: ObjectId, file: &Path) -> Result<()> {
        let bytes = fs::metadata(file).map_err(|e| Error::io("stat", file, e))?.len();
        self.with_granary(|granary| granary.adopt_object(kind.object_kind(), id, file))?;
        self.note_added(kind, id, bytes);
        Ok(())
    }

    fn note_added(&self, kind: WireKind, id: ObjectId, bytes: u64) {
        let mut inventory = self.inventory.write();
        if inventory.insert((kind, id), bytes) != Some(bytes) {
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
    }

    fn note_removed(&self, kind: WireKind, id: ObjectId) {
        self.set_cached(id, false);
        let mut inventory = self.inventory.write();
        if inventory.remove(&(kind, id)).is_some() {
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Moves a damaged object to quarantine. Blocking.
    pub(crate) fn quarantine(&self, kind: WireKind, id: ObjectId) -> Result<Option<PathBuf>> {
        let moved = self.with_granary(|granary| granary.quarantine_object(kind.object_kind(), id))?;
        self.note_removed(kind, id);
        Ok(moved)
    }

    /// Deletes an object (a cache eviction). Blocking.
    pub(crate) fn remove(&self, kind: WireKind, id: ObjectId) -> Result<()> {
        self.with_granary(|granary| granary.forget_object(kind.object_kind(), id))?;
        self.note_removed(kind, id);
        Ok(())
    }

    /// Adopts dataset `name`'s ref from a peer if it is newer. Blocking.
    pub(crate) fn adopt_ref(&self, name: &DatasetName, log: &RefLog) -> Result<bool> {
        self.with_granary(|granary| granary.adopt_ref(name, log))
    }

    /// Records where the node listens, for clients on this machine.
    pub(crate) fn record_listen(&self, addr: &std::net::SocketAddr) -> Result<()> {
        let dir = self.paths.root().join("replication");
        write_atomically(&dir, &dir.join("listen"), format!("{addr}\n").as_bytes())
    }

    /// Records where the node serves its metrics, for `granary top` on this machine.
    pub(crate) fn record_metrics_listen(&self, addr: Option<&std::net::SocketAddr>) -> Result<()> {
        let dir = self.paths.root().join("replication");
        let path = dir.join("metrics-listen");
        match addr {
            Some(addr) => write_atomically(&dir, &path, format!("{addr}\n").as_bytes()),
            // A node that does not serve them leaves no address of an earlier life behind.
            None => match fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io("remove", &path, e)),
                _ => Ok(()),
            },
        }
    }

    /// The replication goal of every dataset that has one: copies or coded fragments of each
    /// shard.
    pub(crate) fn goals(&self) -> Result<BTreeMap<DatasetName, Goal>> {
        let mut goals = BTreeMap::new();
        let entries = match fs::read_dir(&self.goals_dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(goals),
            Err(e) => return Err(Error::io("read directory", &self.goals_dir, e)),
        };
        for entry in entries {
            let entry = entry.map_err(|e| Error::io("read directory", &self.goals_dir, e))?;
            let Some(name) = entry.file_name().to_str().and_then(|n| DatasetName::new(n).ok()) else { continue };
            let path = entry.path();
            let text = fs::read_to_string(&path).map_err(|e| Error::io("read", &path, e))?;
            let goal = Goal::parse(text.trim_end())
                .ok_or_else(|| Error::invalid_input(format!("{}: not a replication goal: {text:?}", path.display())))?;
            goals.insert(name, goal);
        }
        Ok(goals)
    }

    /// Sets the goal of dataset `name`, durably.
    pub(crate) fn set_goal(&self, name: &DatasetName, goal: Goal) -> Result<()> {
        if goal == Goal::Replicas(0) {
            return Err(Error::invalid_input("a replication factor is at least 1"));
        }
        let target = self.goals_dir.join(name.as_str());
        let text = format!("{goal}\n");
        if fs::read_to_string(&target).ok().as_deref() == Some(text.as_str()) {
            return Ok(());
        }
        write_atomically(&self.goals_dir, &target, text.as_bytes())
    }
}

/// Writes `bytes` to `target` through a temp file in `dir`: fsync, rename, fsync the directory.
fn write_atomically(dir: &Path, target: &Path, bytes: &[u8]) -> Result<()> {
    replace_file(dir, target, bytes, true)
}

/// Reads, increments and durably stores the node's incarnation counter.
fn next_incarnation(dir: &Path) -> Result<u64> {
    let path = dir.join("incarnation");
    let previous = match fs::read_to_string(&path) {
        Ok(text) => text
            .trim()
            .parse::<u64>()
            .map_err(|_| Error::invalid_input(format!("{}: not a number: {text:?}", path.display())))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => return Err(Error::io("read", &path, e)),
    };
    let next = previous + 1;
    write_atomically(dir, &path, format!("{next}\n").as_bytes())?;
    Ok(next)
}
