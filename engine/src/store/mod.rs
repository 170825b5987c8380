//! The store: where shard, manifest and ref files live, and how they are published crash-safely.
//!
//! Owns: `StorePaths` (where each file of a store lives, and reading refs, histories and manifests
//! without a lock), `Store` (the `LOCK` held while it is open, `tmp/`, publishing objects, writing
//! refs with their histories, quarantine), `ObjectKind`, and the file helpers the other modules
//! publish with (`hash_file`, `sync_dir`, `replace_file`).
//!
//! Layout under the root: `granary-store` (marker), `shards/ab/<id>.shard`,
//! `manifests/ab/<id>.manifest`, `fragments/ab/<id>.fragment` (erasure-coded pieces of shards,
//! `erasure`; fan-out by the first two hex digits of the id), `refs/<name>`,
//! `history/<name>` (each ref's append-only history, its second record), `tmp/` (files being
//! written), `quarantine/` (files that failed verification), `catalog/` (sled), and `LOCK`.
//! Publishing is: write to `tmp/`, fsync, rename into place, fsync the directory. Only then does
//! a caller record the object in the catalog. Invariants: a file under `shards/` or `manifests/`
//! is complete and is named by the BLAKE3 hash of its bytes; a file under `fragments/` is
//! complete, checked (`Fragment::check`) and named by its fragment id (`erasure::fragment_id`:
//! the hash of its shard's id, coding and index, which fix its bytes); a ref names only published
//! manifests; every version a ref names is live in its history (an addition is appended before
//! the ref names it, a removal after it stops). Never: decides what to publish (ingest does) or
//! caches anything.

#[cfg_attr(not(feature = "origin"), allow(dead_code, reason = "read and written by origin/"))]
pub mod attached;
mod history;
mod refs;

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

pub use history::{Change, HistoryEntry, RefHistory};
pub use refs::{DatasetName, RefLog, Version, VersionSpec};

use crate::error::{Error, Result};
use crate::id::{ManifestId, ObjectId, ShardId};
use crate::manifest::Manifest;

/// What a quarantined ref's file name starts with (then the dataset's name).
pub const QUARANTINED_REF_PREFIX: &str = "ref-";
/// What a quarantined ref history's file name starts with (then the dataset's name).
pub const QUARANTINED_HISTORY_PREFIX: &str = "history-";

const MARKER_FILE: &str = "granary-store";
const MARKER_TEXT: &str = "granary store 1\n";
const SHARD_SUFFIX: &str = ".shard";
const MANIFEST_SUFFIX: &str = ".manifest";
const FRAGMENT_SUFFIX: &str = ".fragment";

/// The kinds of content-addressed object in a store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectKind {
    /// A shard file.
    Shard,
    /// A manifest file.
    Manifest,
    /// A fragment file: a piece of an erasure-coded shard.
    Fragment,
}

impl ObjectKind {
    fn dir(self) -> &'static str {
        match self {
            Self::Shard => "shards",
            Self::Manifest => "manifests",
            Self::Fragment => "fragments",
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            Self::Shard => SHARD_SUFFIX,
            Self::Manifest => MANIFEST_SUFFIX,
            Self::Fragment => FRAGMENT_SUFFIX,
        }
    }

    /// "shard", "manifest" or "fragment".
    pub fn noun(self) -> &'static str {
        match self {
            Self::Shard => "shard",
            Self::Manifest => "manifest",
            Self::Fragment => "fragment",
        }
    }
}

/// Paths of a store and the read-only operations on them. Needs no lock: readers (every rank of
/// a trainer) use it while one writer holds the store.
#[derive(Clone, Debug)]
pub struct StorePaths {
    root: PathBuf,
}

