//! The catalog: a sled database that caches what the store's files say, for fast listing.
//!
//! Owns: `Catalog` (over any `KvBackend`: sled, or memory for tests and read-only tools),
//! `ObjectEntry` and the encoding of the entries in its trees.
//!
//! Trees: `shards` (id -> counts and layout), `manifests` (id -> counts and layout), `datasets`
//! (name -> the ref's versions). Everything here can be rebuilt from the files (`granary repair`),
//! because sled 0.34 is beta and its format may change. An entry is inserted only after its file is
//! durable, and the catalog is flushed before an ingest is acknowledged, so after a crash the
//! catalog never names a file that is not complete. Never: is consulted by the read path, which
//! resolves names from ref files so that many reader processes can share a store while one writer
//! holds the sled lock. All sled calls stay behind `KvBackend` so the catalog can move off sled.

mod kv;

use crate::error::{Error, Result};
use crate::id::{ID_BYTES, ManifestId, ObjectId, ShardId};
use crate::shard::{LAYOUT_BYTES, Layout, read_u64};
use crate::store::{DatasetName, RefLog};

pub use kv::{KvBackend, MemoryKv, SledKv, Tree};

/// What the catalog knows of a shard or manifest: counts and layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectEntry {
    /// Records in the object.
    pub n_records: u64,
    /// Shards in a manifest; 1 for a shard.
    pub n_shards: u64,
    /// Bytes of the shard files it covers.
    pub file_bytes: u64,
    /// What the records are.
    pub layout: Layout,
}

impl ObjectEntry {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(24 + LAYOUT_BYTES);
        for word in [self.n_records, self.n_shards, self.file_bytes] {
            out.extend_from_slice(&word.to_le_bytes());
        }
        out.extend_from_slice(&self.layout.encode());
        out
    }

    fn decode(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != 24 + LAYOUT_BYTES {
            return Err(Error::Catalog { detail: format!("an object entry of {} bytes", bytes.len()) });
        }
        let mut layout = [0u8; LAYOUT_BYTES];
        layout.copy_from_slice(&bytes[24..]);
        let layout = Layout::decode(&layout).map_err(|e| Error::Catalog { detail: e.to_string() })?;
        Ok(Self {
            n_records: read_u64(bytes, 0),
            n_shards: read_u64(bytes, 8),
            file_bytes: read_u64(bytes, 16),
            layout,
        })
    }
}

/// The catalog over some key-value backend.
pub struct Catalog {
    kv: Box<dyn KvBackend>,
}

impl Catalog {
    /// Whether this process can open a sled catalog: `Error::CatalogForked` in a child forked
    /// after its parent opened one (checked before taking locks or touching files).
    pub fn check_process() -> Result<()> {
        kv::check_process()
    }

    /// Opens (or creates) the sled catalog in `dir`.
    pub fn open_sled(dir: &std::path::Path) -> Result<Self> {
        Ok(Self { kv: Box::new(SledKv::open(dir)?) })
    }

    /// A catalog held in memory (tests, and read-only tools).
    pub fn in_memory() -> Self {
        Self { kv: Box::new(MemoryKv::default()) }
    }

    /// Records a shard.
    pub fn put_shard(&self, id: ShardId, entry: &ObjectEntry) -> Result<()> {
        self.kv.insert(Tree::Shards, id.0.as_bytes(), &entry.encode())
    }

    /// What the catalog knows of shard `id`.
    pub fn shard(&self, id: ShardId) -> Result<Option<ObjectEntry>> {
        self.kv.get(Tree::Shards, id.0.as_bytes())?.map(|v| ObjectEntry::decode(&v)).transpose()
    }

    /// Every shard in the catalog, by id.
    pub fn shards(&self) -> Result<Vec<(ShardId, ObjectEntry)>> {
        self.objects(Tree::Shards).map(|all| all.into_iter().map(|(id, e)| (ShardId(id), e)).collect())
    }

    /// Forgets a shard.
    pub fn remove_shard(&self, id: ShardId) -> Result<()> {
        self.kv.remove(Tree::Shards, id.0.as_bytes())
    }

    /// Records a manifest.
    pub fn put_manifest(&self, id: ManifestId, entry: &ObjectEntry) -> Result<()> {
        self.kv.insert(Tree::Manifests, id.0.as_bytes(), &entry.encode())
    }

    /// What the catalog knows of manifest `id`.
    pub fn manifest(&self, id: ManifestId) -> Result<Option<ObjectEntry>> {
        self.kv.get(Tree::Manifests, id.0.as_bytes())?.map(|v| ObjectEntry::decode(&v)).transpose()
    }

    /// Every manifest in the catalog, by id.
    pub fn manifests(&self) -> Result<Vec<(ManifestId, ObjectEntry)>> {
        self.objects(Tree::Manifests).map(|all| all.into_iter().map(|(id, e)| (ManifestId(id), e)).collect())
    }

