//! Host bindings of the three plugin worlds, generated from `wit/policy.wit`.
//!
//! The shared `types` interface is generated once (with the partitioner) and reused by the
//! others, so a `Node` or a `PolicyError` is one Rust type whatever the plugin.
#![allow(missing_docs, unreachable_pub, reason = "generated code")]
#![allow(clippy::all, reason = "generated code")]

/// The `partitioner-plugin` world.
pub mod partitioner {
    wasmtime::component::bindgen!({
        world: "partitioner-plugin",
        path: "../wit",
    });
}

/// The `evictor-plugin` world.
pub mod evictor {
    wasmtime::component::bindgen!({
        world: "evictor-plugin",
        path: "../wit",
        with: { "granary:policy/types": super::partitioner::granary::policy::types },
    });
}

/// The `replicator-plugin` world.
pub mod replicator {
    wasmtime::component::bindgen!({
        world: "replicator-plugin",
        path: "../wit",
        with: { "granary:policy/types": super::partitioner::granary::policy::types },
    });
}

pub use partitioner::granary::policy::types::{Node as WitNode, PolicyError as WitPolicyError};
