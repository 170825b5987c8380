#!/usr/bin/env bash
# The crates of the workspace's graph on this machine's target that run only while building
# (proc macros, build scripts and their dependencies), for Cargo.toml's `[profile.dev.package]`
# list. Cranelift's generators are left out of that list on purpose (they run at every build).
set -euo pipefail
cd "$(dirname "$0")/.."
target=$(rustc -vV | sed -n 's/^host: //p')
names() { cargo tree --workspace --locked --target "$target" -f '{p}' --prefix none "$@" | awk '{print $1}' | sort -u; }
comm -23 <(names -e all) <(names -e normal,dev,no-proc-macro)
