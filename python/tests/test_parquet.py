"""Parquet files ingest row for row as pyarrow reads them (issue 43): token lists, binary and
string columns, numbers, several columns as samples, nulls refused or skipped, row groups,
compression codecs, directories and glob patterns. Skipped where pyarrow is not installed;
`make python-env` installs it."""

import itertools
import zlib

import numpy as np
import pytest

import granary
from conftest import ingested_damaged_copies, outcome

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def rows_of(store, name):
    """Every record of `name`, in order, as Python values: bytes, lists of numbers, or dicts."""
    loader = store.loader(name, batch_size=1000, order="sequential", output="numpy")
    out = []
    for batch in loader:
        if isinstance(batch, list):  # samples
            out.extend({k: v for k, v in sample.items()} for sample in batch)
        elif isinstance(batch, tuple):  # variable-length records: (data, offsets)
            data, offsets = batch
            for k in range(len(offsets) - 1):
                part = data[offsets[k] : offsets[k + 1]]
                out.append(part.tobytes() if part.dtype == np.uint8 else part.tolist())
        else:  # fixed records of one number
            out.extend(batch.reshape(-1).tolist())
    return out


def layout_of(store, name):
    return [d["layout"] for d in store.datasets() if d["name"] == name][0]


def tokens_table(n, seed, type_):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 50000, int(rng.integers(0, 200))).tolist() for _ in range(n)]
    return pa.table({"input_ids": pa.array(docs, type=type_)}), docs


@pytest.mark.parametrize(
    "type_,compression,layout",
    [
        (pa.list_(pa.int32()), "zstd", "arrays i32"),
        (pa.list_(pa.int64()), "snappy", "arrays i64"),
        (pa.large_list(pa.uint16()), "gzip", "arrays u16"),
        (pa.list_(pa.uint32()), "none", "arrays u32"),
        (pa.list_(pa.int32()), "lz4", "arrays i32"),
        (pa.list_(pa.int32()), "brotli", "arrays i32"),
    ],
)
def test_token_lists_read_back_as_pyarrow_reads_them(store, tmp_path, type_, compression, layout):
    table, _ = tokens_table(700, 1, type_)
    path = tmp_path / "tokens.parquet"
    # Several row groups, and batches of the reader that cross them.
    pq.write_table(table, path, compression=compression, row_group_size=150)
    assert pq.ParquetFile(path).num_row_groups == 5
    committed = store.ingest_parquet("tokens", path)
    assert committed["records"] == 700 and committed["skipped"] == 0
    assert layout_of(store, "tokens") == layout
    assert rows_of(store, "tokens") == pq.read_table(path).column("input_ids").to_pylist()


def test_binary_strings_and_numbers_are_byte_and_fixed_records(store, tmp_path):
    texts = ["plain", "ünïcödé ✓", "", "x" * 10000] * 25
    blobs = [bytes([i % 256]) * (i % 37) for i in range(100)]
    labels = list(range(-50, 50))
    path = tmp_path / "mixed.parquet"
    pq.write_table(
        pa.table(
            {
                "text": pa.array(texts, type=pa.string()),
                "large": pa.array(texts, type=pa.large_string()),
                "blob": pa.array(blobs, type=pa.binary()),
                "label": pa.array(labels, type=pa.int64()),
                "score": pa.array([x / 7 for x in labels], type=pa.float32()),
            }
        ),
        path,
    )
    expected = pq.read_table(path)
    store.ingest_parquet("text", path, columns=["text"])
    assert rows_of(store, "text") == [t.encode() for t in expected.column("text").to_pylist()]
    store.ingest_parquet("large", path, columns=["large"])
    assert rows_of(store, "large") == [t.encode() for t in expected.column("large").to_pylist()]
    store.ingest_parquet("blob", path, columns=["blob"])
    assert layout_of(store, "blob") == "bytes"
    assert rows_of(store, "blob") == expected.column("blob").to_pylist()
    store.ingest_parquet("label", path, columns=["label"])
    assert rows_of(store, "label") == expected.column("label").to_pylist()
    store.ingest_parquet("score", path, columns=["score"])
    assert np.array_equal(
        np.array(rows_of(store, "score"), dtype=np.float32), expected.column("score").to_numpy()
    )


