//! Builds the policy plugins (the `plugins/` workspace, for wasm32-wasip2) so the engine can
//! embed the default ones and the tests can load the rest. In the style of wasmtime's
//! test-programs crate: a nested `cargo build` with its own target directory (`granary-plugins`
//! inside the outer build's), run only when the `policy` feature is on and rerun only when the
//! plugins, the WIT or the records they share with the host (`policy-types/`) change.

use std::path::{Path, PathBuf};
use std::process::Command;

const PLUGINS: &[&str] = &[
    "partitioner_elastic",
    "evictor_lru",
    "evictor_fifo",
    "evictor_sieve",
    "evictor_s3fifo",
    "evictor_planaware",
    "replicator_rendezvous",
    "evictor_template",
    "hostile_evictor",
    "hostile_partitioner",
    "hostile_io",
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_POLICY").is_none() {
        return;
    }
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let root = manifest_dir.parent().expect("engine/ sits in the workspace root").to_owned();
    let plugins = root.join("plugins");
    let wit = root.join("wit");
    let records = root.join("policy-types");
    for dir in [&plugins, &wit, &records] {
        rerun_if_changed_tree(dir);
    }
    // A target directory of their own (the outer build holds the lock on its own), inside the
    // outer build's target directory, wherever CARGO_TARGET_DIR puts it: OUT_DIR is
    // TARGET/[TRIPLE/]PROFILE/build/granary-HASH/out, and debug and release share the plugins.
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo"));
    let profile_dir = out_dir.ancestors().nth(3).expect("OUT_DIR is PROFILE/build/PKG/out");
    let target_dir = profile_dir.parent().unwrap_or(profile_dir).join("granary-plugins");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .current_dir(&plugins)
        .args(["build", "--release", "--locked", "--workspace", "--target", "wasm32-wasip2"])
        .arg("--target-dir")
        .arg(&target_dir);
    // The outer build's flags (sanitizers under cargo-fuzz, coverage, a host target) are not for
    // WebAssembly.
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_MAKEFLAGS",
        "CARGO_PROFILE_RELEASE_DEBUG",
    ] {
        build.env_remove(var);
    }
    let status = build.status().expect("cargo runs");
    if !status.success() {
        panic!(
            "building the policy plugins failed; is the WebAssembly target installed? \
             Run `rustup target add wasm32-wasip2` (or build without the `policy` feature)."
        );
    }
    let out = target_dir.join("wasm32-wasip2").join("release");
    for plugin in PLUGINS {
        let path = out.join(format!("{plugin}.wasm"));
        assert!(path.exists(), "{} was not built", path.display());
    }
    println!("cargo:rustc-env=GRANARY_PLUGIN_DIR={}", out.display());
}

fn rerun_if_changed_tree(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if name == "target" {
            continue;
        }
        if path.is_dir() {
            rerun_if_changed_tree(&path);
        } else {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}
