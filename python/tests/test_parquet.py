"""Parquet files ingest row for row as pyarrow reads them (issue 43): token lists, binary and
string columns, numbers, several columns as samples, nulls refused or skipped, row groups,
compression codecs, directories and glob patterns. Skipped where pyarrow is not installed;
`make python-env` installs it."""

import numpy as np
import pytest

import granary

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
    nested = tmp_path / "nested.parquet"
    pq.write_table(pa.table({"m": pa.array([{"k": 1}])}), nested)
    with pytest.raises(granary.Error, match="only binary, strings, numbers and lists of numbers"):
        store.ingest_parquet("t", nested)
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
