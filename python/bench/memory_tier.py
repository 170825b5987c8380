"""granary's Python loader with its tier against np.memmap, cold and warm, one rank or four, in
the patterns trainers use: one loader over the epochs, a new loader each epoch, a process
restarted between epochs.

The workload users compare against: token records gathered in random batches from an
`np.memmap` of the raw file over the page cache (Megatron-LM's indexed datasets, nanoGPT). Both
sides read the same records in the same order (granary's shuffled plan, its indices taken from
the loader), NumPy output, whole epochs. Cold: the page cache dropped and the tier emptied
before the first epoch (needs root to drop the cache; says so otherwise).

    python python/bench/memory_tier.py --dir /tmp/tierbench --gib 1 --epochs 3
    python python/bench/memory_tier.py --dir /tmp/tierbench --gib 1 --epochs 3 --ranks 4
    python python/bench/memory_tier.py --dir /tmp/tierbench --gib 1 --epochs 3 --pattern loader-per-epoch
    python python/bench/memory_tier.py --dir /tmp/tierbench --gib 1 --epochs 3 --pattern restart --tier memory

--pattern: `one-loader` (one loader, or one np.memmap, over every epoch), `loader-per-epoch` (a
new loader, or a new np.memmap, for each epoch in the same process: an evaluation pass between
epochs, a framework that rebuilds its loaders), `restart` (a new process for each epoch: a job
restarted after a failure). --tier: `page-cache` (the default) or `memory`. CPU seconds per
epoch (every thread of every rank) are reported beside each rate.

With --ranks N, N rank processes (rank 0..N-1 of N, all of this node: the tier plans for all
of them) each read their slice for every epoch, at once, on each side; records/s are summed over the ranks, and the node's memory growth (used plus
page cache plus shared memory, from /proc/meminfo) is reported as a multiple of the dataset's
bytes. One JSON line per measurement, then a summary table with the ratios.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import granary


def meminfo() -> dict:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def node_bytes_in_use() -> int:
    m = meminfo()
    # Everything not free: process memory, page cache, tmpfs (the tier).
    return m["MemTotal"] - m["MemFree"]


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def make(store: granary.Store, raw: str, total: int, record: int) -> None:
    n = total // record
    rng = np.random.default_rng(0)
    with open(raw, "wb") as f:
        left = n * record
        while left:
            chunk = min(left, 64 << 20)
            f.write(rng.integers(0, 256, chunk, dtype=np.uint8).tobytes())
            left -= chunk
    store.ingest_files("tier", raw, dtype="uint8", shape=[record], replace=True)


def granary_rank(args: tuple) -> list:
    """One rank's epochs through granary: (seconds, records, CPU seconds) per epoch."""
    store, rank, ranks, first, epochs, batch, tier, tier_bytes, per_epoch, start, end = args

    def make_loader(epoch: int) -> granary.Loader:
        return granary.Loader(
            store, "tier", batch, seed=1, epoch=epoch, rank=rank, world_size=ranks, device="cpu",
            output="numpy", tier=tier, tier_bytes=tier_bytes, hold=2, local_world_size=ranks,
        )

    loader = None if per_epoch else make_loader(first)
    out = []
    start.wait()
    for e in range(first, first + epochs):
        t, cpu = time.perf_counter(), time.process_time()
        if per_epoch:
            loader = make_loader(e)
        n = 0
        for b in loader:
            n += b.shape[0]
        if per_epoch:
            loader.close()
        out.append((time.perf_counter() - t, n, time.process_time() - cpu))
    in_use = measured(end)
    if not per_epoch:
        loader.close()
    return out, in_use


def measured(end) -> int:
    """The node's memory in use once every rank has finished reading, before any lets go."""
    end.wait()
    in_use = node_bytes_in_use()
    end.wait()
    return in_use


