"""Mosaic Streaming's MDS directories ingest sample for sample as `StreamingDataset` yields
them (issue 43): written by Streaming's own `MDSWriter`, for the common encodings, uncompressed
and compressed, in several shards; one column as records of its own; unsupported encodings and
damaged shards refused. Skipped where mosaicml-streaming is not installed (it needs torch);
`make readme-example` runs it in the torch venv, which installs it."""

import io
import json
from decimal import Decimal
import os
import shutil

import numpy as np
import pytest

import granary
from conftest import ingested_damaged_copies, outcome

streaming = pytest.importorskip("streaming")
PIL = pytest.importorskip("PIL.Image")


def theirs(directory, tmp_path):
    """Every sample StreamingDataset yields for the local directory, in order."""
    os.environ.setdefault("STREAMING_SHM_PREFIX", f"granary{os.getpid()}")
    dataset = streaming.StreamingDataset(local=directory, shuffle=False, batch_size=1)
    try:
        return [dataset[i] for i in range(len(dataset))]
    finally:
        del dataset
        streaming.base.util.clean_stale_shared_memory()


def ours(store, name):
    loader = store.loader(name, batch_size=256, order="sequential", output="numpy")
    out = []
    for batch in loader:
        out.extend(batch if isinstance(batch, list) else [batch])
    return out


def jpeg(i):
    image = PIL.new("RGB", (8 + i % 5, 6), (i % 256, 40, 200))
    out = io.BytesIO()
    image.save(out, format="JPEG")
    return PIL.open(io.BytesIO(out.getvalue()))


COLUMNS = {
    "tokens": "ndarray:int32",
    "matrix": "ndarray",
    "fixed": "ndarray:uint16:2,3",
    "text": "str",
    "raw": "bytes",
    "label": "int",
    "small": "uint8",
    "score": "float32",
    "wide": "float64",
    "count": "str_int",
    "price": "str_decimal",
    "meta": "json",
    "image": "jpeg",
}


def sample(i, rng):
    return {
        "tokens": rng.integers(0, 50000, int(rng.integers(1, 300)), dtype=np.int32),
        "matrix": rng.standard_normal((2, 1 + i % 4)).astype(np.float16 if i % 2 else np.float64),
        "fixed": np.arange(6, dtype=np.uint16).reshape(2, 3) + i,
        "text": f"document {i} ✓",
        "raw": bytes([i % 256]) * (i % 17),
        "label": i - 100,
        "small": np.uint8(i % 256),
        "score": np.float32(i / 7),
        "wide": i / 3,
        "count": i * 1000,
        "price": Decimal(f"{i}.{i:03d}"),
        "meta": {"i": i, "tags": ["a", str(i)]},
        "image": jpeg(i),
    }


def check_equal(granary_sample, their_sample):
    decoded = granary.formats.decode(granary_sample, images=True)
    assert set(decoded) - {"__key__"} == set(their_sample)
    for column, value in their_sample.items():
        mine = decoded[column]
        if isinstance(value, np.ndarray):
            assert mine.dtype == value.dtype and mine.shape == value.shape and np.array_equal(mine, value), column
        elif column == "image":
            assert np.array_equal(np.asarray(mine), np.asarray(value))
        elif column in ("small", "score", "price"):
            # NumPy scalars and Decimals come back as themselves, not as Python numbers.
            assert type(mine) is type(value) and mine == value, column
        else:
            assert mine == value, column


@pytest.mark.parametrize("compression", [None, "zstd", "zstd:7", "gz", "snappy", "br"])
def test_every_sample_equals_what_streaming_dataset_yields(store, tmp_path, compression):
    out = str(tmp_path / "mds")
    rng = np.random.default_rng(1)
    written = [sample(i, rng) for i in range(230)]
    # Small shards: several files, samples in each.
    with streaming.MDSWriter(out=out, columns=COLUMNS, compression=compression, size_limit=1 << 15) as writer:
        for s in written:
            writer.write(s)
    with open(os.path.join(out, "index.json")) as f:
        assert len(json.load(f)["shards"]) > 3
    if compression:
        # What a user who downloaded only the compressed shards has.
        for name in os.listdir(out):
            if name.endswith(".mds"):
                os.remove(os.path.join(out, name))
    expected = theirs(out, tmp_path)
    committed = store.ingest_mds("mds", out)
    assert committed["records"] == 230
    got = ours(store, "mds")
    assert len(got) == len(expected) == 230
    for i, (mine, their) in enumerate(zip(got, expected)):
        assert mine["__key__"] == f"{i:012d}"
        check_equal(mine, their)


