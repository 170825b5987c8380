"""The engine loader on variable-length documents, read sequentially from a cold page cache.

Usage: python scripts/bench-variable-records.py PACKAGE_DIR STORE RUNS

PACKAGE_DIR holds the `granary` package to measure (a venv's site-packages after `make python`). STORE
is made on first use: 1 GiB of random documents of 512-7680 bytes (mean 4 KiB) as dataset
`docs`. Each run drops the page cache (root only) and drains one epoch in batches of 256 (about
1 MiB) through the engine loader alone (`drain`: no Python per batch), memory tier off, no verify
worker, and prints its rate. The bare reader to compare with is
`granary --root STORE bench read docs --seq-qd 32`.
"""

import os
import subprocess
import sys

import numpy as np

package, root, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, package)
import granary  # noqa: E402

if not os.path.exists(root):
    store = granary.Store(root, create=True)
    rng = np.random.default_rng(1)
    lengths = rng.integers(512, 7681, size=(1 << 30) // 4096)
    blob = rng.integers(0, 256, size=int(lengths.sum()), dtype=np.uint8)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    store.ingest("docs", (blob[s : s + n] for s, n in zip(starts, lengths)))
store = granary.Store(root)
for _ in range(runs):
    subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=True)
    loader = granary._native.Loader(
        store._native, "docs", 256, order="sequential", tier_bytes=0, device="cpu", verify_threads=0
    )
    loader.begin_epoch()
    batches, records, nbytes, seconds = loader.drain(10**9)
    print(f"{nbytes / seconds / 1e9:.3f} GB/s: {batches} batches, {records} records", flush=True)
    loader.close()
