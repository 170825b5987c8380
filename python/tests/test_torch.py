"""The bindings with PyTorch: tensors, dtypes, the DataLoader adapter, errors through its
workers. Skipped where torch is not installed (the NumPy suite); `make test` runs them in its
torch venv; the GPU ones also need a CUDA device."""

import gc

import numpy as np
import pytest

import granary

torch = pytest.importorskip("torch")
import granary.torch  # noqa: E402  (needs torch)

RECORD = 64


@pytest.fixture
def store(tmp_path):
    return granary.Store(tmp_path / "store", create=True)


@pytest.fixture
def tokens(store):
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 1 << 15, (1000, RECORD), generator=gen, dtype=torch.int16)
    store.ingest("tokens", list(data), dtype=torch.int16, shape=[RECORD], shard_bytes=16 << 10)
    return store, data


def epoch_indices(batches):
    return [i for indices, _ in batches for i in indices.tolist()]


def test_a_tensor_is_the_loader_s_memory_and_outlives_the_loader(tokens):
    store, data = tokens
    native = granary._native.Loader(store._native, "tokens", 100, device="cpu", order="sequential")
    native.begin_epoch()
    exported = native.next_batch().data()
    tensor = torch.from_dlpack(exported)
    assert tensor.data_ptr() == exported.address, "the tensor is a copy"
    assert tensor.dtype == torch.int16 and tensor.shape == (100, RECORD)
    # The tensor owns its batch: closing and dropping the loader leaves its bytes alone.
    native.close()
    del native, exported
    gc.collect()
    assert torch.equal(tensor, data[:100])


def test_a_view_keeps_its_batch_held(tokens):
    store, data = tokens
    loader = store.loader("tokens", batch_size=100, hold=1, device="cpu", order="sequential")
    it = iter(loader)
    batch = next(it)
    row = batch[3]
    del batch
    gc.collect()
    # The row still points into the batch's buffer, so the batch is still held.
    with pytest.raises(granary.Error, match="holds 1 batch"):
        next(it)
    assert torch.equal(row, data[3])
    del row
    gc.collect()
    assert torch.equal(next(it), data[100:200])


DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
          torch.float64]
# The unsigned types past 8 bits exist in torch 2.3 and later.
DTYPES += [getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_torch_dtype_goes_in_and_comes_back(store, dtype):
    gen = torch.Generator().manual_seed(1)
    data = (torch.rand((40, 3, 5), generator=gen) * 100).to(dtype)
    store.ingest("x", list(data), dtype=dtype, shape=[3, 5])
    (batch,) = list(store.loader("x", batch_size=40, device="cpu", order="sequential"))
    assert batch.dtype == dtype and batch.shape == (40, 3, 5)
    assert torch.equal(batch.view(torch.uint8), data.view(torch.uint8))


def test_a_record_of_another_dtype_is_refused(store):
    with pytest.raises(ValueError, match="record 2: a tensor of dtype float64, but the records are float32"):
        store.ingest("x", [torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.float64)], dtype="float32",
                     shape=[4])
    with pytest.raises(ValueError, match="record 0: an array of dtype int32, but the records are float32"):
        store.ingest("x", [np.zeros(4, dtype=np.int32)], dtype=torch.float32, shape=[4])
    assert store.datasets() == [], "a refused ingest commits nothing"
    # Same dtype under another name is the same dtype.
    for name in ("float16", "half", "f16", torch.float16, np.float16):
        store.ingest("x", [torch.zeros(4, dtype=torch.half), np.zeros(4, dtype=np.float16)], dtype=name, shape=[4])
    # A tensor whose bytes cannot be viewed says which record it is.
    meta = torch.zeros(4, device="meta")
    with pytest.raises(ValueError, match="record 1: this tensor's bytes cannot be read"):
        store.ingest("y", [torch.zeros(4), meta], dtype="float32", shape=[4])


def test_byte_records_come_as_data_and_offset_tensors(store):
    recs = [bytes([i]) * (i * 7 % 50 + 1) for i in range(200)]
    store.ingest("blobs", recs)
    seen = {}
    for indices, (data, offsets) in store.loader("blobs", batch_size=32, device="cpu", with_indices=True):
        assert data.dtype == torch.uint8 and offsets.dtype == torch.int64 and len(offsets) == len(indices) + 1
        for k, index in enumerate(indices.tolist()):
            seen[index] = bytes(data[offsets[k] : offsets[k + 1]].tolist())
    assert seen == dict(enumerate(recs))


def test_the_dataset_adapter_resumes_exactly_without_workers(tokens):
    store, _ = tokens
    ds = granary.torch.IterableDataset(store, "tokens", 64, seed=9, with_indices=True)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    head = []
    for k, (indices, _) in enumerate(dl):
        head.extend(indices.tolist())
        if k == 4:
            break
    state = ds.state_dict()
    assert state["cursor"] == 5 * 64
    resumed = granary.torch.IterableDataset(store, "tokens", 64, seed=9, with_indices=True)
    resumed.load_state_dict(state)
    tail = epoch_indices(torch.utils.data.DataLoader(resumed, batch_size=None))
    assert sorted(head + tail) == list(range(1000))
    full = epoch_indices(granary.torch.IterableDataset(store, "tokens", 64, seed=9, with_indices=True))
    assert head + tail == full, "the resumed epoch is the same epoch, in the same order"
    # The next iteration is the next epoch: another order.
    after = epoch_indices(torch.utils.data.DataLoader(resumed, batch_size=None))
    assert sorted(after) == list(range(1000)) and after != full


