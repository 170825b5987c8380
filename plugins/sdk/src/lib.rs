//! The granary policy SDK: write a partitioner, evictor or replicator as a plain Rust trait, and
//! export it as a WebAssembly component with one macro.
//!
//! ```ignore
//! use granary_policy_sdk::evict::{Evictor, NEVER};
//! use granary_policy_sdk::{Error, Options};
//!
//! struct Fifo { queue: std::collections::VecDeque<u64> }
//!
//! impl Evictor for Fifo {
//!     const NAME: &'static str = "fifo";
//!     fn new(_capacity: u64, options: &Options) -> Result<Self, Error> { options.allow_only(&[])?; Ok(Fifo { queue: Default::default() }) }
//!     fn insert(&mut self, key: u64, _size: u32, _next_use: u64) { self.queue.push_back(key) }
//!     fn hit(&mut self, _key: u64, _size: u32, _next_use: u64) {}
//!     fn evict(&mut self) -> Option<u64> { self.queue.pop_front() }
//!     fn remove(&mut self, key: u64) { self.queue.retain(|k| *k != key) }
//!     fn order(&self) -> Vec<u64> { self.queue.iter().copied().collect() }
//! }
//!
//! granary_policy_sdk::export_evictor!(Fifo);
//! ```
//!
//! Build with `cargo build --release --target wasm32-wasip2`; check with
//! `granary plugin check target/wasm32-wasip2/release/my_policy.wasm`. The policy logic has no
//! WebAssembly in it: it compiles and tests natively too.

// The generated bindings name this crate by its public name, also from inside it.
extern crate self as granary_policy_sdk;

pub mod evict;
pub mod hash;
pub mod list;
mod options;
pub mod partition;
pub mod replicate;

pub use options::{Error, Options};

#[doc(hidden)]
pub use wit_bindgen as __wit_bindgen;

/// Generated bindings of the `partitioner-plugin` world.
#[cfg(feature = "partitioner")]
#[doc(hidden)]
pub mod partitioner_bindings {
    wit_bindgen::generate!({
        world: "partitioner-plugin",
        path: "../../wit",
        pub_export_macro: true,
        export_macro_name: "__export_partitioner_world",
        default_bindings_module: "granary_policy_sdk::partitioner_bindings",
        runtime_path: "granary_policy_sdk::__wit_bindgen::rt",
    });
}

/// Generated bindings of the `evictor-plugin` world.
#[cfg(feature = "evictor")]
#[doc(hidden)]
pub mod evictor_bindings {
    wit_bindgen::generate!({
        world: "evictor-plugin",
        path: "../../wit",
        pub_export_macro: true,
        export_macro_name: "__export_evictor_world",
        default_bindings_module: "granary_policy_sdk::evictor_bindings",
        runtime_path: "granary_policy_sdk::__wit_bindgen::rt",
    });
}

/// Generated bindings of the `replicator-plugin` world.
#[cfg(feature = "replicator")]
#[doc(hidden)]
pub mod replicator_bindings {
    wit_bindgen::generate!({
        world: "replicator-plugin",
        path: "../../wit",
        pub_export_macro: true,
        export_macro_name: "__export_replicator_world",
        default_bindings_module: "granary_policy_sdk::replicator_bindings",
        runtime_path: "granary_policy_sdk::__wit_bindgen::rt",
    });
}

#[cfg(any(feature = "partitioner", feature = "evictor", feature = "replicator"))]
mod adapters;

#[cfg(feature = "partitioner")]
#[doc(hidden)]
pub use adapters::PartitionerAdapter;

#[cfg(feature = "evictor")]
#[doc(hidden)]
pub use adapters::EvictorAdapter;

#[cfg(feature = "replicator")]
#[doc(hidden)]
pub use adapters::ReplicatorAdapter;

/// Exports a type implementing [`partition::Partitioner`] as the plugin's partitioner.
#[cfg(feature = "partitioner")]
#[macro_export]
macro_rules! export_partitioner {
    ($policy:ty) => {
        type __GranaryPartitioner = $crate::PartitionerAdapter<$policy>;
        $crate::partitioner_bindings::__export_partitioner_world!(__GranaryPartitioner with_types_in $crate::partitioner_bindings);
    };
}

/// Exports a type implementing [`evict::Evictor`] as the plugin's evictor.
#[cfg(feature = "evictor")]
#[macro_export]
macro_rules! export_evictor {
    ($policy:ty) => {
        type __GranaryEvictor = $crate::EvictorAdapter<$policy>;
        $crate::evictor_bindings::__export_evictor_world!(__GranaryEvictor with_types_in $crate::evictor_bindings);
    };
}

/// Exports a type implementing [`replicate::Replicator`] as the plugin's replicator.
#[cfg(feature = "replicator")]
#[macro_export]
macro_rules! export_replicator {
    ($policy:ty) => {
        type __GranaryReplicator = $crate::ReplicatorAdapter<$policy>;
        $crate::replicator_bindings::__export_replicator_world!(__GranaryReplicator with_types_in $crate::replicator_bindings);
    };
}