def memmap_rank(args: tuple) -> list:
    """One rank's epochs gathered from np.memmap, in granary's order: (seconds, records) per epoch."""
    store, raw, record, rank, ranks, first, epochs, batch, per_epoch, start, end = args
    # The same order as granary's, taken from a loader's indices (not timed).
    orders = []
    loader = granary.Loader(
        store, "tier", batch, seed=1, epoch=first, rank=rank, world_size=ranks, device="cpu",
        output="numpy", tier_bytes=0, with_indices=True, hold=2,
    )
    for _ in range(epochs):
        orders.append([np.asarray(i) for i, _ in loader])
    loader.close()
    data = None
    out = []
    start.wait()
    for order in orders:
        t, cpu = time.perf_counter(), time.process_time()
        if data is None or per_epoch:
            data = np.memmap(raw, dtype=np.uint8, mode="r").reshape(-1, record)
        n = 0
        for idx in order:
            b = data[idx]  # fancy-index gather: one copy, as the memmap loaders do
            n += b.shape[0]
        out.append((time.perf_counter() - t, n, time.process_time() - cpu))
    return out, measured(end)


def first_batch(args: tuple) -> float:
    """Seconds from nothing (a fresh process, the page cache dropped) to the first batch: a
    granary loader with the default tier (`tier` None), with the tier off (`tier_bytes` 0), or
    np.memmap's gather of the same batch (`kind` "memmap")."""
    store, raw, record, batch, kind, tier_bytes = args
    if kind == "memmap":
        loader = granary.Loader(store, "tier", batch, seed=1, device="cpu", output="numpy", tier_bytes=0,
                                with_indices=True)
        idx = np.asarray(next(iter(loader))[0])
        loader.close()
        drop_caches()
        t = time.perf_counter()
        data = np.memmap(raw, dtype=np.uint8, mode="r").reshape(-1, record)
        data[idx]
        return time.perf_counter() - t
    drop_caches()
    t = time.perf_counter()
    loader = granary.Loader(store, "tier", batch, seed=1, device="cpu", output="numpy", tier_bytes=tier_bytes)
    made = time.perf_counter() - t
    next(iter(loader))
    seconds = time.perf_counter() - t
    # Where the time went: the Python object (arguments, opening the dataset), then the engine
    # loader's stages, each stage's end in seconds from the engine loader's construction.
    stages = {"python_loader_made": made, **{k: made + v for k, v in loader.metrics()["start"].items()}}
    loader.close()
    return seconds, stages


class RawRecords:
    """The raw file's records for a PyTorch DataLoader (a map-style dataset; at module level so
    that spawned workers can unpickle it)."""

    def __init__(self, raw: str, record: int) -> None:
        self.raw, self.record = raw, record

    def __len__(self) -> int:
        return os.path.getsize(self.raw) // self.record

    def __getitem__(self, i: int):
        import torch

        with open(self.raw, "rb") as f:
            f.seek(i * self.record)
            return torch.frombuffer(bytearray(f.read(self.record)), dtype=torch.uint8)


def dataloader_first_batch(args: tuple) -> float:
    """Seconds from nothing (a fresh process, the page cache dropped) to the first batch of a
    PyTorch DataLoader over the same records (2 workers, shuffled, batches of `batch`): the
    baseline issue 44 names. Needs torch in the interpreter running the bench."""
    import torch

    raw, record, batch = args
    drop_caches()
    t = time.perf_counter()
    loader = torch.utils.data.DataLoader(RawRecords(raw, record), batch_size=batch, shuffle=True, num_workers=2,
                                         drop_last=True)
    next(iter(loader))
    return time.perf_counter() - t


def dataloader_child(args: tuple, out) -> None:
    out.put(dataloader_first_batch(args))


def import_seconds() -> float:
    """Seconds a fresh interpreter takes to import granary (and NumPy) with the page cache
    dropped: the part of a first batch that comes before any loader."""
    drop_caches()
    code = "import time; t = time.perf_counter(); import granary, numpy; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return float(out.stdout.strip())


def some_batches(args: tuple) -> tuple:
    """Records/s and CPU seconds of the first `batches` batches of a cold epoch, from nothing (a
    fresh process, the page cache dropped): a run that stops early pays for what it reads."""
    store, batch, batches, tier_bytes = args
    drop_caches()
    t, cpu = time.perf_counter(), time.process_time()
    loader = granary.Loader(store, "tier", batch, seed=1, device="cpu", output="numpy", tier_bytes=tier_bytes)
    it = iter(loader)
    n = sum(next(it).shape[0] for _ in range(batches))
    out = (n / (time.perf_counter() - t), time.process_time() - cpu)
    loader.close()
    return out


