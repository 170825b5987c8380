"""The Python loader's rate against the engine loader's own, on the same data and build.

Two loaders of the same dataset run in alternating rounds: one drained inside Rust
(`_native.Loader.drain`: each batch dropped at once, no Python per batch), one iterated from
Python with every batch converted to a tensor (NumPy, or torch with --output torch) and dropped.
Each round's ratio is (Python bytes/s) / (Rust bytes/s); the median over the rounds is printed,
with the rates, as one JSON line. Alternating cancels the drift of a shared machine; the two
sides read different records at any moment, so neither finds the other's reads in a cache.

    python python/bench/loader_ratio.py --dir /tmp/ratio --gib 1 --device cpu
    python python/bench/loader_ratio.py --dir /tmp/ratio --gib 1 --device cpu --io pread  # from RAM
    python python/bench/loader_ratio.py --dir /tmp/ratio --gib 4 --device cuda --output torch
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

import granary


def make(store: granary.Store, raw: str, total: int, record: int) -> None:
    n = total // record
    rng = np.random.default_rng(0)
    with open(raw, "wb") as f:
        left = n * record
        while left:
            chunk = min(left, 64 << 20)
            f.write(rng.integers(0, 256, chunk, dtype=np.uint8).tobytes())
            left -= chunk
    store.ingest_files("ratio", raw, dtype="uint8", shape=[record], replace=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--record-bytes", type=int, default=4096)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=40, help="batches per round and side")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--device", default="cpu")
    p.add_argument("--output", choices=["numpy", "torch"], default="numpy")
    p.add_argument("--order", choices=["shuffled", "sequential"], default="shuffled")
    p.add_argument(
        "--io", choices=["auto", "uring", "pread"], default="auto",
        help="pread reads through the page cache: with a dataset that fits in memory, a CPU-bound run",
    )
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    store = granary.Store(os.path.join(a.dir, "store"), create=True)
    if not any(d["name"] == "ratio" for d in store.datasets()):
        make(store, os.path.join(a.dir, "ratio.bin"), int(a.gib * (1 << 30)), a.record_bytes)
    options = dict(batch_size=a.batch, device=a.device, order=a.order, output=a.output, io=a.io)
    # The two sides read different records at any moment (other seeds; sequentially, half an
    # epoch apart): the one going second must not find the first one's reads in a cache below
    # the engine (the virtual disk has one).
    rust = granary.Loader(store, "ratio", seed=1, **options)
    python = granary.Loader(store, "ratio", seed=2, **options)
    if a.order == "sequential":
        python.seek(0, (python._native.records // 2) // a.batch * a.batch)
    if a.output == "torch" and a.device.startswith("cuda"):
        import torch

        sync = torch.cuda.synchronize
    else:
        sync = lambda: None  # noqa: E731
    rust_iter, python_iter = iter(rust), iter(python)
    # Warm both up (threads, pools, first reads).
    rust._native.drain(4)
    for _ in range(4):
        next(python_iter)
    ratios, rust_rates, python_rates = [], [], []
    for _ in range(a.rounds):
        n, _, rust_bytes, seconds = rust._native.drain(a.batches)
        if n < a.batches:
            rust_iter = iter(rust)
            n, _, rust_bytes, seconds = rust._native.drain(a.batches)
        rust_rate = rust_bytes / seconds
        start = time.perf_counter()
        python_bytes = 0
        got = 0
        while got < a.batches:
            try:
                batch = next(python_iter)
            except StopIteration:
                python_iter = iter(python)
                continue
            python_bytes += batch.nbytes if hasattr(batch, "nbytes") else batch.numel() * batch.element_size()
            got += 1
            del batch
        sync()
        python_rate = python_bytes / (time.perf_counter() - start)
        ratios.append(python_rate / rust_rate)
        rust_rates.append(rust_rate)
        python_rates.append(python_rate)
    print(
        json.dumps(
            {
                "ratio_python_over_rust": round(statistics.median(ratios), 3),
                "ratio_min": round(min(ratios), 3),
                "ratio_max": round(max(ratios), 3),
                "rust_gb_s": round(statistics.median(rust_rates) / 1e9, 3),
                "python_gb_s": round(statistics.median(python_rates) / 1e9, 3),
                "rounds": a.rounds,
                "batches_per_round": a.batches,
                "batch": a.batch,
                "record_bytes": a.record_bytes,
                "device": python.device,
                "output": a.output,
                "order": a.order,
                "io": a.io,
            }
        )
    )
    del rust_iter


if __name__ == "__main__":
    main()