impl StorePaths {
    /// The paths of a store at `root` (not checked; see [`StorePaths::check`]).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// Checks that `root` holds a store this build reads.
    pub fn check(&self) -> Result<()> {
        let marker = self.root.join(MARKER_FILE);
        match fs::read_to_string(&marker) {
            Ok(text) if text == MARKER_TEXT => Ok(()),
            Ok(text) => Err(Error::NotAStore {
                root: self.root.clone(),
                detail: format!("unknown store marker {:?}", text.trim_end()),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let detail = if self.root.exists() { "no granary-store marker" } else { "it does not exist" };
                Err(Error::NotAStore { root: self.root.clone(), detail: detail.to_owned() })
            }
            Err(e) => Err(Error::io("read", marker, e)),
        }
    }

    /// The store root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the object `id` of `kind` lives.
    pub fn object(&self, kind: ObjectKind, id: ObjectId) -> PathBuf {
        let hex = id.to_string();
        self.root.join(kind.dir()).join(&hex[..2]).join(format!("{hex}{}", kind.suffix()))
    }

    /// Where shard `id` lives.
    pub fn shard(&self, id: ShardId) -> PathBuf {
        self.object(ObjectKind::Shard, id.0)
    }

    /// Where manifest `id` lives.
    pub fn manifest(&self, id: ManifestId) -> PathBuf {
        self.object(ObjectKind::Manifest, id.0)
    }

    /// Where the ref of dataset `name` lives.
    pub fn ref_file(&self, name: &DatasetName) -> PathBuf {
        self.refs_dir().join(name.as_str())
    }

    /// The directory of refs.
    pub fn refs_dir(&self) -> PathBuf {
        self.root.join("refs")
    }

    /// The directory of ref histories.
    pub fn history_dir(&self) -> PathBuf {
        self.root.join("history")
    }

    /// Where the history of dataset `name`'s ref lives.
    pub fn history_file(&self, name: &DatasetName) -> PathBuf {
        self.history_dir().join(name.as_str())
    }

    /// The directory of files being written.
    pub fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }

    /// The directory of files that failed verification.
    pub fn quarantine_dir(&self) -> PathBuf {
        self.root.join("quarantine")
    }

    /// The sled catalog's directory.
    pub fn catalog_dir(&self) -> PathBuf {
        self.root.join("catalog")
    }

    /// Moves the file at `path` into `quarantine/` as `name` plus a unique suffix. A rename: safe
    /// without the write lock (the origin cache, in reader processes, uses it).
    pub(crate) fn move_to_quarantine(&self, path: &Path, name: &str) -> Result<PathBuf> {
        let dir = self.quarantine_dir();
        fs::create_dir_all(&dir).map_err(|e| Error::io("create directory", &dir, e))?;
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let target = dir.join(format!("{name}.{}-{n}", std::process::id()));
        fs::rename(path, &target).map_err(|e| Error::io("rename", path, e))?;
        sync_dir(&dir)?;
        if let Some(parent) = path.parent() {
            sync_dir(parent)?;
        }
        Ok(target)
    }

