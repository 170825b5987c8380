"""granary as a Grain source (issue 43): Grain's own samplers, datasets and workers read a
`granary.grain.DataSource` record for record; granary's loader as a Grain iterator gives the
same batches as the loader itself and resumes exactly from `get_state`. Skipped where grain is
not installed; `make python-env` installs it."""

import json
import os

import numpy as np
import pytest

import granary
import granary.grain
from conftest import write_megatron

grain = pytest.importorskip("grain")


def documents(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50000, int(rng.integers(1, 100)), dtype=np.uint16) for _ in range(n)]


def ingest_documents(store, tmp_path, name, docs, **options):
    """`docs` as a dataset of uint16 arrays (a Megatron corpus ingested)."""
    prefix = str(tmp_path / f"{name}-{len(docs)}")
    write_megatron(prefix, docs, np.uint16, 8)
    store.ingest_megatron(name, prefix, **options)


def test_a_data_source_gives_every_record_to_grains_samplers_and_workers(store, tmp_path):
    docs = documents(300)
    ingest_documents(store, tmp_path, "docs", docs)
    source = granary.grain.DataSource(store, "docs")
    assert len(source) == 300 and source.spec == "docs@1"
    assert np.array_equal(source[7], docs[7]) and np.array_equal(source[-1], docs[-1])
    with pytest.raises(IndexError):
        source[300]
    # Issue 55: an index that is not an integer is a TypeError, as a list's, not record 1 or 5.
    for index in (1.9, "5", None):
        with pytest.raises(TypeError):
            source[index]
    with pytest.raises(TypeError):
        source.__getitems__([0, 2.5])
    assert np.array_equal(source[np.int64(7)], docs[7])
    # Pinned: a later version does not change what it reads.
    ingest_documents(store, tmp_path, "docs", documents(5, 9), mode="replace")
    assert len(source) == 300 and np.array_equal(source[0], docs[0])
    assert repr(source) == f"granary.grain.DataSource({store.path!r}, 'docs@1')"

    # Grain's MapDataset: shuffled by Grain, each element the record it names.
    ds = grain.MapDataset.range(len(source)).shuffle(seed=3).map(lambda i: (i, source[i]))
    seen = set()
    for i, record in ds:
        assert np.array_equal(record, docs[i])
        seen.add(i)
    assert seen == set(range(300))

    # Grain's DataLoader with its IndexSampler and two worker processes (the source pickles as
    # its path and version; each worker opens its own reader). Grain's workers read absl flags,
    # which a program run outside absl.app has not parsed.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    sampler = grain.samplers.IndexSampler(
        num_records=len(source), shard_options=grain.sharding.NoSharding(), shuffle=True, num_epochs=1, seed=5
    )
    loader = grain.DataLoader(data_source=source, sampler=sampler, worker_count=2)
    records = [np.asarray(r) for r in loader]
    assert len(records) == 300
    assert sorted(r.tobytes() for r in records) == sorted(d.tobytes() for d in docs)


def test_fixed_records_bytes_and_samples_come_as_the_loader_gives_them(store, tmp_path):
    tokens = np.arange(64 * 20, dtype=np.int32).reshape(20, 8, 8)
    store.ingest("fixed", list(tokens), dtype=np.int32, shape=[8, 8])
    source = granary.grain.DataSource(store.path, "fixed")
    assert source[3].dtype == np.int32 and source[3].shape == (8, 8)
    assert np.array_equal(np.stack(source.__getitems__([5, 1, 5])), tokens[[5, 1, 5]])
    blobs = [bytes([i]) * i for i in range(1, 30)]
    store.ingest("blobs", blobs)
    assert granary.grain.DataSource(store, "blobs")[10] == blobs[10]
    assert granary.grain.DataSource(store, "blobs", decode=len)[10] == 11
    # WebDataset samples come as the loader's dicts.
    import io
    import tarfile

    tar_path = tmp_path / "samples.tar"
    with tarfile.open(tar_path, "w") as tar:
        for i in range(6):
            for ext, data in (("txt", f"text {i}".encode()), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{i:03d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    store.ingest_tars("samples", tar_path)
    samples = granary.grain.DataSource(store, "samples")
    assert samples[4] == {"__key__": "004", "txt": b"text 4", "cls": b"4"}
    assert [s["__key__"] for s in samples.__getitems__([5, 0])] == ["005", "000"]


def test_a_damaged_record_is_refused_not_returned(store, tmp_path):
    docs = documents(50, 1)
    ingest_documents(store, tmp_path, "docs", docs)
    source = granary.grain.DataSource(store, "docs")
    shards = [os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(store.path, "shards")) for f in fs]
    assert len(shards) == 1
    data = bytearray(open(shards[0], "rb").read())
    data[4096 + 10] ^= 0xFF  # a byte of the first data block
    with open(shards[0], "r+b") as f:
        f.write(bytes(data))
    with pytest.raises(granary.CorruptionError):
        source[0]


def test_the_loader_as_a_grain_iterator_gives_its_batches_and_resumes_exactly(store, tmp_path):
    docs = documents(200, 2)
    ingest_documents(store, tmp_path, "docs", docs)
    options = dict(seed=11, output="numpy", with_indices=True)
    loader = store.loader("docs", 16, **options)
    expected = [indices.tolist() for _ in range(2) for indices, _ in loader]
    assert len(expected) == 26 and expected[:13] != expected[13:]  # two epochs, each shuffled anew
    # The same plan through Grain, two epochs.
    ds = granary.grain.LoaderDataset(store, "docs", 16, num_epochs=2, **options)
    assert isinstance(ds, grain.IterDataset)
    it = iter(ds)
    assert isinstance(it, grain.DatasetIterator)
    got = [indices.tolist() for indices, _ in it]
    assert got == expected

    # Stop after 17 batches (into the second epoch), save the state as JSON, resume in a new
    # iterator: the rest is exactly what the first one went on to give.
    it = iter(ds)
    head = [next(it)[0].tolist() for _ in range(17)]
    state = json.loads(json.dumps(it.get_state()))
    rest = [indices.tolist() for indices, _ in it]
    resumed = iter(granary.grain.LoaderDataset(store, "docs", 16, num_epochs=2, **options))
    resumed.set_state(state)
    assert [indices.tolist() for indices, _ in resumed] == rest
    assert head + rest == expected
    # Grain's own transformations run on it.
    counted = granary.grain.LoaderDataset(store, "docs", 16, **options).map(lambda b: len(b[0]))
    assert sum(counted) == 200


def test_the_jax_example_learns_and_resumes_exactly(tmp_path):
    pytest.importorskip("jax")
    import subprocess
    import sys

    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_tokens_jax.py")
    out = subprocess.run(
        [sys.executable, example, "--steps", "200", "--dir", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["resumed_exactly"] is True
    assert result["last_loss"] < 0.6 * result["log_vocab"], result
