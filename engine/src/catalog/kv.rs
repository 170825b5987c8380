//! The key-value interface the catalog needs, with a sled backend and an in-memory one.
//!
//! Owns: `KvBackend` (what the catalog asks of a key-value store), `Tree` (its three trees),
//! `SledKv` (sled 0.34: opened with a wait for its lock file, and `check_process`, which refuses a
//! child forked after its parent opened sled) and `MemoryKv` (the model the sled backend is tested
//! against). Never: encodes or decodes an entry (`Catalog` does), or reads a shard, manifest or
//! ref file.
//!
//! Invariant: every sled type and error stays in this file.

use std::collections::BTreeMap;

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// The catalog's trees.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tree {
    /// Shard id -> entry.
    Shards,
    /// Manifest id -> entry.
    Manifests,
    /// Dataset name -> ref.
    Datasets,
}

impl Tree {
    /// Every tree.
    pub const ALL: [Tree; 3] = [Tree::Shards, Tree::Manifests, Tree::Datasets];

    fn name(self) -> &'static str {
        match self {
            Tree::Shards => "shards",
            Tree::Manifests => "manifests",
            Tree::Datasets => "datasets",
        }
    }
}

/// What the catalog asks of a key-value store.
pub trait KvBackend: Send + Sync {
    /// The value under `key`.
    fn get(&self, tree: Tree, key: &[u8]) -> Result<Option<Vec<u8>>>;
    /// Sets `key` to `value`.
    fn insert(&self, tree: Tree, key: &[u8], value: &[u8]) -> Result<()>;
    /// Removes `key`.
    fn remove(&self, tree: Tree, key: &[u8]) -> Result<()>;
    /// Every entry of `tree`, by key.
    fn scan(&self, tree: Tree) -> Result<Vec<(Vec<u8>, Vec<u8>)>>;
    /// Removes every entry of `tree`.
    fn clear(&self, tree: Tree) -> Result<()>;
    /// Makes every change durable.
    fn flush(&self) -> Result<()>;
}

/// sled 0.34.
pub struct SledKv {
    db: sled::Db,
    trees: Vec<sled::Tree>,
}

fn catalog_error(e: sled::Error) -> Error {
    let text = e.to_string();
    // sled appends a debug dump of a backtrace (empty in release builds) to corruption errors.
    let detail = text.split(" backtrace ").next().unwrap_or(&text).to_owned();
    Error::Catalog { detail }
}

/// How long opening waits for the database's lock file. sled 0.34 lets go of it from a
/// background thread after its last handle is dropped (sled issues 1234 and 1289), so a reopen
/// in the same process can find it held for a few milliseconds. The engine opens the catalog
/// only while holding the store's own lock, so no other writer can hold this one longer.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The process that opened a sled database first. sled's I/O thread pool is process-wide and
/// started once: a child forked after that inherits a pool whose threads are gone, and opening
/// a database there waits on them forever.
static SLED_PROCESS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();

/// `Error::CatalogForked` in a child forked after its parent opened a sled database. Records
/// nothing: only opening one makes this process the one that opens them.
pub(crate) fn check_process() -> Result<()> {
    match SLED_PROCESS.get() {
        Some(&parent) if parent != std::process::id() => {
            Err(Error::CatalogForked { parent, child: std::process::id() })
        }
        _ => Ok(()),
    }
}

impl SledKv {
    /// Opens or creates the database in `dir`, waiting up to `LOCK_WAIT` (2 s) for its lock;
    /// `Error::CatalogForked` in a child forked after this process's parent opened one.
    pub fn open(dir: &std::path::Path) -> Result<Self> {
        check_process()?;
        SLED_PROCESS.get_or_init(std::process::id);
        let started = std::time::Instant::now();
        let db = loop {
            match sled::Config::new().path(dir).open() {
                Ok(db) => break db,
                // sled reports a held lock as an `Other` error with this text.
                Err(sled::Error::Io(io))
                    if io.to_string().starts_with("could not acquire lock") && started.elapsed() < LOCK_WAIT =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                Err(sled::Error::Io(io)) => return Err(Error::io("open catalog", dir, io)),
                Err(other) => return Err(catalog_error(other)),
            }
        };
        let trees =
            Tree::ALL.iter().map(|t| db.open_tree(t.name())).collect::<Result<_, _>>().map_err(catalog_error)?;
        Ok(Self { db, trees })
    }

    fn tree(&self, tree: Tree) -> &sled::Tree {
        &self.trees[tree as usize]
    }
}

impl KvBackend for SledKv {
    fn get(&self, tree: Tree, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.tree(tree).get(key).map_err(catalog_error)?.map(|v| v.to_vec()))
    }

    fn insert(&self, tree: Tree, key: &[u8], value: &[u8]) -> Result<()> {
        self.tree(tree).insert(key, value).map_err(catalog_error).map(drop)
    }

    fn remove(&self, tree: Tree, key: &[u8]) -> Result<()> {
        self.tree(tree).remove(key).map_err(catalog_error).map(drop)
    }

    fn scan(&self, tree: Tree) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        self.tree(tree).iter().map(|kv| kv.map(|(k, v)| (k.to_vec(), v.to_vec())).map_err(catalog_error)).collect()
    }

    fn clear(&self, tree: Tree) -> Result<()> {
        self.tree(tree).clear().map_err(catalog_error)
    }

    fn flush(&self) -> Result<()> {
        self.db.flush().map_err(catalog_error).map(drop)
    }
}

/// Every entry of every tree, keyed by (tree, key).
type Entries = BTreeMap<(Tree, Vec<u8>), Vec<u8>>;

/// A `BTreeMap` per tree: the model the sled backend is tested against.
#[derive(Default)]
pub struct MemoryKv {
    trees: Mutex<Entries>,
}

impl MemoryKv {
    fn lock(&self) -> parking_lot::MutexGuard<'_, Entries> {
        // A panic while holding this lock (which releases it: parking_lot does not poison)
        // cannot leave the map half-updated: every operation is one BTreeMap call.
        self.trees.lock()
    }
}

impl KvBackend for MemoryKv {
    fn get(&self, tree: Tree, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.lock().get(&(tree, key.to_vec())).cloned())
    }

    fn insert(&self, tree: Tree, key: &[u8], value: &[u8]) -> Result<()> {
        self.lock().insert((tree, key.to_vec()), value.to_vec());
        Ok(())
    }

    fn remove(&self, tree: Tree, key: &[u8]) -> Result<()> {
        self.lock().remove(&(tree, key.to_vec()));
        Ok(())
    }

    fn scan(&self, tree: Tree) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        Ok(self.lock().iter().filter(|((t, _), _)| *t == tree).map(|((_, k), v)| (k.clone(), v.clone())).collect())
    }

    fn clear(&self, tree: Tree) -> Result<()> {
        self.lock().retain(|(t, _), _| *t != tree);
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }
}
