"""Ingest from Python: byte records with offsets, files, directories and tars, dtypes and byte
order, progress and a failing ingest, Megatron indexed datasets, re-ingest intent, tar members
that are not files, Python-style arguments, and the command line shipped in the package."""

import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

import granary

from conftest import RECORD, records, write_megatron


def test_byte_records_come_with_offsets(store):
    data = [bytes([i % 251]) * (1 + i * 7 % 300) for i in range(200)]
    store.ingest("blobs", data)
    loader = store.loader("blobs", batch_size=16, seed=2, output="numpy", with_indices=True)
    n = 0
    for indices, (values, offsets) in loader:
        assert values.dtype == np.uint8 and offsets.dtype == np.int64
        assert len(offsets) == len(indices) + 1 and offsets[0] == 0 and offsets[-1] == len(values)
        for k, index in enumerate(indices.tolist()):
            assert values[offsets[k] : offsets[k + 1]].tobytes() == data[index]
            n += 1
    assert n == 200

def test_ingest_files_directories_and_tars(store, tmp_path):
    tokens = np.arange(RECORD * 50, dtype=np.uint16)
    (tmp_path / "train.bin").write_bytes(tokens.tobytes())
    out = store.ingest_files("bin", tmp_path / "train.bin", dtype=np.uint16, shape=[RECORD])
    assert out["records"] == 50 and out["version"] == 1
    loader = store.loader("bin", batch_size=50, order="sequential", output="numpy")
    (batch,) = list(loader)
    assert np.array_equal(batch.reshape(-1), tokens)

    files = tmp_path / "files"
    (files / "sub").mkdir(parents=True)
    (files / "a.txt").write_bytes(b"alpha")
    (files / "sub" / "b.txt").write_bytes(b"beta")
    assert store.ingest_files("docs", files)["records"] == 2

    tar_path = tmp_path / "shard-000.tar"
    with tarfile.open(tar_path, "w") as tar:
        for key in ("s0", "s1", "s2"):
            for ext, payload in (("txt", key.encode()), ("cls", b"1")):
                member = tmp_path / f"{key}.{ext}"
                member.write_bytes(payload)
                tar.add(member, arcname=f"{key}.{ext}")
    assert store.ingest_tars("wds", [tar_path])["records"] == 3
    names = {d["name"]: d for d in store.datasets()}
    assert set(names) == {"bin", "docs", "wds"}
    assert names["bin"]["records"] == 50 and names["wds"]["records"] == 3
    # Samples come back as WebDataset gives them: one dict per sample.
    loader = store.loader("wds", batch_size=2, order="sequential", with_indices=True)
    assert loader._native.layout == "samples"
    batches = list(loader)
    assert [len(samples) for _, samples in batches] == [2, 1]
    got = {int(i): s for indices, samples in batches for i, s in zip(indices.tolist(), samples)}
    assert got == {
        0: {"__key__": "s0", "txt": b"s0", "cls": b"1"},
        1: {"__key__": "s1", "txt": b"s1", "cls": b"1"},
        2: {"__key__": "s2", "txt": b"s2", "cls": b"1"},
    }
    with pytest.raises(ValueError, match="decoded in host memory"):
        store.loader("wds", batch_size=2, device="cuda")

def test_arrays_of_another_dtype_or_byte_order_are_refused(store):
    # The engine's short names, NumPy's names and NumPy types all name the same dtype.
    for name in ("u16", "uint16", np.uint16):
        store.ingest("a", [np.arange(4, dtype=np.uint16)], dtype=name, shape=[4], replace=True)
    with pytest.raises(ValueError, match="record 1: an array of dtype int16, but the records are uint16"):
        store.ingest("a", [np.zeros(4, np.uint16), np.zeros(4, np.int16)], dtype="u16", shape=[4])
    with pytest.raises(ValueError, match="record 0: an array of non-native byte order"):
        store.ingest("b", [np.arange(4, dtype=">f4")], dtype="float32", shape=[4])
    # Bytes carry no dtype: taken as they are.
    store.ingest("c", [bytes(8)], dtype="f32", shape=[2])
    assert {d["name"] for d in store.datasets()} == {"a", "c"}
    (batch,) = list(store.loader("a", batch_size=1, output="numpy"))
    assert batch.tolist() == [[0, 1, 2, 3]]

