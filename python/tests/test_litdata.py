"""LitData's optimized directories ingest item for item as LitData's `StreamingDataset` yields
them (issue 43): written by `litdata.optimize` itself, for its common serializers, uncompressed
and zstd-compressed at each of its levels (the whole chunk, batches of items, each item); one
leaf as records of its own; unsupported serializers and damaged chunks refused. Skipped where
litdata is not installed (it needs torch); `make readme-example` runs it in the torch venv."""

import os

import numpy as np
import pytest

import granary
from conftest import ingested_damaged_copies, outcome

litdata = pytest.importorskip("litdata")
torch = pytest.importorskip("torch")


def item(i):
    return {
        "tokens": (np.arange(1 + i % 9, dtype=np.int32) * 7 + i),
        "matrix": np.full((2, 1 + i % 3), i / 4, dtype=np.float32),
        "ids": torch.arange(1 + i % 5, dtype=torch.int64) + i,
        "grid": torch.ones((2, 2), dtype=torch.int16) * i,
        "text": f"item {i} ✓",
        "label": i - 20,
        "score": i / 3,
        "raw": bytes([i % 256]) * (i % 4),
        "flag": i % 2 == 0,
    }


def text_item(i):
    """The usual text dataset's item: a dict of str, int, float and bool."""
    return {"text": f"document {i} ✓ " * (1 + i % 5), "label": i % 7 - 3, "score": i / 3, "ok": i % 2 == 0}


def token_document(i):
    """A document of token ids, as a tokenizer's output fed to TokensLoader."""
    return torch.arange(i * 100, i * 100 + 3 + i % 11, dtype=torch.int32)


def pickled(i):
    return {"x": {i, i + 1}}


def optimize(out, fn=item, n=120, **options):
    litdata.optimize(fn=fn, inputs=list(range(n)), output_dir=str(out), chunk_bytes="4KB", num_workers=1, **options)
    return str(out)


def theirs(directory):
    dataset = litdata.StreamingDataset(input_dir=directory)
    return [dataset[i] for i in range(len(dataset))]


def ours(store, name):
    out = []
    for batch in store.loader(name, batch_size=256, order="sequential", output="numpy"):
        out.extend(batch)
    return out


def as_numpy(value):
    return value.numpy() if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize(
    "options",
    [{}, {"compression": "zstd"}, {"compression": "zstd", "compression_level": "chunk"}, {"compression": "zstd", "compression_level": "sample"}],
    ids=["plain", "zstd-batch", "zstd-chunk", "zstd-sample"],
)
def test_every_item_equals_what_streaming_dataset_yields(store, tmp_path, options):
    directory = optimize(tmp_path / "lit", **options)
    expected = theirs(directory)
    committed = store.ingest_litdata("lit", directory)
    assert committed["records"] == 120
    got = ours(store, "lit")
    assert len(got) == len(expected) == 120
    for i, (mine, their) in enumerate(zip(got, expected)):
        assert mine["__key__"] == f"{i:012d}"
        decoded = granary.formats.decode(mine)
        assert set(decoded) - {"__key__"} == set(their)
        for key, value in their.items():
            value = as_numpy(value)
            if isinstance(value, np.ndarray):
                assert decoded[key].dtype == value.dtype and decoded[key].shape == value.shape, key
                assert np.array_equal(decoded[key], value), key
            else:
                if isinstance(value, memoryview):  # LitData hands some bytes over as a view
                    value = bytes(value)
                assert type(decoded[key]) is type(value) and decoded[key] == value, key


def test_one_leaf_becomes_records_of_its_own(store, tmp_path):
    directory = optimize(tmp_path / "lit", compression="zstd")
    expected = theirs(directory)
    store.ingest_litdata("tokens", directory, columns=["tokens"])
    assert [d["layout"] for d in store.datasets() if d["name"] == "tokens"] == ["arrays i32"]
    (data, offsets), = list(store.loader("tokens", batch_size=1000, order="sequential", output="numpy"))
    for k, their in enumerate(expected):
        assert np.array_equal(data[offsets[k] : offsets[k + 1]], their["tokens"])
    store.ingest_litdata("label", directory, columns=["label"])
    (labels,) = list(store.loader("label", batch_size=1000, order="sequential", output="numpy"))
    assert labels.reshape(-1).tolist() == [t["label"] for t in expected]
    with pytest.raises(granary.Error, match="several dimensions"):
        store.ingest_litdata("matrix", directory, columns=["matrix"])
    with pytest.raises(granary.Error, match=r'no leaf "nope"'):
        store.ingest_litdata("nope", directory, columns=["nope"])