def test_several_columns_make_samples_of_named_parts(store, tmp_path):
    rng = np.random.default_rng(3)
    n = 300
    ids = [rng.integers(0, 1000, int(rng.integers(1, 50))).tolist() for _ in range(n)]
    table = pa.table(
        {
            "text": [f"document {i}" for i in range(n)],
            "input_ids": pa.array(ids, type=pa.list_(pa.int32())),
            "label": pa.array([i % 10 for i in range(n)], type=pa.int16()),
            "image": [bytes([i % 256, 0xFF, 0xD8]) for i in range(n)],
            "score": pa.array([i / 3 for i in range(n)], type=pa.float64()),
        }
    )
    path = tmp_path / "samples.parquet"
    pq.write_table(table, path, row_group_size=64, compression="zstd")
    store.ingest_parquet("samples", path, columns=["text", "input_ids", "label", "image", "score"])
    assert layout_of(store, "samples") == "samples"
    expected = pq.read_table(path).to_pylist()
    got = rows_of(store, "samples")
    assert len(got) == n
    for i, (sample, row) in enumerate(zip(got, expected)):
        assert set(sample) == {"__key__", "text.txt", "input_ids.npy", "label.cls", "image.bin", "score.float"}
        assert sample["__key__"] == f"{i:012d}"
        assert sample["text.txt"] == row["text"].encode()
        assert sample["label.cls"] == str(row["label"]).encode()
        assert sample["image.bin"] == row["image"]
        decoded = granary.formats.decode(sample)
        assert decoded["input_ids"].dtype == np.int32 and decoded["input_ids"].tolist() == row["input_ids"]
        assert (decoded["text"], decoded["label"], decoded["image"]) == (row["text"], row["label"], row["image"])
        assert decoded["score"] == row["score"]  # the shortest text that parses back exactly


def test_nulls_are_refused_or_their_rows_skipped(store, tmp_path):
    path = tmp_path / "nulls.parquet"
    ids = [[1, 2], None, [3], [4, None], [5]]
    pq.write_table(pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int64()))}), path)
    with pytest.raises(granary.Error, match=r'row 1 has a null in column "input_ids"'):
        store.ingest_parquet("nulls", path)
    assert "nulls" not in [d["name"] for d in store.datasets()]
    committed = store.ingest_parquet("nulls", path, nulls="skip")
    assert committed["records"] == 3 and committed["skipped"] == 2
    assert rows_of(store, "nulls") == [[1, 2], [3], [5]]
    with pytest.raises(ValueError, match="nulls="):
        store.ingest_parquet("other", path, nulls="drop")


def test_directories_and_patterns_take_files_in_path_order(store, tmp_path):
    data = tmp_path / "data"
    (data / "nested").mkdir(parents=True)
    expected = []
    for i, where in enumerate(["train-00000.parquet", "train-00001.parquet", "nested/train-00002.parquet"]):
        table, docs = tokens_table(40 + i, 10 + i, pa.list_(pa.int32()))
        pq.write_table(table, data / where)
        expected.append(docs)
    (data / "README.md").write_text("not a parquet file")
    store.ingest_parquet("dir", data)
    # A directory's files in path order: nested/ sorts before train-*.
    assert rows_of(store, "dir") == expected[2] + expected[0] + expected[1]
    store.ingest_parquet("glob", str(data / "train-*.parquet"))
    assert rows_of(store, "glob") == expected[0] + expected[1]
    store.ingest_parquet("list", [data / "train-00001.parquet", data / "train-00000.parquet"])
    assert rows_of(store, "list") == expected[1] + expected[0]
    with pytest.raises(granary.Error, match="matches no file"):
        store.ingest_parquet("none", str(data / "valid-*.parquet"))


