"""Seeds the Parquet, MDS and LitData fuzz targets with datasets their own writers wrote.

    target/torch-venv/bin/python scripts/fuzz-format-seeds.py fuzz/seeds

The seeds are kept in fuzz/seeds/ (scripts/fuzz-seeds.sh copies them into the corpora): run
this again when a writer's format changes, and commit what it writes.

Needs pyarrow, mosaicml-streaming, litdata and torch (`make test`'s torch venv has them). Each
dataset is packed as `fuzz/src/lib.rs` unpacks it: a flags byte, then each file as a `u8` name
length, the name, a `u32` little-endian length and the contents.
"""

import os
import struct
import sys
import tempfile

import numpy as np


def pack(directory, flags=0):
    out = bytearray([flags])
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        data = open(path, "rb").read()
        out += bytes([len(name)]) + name.encode() + struct.pack("<I", len(data)) + data
    return bytes(out)


def save(corpus, target, name, data):
    os.makedirs(os.path.join(corpus, target), exist_ok=True)
    with open(os.path.join(corpus, target, name), "wb") as f:
        f.write(data)


def parquet_seeds(corpus, work):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 40
    tables = {
        # One column (flags 0: a file's only column).
        "one": (pa.table({"a": pa.array(range(n), pa.int64())}), 0, {"compression": "snappy"}),
        "lists": (
            pa.table(
                {
                    "a": pa.array([list(range(i % 5)) for i in range(n)], pa.list_(pa.int32())),
                    "b": pa.array([f"row {i}" for i in range(n)]),
                    "c": pa.array([bytes([i]) * (i % 3) for i in range(n)], pa.binary()),
                }
            ),
            0b111,
            {"compression": "zstd"},
        ),
        "hub": (
            pa.table(
                {
                    "a": pa.array(
                        [{"bytes": b"\x89PNG" + bytes([i]), "path": f"{i}.png"} for i in range(n)],
                        pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
                    ),
                    "b": pa.array([i % 2 == 0 for i in range(n)]),
                    "c": pa.array([["x", "y", "z"][i % 3] for i in range(n)]).dictionary_encode(),
                    "d": pa.array([i * 1000 for i in range(n)], pa.timestamp("ms", tz="UTC")),
                    "e": pa.array([[[i], [i, i]] for i in range(n)], pa.list_(pa.list_(pa.int64()))),
                    "f": pa.array([None if i % 7 == 0 else i / 2 for i in range(n)], pa.float32()),
                }
            ),
            0b111111,
            {"compression": "none", "data_page_version": "2.0", "use_dictionary": True},
        ),
    }
    for name, (table, flags, options) in tables.items():
        d = os.path.join(work, "pq-" + name)
        os.makedirs(d)
        pq.write_table(table, os.path.join(d, "data.parquet"), row_group_size=16, **options)
        save(corpus, "parquet_decode", name, pack(d, flags))
    # Two files whose columns stand in other orders.
    d = os.path.join(work, "pq-orders")
    os.makedirs(d)
    pq.write_table(pa.table({"a": [1, 2], "b": ["x", "y"]}), os.path.join(d, "1.parquet"))
    pq.write_table(pa.table({"b": ["z"], "a": [3]}), os.path.join(d, "2.parquet"))
    save(corpus, "parquet_decode", "orders", pack(d, 0b11))


def mds_seeds(corpus, work):
    from PIL import Image
    import streaming

    columns = {"a": "bytes", "b": "str", "c": "int", "d": "ndarray:int16:3", "e": "json", "f": "float32", "g": "str_int"}
    for compression in (None, "zstd", "gz"):
        d = os.path.join(work, f"mds-{compression}")
        with streaming.MDSWriter(out=d, columns=columns, compression=compression, size_limit=1 << 11) as writer:
            for i in range(24):
                writer.write(
                    {
                        "a": bytes([i]) * (i % 4),
                        "b": f"sample {i}",
                        "c": i - 5,
                        "d": np.arange(3, dtype=np.int16) + i,
                        "e": {"i": i},
                        "f": np.float32(i / 4),
                        "g": i,
                    }
                )
        save(corpus, "mds_decode", f"columns-{compression}", pack(d))
    d = os.path.join(work, "mds-images")
    images = {"p": "pil", "n": "ndarray", "l": "list[pil]"}
    with streaming.MDSWriter(out=d, columns=images, hashes=["sha1", "xxh64"]) as writer:
        for i in range(6):
            image = Image.new("RGB", (2, 1 + i % 2), (i, 2 * i, 3 * i))
            writer.write({"p": image, "n": np.ones((2, 2), np.float32) * i, "l": [image, image]})
    save(corpus, "mds_decode", "images", pack(d))


# LitData's workers are processes started by spawn: its item functions live at the top level.
def lit_item(i):
    return {"tokens": np.arange(1 + i % 5, dtype=np.int32) + i, "text": f"item {i}", "label": i, "raw": bytes([i])}


def lit_text(i):
    return {"text": f"document {i}", "label": i % 3, "score": i / 3, "ok": i % 2 == 0}


def lit_tokens(i):
    import torch

    return torch.arange(i * 10, i * 10 + 3 + i % 7, dtype=torch.int32)


def litdata_seeds(corpus, work):
    import litdata
    from litdata.streaming.item_loader import TokensLoader

    runs = {
        "leaves": (lit_item, {}, 0),
        "leaves-zstd-sample": (lit_item, {"compression": "zstd", "compression_level": "sample"}, 0),
        "footer": (lit_text, {}, 0),
        "footer-zstd": (lit_text, {"compression": "zstd"}, 0),
        "tokens": (lit_tokens, {"item_loader": TokensLoader()}, 1),
    }
    for name, (fn, options, flags) in runs.items():
        d = os.path.join(work, "lit-" + name)
        litdata.optimize(fn=fn, inputs=list(range(20)), output_dir=d, chunk_bytes="1KB", num_workers=1, **options)
        save(corpus, "litdata_decode", name, pack(d, flags))


def main():
    corpus = sys.argv[1]
    for target in ("parquet_decode", "mds_decode", "litdata_decode"):
        for name in os.listdir(os.path.join(corpus, target)) if os.path.isdir(os.path.join(corpus, target)) else []:
            os.remove(os.path.join(corpus, target, name))
    with tempfile.TemporaryDirectory() as work:
        parquet_seeds(corpus, work)
        mds_seeds(corpus, work)
        litdata_seeds(corpus, work)
    counts = {t: len(os.listdir(os.path.join(corpus, t))) for t in ("parquet_decode", "mds_decode", "litdata_decode")}
    print("format fuzz seeds: " + ", ".join(f"{n} {t}" for t, n in counts.items()))


if __name__ == "__main__":
    main()