def test_progress_is_reported_and_a_raising_callback_commits_nothing(store, tmp_path):
    calls = []
    store.ingest("p", (bytes(1000) for _ in range(50)), progress=lambda n, b: calls.append((n, b)))
    assert calls and calls[-1] == (50, 50_000)

    def boom(n, b):
        raise KeyError("stop")

    with pytest.raises(KeyError):
        store.ingest("p", (bytes(10) for _ in range(5)), progress=boom)
    (tmp_path / "t.bin").write_bytes(bytes(RECORD * 2 * 10))
    with pytest.raises(KeyError):
        store.ingest_files("q", tmp_path / "t.bin", dtype="uint16", shape=[RECORD], progress=boom)
    names = {d["name"]: d for d in store.datasets()}
    assert names["p"]["version"] == 1, "the failed ingest published a version"
    assert "q" not in names

def test_an_ingest_that_fails_midway_leaves_no_files_behind(store):
    store.ingest("a", [bytes([i]) * 100 for i in range(100)], shard_bytes=4096)
    root = os.path.join(store.path, "shards")

    def files():
        return sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)

    before = files()

    def failing():
        for i in range(200):
            yield bytes([i % 251]) * 1000
        raise RuntimeError("the source failed")

    with pytest.raises(RuntimeError, match="the source failed"):
        store.ingest("b", failing(), shard_bytes=4096)
    # Dozens of shards were published along the way; none are left, nor the partial one.
    assert files() == before
    assert os.listdir(os.path.join(store.path, "tmp")) == []
    assert [d["name"] for d in store.datasets()] == ["a"]

def test_dtypes_take_the_cli_names_too(store):
    data = records(4)
    store.ingest("short-names", data, dtype="u16", shape=[RECORD])
    loader = store.loader("short-names", batch_size=4, output="numpy", order="sequential")
    (batch,) = list(loader)
    assert batch.dtype == np.uint16 and (batch == np.stack(data)).all()

def _read_megatron(prefix, i):
    """Sequence `i` as Megatron's IndexedDataset returns it: a view of the memory-mapped `.bin`."""
    import struct

    with open(f"{prefix}.idx", "rb") as f:
        raw = f.read()
    code = raw[17]
    dtype = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}[code]
    count = struct.unpack_from("<Q", raw, 18)[0]
    lengths = np.frombuffer(raw, dtype=np.int32, count=count, offset=34)
    pointers = np.frombuffer(raw, dtype=np.int64, count=count, offset=34 + 4 * count)
    data = np.memmap(f"{prefix}.bin", dtype=np.uint8, mode="r")
    return np.frombuffer(data, dtype=dtype, count=int(lengths[i]), offset=int(pointers[i]))

def test_a_megatron_indexed_dataset_reads_back_as_megatron_reads_it(store, tmp_path):
    rng = np.random.default_rng(5)
    sequences = [rng.integers(0, 50000, int(rng.integers(0, 300)), dtype=np.uint16) for _ in range(257)]
    prefix = str(tmp_path / "corpus_text_document")
    # Documents of several sequences (Megatron's sentence-split preprocessing) stay sequences.
    write_megatron(prefix, sequences, np.uint16, 8, documents=[0, 3, 100, 257])
    committed = store.ingest_megatron("corpus", prefix + ".bin")
    assert committed["records"] == 257
    assert [d["layout"] for d in store.datasets() if d["name"] == "corpus"] == ["arrays u16"]
    loader = store.loader("corpus", batch_size=16, order="sequential", output="numpy", with_indices=True)
    seen = 0
    for indices, (data, offsets) in loader:
        assert data.dtype == np.uint16 and offsets[0] == 0 and offsets[-1] == len(data)
        for k, i in enumerate(indices.tolist()):
            assert np.array_equal(data[offsets[k] : offsets[k + 1]], _read_megatron(prefix, i)), i
            seen += 1
    assert seen == 257
    # Widened for an embedding in the same pass.
    loader = store.loader("corpus", batch_size=16, order="sequential", output="numpy", dtype="int64")
    data, offsets = next(iter(loader))
    assert data.dtype == np.int64 and np.array_equal(data[offsets[1] : offsets[2]], sequences[1].astype(np.int64))

    # int32 tokens too.
    write_megatron(str(tmp_path / "wide"), [np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int32)], np.int32, 4)
    store.ingest_megatron("wide", tmp_path / "wide")
    data, offsets = next(iter(store.loader("wide", batch_size=2, order="sequential", output="numpy")))
    assert data.dtype == np.int32 and offsets.tolist() == [0, 5, 8]

