"""Fixtures the test files share: a store, and a dataset of u16 token records in it.

With GRANARY_TEST_INSTALLED set (`make python` sets it), the suite refuses to run on anything
but an installed package: what users install is what is tested."""

import importlib
import os

import numpy as np
import pytest

import granary

if os.environ.get("GRANARY_TEST_INSTALLED"):
    _source = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "granary"))
    _imported = os.path.realpath(os.path.dirname(granary.__file__))
    if _imported == _source or "site-packages" not in _imported:
        raise RuntimeError(f"GRANARY_TEST_INSTALLED: granary was imported from {_imported}, not an installed wheel")

# The test files skip where an oracle package is not installed (`pytest.importorskip`): the
# NumPy-only venv has no torch, the torch venv no grain. GRANARY_TEST_MODULES (set by the Makefile
# for each venv) names the ones that venv must have: a package gone missing fails the run here,
# instead of its tests passing as skipped.
for _module in os.environ.get("GRANARY_TEST_MODULES", "").split():
    try:
        importlib.import_module(_module)
    except ImportError as error:
        raise RuntimeError(f"GRANARY_TEST_MODULES: {_module} cannot be imported in this venv: {error}") from error

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


def in_global_order(per_rank):
    """Every rank's batches (one list per rank, full steps) put back in global order: step by
    step, ranks in order."""
    return [item for step in zip(*per_rank) for batch in step for item in batch]


def save_after_a_weight_change(store, mixture, batch_size, world_size, before, weights, after, **options):
    """Each of `world_size` ranks of a loader of `mixture` reads `before` batches, changes the
    weights to `weights`, reads `after` more and saves its state; the states, one per rank."""
    states = []
    for rank in range(world_size):
        loader = store.loader(mixture, batch_size, rank=rank, world_size=world_size, **options)
        it = iter(loader)
        for _ in range(before):
            next(it)
        loader.change_weights(weights)
        for _ in range(after):
            next(it)
        states.append(loader.state_dict())
    return states


def resumed(store, mixture, batch_size, world_size, state, item, **options):
    """What `world_size` fresh ranks of a loader of `mixture` (made with its first weights only)
    read after `load_state_dict(state)`, in global order; `item` picks what a batch holds."""
    per_rank = []
    for rank in range(world_size):
        loader = store.loader(mixture, batch_size, rank=rank, world_size=world_size, **options)
        loader.load_state_dict(state)
        per_rank.append([item(batch) for batch in loader])
    return in_global_order(per_rank)


def damaged_copies(clean, tmp_path, trials, seed):
    """`trials` copies of `clean` (a directory, or one file), each with one file damaged at
    random: a byte flipped, the file cut short, or a word overwritten by a large number; yields
    each copy with what was done to it."""
    import random
    import shutil

    rng = random.Random(seed)
    files = sorted(os.listdir(clean)) if os.path.isdir(clean) else [None]
    for trial in range(trials):
        copy = tmp_path / f"damaged{trial}"
        name = rng.choice(files)
        if name is None:
            copy = copy.with_suffix(clean.suffix)
            shutil.copy(clean, copy)
            path, name = copy, clean.name
        else:
            shutil.copytree(clean, copy)
            path = copy / name
        data = bytearray(path.read_bytes())
        kind = rng.choice(["flip", "cut", "word"])
        at = rng.randrange(len(data))
        if kind == "flip":
            data[at] ^= 1 << rng.randrange(8)
        elif kind == "cut":
            del data[at:]
        else:
            data[at : at + 4] = rng.choice([0xFFFFFFFF, 1 << 28, len(data) + 1]).to_bytes(4, "little")
        path.write_bytes(bytes(data))
        yield copy, f"trial {trial}: {kind} at byte {at} of {name}"


def ingested_damaged_copies(store, ingest, clean, tmp_path, trials, seed=52):
    """Damaged copies of `clean` (`damaged_copies`) given to `ingest(name, path)` one by one: a
    copy it refuses (`granary.Error`) must have committed nothing; one it takes is yielded as
    (name, path, what was done), for the caller to compare with the format's own reader. Once
    all are through, both outcomes must have happened: the property was checked, not passed
    over."""
    refused = ingested = 0
    for n, (copy, what) in enumerate(damaged_copies(clean, tmp_path, trials=trials, seed=seed)):
        name = f"t{n}"
        try:
            ingest(name, str(copy))
        except granary.Error:
            assert name not in [d["name"] for d in store.datasets()], what
            refused += 1
            continue
        ingested += 1
        yield name, copy, what
    assert refused > 0 and ingested > 0, (refused, ingested)


def outcome(read):
    """What `read()` gives, or the exception it raises (an outcome to compare, not a failure)."""
    try:
        return read()
    except Exception as e:  # noqa: BLE001 - a reader's refusal, whatever its type
        return e