def test_unsupported_serializers_and_damaged_chunks_are_refused(store, tmp_path):
    directory = optimize(tmp_path / "pickled", fn=pickled, n=5)
    with pytest.raises(granary.Error, match=r'leaf "x" was serialized as pickle'):
        store.ingest_litdata("p", directory)
    directory = optimize(tmp_path / "lit")
    chunks = sorted(f for f in os.listdir(directory) if f.endswith(".bin"))
    assert len(chunks) > 2
    path = os.path.join(directory, chunks[1])
    data = bytearray(open(path, "rb").read())
    data[8:12] = (len(data) + 50).to_bytes(4, "little")  # item 0 ends past the file
    open(path, "wb").write(bytes(data))
    with pytest.raises(granary.Error, match=chunks[1] + r": item 0 at bytes"):
        store.ingest_litdata("d", directory)
    os.remove(path)
    with pytest.raises(granary.Error, match=f"chunk 1's file {chunks[1]} is missing"):
        store.ingest_litdata("d", directory)
    assert store.datasets() == []


@pytest.mark.parametrize("options", [{}, {"compression": "zstd"}], ids=["plain", "zstd"])
def test_arrow_footer_chunks_of_text_items_equal_what_streaming_dataset_yields(store, tmp_path, options):
    pytest.importorskip("pyarrow")  # LitData writes its Arrow footer only where pyarrow is installed
    directory = optimize(tmp_path / "text", fn=text_item, n=300, **options)
    chunks = sorted(f for f in os.listdir(directory) if f.endswith(".bin"))
    assert len(chunks) >= 2
    for name in chunks:
        with open(os.path.join(directory, name), "rb") as f:
            assert f.read()[-8:] == b"LDARW01\0", name  # the footer this test is about
    expected = theirs(directory)
    store.ingest_litdata("text", directory)
    got = [granary.formats.decode(s) for s in ours(store, "text")]
    assert len(got) == len(expected) == 300
    for mine, their in zip(got, expected):
        assert set(mine) - {"__key__"} == set(their)
        for key, value in their.items():
            assert type(mine[key]) is type(value) and mine[key] == value, key
    # One key alone: byte records of the texts; bools as one byte.
    store.ingest_litdata("texts", directory, columns=["text"])
    assert [bytes(r) for b in store.loader("texts", batch_size=1000, order="sequential", output="numpy") for r in _records(b)] == [
        t["text"].encode() for t in expected
    ]


def _records(batch):
    data, offsets = batch
    return [data[offsets[k] : offsets[k + 1]] for k in range(len(offsets) - 1)]


@pytest.mark.parametrize("block_size", [None, 16, 64])
def test_tokens_loader_directories_read_as_litdata_reads_them(store, tmp_path, block_size):
    from litdata.streaming.item_loader import TokensLoader

    directory = optimize(tmp_path / "tokens", fn=token_document, n=200, item_loader=TokensLoader())
    if block_size is None:
        # The documents the writer wrote.
        store.ingest_litdata("docs", directory)
        got = [r.tolist() for b in store.loader("docs", batch_size=1000, order="sequential", output="numpy") for r in _records(b)]
        assert got == [token_document(i).tolist() for i in range(200)]
        return
    dataset = litdata.StreamingDataset(input_dir=directory, item_loader=TokensLoader(block_size=block_size))
    expected = [dataset[i].numpy() for i in range(len(dataset))]
    committed = store.ingest_litdata("blocks", directory, block_size=block_size)
    assert committed["records"] == len(expected) > 0
    got = np.concatenate([b for b in store.loader("blocks", batch_size=4096, order="sequential", output="numpy")])
    assert got.dtype == np.int32 and got.shape == (len(expected), block_size)
    assert np.array_equal(got, np.stack(expected))
    with pytest.raises(ValueError, match="block_size"):
        store.ingest_litdata("x", directory, block_size=0)
    with pytest.raises(granary.Error, match="has no leaves to choose"):
        store.ingest_litdata("x", directory, columns=["a"])


def peak_rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


# 2 GiB of zeros: one zstd frame of 16 MiB of zeros (its header says so), 128 times over (a
# reader goes on from frame to frame).
def bomb():
    import zstd  # python-zstd, as Streaming's test of the same uses

    return zstd.compress(bytes(1 << 24), 3) * 128


def refused_within_bounds(store, directory, message):
    """The ingest of `directory` fails with `message`, commits nothing, and its peak memory stays
    within 256 MiB above where it began (far from a bomb's 2 GiB)."""
    before = peak_rss_kib()
    with pytest.raises(granary.Error, match=message):
        store.ingest_litdata("bomb", directory)
    assert peak_rss_kib() - before < 256 << 10
    assert store.datasets() == []


