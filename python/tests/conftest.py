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
