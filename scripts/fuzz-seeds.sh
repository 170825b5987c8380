#!/usr/bin/env bash
# Fills fuzz/corpus/ with valid objects: shards of every layout, manifests, refs, samples.
set -euo pipefail
cd "$(dirname "$0")/.."
# --workspace --tests: the packages and features `cargo test --workspace` built with (make test),
# so nothing is rebuilt (`-p granary` unifies other features and rebuilds the engine).
cargo build -q --workspace --tests --locked
granary=$(scripts/target-dir.sh)/debug/granary
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

head -c 40960 /dev/urandom > "$work/tokens.bin"
mkdir -p "$work/tree/sub"
printf 'a' > "$work/tree/one"; : > "$work/tree/empty"; head -c 5000 /dev/urandom > "$work/tree/sub/two"
mkdir -p "$work/wds"
printf 'x' > "$work/wds/0001.cls"; head -c 300 /dev/urandom > "$work/wds/0001.jpg"; printf 'y' > "$work/wds/0002.cls"
tar -C "$work/wds" -cf "$work/wds.tar" 0001.cls 0001.jpg 0002.cls

store="$work/store"
$granary --root "$store" ingest records --name tok --record-bytes 4096 --dtype u16 --shard-bytes 16K "$work/tokens.bin" >/dev/null
$granary --root "$store" ingest records --name odd --record-bytes 10 --drop-remainder --shard-bytes 8K "$work/tokens.bin" >/dev/null
$granary --root "$store" ingest files --name tree "$work/tree" >/dev/null
$granary --root "$store" ingest tar --name wds "$work/wds.tar" >/dev/null

mkdir -p fuzz/corpus/shard_decode fuzz/corpus/object_decode
find "$store/shards" -name '*.shard' -size -64k -exec cp {} fuzz/corpus/shard_decode/ \;
find "$store/manifests" -name '*.manifest' -exec cp {} fuzz/corpus/object_decode/ \;
for ref in "$store"/refs/*; do cp "$ref" "fuzz/corpus/object_decode/ref-$(basename "$ref")"; done
# Tars: plain, gzip, concatenated, with a link and a metadata member.
mkdir -p fuzz/corpus/tar_decode
cp "$work/wds.tar" fuzz/corpus/tar_decode/plain.tar
gzip -c "$work/wds.tar" > fuzz/corpus/tar_decode/plain.tar.gz
cat "$work/wds.tar" "$work/wds.tar" > fuzz/corpus/tar_decode/concatenated.tar
(cd "$work/wds" && ln -sf 0001.jpg 0003.jpg && printf '{}' > __meta__ && tar -cf "$work/odd.tar" 0001.cls 0003.jpg __meta__)
cp "$work/odd.tar" fuzz/corpus/tar_decode/odd.tar
# One replication frame of every kind, from the frame codec's own samples.
GRANARY_FRAME_SEEDS="$PWD/fuzz/corpus/frame_decode" cargo test -q --workspace --tests --locked write_frame_fuzz_seeds -- --ignored >/dev/null
# Fragments of a shard in three codings, from the coder's own test.
GRANARY_FRAGMENT_SEEDS="$PWD/fuzz/corpus/fragment_decode" cargo test -q --workspace --tests --locked write_fragment_fuzz_seeds -- --ignored >/dev/null
# Parquet files, MDS and LitData directories their own writers wrote (scripts/fuzz-format-seeds.py).
for target in parquet_decode mds_decode litdata_decode; do
  mkdir -p "fuzz/corpus/$target"
  cp fuzz/seeds/$target/* "fuzz/corpus/$target/"
done
echo "fuzz seeds: $(ls fuzz/corpus/shard_decode | wc -l) shards, $(ls fuzz/corpus/object_decode | wc -l) manifests and refs, $(ls fuzz/corpus/frame_decode | wc -l) frames, $(ls fuzz/corpus/tar_decode | wc -l) tars, $(ls fuzz/corpus/fragment_decode | wc -l) fragments, $(find fuzz/seeds -type f | wc -l) Parquet, MDS and LitData datasets"
