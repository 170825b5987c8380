#!/usr/bin/env bash
# Part of the demo: three `granary serve` nodes on loopback. Node 0 is the demo store; nodes 1
# and 2 start empty. Replicates the `tree` dataset to 2 copies (synchronously: the command
# returns once every copy is verified on its node), shows a node's status, damages one of node
# 1's shards and reads a record of it back, repaired from a peer.
#   usage: scripts/demo-replication.sh DIR STORE
set -euo pipefail
dir=$1 store=$2
bin=${GRANARY_BIN:-$("$(dirname "$0")/target-dir.sh")/release/granary}
key="$dir/cluster.key"
rm -f "$key"
"$bin" cluster-key --out "$key" >/dev/null
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ports=($(port) $(port) $(port))
roots=("$store" "$dir/node1" "$dir/node2")
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
rm -rf "${roots[1]}" "${roots[2]}"   # `serve` makes an empty store
for i in 0 1 2; do
  peers=""
  for j in 0 1 2; do if [[ $j != "$i" ]]; then peers+="127.0.0.1:${ports[$j]},"; fi; done
  "$bin" --root "${roots[$i]}" serve --listen "127.0.0.1:${ports[$i]}" --peers "${peers%,}" --cluster-key "$key" \
    --replicator-options mode=sync --heartbeat-ms 200 --down-after-ms 1500 2>"$dir/node$i.log" >/dev/null &
  pids+=($!)
done
for i in 0 1 2; do
  for _ in $(seq 100); do [[ -f "${roots[$i]}/replication/listen" ]] && break; sleep 0.1; done
done
# Wait until every node sees both peers (a node that has not heard from the origin yet would
# wait for it anyway, up to 10 s, when asked to fetch).
for i in 0 1 2; do
  for _ in $(seq 100); do
    [[ $("$bin" --root "${roots[$i]}" status --cluster-key "$key" | grep -c ' up ') == 2 ]] && break; sleep 0.1
  done
done
"$bin" --root "$store" replicate tree --replicas 2 --cluster-key "$key"
"$bin" --root "$store" status --cluster-key "$key" | grep -v '^event'
# Damage a shard of the tree dataset on whichever peer holds one, then read it there.
for i in 1 2; do
  shard=$(find "${roots[$i]}/shards" -name '*.shard' -newer "$key" | head -1)
  [[ -n "$shard" ]] && break
done
printf 'damaging one byte of %s on node %s\n' "$(basename "$shard")" "$i"
python3 - "$shard" <<'PY'
import sys
path = sys.argv[1]
with open(path, "r+b") as f:
    f.seek(4096 + 100)
    b = f.read(1)
    f.seek(4096 + 100)
    f.write(bytes([b[0] ^ 0x20]))
PY
echo "reading every record of tree on node $i (it holds some shards; the others it fetches):"
n=$(find "$dir/tree" -type f | wc -l)
for r in $(seq 0 $((n - 1))); do
  "$bin" --root "${roots[$i]}" get tree "$r" --cluster-key "$key" > /dev/null
done
"$bin" --root "${roots[$i]}" verify tree
echo "node $i: $(ls "${roots[$i]}/quarantine" | wc -l) damaged file in quarantine; all $n records read, verified"
