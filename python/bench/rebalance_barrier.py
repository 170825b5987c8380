"""Rebalancing under a synchronous trainer: the epoch time with and without `rebalance_every`.

Two rank processes (started as torchrun starts them: one process per rank, RANK and WORLD_SIZE
given) each iterate a Python loader of the same dataset, "compute" for a time proportional to
their batch (a sleep: the slow rank's per-record time is FACTOR x the other's), then meet at a
barrier, as DDP's all-reduce makes every step wait for the slowest rank. Nobody calls
`report_busy`: the setting a user reaches first. The exchange of the ranks' measures goes
through a multiprocessing manager (torch.distributed's all_gather_object does the same in a
real job).

For each case (equal ranks, rank 1 2, 3 and 4 x slow by default) the epoch runs with and without rebalancing
(without: the same plan, the default partitioner's, never rebalanced), alternating, ROUNDS
times, each timed from its first batch; the medians and their ratio are printed as one JSON line
per case. A ratio above 1.0 means rebalancing made the epoch slower.

    python python/bench/rebalance_barrier.py --dir /tmp/rb --rounds 3 [--batch 16] [--factors 1,2,3,4]
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



class ManagerExchange:
    """`rebalance_exchange` for rank processes: every rank's measure of a point, in rank order."""

    def __init__(self, table, barrier):
        self.table = table
        self.barrier = barrier

    def __call__(self, epoch, step, mine):
        self.table[(epoch, step, mine[0])] = tuple(mine)
        self.barrier.wait()
        return [self.table[(epoch, step, rank)] for rank in range(2)]


def spin(seconds):
    """Compute on the CPU for `seconds` (a trainer's step on the CPU: the reader shares the cores)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def rank_main(rank, root, batch_size, every, per_record_s, step_barrier, exchange, out, report_busy, compute_fn):
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), "2"
    store = granary.Store(root)
    options = dict(batch_size=batch_size, seed=1, output="numpy", drop_last=True, tier_bytes=0)
    if every is not None:
        options.update(rebalance_every=every, rebalance_exchange=exchange)
    if every is None:
        # The same plan as a rebalancing loader's (the default partitioner), never rebalanced.
        options.update(partitioner="default")
    loader = store.loader("bench", **options)
    step_barrier.wait()
    records = 0
    started = None
    waited = 0.0
    batches = iter(loader)
    while True:
        asked = time.perf_counter()
        batch = next(batches, None)
        if batch is None:
            break
        # Timed from the first batch: the start (the partitioner plugin compiled, the first
        # plan) is the same with and without rebalancing, and is issue 44's subject.
        if started is None:
            started = time.perf_counter()
        else:
            waited += time.perf_counter() - asked
        compute = per_record_s * len(batch)
        compute_fn(compute)
        records += len(batch)
        step_barrier.wait()
        if report_busy and every is not None:
            loader.report_busy(compute)
    out[rank] = (time.perf_counter() - started, records, waited)
    loader.close()


def epoch(root, batch_size, every, per_record_s, report_busy=False, compute_fn=time.sleep, step_barrier="process"):
    with mp.Manager() as manager:
        # The step's barrier: a semaphore between the processes, or one the manager serves
        # (each wait a round trip to its process, as a collective over the network costs).
        step_barrier = mp.Barrier(2) if step_barrier == "process" else manager.Barrier(2)
        exchange = ManagerExchange(manager.dict(), manager.Barrier(2))
        out = manager.dict()
        procs = [
            mp.Process(
                target=rank_main,
                args=(
                    rank, root, batch_size, every, per_record_s[rank], step_barrier, exchange, out, report_busy, compute_fn
                ),
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
        # The trainers' waits inside `next()` after the first batch: a reader that lost its lead
        # shows here first.
        stall = max(out[r][2] for r in range(2))
        return seconds, records, stall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--records", type=int, default=8192)
    parser.add_argument(
        "--record-bytes", type=int, default=256,
        help="bytes a record (larger ones make each read take time: the reader's lead then shows)",
    )
    parser.add_argument("--batch", type=int, default=16, help="records per rank of a step")
    parser.add_argument("--fast-ms-per-record", type=float, default=0.2)
    parser.add_argument(
        "--compute", choices=("sleep", "spin"), default="spin",
        help="a step's compute: the CPU kept busy (spin, as a trainer on the CPU) or a sleep (as a GPU step)",
    )
    parser.add_argument(
        "--step-barrier", choices=("process", "manager"), default="process",
        help="the per-step barrier: multiprocessing's, or the manager's (a round trip to another process)",
    )
    parser.add_argument("--factors", default="1,2,3,4", help="how much slower rank 1 computes, one case each")
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--report-busy", action="store_true", help="each rank reports its compute time (report_busy), as under DDP"
    )
    args = parser.parse_args()
    root = os.path.join(args.dir, f"store-{args.records}x{args.record_bytes}")
    store = granary.Store(root, create=True)
    if not any(d["name"] == "bench" for d in store.datasets()):
        data = np.random.default_rng(0).integers(0, 256, size=(args.records, args.record_bytes), dtype=np.uint8)
        store.ingest("bench", data, dtype="uint8", shape=[args.record_bytes])
    fast = args.fast_ms_per_record / 1000
    compute_fn = spin if args.compute == "spin" else time.sleep
    for factor in (float(f) for f in args.factors.split(",")):
        case = "equal ranks" if factor == 1 else f"rank 1 {factor:g} x slow"
        per_record = (fast, fast * factor)
        with_rb, without, stall_rb, stall_without = [], [], [], []
        shares = None
        for _ in range(args.rounds):
            seconds, records, stall = epoch(root, args.batch, args.every, per_record, args.report_busy, compute_fn, args.step_barrier)
            with_rb.append(seconds)
            stall_rb.append(stall)
            shares = records
            seconds, _, stall = epoch(root, args.batch, None, per_record, compute_fn=compute_fn, step_barrier=args.step_barrier)
            without.append(seconds)
            stall_without.append(stall)
        print(
            json.dumps(
                {
                    "case": case + (", report_busy" if args.report_busy else "") + f", {args.compute}",
                    "epoch_s_rebalanced": round(statistics.median(with_rb), 3),
                    "epoch_s_without": round(statistics.median(without), 3),
                    "ratio": round(statistics.median(with_rb) / statistics.median(without), 3),
                    "records_per_rank_rebalanced": shares,
                    "next_wait_s_rebalanced": round(statistics.median(stall_rb), 3),
                    "next_wait_s_without": round(statistics.median(stall_without), 3),
                    "rounds": args.rounds,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
