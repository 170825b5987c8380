"""The disk an attached dataset takes while a trainer reads it through an origin cache: what
`df` counts (the cached shard files, and the evicted ones this process still holds open or
mapped) against the cache's bound, sampled after every batch, with the loader's fetches.

The reading a user reaches first: a dataset pushed to an origin (`file://` here), attached with
a cache a quarter of its size, read by the default loader for several epochs.

    python python/bench/cache_disk.py --dir /tmp/cachedisk --mib 64 --cache-mib 16 --epochs 3
"""

import argparse
import os
import shutil

import numpy as np

import granary

RECORD = 4096


def on_disk(shards):
    """(bytes of the files under `shards`, bytes of removed ones this process holds)."""
    files = 0
    for root, _, names in os.walk(shards):
        for name in names:
            try:
                files += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass  # evicted between the listing and the look
    held = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(shards) and target.endswith(" (deleted)"):
                stat = os.stat(f"/proc/self/fd/{fd}")
                held[stat.st_ino] = stat.st_size
        except OSError:
            pass
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].strip().startswith(shards) and fields[5].strip().endswith("(deleted)"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inode = int(fields[4])
                held[inode] = max(held.get(inode, 0), end - start)
    return files, sum(held.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--cache-mib", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    n = (args.mib << 20) // RECORD
    data = np.random.default_rng(0).integers(0, 255, (n, RECORD), dtype=np.uint8)
    source = granary.Store(os.path.join(args.dir, "source"), create=True)
    source.ingest("d", list(data), dtype="uint8", shape=[RECORD], shard_bytes=4 << 20)
    origin = "file://" + os.path.join(os.path.abspath(args.dir), "origin")
    source.push("d", origin)
    here = granary.Store(os.path.join(args.dir, "here"), create=True)
    here.attach("d", origin, cache_bytes=args.cache_mib << 20)
    shards = os.path.realpath(os.path.join(args.dir, "here", "shards"))
    loader = here.loader("d", batch_size=args.batch, seed=1, output="numpy", with_indices=True)
    peak = peak_held = records = 0
    for _ in range(args.epochs):
        for indices, batch in loader:
            assert np.array_equal(batch, data[indices]), "the records read are the ones written"
            records += len(indices)
            files, held = on_disk(shards)
            peak, peak_held = max(peak, files + held), max(peak_held, held)
    metrics = loader.metrics()
    loader.close()
    bound = args.cache_mib << 20
    print(f"{args.epochs} epochs of {args.mib} MiB ({records} records) through a {args.cache_mib} MiB cache: "
          f"on disk at most {peak / 2**20:.1f} MiB ({peak / bound:.2f} x the bound; "
          f"{peak_held / 2**20:.1f} MiB of it removed but held), "
          f"{metrics['origin_shards_fetched']} shards fetched ({metrics['origin_shards_fetched'] * 4 / args.mib:.2f} "
          f"x the data over {args.epochs} epochs)")


if __name__ == "__main__":
    main()