def test_one_column_becomes_records_of_its_own(store, tmp_path):
    out = str(tmp_path / "mds")
    rng = np.random.default_rng(2)
    written = [sample(i, rng) for i in range(120)]
    with streaming.MDSWriter(out=out, columns=COLUMNS, compression="zstd", size_limit=1 << 14) as writer:
        for s in written:
            writer.write(s)
    expected = theirs(out, tmp_path)
    store.ingest_mds("tokens", out, columns=["tokens"])
    assert [d["layout"] for d in store.datasets() if d["name"] == "tokens"] == ["arrays i32"]
    loader = store.loader("tokens", batch_size=1000, order="sequential", output="numpy")
    (data, offsets), = list(loader)
    for k, their in enumerate(expected):
        assert np.array_equal(data[offsets[k] : offsets[k + 1]], their["tokens"])
    store.ingest_mds("text", out, columns=["text"])
    (values, offsets), = list(store.loader("text", batch_size=1000, order="sequential", output="numpy"))
    assert [values[offsets[k] : offsets[k + 1]].tobytes().decode() for k in range(120)] == [
        s["text"] for s in expected
    ]
    store.ingest_mds("label", out, columns=["label"])
    (labels,) = list(store.loader("label", batch_size=1000, order="sequential", output="numpy"))
    assert labels.reshape(-1).tolist() == [s["label"] for s in expected]
    # Arrays of two dimensions keep their shape as samples' parts, the column chosen alone too.
    store.ingest_mds("matrix", out, columns=["matrix"])
    matrices = [granary.formats.decode(s) for s in ours(store, "matrix")]
    assert [set(s) for s in matrices] == [{"__key__", "matrix"}] * 120
    for mine, their in zip(matrices, expected, strict=True):
        assert mine["matrix"].dtype == their["matrix"].dtype and np.array_equal(mine["matrix"], their["matrix"])
    # A column whose first array is one-dimensional makes array records, which a later array
    # of two dimensions cannot join.
    mixed = str(tmp_path / "mixed")
    with streaming.MDSWriter(out=mixed, columns={"a": "ndarray:int16"}) as writer:
        writer.write({"a": np.arange(3, dtype=np.int16)})
        writer.write({"a": np.zeros((2, 2), dtype=np.int16)})
    with pytest.raises(granary.Error, match=r"shape \[2, 2\] in a column of one-dimensional arrays"):
        store.ingest_mds("mixed", mixed)
    with pytest.raises(granary.Error, match=r'no column "nope" \(its columns: count, fixed, image'):
        store.ingest_mds("nope", out, columns=["nope"])