    /// Reads the ref of dataset `name`.
    pub fn read_ref(&self, name: &DatasetName) -> Result<RefLog> {
        let path = self.ref_file(name);
        let bytes = fs::read(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::NotFound { what: format!("dataset {name}") },
            _ => Error::io("read", &path, e),
        })?;
        RefLog::decode(&bytes).map_err(|source| Error::Format { path, source })
    }

    /// Reads the history of dataset `name`'s ref; `None` when it has none (a store written
    /// before histories, or a name never used).
    pub fn read_history(&self, name: &DatasetName) -> Result<Option<RefHistory>> {
        let path = self.history_file(name);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io("read", &path, e)),
        };
        RefHistory::decode(&bytes).map(Some).map_err(|source| Error::Format { path, source })
    }

    /// Reads manifest `id`, checking its bytes against the id.
    pub fn read_manifest(&self, id: ManifestId) -> Result<Manifest> {
        let path = self.manifest(id);
        let bytes = fs::read(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::NotFound { what: format!("manifest {id}") },
            _ => Error::io("read", &path, e),
        })?;
        let actual = ObjectId::of(&bytes);
        if actual != id.0 {
            return Err(Error::HashMismatch { path, expected: id.0, actual });
        }
        Manifest::decode(&bytes).map_err(|source| Error::Format { path, source })
    }

    /// Resolves a version spec to the dataset version's manifest id and, for named specs, its
    /// name and number.
    pub fn resolve(&self, spec: &VersionSpec) -> Result<(ManifestId, Option<(DatasetName, u64)>)> {
        match spec {
            VersionSpec::Manifest(id) => Ok((*id, None)),
            VersionSpec::Latest(name) => {
                let latest = self.read_ref(name)?.latest();
                Ok((latest.manifest, Some((name.clone(), latest.number))))
            }
            VersionSpec::Numbered(name, number) => {
                let version = self
                    .read_ref(name)?
                    .version(*number)
                    .ok_or_else(|| Error::NotFound { what: format!("version {number} of dataset {name}") })?;
                Ok((version.manifest, Some((name.clone(), *number))))
            }
        }
    }

    /// The objects of `kinds` whose id starts with `prefix` (lowercase or uppercase hex, at
    /// least `ID_PREFIX_MIN` digits), as an id names them in `ls` and `inspect`: one, or
    /// `Error::NotFound`, or `Error::InvalidInput` naming the candidates when it is ambiguous.
    pub fn expand_prefix(&self, kinds: &[ObjectKind], prefix: &str) -> Result<(ObjectKind, ObjectId)> {
        let prefix = prefix.to_ascii_lowercase();
        if !is_id_prefix(&prefix) {
            return Err(Error::invalid_input(format!(
                "{prefix:?} is not an id prefix ({ID_PREFIX_MIN} to 64 hex digits)"
            )));
        }
        let mut found = Vec::new();
        for &kind in kinds {
            for entry in read_dir_if_exists(&self.root.join(kind.dir()).join(&prefix[..2]))? {
                let name = entry.file_name();
                let id = name.to_str().and_then(|n| n.strip_suffix(kind.suffix())).and_then(ObjectId::parse_hex);
                if let Some(id) = id.filter(|id| id.to_string().starts_with(&prefix)) {
                    found.push((kind, id));
                }
            }
        }
        match found.as_slice() {
            [] => Err(Error::NotFound { what: format!("an object with id prefix {prefix}") }),
            [one] => Ok(*one),
            many => {
                let names: Vec<String> =
                    many.iter().take(4).map(|(kind, id)| format!("{} {}", kind.noun(), id.short(16))).collect();
                Err(Error::invalid_input(format!(
                    "id prefix {prefix} is ambiguous ({} objects: {}{}); give more digits",
                    many.len(),
                    names.join(", "),
                    if many.len() > 4 { ", ..." } else { "" }
                )))
            }
        }
    }

    /// `VersionSpec::parse`, and a name that is no dataset's but an id prefix of at least
    /// `ID_PREFIX_MIN` hex digits names the manifest it is the prefix of (as `ls` shows ids).
    pub fn parse_spec(&self, text: &str) -> Result<VersionSpec> {
        let spec = VersionSpec::parse(text)?;
        if let VersionSpec::Latest(name) = &spec
            && is_id_prefix(text)
            && !self.ref_file(name).exists()
        {
            let (_, id) = self.expand_prefix(&[ObjectKind::Manifest], text).map_err(|e| match e {
                Error::NotFound { .. } => {
                    Error::NotFound { what: format!("dataset {text} (nor a manifest whose id begins {text})") }
                }
                other => other,
            })?;
            return Ok(VersionSpec::Manifest(ManifestId(id)));
        }
        if let VersionSpec::Latest(name) = &spec
            && text.len() < ID_PREFIX_MIN
            && text.bytes().all(|b| b.is_ascii_hexdigit())
            && !self.ref_file(name).exists()
        {
            // Hex too short to be an id prefix: say so rather than a bare "not found".
            return Err(Error::NotFound {
                what: format!(
                    "dataset {text} (an id prefix, as `ls` shows ids, needs at least {ID_PREFIX_MIN} hex digits)"
                ),
            });
        }
        Ok(spec)
    }

    /// The names of every dataset with a ref file, sorted.
    pub fn list_refs(&self) -> Result<Vec<DatasetName>> {
        list_names(&self.refs_dir())
    }

    /// The names of every dataset with a ref history (live or not), sorted.
    pub fn list_histories(&self) -> Result<Vec<DatasetName>> {
        list_names(&self.history_dir())
    }

    /// Who holds the store's write lock, as the holder wrote it (`process PID (COMMAND)`), if
    /// anyone wrote it and that process is alive.
    pub fn lock_holder(&self) -> Option<String> {
        let text = fs::read_to_string(self.root.join("LOCK")).ok()?;
        let pid = text.strip_prefix("process ")?.split_whitespace().next()?.parse::<u32>().ok()?;
        Path::new(&format!("/proc/{pid}")).exists().then(|| text.trim().to_owned())
    }

    /// Entries of `tmp/`, `refs/` and `history/` the store did not write (directories,
    /// symlinks, files of other names): ignored by every command, listed by repair.
    pub fn strays(&self) -> Result<Vec<PathBuf>> {
        let mut strays = Vec::new();
        for entry in read_dir_if_exists(&self.tmp_dir())? {
            if !is_own_tmp(&entry) {
                strays.push(entry.path());
            }
        }
        for dir in [self.refs_dir(), self.history_dir()] {
            for entry in read_dir_if_exists(&dir)? {
                let named = entry.file_name().to_str().is_some_and(|name| DatasetName::new(name).is_ok());
                if !(named && entry.file_type().is_ok_and(|t| t.is_file())) {
                    strays.push(entry.path());
                }
            }
        }
        strays.sort();
        Ok(strays)
    }

    /// The names with a ref file or a history, sorted: every dataset the store has a record of.
    pub fn list_names(&self) -> Result<Vec<DatasetName>> {
        let mut names = self.list_refs()?;
        names.extend(self.list_histories()?);
        names.sort();
        names.dedup();
        Ok(names)
    }

    /// Every object file of `kind` whose name is a well-formed id, sorted by id.
    pub fn list_objects(&self, kind: ObjectKind) -> Result<Vec<(ObjectId, PathBuf)>> {
        let mut objects = Vec::new();
        for fan in read_dir_if_exists(&self.root.join(kind.dir()))? {
            for entry in read_dir_if_exists(&fan.path())? {
                let name = entry.file_name();
                let id = name.to_str().and_then(|name| name.strip_suffix(kind.suffix())).and_then(ObjectId::parse_hex);
                if let Some(id) = id {
                    objects.push((id, entry.path()));
                }
            }
        }
        objects.sort();
        Ok(objects)
    }
}

