//! Host bindings of the three plugin worlds, generated from `wit/policy.wit` (`@0.2.0`), and of
//! the same worlds at `@0.1.0` (`wit/v0.1.0/policy.wit`) for components built against it.
//!
//! In each version the shared `types` interface is generated once (with the partitioner) and
//! reused by the others, so a `Node` or a `PolicyError` is one Rust type per version.
//!
//! Owns: the generated modules (`partitioner`, `evictor`, `replicator`, and the three of `v1`),
//! `WitNode` and `WitPolicyError`, and the conversions between the two versions' types. Never:
//! calls a plugin or checks an answer (the hosts do).
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

/// The worlds of `granary:policy@0.1.0`.
pub mod v1 {
    /// The `partitioner-plugin` world at 0.1.0.
    pub mod partitioner {
        wasmtime::component::bindgen!({
            world: "partitioner-plugin",
            path: "../wit/v0.1.0",
        });
    }

    /// The `evictor-plugin` world at 0.1.0.
    pub mod evictor {
        wasmtime::component::bindgen!({
            world: "evictor-plugin",
            path: "../wit/v0.1.0",
            with: { "granary:policy/types": super::partitioner::granary::policy::types },
        });
    }

    /// The `replicator-plugin` world at 0.1.0.
    pub mod replicator {
        wasmtime::component::bindgen!({
            world: "replicator-plugin",
            path: "../wit/v0.1.0",
            with: { "granary:policy/types": super::partitioner::granary::policy::types },
        });
    }

    pub use partitioner::granary::policy::types::{Node as WitNode, PolicyError as WitPolicyError};
}

pub use partitioner::granary::policy::types::{Node as WitNode, PolicyError as WitPolicyError};

impl From<v1::WitPolicyError> for WitPolicyError {
    fn from(error: v1::WitPolicyError) -> Self {
        match error {
            v1::WitPolicyError::InvalidInput(detail) => Self::InvalidInput(detail),
            v1::WitPolicyError::Unsupported(detail) => Self::Unsupported(detail),
        }
    }
}

impl From<&WitNode> for v1::WitNode {
    fn from(node: &WitNode) -> Self {
        Self { id: node.id, weight: node.weight, failure_domain: node.failure_domain, up: node.up }
    }
}
