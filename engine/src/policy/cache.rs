//! Compiled plugins, cached by content hash: in memory for the process, on disk across restarts.
//!
//! Compiling a component takes 50-130 ms; loading its precompiled artifact takes a fraction of
//! a millisecond. The disk cache key is the BLAKE3 of the component's bytes together with the
//! engine's compatibility hash (a different engine configuration, such as fuel metering,
//! produces different machine code). Each cache file ends with the BLAKE3 of its content and is
//! written through a temp file and a rename; a file that fails its hash is recompiled over.
//!
//! Owns: `ComponentCache` (compiled components by content id, in memory and in `<key>.cwasm` files
//! of the cache directory) and `CompiledFrom`. Never: deserializes a file whose trailer does not
//! match, fails a load because the disk cache cannot be written (the next start compiles again), or
//! removes an old cache file.
#![allow(unsafe_code, reason = "loading precompiled machine code is unsafe by nature; see the SAFETY comment")]

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use wasmtime::Engine;
use wasmtime::component::Component;

use crate::id::ObjectId;

/// Compiled components by content id.
pub(crate) struct ComponentCache {
    dir: Option<PathBuf>,
    compiled: Mutex<HashMap<ObjectId, Component>>,
}

/// Where a component came from this time, for reports and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompiledFrom {
    /// Already compiled in this process.
    Memory,
    /// Deserialized from the disk cache.
    Disk,
    /// Compiled now (and written to the disk cache if there is one).
    Compiler,
}

impl ComponentCache {
    pub(crate) fn new(dir: Option<PathBuf>) -> Self {
        Self { dir, compiled: Mutex::new(HashMap::new()) }
    }

    /// The compiled component of `bytes`.
    pub(crate) fn get(&self, engine: &Engine, bytes: &[u8]) -> wasmtime::Result<(ObjectId, Component, CompiledFrom)> {
        let id = ObjectId::of(bytes);
        if let Some(component) = self.lock().get(&id) {
            return Ok((id, component.clone(), CompiledFrom::Memory));
        }
        let file = self.dir.as_ref().map(|dir| dir.join(format!("{}.cwasm", cache_key(engine, id))));
        if let Some(component) = file.as_deref().and_then(|file| load(engine, file)) {
            self.lock().insert(id, component.clone());
            return Ok((id, component, CompiledFrom::Disk));
        }
        let component = Component::new(engine, bytes)?;
        if let Some(file) = file {
            // A cache that cannot be written only costs the next start a compile.
            let _ = store(&component, &file);
        }
        self.lock().insert(id, component.clone());
        Ok((id, component, CompiledFrom::Compiler))
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, HashMap<ObjectId, Component>> {
        // Every operation under the lock is one map call: a panic that releases it (parking_lot
        // does not poison) leaves the map consistent.
        self.compiled.lock()
    }
}

fn cache_key(engine: &Engine, id: ObjectId) -> ObjectId {
    let mut compat = std::collections::hash_map::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut compat);
    let mut hasher = blake3::Hasher::new();
    hasher.update(id.as_bytes());
    hasher.update(&compat.finish().to_le_bytes());
    hasher.update(env!("CARGO_PKG_VERSION").as_bytes());
    ObjectId::from_hash(hasher.finalize())
}

fn load(engine: &Engine, file: &Path) -> Option<Component> {
    let bytes = std::fs::read(file).ok()?;
    let body_len = bytes.len().checked_sub(32)?;
    let (body, trailer) = bytes.split_at(body_len);
    if blake3::hash(body).as_bytes() != trailer {
        return None;
    }
    // SAFETY: `body` is exactly what `Component::serialize` produced for a component compiled by
    // an engine with this compatibility hash (it is part of the file name), and its BLAKE3
    // trailer matches, so it was not truncated or altered since. The cache directory belongs to
    // the engine's user, who could equally replace the engine binary.
    unsafe { Component::deserialize(engine, body) }.ok()
}

fn store(component: &Component, file: &Path) -> std::io::Result<()> {
    let body = component.serialize().map_err(|e| std::io::Error::other(e.to_string()))?;
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = file.with_extension(format!("tmp{}", std::process::id()));
    let mut out = std::fs::File::create(&tmp)?;
    out.write_all(&body)?;
    out.write_all(blake3::hash(&body).as_bytes())?;
    out.sync_all()?;
    std::fs::rename(&tmp, file)
}