/// A store opened for writing: holds the exclusive lock, publishes files.
#[derive(Debug)]
pub struct Store {
    paths: StorePaths,
    /// Held (flock) for as long as the store is open; released when the file closes.
    _lock: File,
    /// Temp files of dead writers removed when the store was opened.
    stale_tmp_removed: usize,
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl Store {
    /// Opens the store at `root` for writing, creating it when `create` is set. Removes what
    /// dead writers left in `tmp/` (safe: the lock proves no writer is alive).
    pub fn open(root: impl Into<PathBuf>, create: bool) -> Result<Self> {
        let paths = StorePaths::new(root);
        if create && !paths.root.join(MARKER_FILE).exists() {
            Self::create(&paths)?;
        }
        paths.check()?;
        let lock_path = paths.root.join("LOCK");
        let lock = OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path).map_err(|e| {
            let detail = match e.raw_os_error() {
                Some(libc::EROFS) => "a read-only file system",
                Some(libc::EACCES | libc::EPERM) => "this user may not write it",
                _ => return Error::io("open", &lock_path, e),
            };
            Error::ReadOnlyStore { root: paths.root.clone(), detail: detail.to_owned() }
        })?;
        lock.try_lock().map_err(|e| match e {
            fs::TryLockError::WouldBlock => {
                Error::StoreLocked { root: paths.root.clone(), holder: paths.lock_holder() }
            }
            fs::TryLockError::Error(e) => Error::io("lock", &lock_path, e),
        })?;
        // Who holds it, for a writer that finds it locked: best effort (the lock is the flock,
        // not this text).
        let _ = write_holder(&lock);
        let mut store = Self { paths, _lock: lock, stale_tmp_removed: 0 };
        store.stale_tmp_removed = store.clean_tmp()?;
        Ok(store)
    }