def test_bad_inputs_are_refused_before_anything_is_written(store, tmp_path):
    a = tmp_path / "a.parquet"
    b = tmp_path / "b.parquet"
    pq.write_table(pa.table({"x": pa.array([[1]], type=pa.list_(pa.int32())), "y": ["s"]}), a)
    pq.write_table(pa.table({"x": pa.array(["not a list"]), "y": ["s"]}), b)
    with pytest.raises(granary.Error, match=r"2 columns \(x, y\)"):
        store.ingest_parquet("t", a)
    with pytest.raises(granary.Error, match=r'no column "z" \(its columns: x, y\)'):
        store.ingest_parquet("t", a, columns=["z"])
    with pytest.raises(granary.Error, match=r'column "x" is Utf8 here'):
        store.ingest_parquet("t", [a, b], columns=["x"])
    maps = tmp_path / "maps.parquet"
    pq.write_table(pa.table({"kv": pa.array([[("a", 1)]], type=pa.map_(pa.string(), pa.int32()))}), maps)
    with pytest.raises(granary.Error, match=r'column "kv" is Map.*which is not ingested'):
        store.ingest_parquet("t", maps)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1 not really")
    with pytest.raises(granary.Error, match="not a readable Parquet file"):
        store.ingest_parquet("t", junk)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(a.read_bytes()[:-9])
    with pytest.raises(granary.Error, match="not a readable Parquet file"):
        store.ingest_parquet("t", truncated)
    assert store.datasets() == []


def test_the_hugging_face_datasets_library_reads_the_same_rows(store, tmp_path, monkeypatch):
    # Its caches in the test's directory, and no look at the Hub (set before the import reads them).
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    table, _ = tokens_table(123, 7, pa.list_(pa.int32()))
    path = tmp_path / "hf.parquet"
    pq.write_table(table, path)
    store.ingest_parquet("hf", path)
    hf = datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert rows_of(store, "hf") == hf["input_ids"]


def decoded_rows(store, name):
    return [granary.formats.decode(sample) for sample in rows_of(store, name)]


def as_python(value):
    """A decoded part as the Python value pyarrow's to_pylist gives (arrays as lists)."""
    return value.tolist() if isinstance(value, np.ndarray) else value


FOUR_COLUMNS = {
    "input_ids": pa.list_(pa.int32()),
    "labels": pa.list_(pa.int32()),
    "text": pa.string(),
    "id": pa.int64(),
}


def four_columns_table(n, seed):
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "input_ids": pa.array([rng.integers(0, 50000, 5).tolist() for _ in range(n)], type=pa.list_(pa.int32())),
            # Other values than input_ids' in every row: a swap cannot pass unseen.
            "labels": pa.array([(-rng.integers(1, 100, 5)).tolist() for _ in range(n)], type=pa.list_(pa.int32())),
            "text": [f"text of row {i}" for i in range(n)],
            "id": pa.array(range(1000, 1000 + n), type=pa.int64()),
        }
    )


def test_columns_are_taken_by_name_in_every_order(store, tmp_path):
    # Issue 52: columns came back in the file's order and were used in the caller's, which put
    # input_ids' values under labels, exit 0; of different types it panicked.
    table = four_columns_table(50, 1)
    path = tmp_path / "four.parquet"
    pq.write_table(table, path, row_group_size=20)
    expected = pq.read_table(path).to_pylist()
    orders = [p for k in (2, 3) for p in itertools.permutations(FOUR_COLUMNS, k)]
    assert len(orders) == 36
    for n, columns in enumerate(orders):
        name = f"order{n}"
        store.ingest_parquet(name, path, columns=list(columns))
        got = decoded_rows(store, name)
        assert len(got) == len(expected)
        for sample, row in zip(got, expected):
            assert {c: as_python(sample[c]) for c in columns} == {c: row[c] for c in columns}, columns


