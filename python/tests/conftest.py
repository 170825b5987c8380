"""Fixtures the test files share: a store, and a dataset of u16 token records in it."""

import numpy as np
import pytest

import granary

RECORD = 64  # u16 tokens per record


def records(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 65535, RECORD, dtype=np.uint16) for _ in range(n)]


@pytest.fixture
def store(tmp_path):
    return granary.Store(tmp_path / "store", create=True)


@pytest.fixture
def tokens(store):
    data = records(1000)
    store.ingest("tokens", data, dtype="uint16", shape=[RECORD], shard_bytes=16 << 10)
    return store, data


def read_epoch(loader):
    """(indices, arrays) of one epoch, copied out of the batches."""
    got = []
    for indices, batch in loader:
        got.extend(zip(indices.tolist(), [row.copy() for row in batch]))
    return got


def write_megatron(prefix, sequences, dtype, code, documents=None, modes=False):
    """A `.bin` + `.idx` pair in Megatron-LM's published layout (MMapIndexedDataset, version 1)."""
    import struct

    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = np.zeros(len(sequences), dtype=np.int64)
    if len(sequences) > 1:
        pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize)
    documents = np.arange(len(sequences) + 1, dtype=np.int64) if documents is None else np.array(documents, dtype=np.int64)
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(np.asarray(s, dtype=dtype).tobytes(order="C"))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(documents)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(documents.tobytes(order="C"))
        if modes:
            f.write(np.zeros(len(sequences), dtype=np.int8).tobytes())