    fn create(paths: &StorePaths) -> Result<()> {
        let root = &paths.root;
        for dir in [root.clone(), root.join("shards"), root.join("manifests"), paths.refs_dir(), paths.tmp_dir()] {
            fs::create_dir_all(&dir).map_err(|e| Error::io("create directory", &dir, e))?;
        }
        let tmp = paths.tmp_dir().join("granary-store");
        write_synced(&tmp, MARKER_TEXT.as_bytes())?;
        let marker = root.join(MARKER_FILE);
        fs::rename(&tmp, &marker).map_err(|e| Error::io("rename", &marker, e))?;
        sync_dir(root)
    }

    /// The store's paths.
    pub fn paths(&self) -> &StorePaths {
        &self.paths
    }

    /// Creates a new empty file in `tmp/`.
    pub fn create_tmp(&self) -> Result<(File, PathBuf)> {
        let dir = self.paths.tmp_dir();
        fs::create_dir_all(&dir).map_err(|e| Error::io("create directory", &dir, e))?;
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{}-{n}.tmp", std::process::id()));
        let file =
            OpenOptions::new().write(true).create_new(true).open(&path).map_err(|e| Error::io("create", &path, e))?;
        Ok((file, path))
    }

    /// Publishes a synced temp file as object `id` of `kind`. Returns false when an intact copy
    /// was already there (identical content is stored once; the temp file is removed). A damaged
    /// copy already in place is quarantined and replaced.
    pub fn publish(&self, kind: ObjectKind, id: ObjectId, tmp: &Path) -> Result<bool> {
        let target = self.paths.object(kind, id);
        let fan = target.parent().expect("objects live in a fan-out directory");
        let kind_dir = fan.parent().expect("fan-out directories have a parent");
        if target.exists() {
            // Intact: a shard or manifest hashes to its id; a fragment checks out whole.
            let intact = match kind {
                ObjectKind::Shard | ObjectKind::Manifest => hash_file(&target)? == id,
                ObjectKind::Fragment => {
                    match crate::erasure::FragmentFile::open(&target, id).and_then(|fragment| fragment.check_all()) {
                        Ok(_) => true,
                        Err(e) if e.is_corruption() => false,
                        Err(e) => return Err(e),
                    }
                }
            };
            if intact {
                fs::remove_file(tmp).map_err(|e| Error::io("remove", tmp, e))?;
                // The copy found may be one a killed writer renamed but never made durable:
                // make it durable now, before a manifest that names it is.
                File::open(&target).and_then(|f| f.sync_all()).map_err(|e| Error::io("fsync", &target, e))?;
                sync_dir(fan)?;
                sync_dir(kind_dir)?;
                return Ok(false);
            }
            self.quarantine(&target)?;
        }
        fs::create_dir_all(fan).map_err(|e| Error::io("create directory", fan, e))?;
        fs::rename(tmp, &target).map_err(|e| Error::io("rename", &target, e))?;
        // The rename, and the fan-out directory's own entry (a writer may have been killed
        // between creating it and syncing its parent).
        sync_dir(fan)?;
        sync_dir(kind_dir)?;
        Ok(true)
    }