def test_files_whose_columns_stand_in_other_orders_are_read_by_name(store, tmp_path):
    table = four_columns_table(30, 2)
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(table.slice(0, 10), first)
    # The same columns, in the reverse order, in the second file.
    pq.write_table(table.slice(10).select(list(reversed(table.column_names))), second)
    store.ingest_parquet("two", [first, second], columns=["labels", "input_ids", "id"])
    got = decoded_rows(store, "two")
    expected = table.to_pylist()
    assert [{c: as_python(s[c]) for c in ("labels", "input_ids", "id")} for s in got] == [
        {c: r[c] for c in ("labels", "input_ids", "id")} for r in expected
    ]
    # One column alone, from both files: the records are that column's.
    store.ingest_parquet("labels", [first, second], columns=["labels"])
    assert rows_of(store, "labels") == [r["labels"] for r in expected]


def test_a_column_named_as_a_samples_own_field_is_refused_not_lost(store, tmp_path):
    path = tmp_path / "reserved.parquet"
    pq.write_table(pa.table({"__key__": ["mine"], "text": ["t"]}), path)
    with pytest.raises(granary.Error, match=r'column "__key__": that name stands for the sample\'s own key'):
        store.ingest_parquet("r", path, columns=["__key__", "text"])
    # Alone, it is a byte record: nothing is lost.
    store.ingest_parquet("r", path, columns=["__key__"])
    assert rows_of(store, "r") == [b"mine"]
    # pandas' index column is not reserved: it decodes to its value.
    index = tmp_path / "index.parquet"
    pq.write_table(pa.table({"__index_level_0__": [7], "text": ["t"]}), index)
    store.ingest_parquet("i", index, columns=["__index_level_0__", "text"])
    assert decoded_rows(store, "i") == [{"__key__": "000000000000", "__index_level_0__": 7, "text": "t"}]


def png_bytes(width, height, seed):
    """A real PNG (grey, 8 bits), made by hand: its bytes must arrive as they are."""
    rng = np.random.default_rng(seed)
    rows = b"".join(b"\x00" + rng.integers(0, 256, width, dtype=np.uint8).tobytes() for _ in range(height))

    def chunk(kind, data):
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def test_the_types_hub_datasets_hold_read_as_pyarrow_reads_them(store, tmp_path):
    n = 40
    jpeg = b"\xff\xd8\xff\xe0" + bytes(range(60))
    media = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table(
        {
            "flag": pa.array([i % 3 == 0 for i in range(n)], type=pa.bool_()),
            "category": pa.array([["cat", "dog", "émeu"][i % 3] for i in range(n)]).dictionary_encode(),
            "tags": pa.array([[f"t{j}" for j in range(i % 4)] for i in range(n)], type=pa.list_(pa.string())),
            "grid": pa.array([[[i, j] for j in range(i % 3)] for i in range(n)], type=pa.list_(pa.list_(pa.int64()))),
            "meta": pa.array(
                [{"score": i / 7, "ok": i % 2 == 0, "name": f"m{i}", "nan": float("nan") if i == 3 else 1.5} for i in range(n)]
            ),
            "image": pa.array(
                [{"bytes": png_bytes(4 + i % 3, 3, i) if i % 2 else jpeg, "path": f"img{i}.png"} for i in range(n)],
                type=media,
            ),
        }
    )
    path = tmp_path / "hub.parquet"
    pq.write_table(table, path, row_group_size=16)
    columns = table.column_names
    store.ingest_parquet("hub", path, columns=columns)
    expected = pq.read_table(path).to_pylist()
    got = rows_of(store, "hub")
    for i, (sample, row) in enumerate(zip(got, expected)):
        ext = "png" if i % 2 else "jpg"
        assert set(sample) == {"__key__", "flag.json", "category.txt", "tags.json", "grid.json", "meta.json", f"image.{ext}"}
        assert sample[f"image.{ext}"] == row["image"]["bytes"]
        decoded = granary.formats.decode(sample)
        assert type(decoded["flag"]) is bool and decoded["flag"] == row["flag"]
        assert decoded["category"] == row["category"]
        assert decoded["tags"] == row["tags"] and decoded["grid"] == row["grid"]
        meta, want = decoded["meta"], row["meta"]
        assert list(meta) == list(want)
        assert (meta["score"], meta["ok"], meta["name"]) == (want["score"], want["ok"], want["name"])
        assert meta["nan"] != meta["nan"] if i == 3 else meta["nan"] == want["nan"]
    # One image column alone: its files' bytes as byte records.
    store.ingest_parquet("images", path, columns=["image"])
    assert rows_of(store, "images") == [row["image"]["bytes"] for row in expected]
    # One bool column alone: records of one byte, 0 or 1.
    store.ingest_parquet("flags", path, columns=["flag"])
    assert rows_of(store, "flags") == [int(row["flag"]) for row in expected]
    # An image stored by its path only cannot be ingested as it is: refused, naming it.
    by_path = tmp_path / "by_path.parquet"
    pq.write_table(pa.table({"image": pa.array([{"bytes": None, "path": "/data/a.jpg"}], type=media), "x": [1]}), by_path)
    with pytest.raises(granary.Error, match=r'row 0, column "image": a media file stored by its path only \("/data/a.jpg"\)'):
        store.ingest_parquet("p", by_path, columns=["image", "x"])