def test_a_whole_chunk_bomb_is_refused_at_the_index_s_chunk_bytes(store, tmp_path):
    directory = optimize(tmp_path / "lit", compression="zstd", compression_level="chunk")
    chunks = sorted(f for f in os.listdir(directory) if f.endswith(".zstd.bin"))
    assert len(chunks) > 2
    with open(os.path.join(directory, chunks[1]), "wb") as f:
        f.write(bomb())
    # Bounded by the chunk the index says it is (4 KB).
    refused_within_bounds(store, directory, chunks[1] + r": it decompresses to more than the \d+ bytes it claims")


def test_an_item_bomb_is_refused_at_its_frame_s_size(store, tmp_path):
    directory = optimize(tmp_path / "lit", compression="zstd", compression_level="sample")
    chunks = sorted(f for f in os.listdir(directory) if f.endswith(".bin"))
    path = os.path.join(directory, chunks[1])
    data = open(path, "rb").read()
    n = int.from_bytes(data[:4], "little")
    offsets = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "little") for i in range(n + 1)]
    # Item 0's frame replaced by the bomb, the offsets after it moved along.
    packed = bomb()
    items = [packed] + [data[offsets[i] : offsets[i + 1]] for i in range(1, n)]
    moved = [offsets[0]]
    for item_bytes in items:
        moved.append(moved[-1] + len(item_bytes))
    with open(path, "wb") as f:
        f.write(n.to_bytes(4, "little") + b"".join(o.to_bytes(4, "little") for o in moved) + b"".join(items))
    refused_within_bounds(store, directory, chunks[1] + r": item 0: it decompresses to more than the 16777216 bytes")


def test_a_frame_claiming_more_than_its_items_is_refused_before_it_is_read(store, tmp_path):
    directory = optimize(tmp_path / "lit", compression="zstd")
    chunks = sorted(f for f in os.listdir(directory) if f.endswith(".bin"))
    path = os.path.join(directory, chunks[1])
    data = bytearray(open(path, "rb").read())
    assert data[:8] == b"LDFZ01\0\0"
    count = int.from_bytes(data[12:16], "little")
    raw_len_at = 24 + 4 * (count + 1) + 20  # frame 0's raw length
    data[raw_len_at : raw_len_at + 4] = (0xFFFFFFF0).to_bytes(4, "little")
    open(path, "wb").write(bytes(data))
    with pytest.raises(granary.Error, match=chunks[1] + r": its frames hold \d+ bytes where its offsets end at \d+"):
        store.ingest_litdata("lying", directory)
    assert store.datasets() == []


def small_item(i):
    return {"tokens": np.arange(1 + i % 5, dtype=np.int32) + i, "text": f"item {i}", "label": i - 3, "raw": bytes([i]) * (i % 3)}


@pytest.mark.parametrize("fn,options", [(small_item, {}), (text_item, {"compression": "zstd"})], ids=["leaves", "footer-zstd"])
def test_a_damaged_directory_is_refused_or_ingested_as_litdata_reads_it(store, tmp_path, fn, options):
    """The property behind the format doors: a randomly damaged LitData directory is either
    refused (nothing committed) or ingested so that every item decodes to what LitData's
    StreamingDataset yields for it, or fails to decode where LitData's fails. Never half, never
    different."""
    if fn is text_item:
        pytest.importorskip("pyarrow")
    clean = tmp_path / "clean"
    litdata.optimize(fn=fn, inputs=list(range(24)), output_dir=str(clean), chunk_bytes="1KB", num_workers=1, **options)
    for name, directory, what in ingested_damaged_copies(store, store.ingest_litdata, clean, tmp_path, trials=30):
        dataset = outcome(lambda: litdata.StreamingDataset(input_dir=str(directory)))
        assert not isinstance(dataset, Exception), f"{what}: granary ingested what LitData refuses: {dataset!r}"
        mine = ours(store, name)
        assert len(mine) == len(dataset), what
        for i, m in enumerate(mine):
            their = outcome(lambda: dataset[i])
            decoded = outcome(lambda: granary.formats.decode(m))
            if isinstance(decoded, Exception) or isinstance(their, Exception):
                assert isinstance(decoded, Exception) and isinstance(their, Exception), f"{what}: item {i}: {decoded!r} {their!r}"
                continue
            assert set(decoded) - {"__key__"} == set(their), f"{what}: item {i}"
            for key, value in their.items():
                value = as_numpy(value)
                if isinstance(value, memoryview):
                    value = bytes(value)
                if isinstance(value, np.ndarray):
                    assert np.array_equal(decoded[key], value) and decoded[key].dtype == value.dtype, f"{what}: item {i}: {key}"
                else:
                    assert type(decoded[key]) is type(value) and decoded[key] == value, f"{what}: item {i}: {key}"