    /// Writes, syncs and publishes a manifest.
    pub fn publish_manifest(&self, manifest: &Manifest) -> Result<ManifestId> {
        let (id, bytes) = manifest.encode();
        let (mut file, tmp) = self.create_tmp()?;
        file.write_all(&bytes).map_err(|e| Error::io("write", &tmp, e))?;
        file.sync_all().map_err(|e| Error::io("fsync", &tmp, e))?;
        drop(file);
        self.publish(ObjectKind::Manifest, id.0, &tmp)?;
        Ok(id)
    }

    /// Replaces the ref of `name` atomically (temp file, fsync, rename, fsync the directory),
    /// recording the change in its history: the versions it adds before the rename, the ones it
    /// drops after, so the history always holds every version the ref names.
    pub fn write_ref(&self, name: &DatasetName, log: &RefLog) -> Result<()> {
        let history = self.history_for_writing(name)?;
        self.append_history(name, &history.additions_for(log, now_unix_secs()))?;
        // Before the ref names a version, the history does (what `gc` honours).
        debug_assert!(
            self.paths.read_history(name).ok().flatten().is_some_and(|h| h.additions_for(log, 0).is_empty()),
            "the history of {name} holds every version its new ref names"
        );
        let dir = self.paths.refs_dir();
        fs::create_dir_all(&dir).map_err(|e| Error::io("create directory", &dir, e))?;
        let (_, tmp) = self.create_tmp()?;
        write_synced(&tmp, log.encode().as_bytes())?;
        let target = self.paths.ref_file(name);
        fs::rename(&tmp, &target).map_err(|e| Error::io("rename", &target, e))?;
        sync_dir(&dir)?;
        self.append_history(name, &history.removals_for(Some(log), now_unix_secs()))
    }

    /// Removes the ref of `name`, then records the removal of its versions in its history.
    pub fn remove_ref(&self, name: &DatasetName) -> Result<()> {
        let history = self.history_for_writing(name)?;
        let path = self.paths.ref_file(name);
        fs::remove_file(&path).map_err(|e| Error::io("remove", &path, e))?;
        sync_dir(&self.paths.refs_dir())?;
        self.append_history(name, &history.removals_for(None, now_unix_secs()))
    }

    /// Brings the history of `name` in line with `log`, the ref as it stands (an intact ref is
    /// the commit point): after a crash between a history append and a ref rename, or for a
    /// store written before histories. Returns the lines appended.
    pub fn sync_history(&self, name: &DatasetName, log: &RefLog) -> Result<usize> {
        let history = self.history_for_writing(name)?;
        let now = now_unix_secs();
        let mut lines = history.additions_for(log, now);
        lines.extend(history.removals_for(Some(log), now));
        self.append_history(name, &lines)?;
        Ok(lines.len())
    }

    /// The history of `name` as it stands, to append to. A history whose header is damaged is
    /// moved to `quarantine/` (where `gc` still honours what it names) and a new one begins.
    fn history_for_writing(&self, name: &DatasetName) -> Result<RefHistory> {
        match self.paths.read_history(name) {
            Ok(history) => Ok(history.unwrap_or_default()),
            Err(e) if e.is_corruption() => {
                self.quarantine_history(name)?;
                Ok(RefHistory::default())
            }
            Err(e) => Err(e),
        }
    }

