//! granary: an embedded storage engine that keeps a trainer's GPU fed from local disk.
//!
//! Modules follow a sample's path (after `id`, `error` and `size`, the size grammar): `shard`
//! (the file format; beside it `erasure`, a shard coded into fragments) -> `manifest` (dataset
//! versions) -> `store`
//! (files on disk, crash-safe publishing, the records of attached datasets) -> `catalog` (sled
//! cache of what the files say) -> `ingest` (sources into shards) -> `plan` (which record each
//! rank reads, in which order) -> `io` (io_uring and pread backends) -> `staging` (the bounded
//! pool of page-aligned buffers, page-locked through CUDA when present) -> `metrics` (the
//! registry the parts after it report to, and its `/metrics` endpoint) -> `policy`
//! (partitioning, eviction and replication as WebAssembly plugins) -> `tier` (the node's
//! records in memory, filled ahead in plan order, the evictor plugin choosing what leaves) ->
//! `read` (batch planning, verification, assembly) -> `engine` (the write side wired together:
//! store, catalog, ingest, verify, repair) -> `replication` (copies of shards on the other
//! nodes of a job, reads repaired from them) -> `origin` (datasets in object storage, read
//! through a bounded cache that asks the node's peers first) -> `loader` (one rank's batches,
//! prefetched, verified, copied to the GPU) -> `cli`. A module uses only the modules before it
//! in this order, never one after it (`tests/tidy.rs` checks every `crate::` path).
//!
//! Owns the module tree and the names a user starts from (re-exported below). Never: holds
//! code of its own beyond those re-exports.
//!
//! ```no_run
//! use granary::{Granary, IngestOptions, Layout, Dtype, FixedLayout, DatasetName, VersionSpec};
//! # fn main() -> granary::Result<()> {
//! let mut granary = Granary::create("/data/store")?;
//! let layout = Layout::Fixed(FixedLayout::new(Dtype::U16, &[2048]).expect("a valid shape"));
//! let mut ingest = granary.ingest(DatasetName::new("tokens")?, layout, IngestOptions::default())?;
//! ingest.push(&[0u8; 4096])?;
//! ingest.commit()?;
//!
//! let dataset = granary.open_dataset(&VersionSpec::parse("tokens")?)?;
//! let mut reader = granary::Reader::new(dataset, granary::IoConfig::default().build()?);
//! let record = reader.get(0)?; // every block it touches was CRC-checked
//! # Ok(()) }
//! ```

#![deny(clippy::unwrap_used)]

pub mod id;
pub mod error;
pub mod size;
pub mod shard;
pub mod erasure;
pub mod manifest;
pub mod store;
pub mod catalog;
pub mod ingest;
pub mod plan;
pub mod blend;
pub mod pack;
pub mod io;
pub mod staging;
pub mod metrics;
#[cfg(feature = "policy")]
pub mod policy;
pub mod tier;
pub mod read;
pub mod engine;
pub mod replication;
#[cfg(feature = "origin")]
pub mod origin;
pub mod loader;
#[cfg(feature = "cli")]
pub mod cli;

// The command line names the library's items as `granary::...`, as a user of the crate would.
extern crate self as granary;

pub use blend::Blend;
pub use engine::Granary;
pub use error::{Error, FormatError, PluginError, Result, catch_panic};
pub use id::{ManifestId, ObjectId, ShardId};
pub use ingest::{Ingest, IngestMode, IngestOptions};
pub use io::{Backend, Io, IoConfig};
pub use loader::{LoadedBatch, Loader, LoaderConfig, LoaderStats, PlanSource, Target, TierSetting};
pub use plan::{EpochPlan, Order, Position, RankCursor, World};
pub use read::{Batch, CacheStats, Dataset, EpochLength, Mixture, MixtureSource, PublishedStats, Reader, ShardSource};
pub use shard::{Dtype, FixedLayout, Layout};
pub use staging::{Lease, StagingConfig, StagingPool};
pub use store::{DatasetName, StorePaths, VersionSpec};
pub use tier::{MemoryTier, TierConfig, TierKind, TierStats};