@pytest.mark.parametrize("persistent", [False, True])
def test_dataloader_workers_read_every_record_once_per_epoch(tokens, persistent):
    store, _ = tokens

    def dataloader():
        ds = granary.torch.IterableDataset(store, "tokens", 50, seed=2, with_indices=True)
        return ds, torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)

    # Epochs named by set_epoch.
    ds, dl = dataloader()
    named = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        got = epoch_indices(dl)
        assert sorted(got) == list(range(1000)), f"epoch {epoch}"
        named.append(got)
    assert named[0] != named[1] != named[2] and named[0] != named[2], "every epoch has its own order"
    # set_epoch reaches the workers, persistent or not: the same epoch again is the same order.
    ds.set_epoch(1)
    assert epoch_indices(dl) == named[1]
    # Without set_epoch, each iteration read to its end is followed by the next epoch; one left
    # early starts its epoch again.
    ds, dl = dataloader()
    next(iter(dl))
    assert [epoch_indices(dl) for _ in range(3)] == named


def test_the_dataset_adapter_copies_and_pickles(tokens):
    import copy
    import pickle

    store, _ = tokens
    ds = granary.torch.IterableDataset(store, "tokens", 50, seed=2, with_indices=True)
    ds.set_epoch(4)
    epoch_indices(ds)  # reads epoch 4 in this process; the next is 5
    for twin in (copy.deepcopy(ds), pickle.loads(pickle.dumps(ds))):
        assert epoch_indices(twin) == epoch_indices(
            granary.torch.IterableDataset(store, "tokens", 50, seed=2, epoch=5, with_indices=True)
        )


def test_worker_batches_hold_the_right_bytes(tokens):
    store, data = tokens
    ds = granary.torch.IterableDataset(store, "tokens", 50, seed=4, with_indices=True)
    for indices, batch in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2):
        assert torch.equal(batch, data[indices])


cuda = pytest.mark.skipif(not granary.cuda_available()[0] or not torch.cuda.is_available(), reason="no CUDA device")


@cuda
def test_gpu_batches_are_device_tensors_with_the_source_bytes(tokens):
    store, data = tokens
    loader = store.loader("tokens", batch_size=100, device="cuda", seed=3, with_indices=True)
    for indices, batch in loader:
        assert batch.is_cuda and batch.device.index == torch.cuda.current_device()
        assert torch.equal(batch.cpu(), data[indices])


@cuda
def test_gpu_batches_are_ordered_on_a_side_stream(tokens):
    store, data = tokens
    loader = store.loader("tokens", batch_size=100, device="cuda", hold=2, prefetch=4, with_indices=True)
    side = torch.cuda.Stream()
    sums, expected = [], []
    for _ in range(3):
        with torch.cuda.stream(side):
            for indices, batch in loader:
                # Converted on `side`: kernels queued there see the copied bytes.
                sums.append(batch.to(torch.int64).sum(dim=1))
                expected.append(data[indices].to(torch.int64).sum(dim=1))
                del batch
    torch.cuda.synchronize()
    assert torch.equal(torch.cat(sums).cpu(), torch.cat(expected))


class MissingDataset:
    """A map-style dataset whose every item fails with a granary error (a dataset not in the
    store), raised in a DataLoader worker."""

    def __init__(self, root):
        self.root = str(root)

    def __len__(self):
        return 2

    def __getitem__(self, i):
        granary.Store(self.root).loader("no-such-dataset", batch_size=1)


def test_an_error_in_a_dataloader_worker_keeps_its_class_and_kind(store, tmp_path):
    loader = torch.utils.data.DataLoader(MissingDataset(tmp_path / "store"), num_workers=1)
    with pytest.raises(granary.NotFoundError) as caught:
        next(iter(loader))
    assert caught.value.kind == "not_found", str(caught.value)
    # Raised here, it has its `kind` as an attribute, and a missing attribute is still missing.
    with pytest.raises(granary.NotFoundError) as direct:
        store.loader("no-such-dataset", batch_size=1)
    assert direct.value.kind == "not_found"
    with pytest.raises(AttributeError):
        direct.value.no_such_attribute


def test_packed_windows_come_as_tensors_for_variable_length_attention(store, tmp_path):
    from conftest import write_megatron

    docs = [np.arange(d * 100, d * 100 + 5 + d % 7, dtype=np.uint16) for d in range(40)]
    write_megatron(str(tmp_path / "c"), docs, np.uint16, 8)
    store.ingest_megatron("c", tmp_path / "c")
    loader = store.loader("c", 4, seq_len=8, eod=65535, dtype="int64", device="cpu")
    batch = next(iter(loader))
    assert batch["tokens"].dtype == torch.int64 and tuple(batch["tokens"].shape) == (4, 9)
    assert batch["cu_seqlens"].dtype == torch.int32 and int(batch["cu_seqlens"][-1]) == 36
    assert tuple(batch["position_ids"].shape) == (4, 9)
    # The runs are documents: a run's tokens are consecutive ids of one document.
    flat = batch["tokens"].reshape(-1).tolist()
    cu = batch["cu_seqlens"].tolist()
    for lo, hi in zip(cu[:-1], cu[1:]):
        run = [t for t in flat[lo:hi] if t != 65535]
        assert len({t // 100 for t in run}) <= 1
