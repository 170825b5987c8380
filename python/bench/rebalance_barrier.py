"""Rebalancing under a synchronous trainer: the epoch time with and without `rebalance_every`.

Two rank processes (started as torchrun starts them: one process per rank, RANK and WORLD_SIZE
given) each iterate a Python loader of the same dataset, "compute" for a time proportional to
their batch (a sleep: the slow rank's per-record time is FACTOR x the other's), then meet at a
barrier, as DDP's all-reduce makes every step wait for the slowest rank. Nobody calls
`report_busy`: the setting a user reaches first. The exchange of the ranks' measures goes
through a multiprocessing manager (torch.distributed's all_gather_object does the same in a
real job).

For each case (equal ranks, rank 1 FACTOR x slow) the epoch runs with and without rebalancing
(without: the same plan, the default partitioner's, never rebalanced), alternating, ROUNDS
times, each timed from its first batch; the medians and their ratio are printed as one JSON line
per case. A ratio above 1.0 means rebalancing made the epoch slower.

    python python/bench/rebalance_barrier.py --dir /tmp/rb --rounds 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

import granary

RECORD = 256
BATCH = 32


class ManagerExchange:
    """`rebalance_exchange` for rank processes: every rank's measure of a point, in rank order."""

    def __init__(self, table, barrier):
        self.table = table
        self.barrier = barrier

    def __call__(self, epoch, step, mine):
        self.table[(epoch, step, mine[0])] = tuple(mine)
        self.barrier.wait()
        return [self.table[(epoch, step, rank)] for rank in range(2)]


def rank_main(rank, root, every, per_record_s, step_barrier, exchange, out, report_busy):
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), "2"
    store = granary.Store(root)
    options = dict(batch_size=BATCH, seed=1, output="numpy", drop_last=True, tier_bytes=0)
    if every is not None:
        options.update(rebalance_every=every, rebalance_exchange=exchange)
    if every is None:
        # The same plan as a rebalancing loader's (the default partitioner), never rebalanced.
        options.update(partitioner="default")
    loader = store.loader("bench", **options)
    step_barrier.wait()
    records = 0
    started = None
    for batch in loader:
        # Timed from the first batch: the start (the partitioner plugin compiled, the first
        # plan) is the same with and without rebalancing, and is issue 44's subject.
        started = started or time.perf_counter()
        compute = per_record_s * len(batch)
        time.sleep(compute)
        records += len(batch)
        step_barrier.wait()
        if report_busy and every is not None:
            loader.report_busy(compute)
    out[rank] = (time.perf_counter() - started, records, loader.metrics())
    loader.close()


def epoch(root, every, per_record_s, report_busy=False):
    with mp.Manager() as manager:
        step_barrier = mp.Barrier(2)
        exchange = ManagerExchange(manager.dict(), manager.Barrier(2))
        out = manager.dict()
        procs = [
            mp.Process(
                target=rank_main,
                args=(rank, root, every, per_record_s[rank], step_barrier, exchange, out, report_busy),
            )
            for rank in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
            assert p.exitcode == 0, f"a rank failed ({p.exitcode})"
        seconds = max(out[r][0] for r in range(2))
        records = [out[r][1] for r in range(2)]
        return seconds, records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--records", type=int, default=8192)
    parser.add_argument("--fast-ms-per-record", type=float, default=0.25)
    parser.add_argument("--factor", type=float, default=4.0)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--report-busy", action="store_true", help="each rank reports its compute time (report_busy), as under DDP"
    )
    args = parser.parse_args()
    root = os.path.join(args.dir, "store")
    store = granary.Store(root, create=True)
    if not any(d["name"] == "bench" for d in store.datasets()):
        data = np.random.default_rng(0).integers(0, 256, size=(args.records, RECORD), dtype=np.uint8)
        store.ingest("bench", data, dtype="uint8", shape=[RECORD])
    fast = args.fast_ms_per_record / 1000
    for case, per_record in (("equal ranks", (fast, fast)), (f"rank 1 {args.factor:g} x slow", (fast, fast * args.factor))):
        with_rb, without = [], []
        shares = None
        for _ in range(args.rounds):
            seconds, records = epoch(root, args.every, per_record, args.report_busy)
            with_rb.append(seconds)
            shares = records
            without.append(epoch(root, None, per_record)[0])
        print(
            json.dumps(
                {
                    "case": case + (", report_busy" if args.report_busy else ""),
                    "epoch_s_rebalanced": round(statistics.median(with_rb), 3),
                    "epoch_s_without": round(statistics.median(without), 3),
                    "ratio": round(statistics.median(with_rb) / statistics.median(without), 3),
                    "records_per_rank_rebalanced": shares,
                    "rounds": args.rounds,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