def test_a_hugging_face_image_dataset_arrives_as_its_files(store, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    images = [png_bytes(5, 4, i) for i in range(12)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])})
    hf = datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in images], "label": [i % 3 for i in range(12)]}, features=features
    )
    path = tmp_path / "images.parquet"
    hf.to_parquet(str(path))
    store.ingest_parquet("hub_images", path, columns=["image", "label"])
    got = decoded_rows(store, "hub_images")
    undecoded = hf.cast_column("image", datasets.Image(decode=False))
    for sample, row in zip(got, undecoded):
        assert sample["image"] == row["image"]["bytes"] and sample["label"] == row["label"]


def arrow_table(n, seed):
    """A table of the kinds a training set holds: token lists, text, labels, a nested value."""
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "input_ids": pa.array([rng.integers(0, 50000, int(rng.integers(1, 40))).tolist() for _ in range(n)], type=pa.list_(pa.int32())),
            "text": [f"row {i} ✓" for i in range(n)],
            "label": pa.array(rng.integers(0, 10, n), type=pa.int64()),
            "keep": pa.array([i % 2 == 0 for i in range(n)]),
        }
    )


def test_ingest_arrow_takes_any_arrow_stream_as_parquet_rows(store):
    table = arrow_table(500, 4)
    expected = table.to_pylist()
    # A Table, and a RecordBatchReader of small batches: one record per row, every column.
    store.ingest_arrow("table", table)
    assert [{k: as_python(v) for k, v in s.items() if k != "__key__"} for s in decoded_rows(store, "table")] == expected
    reader = pa.RecordBatchReader.from_batches(table.schema, table.to_batches(max_chunksize=37))
    committed = store.ingest_arrow("reader", reader, columns=["label", "input_ids"])
    assert committed["records"] == 500 and committed["skipped"] == 0
    got = decoded_rows(store, "reader")
    assert [(s["label"], s["input_ids"].tolist()) for s in got] == [(r["label"], r["input_ids"]) for r in expected]
    # One column: token arrays, as from Parquet.
    store.ingest_arrow("tokens", table.select(["input_ids"]))
    assert layout_of(store, "tokens") == "arrays i32"
    assert rows_of(store, "tokens") == [r["input_ids"] for r in expected]


