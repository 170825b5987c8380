//! `granary bench`: the engine measured against the baselines a user would compare it with, on
//! data each benchmark makes or is pointed at.
//!
//! Owns the benchmark commands: `read.rs` (`bench read`: random and sequential reads against a
//! bare io_uring reader), `loader.rs` (`bench loader`: the loader and its tier against a memory
//! map's gather, in the patterns trainers use), `cache.rs` (`bench cache`: an attached dataset
//! through the origin cache against Belady's minimum), `replication.rs` (`bench replication`:
//! copies between real nodes), and what they share (`measure.rs`: the median, the generator).
//! Never: writes to a store it was not asked to make, or prints a figure without the baseline
//! measured in the same run.

pub(super) mod cache;
pub(super) mod loader;
mod loader_rows;
mod measure;
pub(super) mod read;
pub(super) mod replication;