    /// Appends `entries` to the history of `name` (creating it with its header) and fsyncs.
    fn append_history(&self, name: &DatasetName, entries: &[HistoryEntry]) -> Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        let dir = self.paths.history_dir();
        fs::create_dir_all(&dir).map_err(|e| Error::io("create directory", &dir, e))?;
        let path = self.paths.history_file(name);
        let mut file =
            OpenOptions::new().create(true).append(true).open(&path).map_err(|e| Error::io("open", &path, e))?;
        let len = file.metadata().map_err(|e| Error::io("stat", &path, e))?.len();
        let mut text = String::new();
        if len == 0 {
            text.push_str(&RefHistory::header());
        } else if !ends_with_newline(&path, len)? {
            // A torn last append: end its line, so the damage stays in that line.
            text.push('\n');
        }
        entries.iter().for_each(|entry| text.push_str(&entry.encode()));
        file.write_all(text.as_bytes()).map_err(|e| Error::io("write", &path, e))?;
        file.sync_all().map_err(|e| Error::io("fsync", &path, e))?;
        if len == 0 {
            sync_dir(&dir)?;
        }
        Ok(())
    }

    /// Removes an object file (garbage collection).
    pub fn remove_object(&self, kind: ObjectKind, id: ObjectId) -> Result<()> {
        let path = self.paths.object(kind, id);
        fs::remove_file(&path).map_err(|e| Error::io("remove", &path, e))?;
        sync_dir(path.parent().expect("objects live in a fan-out directory"))
    }

    /// Removes the history of `name` (gc, once a removed dataset's grace period is over).
    pub fn remove_history(&self, name: &DatasetName) -> Result<()> {
        let path = self.paths.history_file(name);
        fs::remove_file(&path).map_err(|e| Error::io("remove", &path, e))?;
        sync_dir(&self.paths.history_dir())
    }

    /// Moves the damaged ref of `name` to `quarantine/` as `ref-NAME.*`. Returns its new path.
    pub fn quarantine_ref(&self, name: &DatasetName) -> Result<PathBuf> {
        self.quarantine_named(&self.paths.ref_file(name), &format!("{QUARANTINED_REF_PREFIX}{name}"))
    }

    /// Moves the damaged history of `name` to `quarantine/` as `history-NAME.*`. Returns its new
    /// path.
    pub fn quarantine_history(&self, name: &DatasetName) -> Result<PathBuf> {
        self.quarantine_named(&self.paths.history_file(name), &format!("{QUARANTINED_HISTORY_PREFIX}{name}"))
    }

    /// Moves a file (or a directory: a damaged catalog) that failed verification to
    /// `quarantine/`, where nothing reads it but a person can still look at it. Returns its new
    /// path.
    pub fn quarantine(&self, path: &Path) -> Result<PathBuf> {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        self.quarantine_named(path, &name)
    }

    fn quarantine_named(&self, path: &Path, name: &str) -> Result<PathBuf> {
        self.paths.move_to_quarantine(path, name)
    }

    /// Temp files of dead writers that opening the store removed.
    pub fn stale_tmp_removed(&self) -> usize {
        self.stale_tmp_removed
    }

    /// Removes every file in `tmp/`; returns how many.
    pub fn clean_tmp(&self) -> Result<usize> {
        let mut n = 0;
        for entry in read_dir_if_exists(&self.paths.tmp_dir())? {
            // Only the store's own temp files: a directory or a file someone else put here is
            // left alone (repair reports it), not a reason to stop every writer.
            if !is_own_tmp(&entry) {
                continue;
            }
            let path = entry.path();
            match fs::remove_file(&path) {
                Ok(()) => n += 1,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("remove", &path, e)),
            }
        }
        Ok(n)
    }
}

/// The BLAKE3 hash of a whole file, streamed.
pub fn hash_file(path: &Path) -> Result<ObjectId> {
    let mut file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = std::io::Read::read(&mut file, &mut buf).map_err(|e| Error::io("read", path, e))?;
        if n == 0 {
            return Ok(ObjectId::from_hash(hasher.finalize()));
        }
        hasher.update(&buf[..n]);
    }
}

/// Whether the file at `path`, `len` bytes long (> 0), ends with a newline.
fn ends_with_newline(path: &Path, len: u64) -> Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    let mut last = [0u8; 1];
    file.seek(SeekFrom::Start(len - 1))
        .and_then(|_| file.read_exact(&mut last))
        .map_err(|e| Error::io("read", path, e))?;
    Ok(last[0] == b'\n')
}