def test_ingest_arrow_streams_a_source_larger_than_its_batches(store):
    # Batches made as they are read: the stream is never whole in memory.
    schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
    made = []

    def batches():
        for b in range(50):
            made.append(b)
            yield pa.record_batch([pa.array([[b, i] for i in range(100)], type=pa.list_(pa.int32()))], schema=schema)

    store.ingest_arrow("streamed", pa.RecordBatchReader.from_batches(schema, batches()))
    assert made == list(range(50))
    assert rows_of(store, "streamed") == [[b, i] for b in range(50) for i in range(100)]


def test_ingest_arrow_refuses_what_is_not_a_stream_and_stream_errors(store):
    with pytest.raises(TypeError, match="offers no Arrow stream"):
        store.ingest_arrow("x", [1, 2, 3])
    with pytest.raises(granary.Error, match=r'no column "nope" \(its columns: input_ids, text, label, keep\)'):
        store.ingest_arrow("x", arrow_table(3, 1), columns=["nope"])
    schema = pa.schema([("t", pa.string())])

    def failing():
        yield pa.record_batch([pa.array(["a", "b"])], schema=schema)
        raise RuntimeError("the producer broke")

    with pytest.raises(granary.Error, match="the Arrow stream's batch 1"):
        store.ingest_arrow("x", pa.RecordBatchReader.from_batches(schema, failing()))
    with pytest.raises(granary.Error, match="no row to ingest"):
        store.ingest_arrow("x", pa.table({"t": pa.array([], type=pa.string())}))
    assert store.datasets() == []


def test_polars_duckdb_and_lance_streams_read_as_their_tables(store, tmp_path):
    table = arrow_table(300, 5)
    expected = [{k: r[k] for k in ("input_ids", "text", "label")} for r in table.to_pylist()]

    def ingested(name):
        return [{k: as_python(s[k]) for k in ("input_ids", "text", "label")} for s in decoded_rows(store, name)]

    polars = pytest.importorskip("polars")
    frame = polars.from_arrow(table)
    store.ingest_arrow("polars", frame, columns=["input_ids", "text", "label"])
    assert ingested("polars") == expected

    duckdb = pytest.importorskip("duckdb")
    rows = table  # the name DuckDB's replacement scan finds
    relation = duckdb.sql("select input_ids, text, label from rows order by label, text")
    ordered = duckdb.sql("select input_ids, text, label from rows order by label, text").arrow()
    if hasattr(ordered, "read_all"):
        ordered = ordered.read_all()
    store.ingest_arrow("duckdb", relation)
    assert ingested("duckdb") == ordered.to_pylist()

    lance = pytest.importorskip("lance")
    lance.write_dataset(table, str(tmp_path / "t.lance"))
    reader = lance.dataset(str(tmp_path / "t.lance")).scanner(columns=["input_ids", "text", "label"]).to_reader()
    store.ingest_arrow("lance", reader)
    assert ingested("lance") == expected


