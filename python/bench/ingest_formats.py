"""Ingest rate of a format against reading the same files with the format's own library, on the
same data, in the same run.

  parquet  a corpus of token documents (list<int32>, snappy, row groups of 10k rows), by
           `granary ingest parquet` (the CLI, a new store each round) against pyarrow reading the
           column (`pq.read_table(columns=[...])`, its threads on) and against iterating its rows
           as NumPy arrays (what a Python conversion script does before it can write anything)
  mds      the same documents written by Mosaic's MDSWriter (ndarray:int32 and str columns,
           zstd), by `granary ingest mds` against StreamingDataset iterating every sample of
           the local directory (only when mosaicml-streaming is installed)
  litdata  the same documents through litdata.optimize (a dict of a NumPy array and a str, zstd),
           by `granary ingest litdata` against LitData's StreamingDataset iterating every item
           (only when litdata is installed)

Rounds alternate the sides once every file is in the page cache; each round's ratios are taken
within the round and the medians printed as one JSON line (ratio = granary time / theirs:
below 1, granary ingests faster than their library reads).

    python python/bench/ingest_formats.py --dir /tmp/ingestbench --mib 256 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time

import numpy as np


def documents(mib: int, seed: int):
    rng = np.random.default_rng(seed)
    total = mib << 20
    docs, size = [], 0
    while size < total:
        n = int(rng.integers(64, 2048))
        docs.append(rng.integers(0, 50000, n, dtype=np.int32))
        size += 4 * n
    return docs


def _lit_item(pair: tuple) -> dict:
    # litdata.optimize calls this in a worker process of its own, with one input.
    i, doc = pair
    return {"input_ids": doc, "text": f"d{i}"}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def granary_ingest(binary: str, root: str, args: list) -> None:
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run([binary, "--root", root, "ingest", *args], check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--granary", default=os.environ.get("GRANARY_BIN", "granary"))
    parser.add_argument("--skip-mds", action="store_true", help="Parquet only (StreamingDataset takes minutes)")
    parser.add_argument("--with-litdata", action="store_true", help="with --skip-mds: LitData still runs")
    args = parser.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(args.dir, exist_ok=True)
    docs = documents(args.mib, 1)
    path = os.path.join(args.dir, "corpus.parquet")
    pq.write_table(
        pa.table({"input_ids": pa.array(docs, type=pa.list_(pa.int32())), "text": [f"d{i}" for i in range(len(docs))]}),
        path,
        compression="snappy",
        row_group_size=10_000,
    )
    root = os.path.join(args.dir, "store")
    sides = {
        "granary": lambda: granary_ingest(args.granary, root, ["parquet", "--name", "c", "--column", "input_ids", path]),
        "pyarrow_read": lambda: pq.read_table(path, columns=["input_ids"]),
        "pyarrow_rows": lambda: [
            a.values.to_numpy() for b in pq.ParquetFile(path).iter_batches(columns=["input_ids"]) for a in b.column(0)
        ],
    }
    mds_dir = os.path.join(args.dir, "mds")
    try:
        if args.skip_mds:
            raise ImportError
        from streaming import MDSWriter, StreamingDataset

        shutil.rmtree(mds_dir, ignore_errors=True)
        with MDSWriter(out=mds_dir, columns={"input_ids": "ndarray:int32", "text": "str"}, compression="zstd") as w:
            for i, doc in enumerate(docs):
                w.write({"input_ids": doc, "text": f"d{i}"})

        def streaming_read() -> None:
            cache = os.path.join(args.dir, "mds-cache")
            shutil.rmtree(cache, ignore_errors=True)
            for _ in StreamingDataset(local=mds_dir, shuffle=False, batch_size=1):
                pass

        sides["granary_mds"] = lambda: granary_ingest(args.granary, root, ["mds", "--name", "m", mds_dir])
        sides["streaming_read"] = streaming_read
    except ImportError:
        pass
    lit_dir = os.path.join(args.dir, "litdata")
    try:
        if args.skip_mds and not args.with_litdata:
            raise ImportError
        import litdata

        shutil.rmtree(lit_dir, ignore_errors=True)
        litdata.optimize(
            fn=_lit_item, inputs=list(enumerate(docs)), output_dir=lit_dir, chunk_bytes="64MB", num_workers=1,
            compression="zstd",
        )

        def litdata_read() -> None:
            for _ in litdata.StreamingDataset(input_dir=lit_dir):
                pass

        sides["granary_litdata"] = lambda: granary_ingest(args.granary, root, ["litdata", "--name", "l", lit_dir])
        sides["litdata_read"] = litdata_read
    except ImportError:
        pass
    for fn in sides.values():  # warm: every file in the page cache
        fn()
    rounds = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, fn in sides.items():
            rounds[name].append(timed(fn))
    result = {
        "mib": args.mib,
        "documents": len(docs),
        "parquet_file_mib": round(os.path.getsize(path) / 2**20, 1),
        "seconds": {name: round(statistics.median(t), 3) for name, t in rounds.items()},
        "granary_mib_per_s": round(args.mib / statistics.median(rounds["granary"]), 1),
        "parquet_vs_pyarrow_read": round(
            statistics.median(g / p for g, p in zip(rounds["granary"], rounds["pyarrow_read"])), 2
        ),
        "parquet_vs_pyarrow_rows": round(
            statistics.median(g / p for g, p in zip(rounds["granary"], rounds["pyarrow_rows"])), 2
        ),
    }
    if "granary_litdata" in rounds:
        result["litdata_vs_streaming_read"] = round(
            statistics.median(g / s for g, s in zip(rounds["granary_litdata"], rounds["litdata_read"])), 2
        )
    if "granary_mds" in rounds:
        result["mds_vs_streaming_read"] = round(
            statistics.median(g / s for g, s in zip(rounds["granary_mds"], rounds["streaming_read"])), 2
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