/// Creates `path`, writes `bytes`, fsyncs.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut file = File::create(path).map_err(|e| Error::io("create", path, e))?;
    file.write_all(bytes).map_err(|e| Error::io("write", path, e))?;
    file.sync_all().map_err(|e| Error::io("fsync", path, e))
}

/// Replaces `target` with `bytes` through a temp file in `dir` (readers see the old content or
/// the new, never a mix); durable (synced) only when `durable`.
#[cfg(feature = "replication")]
pub(crate) fn replace_file(dir: &Path, target: &Path, bytes: &[u8], durable: bool) -> Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(".{}-{n}.tmp", std::process::id()));
    let mut file = File::create(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
    let written = file
        .write_all(bytes)
        .and_then(|()| if durable { file.sync_all() } else { Ok(()) })
        .map_err(|e| Error::io("write", &tmp, e))
        .and_then(|()| fs::rename(&tmp, target).map_err(|e| Error::io("rename", target, e)));
    if let Err(e) = written {
        // A full disk, say: leave no temp file behind.
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    if durable { sync_dir(dir) } else { Ok(()) }
}

/// Makes a directory's entries (a rename into it, a new file) durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io("fsync directory", dir, e))
}

/// The valid dataset names among the files of `dir`, sorted.
fn list_names(dir: &Path) -> Result<Vec<DatasetName>> {
    let mut names = Vec::new();
    for entry in read_dir_if_exists(dir)? {
        // The store writes regular files with valid names; anything else (a directory, a
        // symlink, another name) is not its own: ignored here, reported by `strays`.
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        if let Some(name) = entry.file_name().to_str().and_then(|name| DatasetName::new(name).ok()) {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// The fewest hex digits taken as an id prefix (`ls` shows 12).
pub const ID_PREFIX_MIN: usize = 8;

fn is_id_prefix(text: &str) -> bool {
    (ID_PREFIX_MIN..=64).contains(&text.len()) && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Writes `process PID (COMMAND LINE)` into the held lock file.
fn write_holder(mut lock: &File) -> std::io::Result<()> {
    let command = std::fs::read("/proc/self/cmdline")
        .map(|raw| {
            let words: Vec<String> = raw
                .split(|&b| b == 0)
                .filter(|w| !w.is_empty())
                .map(|w| String::from_utf8_lossy(w).into_owned())
                .collect();
            words.join(" ")
        })
        .unwrap_or_default();
    // Bounded: a command line can be long; the start names it.
    let command: String = command.chars().take(200).collect();
    lock.set_len(0)?;
    std::io::Seek::seek(&mut lock, std::io::SeekFrom::Start(0))?;
    write!(lock, "process {} ({command})", std::process::id())
}

/// Whether `entry` of `tmp/` is a temp file the store wrote (`PID-N.tmp`, or the marker being
/// created), a regular file.
fn is_own_tmp(entry: &fs::DirEntry) -> bool {
    let name = entry.file_name();
    let Some(name) = name.to_str() else { return false };
    let own = name == MARKER_FILE
        || name.strip_suffix(".tmp").and_then(|stem| stem.split_once('-')).is_some_and(|(pid, n)| {
            !pid.is_empty() && !n.is_empty() && (pid.bytes().chain(n.bytes())).all(|b| b.is_ascii_digit())
        });
    own && entry.file_type().is_ok_and(|t| t.is_file())
}

/// Seconds since the Unix epoch, now (0 on a clock set before 1970).
pub fn now_unix_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn read_dir_if_exists(dir: &Path) -> Result<Vec<fs::DirEntry>> {
    match fs::read_dir(dir) {
        Ok(entries) => entries.collect::<Result<Vec<_>, _>>().map_err(|e| Error::io("read directory", dir, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(Error::io("read directory", dir, e)),
    }
}