def first_batches(a: argparse.Namespace, store: str, raw: str) -> None:
    """Issue 44's row: the cold first batch with the default tier, the tier off, and np.memmap."""
    ctx = mp.get_context("spawn")
    cases = [("default tier", "granary", None), ("tier off", "granary", 0), ("np.memmap gather", "memmap", None)]
    times = {label: [] for label, _, _ in cases}
    stages = {label: [] for label, kind, _ in cases if kind == "granary"}
    imports = []
    for _ in range(a.runs):
        imports.append(import_seconds())
        for label, kind, tier_bytes in cases:
            with ctx.Pool(1) as pool:
                got = pool.map(first_batch, [(store, raw, a.record_bytes, a.batch, kind, tier_bytes)])[0]
            if kind == "granary":
                got, marks = got
                stages[label].append(marks)
            times[label].append(got)
    try:
        import torch  # noqa: F401

        times["torch DataLoader (2 workers)"] = []
        for _ in range(a.runs):
            # A process of its own that may start the DataLoader's workers (a pool's may not).
            out = ctx.Queue()
            child = ctx.Process(target=dataloader_child, args=((raw, a.record_bytes, a.batch), out))
            child.start()
            times["torch DataLoader (2 workers)"].append(out.get())
            child.join()
    except ImportError:
        print("torch DataLoader first batch: not measured (no torch in this interpreter)")
    medians = {label: statistics.median(t) for label, t in times.items()}
    print(json.dumps({"first_batch_seconds": medians}), flush=True)
    print(f"import granary, numpy (cold, before any loader): {statistics.median(imports) * 1e3:.0f} ms")
    for label, runs in stages.items():
        names = [name for name in runs[0] if all(name in r for r in runs)]
        ends = {name: statistics.median(r[name] for r in runs) for name in names}
        print(json.dumps({"first_batch_stages": label, "ends_seconds": ends}), flush=True)
        print(f"{label}, stage ends (ms from granary.Loader): "
              + ", ".join(f"{name} {at * 1e3:.1f}" for name, at in sorted(ends.items(), key=lambda kv: kv[1])))
    print(f"first batch, cold, medians of {a.runs}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in medians.items()))
    print(f"default tier / tier off {medians['default tier'] / medians['tier off']:.2f} (target <= 1.1); "
          f"default tier / np.memmap {medians['default tier'] / medians['np.memmap gather']:.2f} (target <= 0.5)")
    if "torch DataLoader (2 workers)" in medians:
        print(f"default tier / torch DataLoader {medians['default tier'] / medians['torch DataLoader (2 workers)']:.2f} "
              "(target <= 0.5)")
    if a.partial_batches:
        runs = {"default tier": [], "tier off": []}
        for _ in range(a.runs):
            for label, tier_bytes in (("default tier", None), ("tier off", 0)):
                with ctx.Pool(1) as pool:
                    runs[label].append(pool.map(some_batches, [(store, a.batch, a.partial_batches, tier_bytes)])[0])
        rate = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
        cpu = {k: statistics.median(r[1] for r in v) for k, v in runs.items()}
        print(json.dumps({"partial_batches": a.partial_batches, "records_per_s": rate, "cpu_seconds": cpu}), flush=True)
        print(f"{a.partial_batches} batches of a cold epoch: default tier {rate['default tier']:.0f} rec/s, "
              f"{cpu['default tier']:.2f} CPU s; tier off {rate['tier off']:.0f} rec/s, {cpu['tier off']:.2f} CPU s; "
              f"rate {rate['default tier'] / rate['tier off']:.2f} (target >= 1.0), "
              f"CPU {cpu['default tier'] / cpu['tier off']:.2f} (target <= 1.2)")


def run(kind: str, a: argparse.Namespace, store: str, raw: str) -> dict:
    if drop_caches() is False:
        print("note: could not drop the page cache (needs root): the cold epoch is not cold", flush=True)
    if kind == "granary" and a.tier == "memory":
        # The memory tier of a previous run that kept it would make the cold epoch warm.
        subprocess.run([os.environ.get("GRANARY_BIN", "granary"), "tier", "clear"], capture_output=True)
    before = node_bytes_in_use()
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    per_epoch = a.pattern != "one-loader"
    # A restarted job is a new process per epoch: one pool per epoch.
    spans = [(e, 1) for e in range(a.epochs)] if a.pattern == "restart" else [(0, a.epochs)]
    results = [[] for _ in range(a.ranks)]
    grown = 0
    for first, epochs in spans:
        start, end = manager.Barrier(a.ranks), manager.Barrier(a.ranks)
        if kind == "granary":
            jobs = [(store, r, a.ranks, first, epochs, a.batch, a.tier, a.tier_bytes, per_epoch, start, end)
                    for r in range(a.ranks)]
            fn = granary_rank
        else:
            jobs = [(store, raw, a.record_bytes, r, a.ranks, first, epochs, a.batch, per_epoch, start, end)
                    for r in range(a.ranks)]
            fn = memmap_rank
        with ctx.Pool(a.ranks) as pool:
            outcomes = pool.map(fn, jobs)
        for r, o in enumerate(outcomes):
            results[r].extend(o[0])
        grown = max(grown, max(o[1] for o in outcomes) - before)
    rates, cpus = [], []
    for e in range(a.epochs):
        seconds = max(r[e][0] for r in results)
        records = sum(r[e][1] for r in results)
        rates.append(records / seconds)
        cpus.append(sum(r[e][2] for r in results))
    return {"loader": kind, "ranks": a.ranks, "pattern": a.pattern, "records_per_s": rates, "cpu_seconds": cpus,
            "memory_growth_bytes": grown}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--record-bytes", type=int, default=4096)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--runs", type=int, default=3, help="medians over this many runs of each side")
    p.add_argument("--tier-bytes", type=int, default=None, help="the tier's budget (default: the tier's own)")
    p.add_argument("--tier", choices=("page-cache", "memory"), default="page-cache")
    p.add_argument("--pattern", choices=("one-loader", "loader-per-epoch", "restart"), default="one-loader")
    p.add_argument("--first-batch", action="store_true",
                   help="measure only the cold first batch: default tier, tier off, np.memmap (issue 44)")
    p.add_argument("--partial-batches", type=int, default=0,
                   help="with --first-batch: also the first N batches of a cold epoch, tier on and off (issue 44: 300)")
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    store_dir = os.path.join(a.dir, "store")
    raw = os.path.join(a.dir, "tier.bin")
    store = granary.Store(store_dir, create=True)
    if not any(d["name"] == "tier" for d in store.datasets()):
        make(store, raw, int(a.gib * (1 << 30)), a.record_bytes)
    dataset_bytes = os.path.getsize(raw)
    if a.first_batch:
        first_batches(a, store_dir, raw)
        return
    runs = {"granary": [], "memmap": []}
    for _ in range(a.runs):
        for kind in ("granary", "memmap"):
            result = run(kind, a, store_dir, raw)
            result["memory_growth_x_dataset"] = result["memory_growth_bytes"] / dataset_bytes
            print(json.dumps(result), flush=True)
            runs[kind].append(result)
    print()
    print(f"{a.ranks} rank(s), {dataset_bytes / (1 << 30):.2f} GiB of {a.record_bytes}-byte records, "
          f"batch {a.batch}, {a.pattern}, {a.tier} tier, medians of {a.runs}")
    print(f"{'epoch':<8} {'granary rec/s':>14} {'memmap rec/s':>14} {'ratio':>8} {'granary CPU s':>14} "
          f"{'memmap CPU s':>13} {'CPU ratio':>10}")
    for e in range(a.epochs):
        g = statistics.median(r["records_per_s"][e] for r in runs["granary"])
        m = statistics.median(r["records_per_s"][e] for r in runs["memmap"])
        gc = statistics.median(r["cpu_seconds"][e] for r in runs["granary"])
        mc = statistics.median(r["cpu_seconds"][e] for r in runs["memmap"])
        label = "cold" if e == 0 else f"warm {e}"
        print(f"{label:<8} {g:>14.0f} {m:>14.0f} {g / m:>8.2f} {gc:>14.2f} {mc:>13.2f} {gc / max(mc, 1e-9):>10.2f}")
    for kind in ("granary", "memmap"):
        x = statistics.median(r["memory_growth_x_dataset"] for r in runs[kind])
        print(f"memory growth, {kind}: {x:.2f} x the dataset" + ("   target <= 1.2" if kind == "granary" else ""))


if __name__ == "__main__":
    main()