def test_raw_pil_images_become_the_arrays_numpy_makes_of_them(store, tmp_path):
    out = str(tmp_path / "pil")
    rng = np.random.default_rng(3)
    images = [
        PIL.fromarray(rng.integers(0, 256, (4, 7), dtype=np.uint8), mode="L"),
        PIL.fromarray(rng.integers(0, 256, (5, 3, 3), dtype=np.uint8), mode="RGB"),
        PIL.fromarray(rng.integers(0, 256, (2, 9, 4), dtype=np.uint8), mode="RGBA"),
        PIL.fromarray(rng.integers(0, 60000, (3, 4), dtype=np.uint16)),
        PIL.fromarray(rng.integers(-(2**31), 2**31 - 1, (3, 2), dtype=np.int32)),
        PIL.fromarray(rng.standard_normal((6, 5)).astype(np.float32)),
        PIL.new("P", (3, 2), 7),
    ]
    assert [image.mode for image in images] == ["L", "RGB", "RGBA", "I;16", "I", "F", "P"]
    with streaming.MDSWriter(out=out, columns={"image": "pil", "n": "int"}, compression="zstd") as writer:
        for n, image in enumerate(images):
            writer.write({"image": image, "n": n})
    expected = theirs(out, tmp_path)
    assert store.ingest_mds("pil", out)["records"] == len(images)
    got = ours(store, "pil")
    for mine, their in zip(got, expected, strict=True):
        decoded = granary.formats.decode(mine)
        want = np.asarray(their["image"])
        assert decoded["image"].dtype == want.dtype and np.array_equal(decoded["image"], want), their["image"].mode
        assert decoded["n"] == their["n"]
    # Chosen alone, images are still samples: an array keeps its shape only as a sample's part.
    store.ingest_mds("one", out, columns=["image"])
    alone = [granary.formats.decode(s) for s in ours(store, "one")]
    assert [set(s) for s in alone] == [{"__key__", "image"}] * len(images)
    assert all(np.array_equal(s["image"], np.asarray(t["image"])) for s, t in zip(alone, expected, strict=True))
    bits = str(tmp_path / "bits")
    with streaming.MDSWriter(out=bits, columns={"image": "pil"}) as writer:
        writer.write({"image": PIL.new("1", (9, 2), 1)})
    with pytest.raises(granary.Error, match='mode "1"'):
        store.ingest_mds("bits", bits)


def test_unsupported_encodings_and_damaged_shards_are_refused(store, tmp_path):
    pickled = str(tmp_path / "pkl")
    with streaming.MDSWriter(out=pickled, columns={"x": "pkl"}) as writer:
        writer.write({"x": {"a": 1}})
    with pytest.raises(granary.Error, match=r'column "x" is encoded as pkl'):
        store.ingest_mds("p", pickled)
    out = str(tmp_path / "mds")
    with streaming.MDSWriter(out=out, columns={"t": "str"}, size_limit=1 << 12) as writer:
        for i in range(400):
            writer.write({"t": f"sample {i:05d} " * 3})
    shard = os.path.join(out, "shard.00001.mds")
    data = bytearray(open(shard, "rb").read())
    # An offset past the end of the file.
    data[8:12] = (len(data) + 100).to_bytes(4, "little")
    open(shard, "wb").write(bytes(data))
    with pytest.raises(granary.Error, match=r"shard.00001.mds: sample 0 at bytes"):
        store.ingest_mds("d", out)
    os.remove(shard)
    with pytest.raises(granary.Error, match=r"shard 1's file shard.00001.mds is missing"):
        store.ingest_mds("d", out)
    shutil.rmtree(out)
    with pytest.raises(granary.Error, match="index.json"):
        store.ingest_mds("d", out)
    assert store.datasets() == []


def write_texts(out, n, **options):
    with streaming.MDSWriter(out=out, columns={"t": "str"}, size_limit=1 << 12, **options) as writer:
        for i in range(n):
            writer.write({"t": f"sample {i:05d} " * 3})


def rewrite_index(out, change):
    path = os.path.join(out, "index.json")
    with open(path) as f:
        index = json.load(f)
    change(index)
    with open(path, "w") as f:
        json.dump(index, f)


def peak_rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_paths_that_leave_the_directory_are_refused(store, tmp_path):
    out = str(tmp_path / "mds")
    write_texts(out, 50)
    outside = tmp_path / "secret.mds"
    shutil.copy(os.path.join(out, "shard.00000.mds"), outside)
    for basename in ["/etc/passwd", "../secret.mds", "a/../../secret.mds"]:
        shutil.copy(os.path.join(out, "index.json"), tmp_path / "index.orig")

        def point(index, basename=basename):
            index["shards"][0]["raw_data"]["basename"] = basename

        rewrite_index(out, point)
        with pytest.raises(granary.Error, match=r"basename .* is not a path inside the dataset's directory"):
            store.ingest_mds("escape", out)
        shutil.copy(tmp_path / "index.orig", os.path.join(out, "index.json"))
    # A link out of the directory is refused too.
    os.symlink(outside, os.path.join(out, "link.mds"))
    rewrite_index(out, lambda index: index["shards"][0]["raw_data"].update(basename="link.mds"))
    with pytest.raises(granary.Error, match=r"leads out of the dataset's directory through a link"):
        store.ingest_mds("escape", out)
    assert store.datasets() == []


