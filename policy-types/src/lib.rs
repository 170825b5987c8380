//! The records of `wit/policy.wit` as plain Rust types, defined once: the engine's policy host
//! (`granary::policy`) and the plugin SDK (`granary-policy-sdk`) both use these, each converting
//! to and from the bindings its side generates from the same WIT file.
//!
//! Owns: the partitioner's records (`partition`) and the replicator's (`replicate`), and the
//! arithmetic both sides must agree on (`partition::step_shares`, `replicate::shard_key`).
//! Never: calls a plugin, checks an answer (the host does), or depends on another crate (it
//! builds for the host and for `wasm32-wasip2`).

pub mod partition;
pub mod replicate;
