#!/usr/bin/env bash
# Prints where cargo builds for this workspace, as cargo itself resolves it (CARGO_TARGET_DIR,
# CARGO_BUILD_TARGET_DIR, a .cargo/config.toml `build.target-dir`, else target/), so the scripts
# find the binaries whatever the user's setup.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo metadata --format-version 1 --no-deps --offline 2>/dev/null \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null \
  || { d=${CARGO_TARGET_DIR:-target}; [[ $d = /* ]] && echo "$d" || echo "$PWD/$d"; }