def test_a_decompression_bomb_is_refused_at_the_declared_size(store, tmp_path):
    import zstd  # python-zstd, which Streaming itself compresses with

    out = str(tmp_path / "mds")
    write_texts(out, 300, compression="zstd")
    for name in os.listdir(out):
        if name.endswith(".mds"):
            os.remove(os.path.join(out, name))
    # 2 GiB of zeros where the index says a shard of a few KiB decompresses: one frame of 16 MiB
    # of zeros, 128 times over (a reader goes on from frame to frame).
    packed = zstd.compress(bytes(1 << 24), 3) * 128
    with open(os.path.join(out, "shard.00001.mds.zstd"), "wb") as f:
        f.write(packed)
    rewrite_index(out, lambda index: index["shards"][1]["zip_data"].update(bytes=len(packed), hashes={}))
    before = peak_rss_kib()
    with pytest.raises(granary.Error, match=r"shard.00001.mds.zstd: cannot be decompressed: it decompresses to more than"):
        store.ingest_mds("bomb", out)
    # Bounded by the shard it claims to be, far from the bomb's 2 GiB.
    assert peak_rss_kib() - before < 256 << 10
    assert store.datasets() == []


@pytest.mark.parametrize("algorithm", ["sha1", "xxh64", "md5", "sha256", "xxh3_64", "xxh128", "blake2b"])
def test_a_shard_unlike_the_hash_its_writer_recorded_is_refused(store, tmp_path, algorithm):
    out = str(tmp_path / "mds")
    write_texts(out, 300, hashes=[algorithm])
    with open(os.path.join(out, "index.json")) as f:
        assert algorithm in json.load(f)["shards"][1]["raw_data"]["hashes"]
    # The writer's own hashes pass.
    assert store.ingest_mds("ok", out)["records"] == 300
    shard = os.path.join(out, "shard.00001.mds")
    data = bytearray(open(shard, "rb").read())
    data[-3] ^= 0x01  # one bit of a sample's text: the shard's layout still reads
    open(shard, "wb").write(bytes(data))
    with pytest.raises(granary.Error, match=rf"shard.00001.mds's {algorithm} is [0-9a-f]+ where the index records"):
        store.ingest_mds("damaged", out)
    assert [d["name"] for d in store.datasets()] == ["ok"]


def png(i):
    image = PIL.new("RGBA", (3 + i % 4, 5), (i % 256, 9, 30, 200))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return PIL.open(io.BytesIO(out.getvalue()))


def test_lists_of_images_arrive_as_lists_streaming_yields(store, tmp_path):
    out = str(tmp_path / "lists")
    rng = np.random.default_rng(5)
    columns = {"shots": "jpeg_array", "jpegs": "list[jpeg]", "pngs": "list[png]", "raw": "list[pil]", "n": "int"}
    with streaming.MDSWriter(out=out, columns=columns, compression="zstd", size_limit=1 << 14) as writer:
        for n in range(24):
            writer.write(
                {
                    # jpeg_array takes the files' bytes; the lists take images.
                    "shots": [jpeg(n + k).fp.getvalue() for k in range(1 + n % 3)],
                    "jpegs": [jpeg(n + k) for k in range(n % 4)],
                    "pngs": [png(n + k) for k in range(1 + n % 2)],
                    "raw": [PIL.fromarray(rng.integers(0, 256, (2 + k, 3, 3), dtype=np.uint8), mode="RGB") for k in range(n % 3)],
                    "n": n,
                }
            )
    expected = theirs(out, tmp_path)
    assert store.ingest_mds("lists", out)["records"] == 24
    got = ours(store, "lists")
    for mine, their in zip(got, expected, strict=True):
        assert set(mine) == {"__key__", "shots.jpg.list", "jpegs.jpg.list", "pngs.png.list", "raw.npy.list", "n.cls"}
        decoded = granary.formats.decode(mine, images=True)
        for column in ("shots", "jpegs", "pngs"):
            assert len(decoded[column]) == len(their[column]), column
            for image, want in zip(decoded[column], their[column]):
                assert image.format == want.format and np.array_equal(np.asarray(image), np.asarray(want)), column
        assert [a.shape for a in decoded["raw"]] == [np.asarray(w).shape for w in their["raw"]]
        assert all(np.array_equal(a, np.asarray(w)) for a, w in zip(decoded["raw"], their["raw"]))
        assert decoded["n"] == their["n"]
    # Without images=True, the files' bytes, as written.
    plain = granary.formats.decode(got[5])
    assert all(isinstance(b, bytes) and b[:2] == b"\xff\xd8" for b in plain["shots"])