    /// Forgets a manifest.
    pub fn remove_manifest(&self, id: ManifestId) -> Result<()> {
        self.kv.remove(Tree::Manifests, id.0.as_bytes())
    }

    /// Records the versions of a dataset.
    pub fn put_dataset(&self, name: &DatasetName, log: &RefLog) -> Result<()> {
        self.kv.insert(Tree::Datasets, name.as_str().as_bytes(), log.encode().as_bytes())
    }

    /// The versions of a dataset.
    pub fn dataset(&self, name: &DatasetName) -> Result<Option<RefLog>> {
        self.kv.get(Tree::Datasets, name.as_str().as_bytes())?.map(|v| decode_ref(&v)).transpose()
    }

    /// Every dataset, by name.
    pub fn datasets(&self) -> Result<Vec<(DatasetName, RefLog)>> {
        let mut out = Vec::new();
        for (key, value) in self.kv.scan(Tree::Datasets)? {
            let name = std::str::from_utf8(&key)
                .ok()
                .and_then(|name| DatasetName::new(name).ok())
                .ok_or_else(|| Error::Catalog { detail: format!("a dataset key {key:?}") })?;
            out.push((name, decode_ref(&value)?));
        }
        Ok(out)
    }

    /// Forgets a dataset.
    pub fn remove_dataset(&self, name: &DatasetName) -> Result<()> {
        self.kv.remove(Tree::Datasets, name.as_str().as_bytes())
    }

    /// Forgets everything (before a rebuild).
    pub fn clear(&self) -> Result<()> {
        for tree in Tree::ALL {
            self.kv.clear(tree)?;
        }
        Ok(())
    }

    /// Makes every change so far durable.
    pub fn flush(&self) -> Result<()> {
        self.kv.flush()
    }

    fn objects(&self, tree: Tree) -> Result<Vec<(ObjectId, ObjectEntry)>> {
        let mut out = Vec::new();
        for (key, value) in self.kv.scan(tree)? {
            let id: [u8; ID_BYTES] = key
                .as_slice()
                .try_into()
                .map_err(|_| Error::Catalog { detail: format!("a key of {} bytes", key.len()) })?;
            out.push((ObjectId::from_bytes(id), ObjectEntry::decode(&value)?));
        }
        Ok(out)
    }
}

fn decode_ref(bytes: &[u8]) -> Result<RefLog> {
    RefLog::decode(bytes).map_err(|e| Error::Catalog { detail: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::{Dtype, FixedLayout};

    fn exercise(catalog: &Catalog) {
        let shard = ShardId(ObjectId::of(b"s"));
        let entry = ObjectEntry {
            n_records: 7,
            n_shards: 1,
            file_bytes: 12288,
            layout: Layout::Fixed(FixedLayout::new(Dtype::U16, &[2048]).unwrap()),
        };
        assert_eq!(catalog.shard(shard).unwrap(), None);
        catalog.put_shard(shard, &entry).unwrap();
        assert_eq!(catalog.shard(shard).unwrap(), Some(entry.clone()));
        assert_eq!(catalog.shards().unwrap(), vec![(shard, entry.clone())]);
        let name = DatasetName::new("d").unwrap();
        let log = RefLog::first(ManifestId(ObjectId::of(b"m")));
        catalog.put_dataset(&name, &log).unwrap();
        assert_eq!(catalog.datasets().unwrap(), vec![(name.clone(), log)]);
        catalog.remove_dataset(&name).unwrap();
        assert_eq!(catalog.dataset(&name).unwrap(), None);
        catalog.clear().unwrap();
        assert!(catalog.shards().unwrap().is_empty());
        catalog.flush().unwrap();
    }

    #[test]
    fn a_sled_catalog_reopens_at_once_after_it_is_dropped() {
        // sled lets go of its lock file from a background thread after a drop; an immediate
        // reopen (what the Python bindings do, opening the store per call) must wait for it.
        let dir = tempfile::tempdir().unwrap();
        let shard = ShardId(ObjectId::of(b"s"));
        let entry = ObjectEntry { n_records: 1, n_shards: 1, file_bytes: 12288, layout: Layout::Bytes };
        for i in 0..200u64 {
            let catalog = Catalog::open_sled(dir.path()).unwrap_or_else(|e| panic!("open {i}: {e}"));
            catalog.put_shard(shard, &ObjectEntry { n_records: i, ..entry.clone() }).unwrap();
            catalog.flush().unwrap();
        }
        let catalog = Catalog::open_sled(dir.path()).unwrap();
        assert_eq!(catalog.shard(shard).unwrap().map(|e| e.n_records), Some(199));
    }

    #[test]
    fn memory_and_sled_catalogs_agree() {
        exercise(&Catalog::in_memory());
        let dir = tempfile::tempdir().unwrap();
        exercise(&Catalog::open_sled(dir.path()).unwrap());
    }
}
