"""Mixtures and packed windows against reading one dataset, and against what a Megatron user
runs today in Python, on the same data and build.

Records: three datasets (web 60 %, code 30 %, math 10 % of the records) and the same records as
one dataset. Sides, each a long-lived loader (epochs run on), read in alternating rounds of
`--batches` batches once every file is in the page cache:
  one      granary, the single dataset, shuffled
  mixture  granary, [(web, .6), (code, .3), (math, .1)]
  blended  Python: a Megatron BlendedDataset-style index (the greedy rule, built once, its build
           time printed) over np.memmap sources, each shuffled, batches stacked with NumPy
Packed: a corpus of documents of varying length (Megatron .bin/.idx), windows of --seq-len + 1
tokens, tokens per second:
  docs     granary, the corpus as documents (batches of whole documents)
  packed   granary, seq_len windows with cu_seqlens and position ids
  gpt      Python: a GPTDataset-style sample index (shuffled documents, cumulative lengths, built
           once) over an np.memmap of the .bin, each window concatenated from its slices
Each round's ratios are taken within the round; the medians are printed as one JSON line.

    python python/bench/mixture.py --dir /tmp/mixbench --mib 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import time

import numpy as np

import granary

SOURCES = [("web", 0.6), ("code", 0.3), ("math", 0.1)]


def write_records(path: str, n: int, record: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        left = n
        while left:
            k = min(left, (64 << 20) // record)
            f.write(rng.integers(0, 256, k * record, dtype=np.uint8).tobytes())
            left -= k


def write_corpus(prefix: str, total_tokens: int, seed: int) -> np.ndarray:
    """A Megatron uint16 corpus of documents of 50 to 8000 tokens; returns the lengths."""
    rng = np.random.default_rng(seed)
    lengths = []
    left = total_tokens
    while left > 0:
        n = int(min(left, rng.integers(50, 8000)))
        lengths.append(n)
        left -= n
    lengths = np.array(lengths, dtype=np.int32)
    with open(prefix + ".bin", "wb") as f:
        for n in lengths:
            f.write(rng.integers(0, 65000, int(n), dtype=np.uint16).tobytes())
    pointers = np.zeros(len(lengths), dtype=np.int64)
    pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64) * 2)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(lengths) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    return lengths


def setup(a: argparse.Namespace) -> tuple[granary.Store, dict]:
    os.makedirs(a.dir, exist_ok=True)
    store = granary.Store(os.path.join(a.dir, "store"), create=True)
    have = {d["name"] for d in store.datasets()}
    n = (a.mib << 20) // a.record_bytes
    paths = {}
    for seed, (name, weight) in enumerate(SOURCES):
        path = os.path.join(a.dir, f"{name}.bin")
        paths[name] = (path, int(n * weight))
        if name not in have:
            write_records(path, int(n * weight), a.record_bytes, seed)
            store.ingest_files(name, path, dtype="uint8", shape=[a.record_bytes])
    if "one" not in have:
        store.ingest_files("one", [paths[name][0] for name, _ in SOURCES], dtype="uint8", shape=[a.record_bytes])
    prefix = os.path.join(a.dir, "corpus")
    if "corpus" not in have:
        write_corpus(prefix, (a.mib << 20) // 2, 9)
        store.ingest_megatron("corpus", prefix + ".bin")
    return store, paths


class Endless:
    """A granary loader read across epochs."""

    def __init__(self, loader, count):
        self.loader, self.count, self.it = loader, count, iter(loader)

    def take(self) -> int:
        try:
            batch = next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            batch = next(self.it)
        return self.count(batch)


class Blended:
    """Megatron's BlendedDataset in Python: the greedy index over the sources, each source's
    samples shuffled, batches stacked from np.memmap views."""

    def __init__(self, paths: dict, record: int, batch: int, samples: int, seed: int):
        self.sources = [np.memmap(paths[name][0], dtype=np.uint8, mode="r").reshape(-1, record) for name, _ in SOURCES]
        weights = np.array([w for _, w in SOURCES])
        started = time.perf_counter()
        index = np.zeros(samples, dtype=np.int16)
        sample = np.zeros(samples, dtype=np.int64)
        counts = np.zeros(len(weights), dtype=np.int64)
        for i in range(samples):
            d = int(np.argmax(weights * (i + 1) - counts))
            index[i], sample[i] = d, counts[d]
            counts[d] += 1
        rng = np.random.default_rng(seed)
        self.orders = [rng.permutation(len(s)) for s in self.sources]
        self.index, self.sample = index, sample
        self.build_seconds = time.perf_counter() - started
        self.batch, self.at = batch, 0

    def take(self) -> int:
        rows = []
        for _ in range(self.batch):
            i = self.at % len(self.index)
            d = self.index[i]
            order = self.orders[d]
            rows.append(self.sources[d][order[self.sample[i] % len(order)]])
            self.at += 1
        np.stack(rows)
        return self.batch


class Gpt:
    """Megatron's GPTDataset in Python: shuffled documents, cumulative lengths, windows of
    seq_len + 1 tokens concatenated from np.memmap slices."""

    def __init__(self, prefix: str, seq_len: int, batch: int, seed: int):
        raw = open(prefix + ".idx", "rb").read()
        count = struct.unpack_from("<Q", raw, 18)[0]
        lengths = np.frombuffer(raw, dtype=np.int32, count=count, offset=34).astype(np.int64)
        pointers = np.frombuffer(raw, dtype=np.int64, count=count, offset=34 + 4 * count)
        self.data = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r")
        started = time.perf_counter()
        order = np.random.default_rng(seed).permutation(count)
        self.starts = pointers[order] // 2
        self.lengths = lengths[order]
        self.cum = np.concatenate([[0], np.cumsum(self.lengths)])
        self.n = (int(self.cum[-1]) - 1) // seq_len
        self.build_seconds = time.perf_counter() - started
        self.seq_len, self.batch, self.at = seq_len, batch, 0

    def window(self, w: int) -> np.ndarray:
        lo, hi = w * self.seq_len, w * self.seq_len + self.seq_len + 1
        k = int(np.searchsorted(self.cum, lo, side="right")) - 1
        parts = []
        while lo < hi:
            take = min(int(self.cum[k + 1]), hi) - lo
            off = int(self.starts[k]) + lo - int(self.cum[k])
            parts.append(self.data[off : off + take])
            lo += take
            k += 1
        return np.concatenate(parts)

    def take(self) -> int:
        np.stack([self.window((self.at + i) % self.n) for i in range(self.batch)])
        self.at += self.batch
        return self.batch * (self.seq_len + 1)


def rate(side, batches: int) -> float:
    started = time.perf_counter()
    units = sum(side.take() for _ in range(batches))
    return units / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True)
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--record-bytes", type=int, default=8192)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=2047)
    p.add_argument("--windows", type=int, default=8, help="windows per packed batch")
    p.add_argument("--batches", type=int, default=400, help="batches per round and side (short rounds are noise)")
    p.add_argument("--rounds", type=int, default=11)
    a = p.parse_args()
    store, paths = setup(a)
    n = sum(count for _, count in paths.values())
    common = dict(device="cpu", output="numpy", seed=1)
    one = Endless(store.loader("one", a.batch, **common), len)
    mixture = Endless(store.loader(SOURCES, a.batch, mixture_samples=n, **common), len)
    blended = Blended(paths, a.record_bytes, a.batch, n, 1)
    docs_loader = store.loader("corpus", a.windows, **common)
    docs = Endless(docs_loader, lambda batch: len(batch[0]))
    packed = Endless(store.loader("corpus", a.windows, seq_len=a.seq_len, eod=0, **common),
                     lambda batch: batch["tokens"].size)
    gpt = Gpt(os.path.join(a.dir, "corpus"), a.seq_len, a.windows, 1)
    sides = {"one": one, "mixture": mixture, "blended": blended, "docs": docs, "packed": packed, "gpt": gpt}
    # Warm: every file in the page cache, every loader started.
    for path in [p for p, _ in paths.values()] + [os.path.join(a.dir, "corpus.bin")]:
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    for side in sides.values():
        rate(side, 5)
    ratios = {"mixture/one": [], "mixture/blended": [], "packed/docs": [], "packed/gpt": []}
    rates = {name: [] for name in sides}
    for _ in range(a.rounds):
        r = {name: rate(side, a.batches) for name, side in sides.items()}
        for name, value in r.items():
            rates[name].append(value)
        ratios["mixture/one"].append(r["mixture"] / r["one"])
        ratios["mixture/blended"].append(r["mixture"] / r["blended"])
        ratios["packed/docs"].append(r["packed"] / r["docs"])
        ratios["packed/gpt"].append(r["packed"] / r["gpt"])
    print(json.dumps({
        "records": n,
        "record_bytes": a.record_bytes,
        "rates_median": {k: round(statistics.median(v)) for k, v in rates.items()},
        "ratios_median": {k: round(statistics.median(v), 3) for k, v in ratios.items()},
        "ratios_min_max": {k: [round(min(v), 3), round(max(v), 3)] for k, v in ratios.items()},
        "index_build_seconds": {"blended": round(blended.build_seconds, 3), "gpt": round(gpt.build_seconds, 3)},
        "units": "records/s for one, mixture, blended; tokens/s for docs, packed, gpt",
    }))


if __name__ == "__main__":
    main()
