#!/usr/bin/env bash
# The main job end to end, on data this script makes: ingest a token corpus, a directory tree and
# a WebDataset tar; list, inspect, read back and compare; scrub; run the policy plugins (checks
# and simulations); train on the loader; benchmark the read path.
#   DEMO_MIB   size of the token corpus (default 1024)
#   DEMO_DIR   where data and store go (default target/demo)
#   --bench-only   reuse an existing demo store and only run the benchmark
set -euo pipefail
cd "$(dirname "$0")/.."
mib=${DEMO_MIB:-1024}
dir=${DEMO_DIR:-target/demo}
store="$dir/store"
step() { printf '\n== %s\n' "$*"; }

# The binary and the example trainer in one build (one feature set, so nothing builds twice).
# A first build takes a few minutes on two cores (wasmtime, and the policy plugins).
echo "building granary (release; a first build takes 3-10 minutes)"
cargo build --release -p granary --locked --bins --examples
bin_dir="$(scripts/target-dir.sh)/release"
export GRANARY_BIN="$bin_dir/granary"
granary() { "$bin_dir/granary" --root "$store" "$@"; }

if [[ "${1:-}" != "--bench-only" ]]; then
  rm -rf "$dir"; mkdir -p "$dir"

  step "make data: ${mib} MiB of u16 tokens (2048-token sequences), a file tree, a WebDataset tar"
  head -c $((mib * 1024 * 1024)) /dev/urandom > "$dir/tokens.bin"
  mkdir -p "$dir/tree/a" "$dir/tree/b"
  for i in $(seq 1 200); do head -c $((RANDOM % 20000)) /dev/urandom > "$dir/tree/$([[ $((i % 2)) == 0 ]] && echo a || echo b)/file-$i.txt"; done
  mkdir -p "$dir/wds"
  for i in $(seq -w 1 50); do
    head -c $((1000 + RANDOM % 50000)) /dev/urandom > "$dir/wds/sample$i.jpg"
    echo $((RANDOM % 10)) > "$dir/wds/sample$i.cls"
  done
  (cd "$dir/wds" && tar -cf ../samples.tar ./*)

  step "ingest"
  time granary ingest records --name tokens --record-bytes 4096 --dtype u16 --shape 2048 "$dir/tokens.bin"
  granary ingest files --name tree --shard-bytes 256K "$dir/tree"
  granary ingest tar --name samples "$dir/samples.tar"

  step "ls"
  granary ls

  step "inspect tokens"
  granary inspect tokens | head -12

  step "read back: record 12345 of tokens equals bytes 12345*4096.. of the input"
  granary get tokens 12345 > "$dir/record.bin"
  dd if="$dir/tokens.bin" of="$dir/expected.bin" bs=4096 skip=12345 count=1 status=none
  cmp "$dir/record.bin" "$dir/expected.bin" && echo "record 12345: identical (4096 bytes, every block CRC-checked)"

  step "verify: BLAKE3 of every file, CRC32C of every block"
  granary verify

  step "policy plugins: the conformance suite on the default evictor (a WebAssembly component)"
  granary plugin check lru --cases 32

  step "evictors on 4 shuffled epochs over 20000 records, cache of 2000: LRU is near worst, the plan-aware evictor optimal"
  granary plugin trace shuffled --objects 20000 --epochs 4 --out "$dir/shuffled.trace"
  for plugin in lru sieve s3-fifo plan-aware; do
    printf '%-11s ' "$plugin"
    granary plugin sim evict --plugin "$plugin" --trace "$dir/shuffled.trace" --cache-objects 2000 | sed -n 2p
  done

  step "partitioner: 20000 shards on 8, then 9, then 8 ranks (affinity mode): balance and movement"
  granary plugin sim partition --plugin elastic --shards 20000 --ranks 8,9,8 --records-per-shard 100 \
    --options mode=affinity,chunk-records=100

  step "replicator: 3 copies over 10 nodes in 5 failure domains, then 11 and 9 nodes"
  granary plugin sim replicate --plugin rendezvous --nodes 10 --replicas 3 --domains 5

  step "train: the example trainer on tokens (GPU if present, else host memory), stopped and resumed halfway, then one epoch block-shuffled"
  "$bin_dir/examples/trainer" "$store" tokens --epochs 2 --batch 64 --step-us 200

  step "replication: three nodes on loopback, the tree dataset at 2 copies, a damaged shard repaired on read"
  scripts/demo-replication.sh "$dir" "$store"
fi

step "benchmark: the engine against a bare io_uring O_DIRECT reader on the same blocks"
granary bench read tokens --runs 5
