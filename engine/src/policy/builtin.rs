//! The default policies, built from `plugins/` and embedded: the plugin path is the path that
//! runs, also when no user plugin is given.
//!
//! Owns: `NAMES`, each kind's default (`DEFAULT_PARTITIONER`, `DEFAULT_EVICTOR`,
//! `DEFAULT_REPLICATOR`), the embedded component bytes (`bytes`) and `built_plugin_path`. Never:
//! compiles or loads a plugin (the host does), or reads a built-in from disk at run time (its bytes
//! are in the binary; `built_plugin_path` names a file for this build's tests and benchmarks only).

use std::path::PathBuf;

/// Names of the built-in plugins.
pub const NAMES: &[&str] = &["elastic", "lru", "fifo", "sieve", "s3-fifo", "plan-aware", "rendezvous"];

/// The default partitioner.
pub const DEFAULT_PARTITIONER: &str = "elastic";
/// The default evictor.
pub const DEFAULT_EVICTOR: &str = "lru";
/// The default replicator.
pub const DEFAULT_REPLICATOR: &str = "rendezvous";

macro_rules! plugin {
    ($file:literal) => {
        include_bytes!(concat!(env!("GRANARY_PLUGIN_DIR"), "/", $file, ".wasm"))
    };
}

/// The component bytes of a built-in plugin.
pub fn bytes(name: &str) -> Option<&'static [u8]> {
    Some(match name {
        "elastic" => plugin!("partitioner_elastic"),
        "lru" => plugin!("evictor_lru"),
        "fifo" => plugin!("evictor_fifo"),
        "sieve" => plugin!("evictor_sieve"),
        "s3-fifo" => plugin!("evictor_s3fifo"),
        "plan-aware" => plugin!("evictor_planaware"),
        "rendezvous" => plugin!("replicator_rendezvous"),
        _ => return None,
    })
}

/// Where the build put a plugin of the `plugins/` workspace (by crate name with underscores,
/// such as `hostile_evictor`): for tests and benchmarks of this build only.
pub fn built_plugin_path(crate_name: &str) -> PathBuf {
    PathBuf::from(env!("GRANARY_PLUGIN_DIR")).join(format!("{crate_name}.wasm"))
}