def test_dates_and_times_read_as_pyarrow_reads_them(store, tmp_path):
    import datetime

    n = 30
    micros = [(-1) ** i * i * 86_400_123_457 + i for i in range(n)]
    table = pa.table(
        {
            "ts_s": pa.array([m // 1_000_000 for m in micros], pa.timestamp("s")),
            "ts_ms": pa.array([m // 1_000 for m in micros], pa.timestamp("ms")),
            "ts_us": pa.array(micros, pa.timestamp("us")),
            "ts_ns": pa.array([m * 1_000 + i for i, m in enumerate(micros)], pa.timestamp("ns")),
            "paris": pa.array(micros, pa.timestamp("us", tz="Europe/Paris")),
            "kolkata": pa.array([m // 1_000 for m in micros], pa.timestamp("ms", tz="+05:30")),
            "ny_ns": pa.array([m * 1_000 + 7 for m in micros], pa.timestamp("ns", tz="America/New_York")),
            "day": pa.array([i * 4_000 - 60_000 for i in range(n)], pa.date32()),
            "t_s": pa.array([i * 2_001 for i in range(n)], pa.time32("s")),
            "t_ms": pa.array([i * 2_000_001 for i in range(n)], pa.time32("ms")),
            "t_us": pa.array([i * 2_000_000_003 for i in range(n)], pa.time64("us")),
            "t_ns": pa.array([i * 2_000_000_003_007 for i in range(n)], pa.time64("ns")),
            "d_s": pa.array([(-1) ** i * i * 1_000 for i in range(n)], pa.duration("s")),
            "d_ms": pa.array([i * 1_000_003 for i in range(n)], pa.duration("ms")),
            "d_us": pa.array([-i * 7_000_003 for i in range(n)], pa.duration("us")),
            "d_ns": pa.array([i * 7_000_000_003 for i in range(n)], pa.duration("ns")),
        }
    )
    path = tmp_path / "times.parquet"
    pq.write_table(table, path, row_group_size=7)
    expected = pq.read_table(path).to_pylist()
    store.ingest_parquet("times", path, columns=table.column_names)
    got = rows_of(store, "times")
    assert len(got) == n
    for sample, row in zip(got, expected):
        decoded = granary.formats.decode(sample)
        assert set(decoded) - {"__key__"} == set(row)
        for key, value in row.items():
            assert type(decoded[key]) is type(value) and decoded[key] == value, (key, decoded[key], value)
            if isinstance(value, datetime.datetime) and value.tzinfo is not None:
                assert decoded[key].utcoffset() == value.utcoffset(), key
    # One column alone: the number Arrow holds, in records of its own type.
    for column, dtype in [("ts_ns", np.int64), ("day", np.int32), ("t_ms", np.int32), ("d_us", np.int64)]:
        store.ingest_parquet(f"one-{column}", path, columns=[column])
        (values,) = list(store.loader(f"one-{column}", batch_size=1000, order="sequential", output="numpy"))
        raw = pq.read_table(path).column(column).cast(pa.int32() if dtype is np.int32 else pa.int64()).to_pylist()
        assert values.dtype == dtype and values.reshape(-1).tolist() == raw, column


def test_a_date_python_cannot_hold_is_refused_naming_it(store, tmp_path):
    path = tmp_path / "far.parquet"
    pq.write_table(pa.table({"when": pa.array([0, 400 * 365 * 86_400 * 30], pa.timestamp("s")), "x": [1, 2]}), path)
    with pytest.raises(granary.Error, match=r"far.parquet.*row 1.*when.*outside the years 1-9999"):
        store.ingest_parquet("far", path, columns=["when", "x"])
    assert store.datasets() == []


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_damaged_file_is_refused_or_ingested_as_pyarrow_reads_it(store, tmp_path, compression):
    """The property behind the format doors: a randomly damaged Parquet file is either refused
    (nothing committed) or ingested with every row equal to what pyarrow reads from it. Where
    pyarrow refuses a file granary takes, the rows are the file's own from before the damage:
    arrow-rs passes over a page header's field that holds no value (found: a flipped bit in a
    data page's type tag, which pyarrow's stricter Thrift reader refuses). Never half, never
    different."""
    clean = tmp_path / "clean.parquet"
    pq.write_table(four_columns_table(60, 7), clean, compression=compression, row_group_size=25)
    before = pq.read_table(clean).to_pylist()
    columns = list(FOUR_COLUMNS)
    ingest = lambda name, path: store.ingest_parquet(name, path, columns=columns)  # noqa: E731
    for name, path, what in ingested_damaged_copies(store, ingest, clean, tmp_path, trials=40):
        theirs = outcome(lambda: pq.read_table(path).to_pylist())
        if isinstance(theirs, Exception):
            theirs, what = before, f"{what} (pyarrow refuses it: {theirs!r})"
        got = decoded_rows(store, name)
        assert len(got) == len(theirs), what
        for i, (sample, row) in enumerate(zip(got, theirs)):
            assert {c: as_python(sample[c]) for c in columns} == {c: row[c] for c in columns}, f"{what}: row {i}"
