#!/usr/bin/env python3
"""Replays the same oracleGeneral traces through granary's evictor plugins and libCacheSim.

LRU, FIFO and SIEVE must give exactly libCacheSim's miss counts, S3-FIFO must be within 0.005
of its miss ratio, and the plan-aware evictor must reach Belady's optimum; on synthetic traces
and on the shard accesses logged by real runs through the origin cache (`bench cache`). Prints one table and
exits non-zero on any miss of those targets.

    python3 scripts/compare-libcachesim.py [--granary target/debug/granary] [--out DIR]

Needs `pip install libcachesim` (Linux, glibc >= 2.34).
"""
import argparse, os, re, subprocess, sys, tempfile

import libcachesim as lcs

PLUGINS = {  # granary plugin -> (libCacheSim class, allowed absolute miss-ratio difference)
    "lru": (lcs.LRU, 0.0),
    "fifo": (lcs.FIFO, 0.0),
    "sieve": (lcs.Sieve, 0.0),
    "s3-fifo": (lcs.S3FIFO, 0.005),
    "plan-aware": (lcs.Belady, 0.0),
}


def granary_misses(granary, plugin, trace, cache):
    out = subprocess.run([granary, "plugin", "sim", "evict", "--plugin", plugin, "--trace", trace,
                          "--cache-objects", str(cache)], check=True, capture_output=True, text=True).stdout
    misses, requests = re.search(r"misses (\d+) of (\d+)", out).groups()
    return int(misses), int(requests)


def libcachesim_ratio(cls, trace, cache):
    params = lcs.ReaderInitParam()
    params.ignore_obj_size = True
    reader = lcs.TraceReader(trace, lcs.TraceType.ORACLE_GENERAL_TRACE, params)
    return cls(cache_size=cache).process_trace(reader)[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--granary", default="target/debug/granary")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = args.out or tempfile.mkdtemp(prefix="granary-lcs-")
    traces = {
        "zipf-1.0": ["zipf", "--objects", "20000", "--requests", "300000", "--alpha", "1.0", "--seed", "7"],
        "zipf-0.8": ["zipf", "--objects", "50000", "--requests", "300000", "--alpha", "0.8", "--seed", "8"],
        "shuffled": ["shuffled", "--objects", "20000", "--epochs", "5", "--seed", "9"],
    }
    failures = 0
    print(f"{'trace':<10} {'cache':>6} {'plugin':<11} {'granary':>9} {'libCacheSim':>12} {'diff':>9}  target")
    for name, spec in traces.items():
        path = os.path.join(work, f"{name}.oracleGeneral.bin")
        subprocess.run([args.granary, "plugin", "trace", *spec, "--out", path], check=True, capture_output=True)
        for cache in (500, 2000, 8000):
            for plugin, (cls, tolerance) in PLUGINS.items():
                misses, requests = granary_misses(args.granary, plugin, path, cache)
                ours = misses / requests
                theirs = libcachesim_ratio(cls, path, cache)
                diff = ours - theirs
                exact = tolerance == 0.0
                ok = round(theirs * requests) == misses if exact else abs(diff) <= tolerance
                failures += not ok
                target = "exact" if exact else f"within {tolerance}"
                print(f"{name:<10} {cache:>6} {plugin:<11} {ours:>9.6f} {theirs:>12.6f} {diff:>+9.6f}  {target}: {'ok' if ok else 'MISSED'}")
    failures += logged_run(args.granary, work)
    print(f"libCacheSim comparison: {failures} targets missed")
    sys.exit(1 if failures else 0)


def logged_run(granary, work):
    """The shard accesses of real runs through the origin cache (`bench cache --trace-out`, a
    loader reading an attached dataset from a throttled in-memory origin), replayed: LRU must
    give libCacheSim's misses exactly and plan-aware Belady's, on the cache's size in shards."""
    root = os.path.join(work, "bench-cache")
    traces = os.path.join(work, "logged")
    out = subprocess.run([granary, "--root", root, "bench", "cache", "--generate", "8MiB", "--shard-bytes", "128KiB",
                          "--batch", "16", "--step-ms", "0", "--latency-ms", "1", "--bandwidth", "1GiB",
                          "--evictors", "lru", "--baseline", "none", "--trace-out", traces],
                         check=True, capture_output=True, text=True).stdout
    cache = int(re.search(r"%, (\d+) shards\)", out).group(1))
    failures = 0
    # The accesses follow the plan, whichever evictor ran: one run's log serves for both.
    for run in ("lru",):
        path = os.path.join(traces, f"{run}.oracleGeneral.bin")
        for plugin in ("lru", "plan-aware"):
            cls, _ = PLUGINS[plugin]
            misses, requests = granary_misses(granary, plugin, path, cache)
            theirs = libcachesim_ratio(cls, path, cache)
            ok = round(theirs * requests) == misses
            failures += not ok
            name = f"run:{run}"
            print(f"{name:<14} {cache:>6} {plugin:<11} {misses / requests:>9.6f} {theirs:>12.6f} "
                  f"{misses / requests - theirs:>+9.6f}  exact: {'ok' if ok else 'MISSED'}")
    return failures


if __name__ == "__main__":
    main()