def test_a_list_whose_lengths_run_past_its_value_is_refused(store, tmp_path):
    out = str(tmp_path / "lists")
    with streaming.MDSWriter(out=out, columns={"shots": "jpeg_array"}) as writer:
        writer.write({"shots": [b"\xff\xd8one", b"\xff\xd8two"]})
        writer.write({"shots": [b"\xff\xd8three"]})
    shard = os.path.join(out, "shard.00000.mds")
    data = bytearray(open(shard, "rb").read())
    at = data.index(b"\x02\x00\x00\x00" + (5).to_bytes(4, "little"))  # sample 0's count, then its first length
    data[at + 4 : at + 8] = (1 << 30).to_bytes(4, "little")
    open(shard, "wb").write(bytes(data))
    with pytest.raises(granary.Error, match=r"shard.00000.mds.*element 0 of the list runs past its value"):
        store.ingest_mds("bad", out)
    assert store.datasets() == []


def theirs_each(directory):
    """What StreamingDataset yields for each sample of the local directory, or what it raises."""
    dataset = streaming.StreamingDataset(local=directory, shuffle=False, batch_size=1)
    try:
        return [outcome(lambda i=i: dataset[i]) for i in range(len(dataset))]
    finally:
        del dataset
        streaming.base.util.clean_stale_shared_memory()


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_damaged_directory_is_refused_or_ingested_as_streaming_reads_it(store, tmp_path, compression):
    """The property behind the format doors: a randomly damaged MDS directory is either refused
    (nothing committed) or ingested so that every sample decodes to what StreamingDataset yields
    for it, or fails to decode where StreamingDataset's fails. Never half, never different."""
    columns = {"tokens": "ndarray:int32", "text": "str", "label": "int", "raw": "bytes", "meta": "json", "score": "float32"}
    clean = tmp_path / "clean"
    with streaming.MDSWriter(out=str(clean), columns=columns, compression=compression, size_limit=1 << 11) as writer:
        for i in range(30):
            writer.write(
                {
                    "tokens": np.arange(1 + i % 7, dtype=np.int32) * i,
                    "text": f"document {i} ✓",
                    "label": i - 10,
                    "raw": bytes([i]) * (i % 5),
                    "meta": {"i": i},
                    "score": np.float32(i / 4),
                }
            )
    for name, directory, what in ingested_damaged_copies(store, store.ingest_mds, clean, tmp_path, trials=30):
        mine = ours(store, name)
        their = outcome(lambda: theirs_each(str(directory)))
        assert not isinstance(their, Exception), f"{what}: granary ingested what Streaming refuses: {their!r}"
        assert len(mine) == len(their), what
        for i, (m, t) in enumerate(zip(mine, their)):
            decoded = outcome(lambda: granary.formats.decode(m, images=True))
            if isinstance(decoded, Exception) or isinstance(t, Exception):
                assert isinstance(decoded, Exception) and isinstance(t, Exception), f"{what}: sample {i}"
                continue
            try:
                check_equal(m, t)
            except AssertionError as e:
                raise AssertionError(f"{what}: sample {i}: {e}") from e