def test_a_damaged_or_unsupported_megatron_index_is_refused_before_anything_is_written(store, tmp_path):
    prefix = str(tmp_path / "c")
    write_megatron(prefix, [np.arange(10, dtype=np.uint16)] * 4, np.uint16, 8)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(40)
    with pytest.raises(granary.Error, match="not a Megatron index"):
        store.ingest_megatron("c", prefix)
    write_megatron(prefix, [np.arange(10, dtype=np.uint16)] * 4, np.uint16, 8)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(50)
    with pytest.raises(granary.Error, match="runs past the end"):
        store.ingest_megatron("c", prefix)
    write_megatron(prefix, [np.arange(10, dtype=np.uint16)] * 4, np.uint16, 8, modes=True)
    with pytest.raises(granary.Error, match="multimodal"):
        store.ingest_megatron("c", prefix)
    write_megatron(prefix, [], np.uint16, 8)
    with pytest.raises(granary.Error, match="no sequences"):
        store.ingest_megatron("c", prefix)
    assert all(d["name"] != "c" for d in store.datasets())

def test_the_same_ingest_twice_changes_nothing_and_a_different_one_asks_for_intent(store):
    data = records(100)
    first = store.ingest("t", data, dtype="uint16", shape=[RECORD])
    assert first["version"] == 1 and not first["unchanged"]
    again = store.ingest("t", data, dtype="uint16", shape=[RECORD])
    assert again["version"] == 1 and again["unchanged"] and again["records"] == 100
    assert again["records_added"] == 0 and again["bytes_added"] == 0, again
    # The same records cut into other shards: refused, saying that they may already be there.
    with pytest.raises(granary.IngestIntentError, match="if only the shard size differs, its records are already"):
        store.ingest("t", data, dtype="uint16", shape=[RECORD], shard_bytes=4096)
    more = records(10, seed=3)
    with pytest.raises(granary.IngestIntentError, match="mode='append'.*mode='replace'") as caught:
        store.ingest("t", more, dtype="uint16", shape=[RECORD])
    assert caught.value.kind == "ingest_intent" and "t@1: 100 records" in str(caught.value)
    assert [(d["name"], d["version"], d["records"]) for d in store.datasets()] == [("t", 1, 100)]
    assert store.ingest("t", more, dtype="uint16", shape=[RECORD], mode="append")["records"] == 110
    assert store.ingest("t", more, dtype="uint16", shape=[RECORD], replace=True)["records"] == 10
    with pytest.raises(ValueError, match="mode='banana'"):
        store.ingest("t", more, dtype="uint16", shape=[RECORD], mode="banana")

def test_tar_members_that_are_not_files_are_listed_and_warned_about(store, tmp_path):
    tar_path = tmp_path / "links.tar"
    with tarfile.open(tar_path, "w") as tar:
        member = tmp_path / "s0.txt"
        member.write_bytes(b"s0")
        tar.add(member, arcname="s0.txt")
        link = tarfile.TarInfo("s1.txt")
        link.type = tarfile.SYMTYPE
        link.linkname = "s0.txt"
        tar.addfile(link)
    with pytest.warns(UserWarning, match="1 tar members not ingested, as 's1.txt'"):
        out = store.ingest_tars("wds", tar_path)
    assert out["records"] == 1
    assert [(s["member"], "link" in s["reason"]) for s in out["skipped"]] == [("s1.txt", True)]

def test_the_command_line_runs_from_the_package(store, tmp_path):
    """`pip install` puts `granary` on the PATH as `granary._cli:main`: the same commands, run
    by the extension in a Python process."""
    store.ingest("t", records(10), dtype="uint16", shape=[RECORD])
    run = lambda *args: subprocess.run(
        [sys.executable, "-m", "granary._cli", "--root", str(store.path), *args], capture_output=True, text=True
    )
    out = run("ls")
    assert out.returncode == 0 and "uint16" not in out.stderr and " 10 " in out.stdout, out
    out = run("get", "t", "99")
    assert out.returncode == 1 and out.stderr.startswith("granary: error: record 99 is out of range"), out
    out = run("no-such-command")
    assert out.returncode == 2 and "no-such-command" in out.stderr, out
    assert run("--version").returncode == 0

def test_ingest_arguments_speak_python(store, tmp_path):
    data = records(4)
    # A bare int is a one-dimensional shape.
    assert store.ingest("a", data, dtype="uint16", shape=RECORD)["records"] == 4
    for bad in (0, -3, [RECORD, 0], "64"):
        with pytest.raises(ValueError, match="shape must be a positive int"):
            store.ingest("b", data, dtype="uint16", shape=bad)
    with pytest.raises(ValueError, match="shard_bytes must be a positive number of bytes"):
        store.ingest("b", data, dtype="uint16", shape=RECORD, shard_bytes=-1)
    (tmp_path / "odd.bin").write_bytes(b"x" * (RECORD * 2 + 3))
    with pytest.raises(granary.Error, match="drop_remainder=True"):
        store.ingest_files("c", tmp_path / "odd.bin", dtype="uint8", shape=[RECORD])
