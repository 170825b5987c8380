"""The Python loader end to end with NumPy: every record once an epoch, holding and releasing
batches, resume at another world size, the short last step, metrics, threads and the GIL, the
loader's arguments, whole-block reads, dtype widening, a missing GPU."""

import gc
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import granary

from conftest import RECORD, read_epoch, records


def test_every_record_comes_once_per_epoch_with_its_bytes(tokens):
    store, data = tokens
    loader = store.loader("tokens", batch_size=64, seed=7, output="numpy", with_indices=True)
    assert len(loader) == 16
    got = read_epoch(loader)
    assert sorted(i for i, _ in got) == list(range(1000))
    for index, row in got:
        assert row.dtype == np.uint16 and row.shape == (RECORD,)
        assert np.array_equal(row, data[index]), f"record {index}"
    # Shuffled, and another epoch is another order over the same records.
    order0 = [i for i, _ in got]
    assert order0 != sorted(order0)
    order1 = [i for i, _ in read_epoch(loader)]
    assert sorted(order1) == list(range(1000)) and order1 != order0
    assert loader.position == (2, 0)
    # The same seed and epoch give the same order in a new loader.
    again = store.loader("tokens", batch_size=64, seed=7, output="numpy", with_indices=True)
    assert [i for i, _ in read_epoch(again)] == order0

def test_holding_too_many_batches_is_refused_and_releasing_one_goes_on(tokens):
    store, data = tokens
    loader = store.loader("tokens", batch_size=100, seed=1, hold=2, output="numpy", with_indices=True, order="sequential")
    it = iter(loader)
    i0, b0 = next(it)
    expected = np.stack([data[i] for i in i0.tolist()])
    i1, b1 = next(it)
    # Two batches held: the third is refused rather than deadlocking or overwriting one.
    with pytest.raises(granary.Error) as refused:
        next(it)
    assert refused.value.kind == "hold_limit"
    # In Python's terms: the argument is `hold`, and list(loader) is the usual way to hit it.
    assert "holds 2 batches" in str(refused.value) and "hold=2" in str(refused.value)
    assert "hold_max" not in str(refused.value) and "list(loader)" in str(refused.value)
    # The first batch still holds its bytes while it lives.
    assert np.array_equal(b0, expected)
    # Letting one go lets the loader go on where it was, in order, with nothing lost.
    del i1, b1
    gc.collect()
    i2, _ = next(it)
    assert i2.tolist() == list(range(200, 300))

def test_an_array_is_the_loader_s_own_memory(tokens):
    store, data = tokens
    native = granary._native.Loader(store._native, "tokens", 100, device="cpu", order="sequential")
    native.begin_epoch()
    batch = native.next_batch()
    exported = batch.data()
    array = np.from_dlpack(exported)
    assert array.ctypes.data == exported.address, "the array is a copy"
    assert np.from_dlpack(batch.data()).ctypes.data == exported.address
    assert np.array_equal(array, np.stack(data[:100]))

def test_releasing_a_batch_lets_the_loader_go_on(tokens):
    store, data = tokens
    loader = store.loader("tokens", batch_size=100, seed=1, hold=1, output="numpy", order="sequential")
    n = 0
    for batch in loader:
        assert batch.shape == (100, RECORD)
        n += 1
        del batch
    assert n == 10
    # An export nobody consumed gives its batch back when the capsule goes.
    native = granary._native.Loader(store._native, "tokens", 100, hold=1, device="cpu")
    native.begin_epoch()
    capsule = native.next_batch().data().__dlpack__()
    del capsule
    gc.collect()
    assert native.next_batch() is not None

def test_resume_on_another_world_size_reads_exactly_the_rest(tokens):
    store, data = tokens
    first = store.loader("tokens", batch_size=32, seed=3, world_size=2, rank=0, output="numpy", with_indices=True)
    other = store.loader("tokens", batch_size=32, seed=3, world_size=2, rank=1, output="numpy", with_indices=True)
    seen = []
    for _ in range(5):
        for loader in (first, other):
            indices, _ = next(iter(loader)) if loader is first else next(loader)
            seen.extend(indices.tolist())
    state = first.state_dict()
    assert state["cursor"] == 5 * 2 * 32 and state["epoch"] == 0
    assert other.state_dict() == state
    # Resume on three ranks.
    rest = []
    for rank in range(3):
        loader = store.loader("tokens", batch_size=32, seed=3, world_size=3, rank=rank, output="numpy", with_indices=True)
        loader.load_state_dict(state)
        expected = len(loader)
        assert expected < loader.batches_per_epoch(), "len() counts what is left of the epoch"
        yielded = 0
        for indices, batch in loader:
            yielded += 1
            rest.extend(indices.tolist())
            assert all(np.array_equal(row, data[i]) for i, row in zip(indices.tolist(), batch))
        assert yielded == expected, (rank, yielded, expected)
        assert len(loader) == loader.batches_per_epoch(), "the next iteration is a whole epoch"
    assert len(seen) + len(rest) == 1000
    assert sorted(seen + rest) == list(range(1000)), "a sample lost or read twice across the resume"
    # A state from another seed or dataset version is refused, not silently misapplied.
    wrong = store.loader("tokens", batch_size=32, seed=4, output="numpy")
    with pytest.raises(ValueError, match="seed"):
        wrong.load_state_dict(state)
    store.ingest("tokens", records(10, seed=9), dtype="uint16", shape=[RECORD], mode="append")
    newer = store.loader("tokens", batch_size=32, seed=3, output="numpy")
    with pytest.raises(ValueError, match="version"):
        newer.load_state_dict(state)
    # Naming the old version by its manifest resumes it.
    pinned = store.loader(state["manifest"], batch_size=32, seed=3, output="numpy")
    pinned.load_state_dict(state)
    assert sum(len(b) for b in pinned) == 1000 - state["cursor"]

def test_the_short_last_step_ends_every_rank_s_epoch_together(store):
    # 9 records, batches of 4, two ranks: one full step (4 + 4), then 1 record, which rank 0
    # reads and rank 1 has no share of.
    data = records(9, seed=4)
    store.ingest("nine", data, dtype="uint16", shape=[RECORD])
    for drop_last, counts in ((False, [2, 1]), (True, [1, 1])):
        loaders = [
            store.loader("nine", batch_size=4, seed=2, rank=r, world_size=2, output="numpy", with_indices=True, drop_last=drop_last)
            for r in range(2)
        ]
        for epoch in range(3):
            seen = []
            for rank, loader in enumerate(loaders):
                assert len(loader) == counts[rank], (drop_last, rank)
                batches = list(loader)
                assert len(batches) == counts[rank], (drop_last, epoch, rank)
                seen.extend(i for indices, _ in batches for i in indices.tolist())
                assert loader.position == (epoch + 1, 0), (drop_last, epoch, rank)
            # Each epoch reads its own permutation: the same as a loader started at that epoch.
            fresh = [
                store.loader("nine", batch_size=4, seed=2, rank=r, world_size=2, epoch=epoch, output="numpy", with_indices=True, drop_last=drop_last)
                for r in range(2)
            ]
            again = [i for loader in fresh for indices, _ in loader for i in indices.tolist()]
            assert seen == again, (drop_last, epoch)
            assert len(set(seen)) == (9 if not drop_last else 8)
        assert loaders[0].state_dict() == loaders[1].state_dict()

def test_ranks_with_nothing_to_read_end_their_epochs_at_once(store):
    # 3 records: with four ranks the last reads nothing; with drop_last and batches of 2 over
    # two ranks there is no whole step at all. Neither may hang or hand out a dropped batch.
    store.ingest("three", records(3, seed=5), dtype="uint16", shape=[RECORD])
    idle = store.loader("three", batch_size=1, rank=3, world_size=4, output="numpy")
    assert len(idle) == 0
    for epoch in range(2):
        assert list(idle) == [] and idle.position == (epoch + 1, 0)
    for rank in range(2):
        short = store.loader("three", batch_size=2, rank=rank, world_size=2, drop_last=True, output="numpy")
        assert len(short) == 0
        for epoch in range(2):
            assert list(short) == [] and short.position == (epoch + 1, 0)
    busy = store.loader("three", batch_size=1, rank=0, world_size=4, output="numpy")
    assert len(busy) == 1 and sum(len(b) for b in busy) == 1

def test_set_epoch_keeps_a_resumed_position_and_a_changed_plan_is_refused(tokens):
    store, _ = tokens
    first = store.loader("tokens", batch_size=100, seed=1, output="numpy", with_indices=True)
    it = iter(first)
    read = [i for _ in range(3) for i in next(it)[0].tolist()]
    state = first.state_dict()
    resumed = store.loader("tokens", batch_size=100, seed=1, output="numpy", with_indices=True)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # the usual loop calls it every epoch: it must not rewind
    rest = [i for indices, _ in resumed for i in indices.tolist()]
    assert sorted(read + rest) == list(range(1000))
    resumed.set_epoch(5)
    assert resumed.position == (5, 0)
    other = store.loader("tokens", batch_size=100, seed=1, order="sequential", output="numpy")
    with pytest.raises(ValueError, match="plan"):
        other.load_state_dict(state)

def test_waits_release_the_gil(store, tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(np.random.default_rng(0).integers(0, 255, 96 << 20, dtype=np.uint8).tobytes())
    done = threading.Event()

    def ingest():
        store.ingest_files("big", big, dtype="uint8", shape=[1 << 16])
        done.set()

    worker = threading.Thread(target=ingest)
    worker.start()
    time.sleep(0.01)
    n = 0
    start = time.monotonic()
    while not done.is_set():
        n += 1
    elapsed = time.monotonic() - start
    worker.join()
    # Hashing and writing 96 MB takes a good fraction of a second; with the GIL held by the
    # ingest this loop would not have run at all meanwhile.
    assert elapsed > 0.05 and n > 10_000, (elapsed, n)

def test_metrics_count_what_was_delivered(tokens):
    store, _ = tokens
    loader = store.loader("tokens", batch_size=100, output="numpy")
    for _ in loader:
        pass
    m = loader.metrics()
    assert m["batches"] == 10 and m["records"] == 1000 and m["bytes"] == 1000 * RECORD * 2
    assert m["blocks_verified"] > 0 and m["verify_failures"] == 0
    assert 0.0 <= m["cache_hit_ratio"] <= 1.0 and 0.0 <= m["stall_fraction"] <= 1.0
    assert m["stall_seconds"] >= 0.0
    # The start, stage by stage (issue 44): each stage's end, from the loader's construction.
    start = m["start"]
    assert 0.0 <= start["built"] <= start["first_batch_taken"], start
    assert start["epoch_planned"] <= start["first_batch_read"] <= start["first_batch_taken"], start

def test_drain_reads_the_epoch_as_iteration_does(tokens):
    # The benchmark's baseline: the engine loader drained in Rust covers the same epoch.
    store, _ = tokens
    loader = store.loader("tokens", batch_size=64, output="numpy")
    iter(loader)
    batches, records, nbytes, seconds = loader._native.drain(1000)
    assert (batches, records, nbytes) == (16, 1000, 1000 * RECORD * 2) and seconds > 0
    assert loader.position == (1, 0)
    assert loader._native.drain(5)[0] == 0, "drain stops at the end of the epoch being iterated"
    iter(loader)
    assert loader._native.drain(5)[:2] == (5, 320)

def test_another_thread_can_ask_while_one_waits_for_a_batch(tokens, tmp_path):
    # One thread iterates (waiting for batches with the GIL released, holding the loader's
    # state); another asks for metrics and the position all the while. Run in a child process:
    # were the state locked with the GIL held, both would wait on each other forever.
    store, _ = tokens
    script = f"""
import threading, granary
loader = granary.Store({str(tmp_path / "store")!r}).loader("tokens", batch_size=8, output="numpy", prefetch=1)
done = threading.Event()
asked = [0]
def ask():
    while not done.is_set():
        loader.metrics(); loader.position
        asked[0] += 1
t = threading.Thread(target=ask)
t.start()
n = 0
for epoch in range(5):
    for batch in loader:
        n += len(batch)
done.set()
t.join()
print(n, asked[0])
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    n, asked = map(int, out.stdout.split())
    assert n == 5000 and asked > 0

def test_local_world_size_reaches_the_loader_and_a_bad_one_is_refused(tokens, tmp_path, monkeypatch):
    # What the node's plan does for the tier is tested in Rust (tests/memory_tier.rs); here: the
    # ranks of a node, planning together, still read every record right.
    monkeypatch.setenv("GRANARY_TIER_DIR", str(tmp_path / "tier"))
    store, data = tokens
    loaders = [
        store.loader("tokens", batch_size=50, output="numpy", with_indices=True, tier_bytes=64 << 20,
                     rank=rank, world_size=2, local_world_size=2)
        for rank in range(2)
    ]
    seen = []
    for loader in loaders:
        for index, row in read_epoch(loader):
            assert (row == data[index]).all()
            seen.append(int(index))
    assert sorted(seen) == list(range(len(data)))
    # All but each loader's first batches (read from disk while the fills start, issue 44).
    assert all(loader.metrics()["tier_hit_ratio"] >= 0.5 for loader in loaders)
    for loader in loaders:
        loader.close()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    with pytest.raises(granary.Error, match="LOCAL_WORLD_SIZE") as caught:
        next(iter(store.loader("tokens", batch_size=50, tier_bytes=64 << 20)))
    assert caught.value.kind == "invalid_input"

def test_loader_arguments_are_checked_where_the_loader_is_made(tokens, monkeypatch):
    store, _ = tokens
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="world_size given without rank"):
        store.loader("tokens", batch_size=10, world_size=4)
    with pytest.raises(ValueError, match="rank given without world_size"):
        store.loader("tokens", batch_size=10, rank=1)
    for bad in (dict(prefetch=0), dict(hold=0), dict(read_depth=-1), dict(seed=-3), dict(batch_size=0),
                dict(tier_bytes=-1), dict(local_world_size=0), dict(rank=4, world_size=4),
                dict(verify_threads=-1), dict(verify_threads=65), dict(verify_threads=True)):
        options = dict(batch_size=10, **{k: v for k, v in bad.items() if k != "batch_size"})
        if "batch_size" in bad:
            options["batch_size"] = bad["batch_size"]
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name if name != "world_size" else "rank"):
            store.loader("tokens", **options)
    # Under a launcher, the environment supplies the other.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert store.loader("tokens", batch_size=10, world_size=2).rank == 1

def test_whole_block_records_are_read_into_the_batch_and_checked_on_workers_or_not(store):
    # 4 KiB records in 1 MiB shards, sequential batches of 64: reads of 64 KiB or more go
    # straight into the batch and are checked there, by a verify thread when there is one.
    data = records(512, seed=3)
    wide = [np.concatenate([r] * 32) for r in data]
    store.ingest("blocks", wide, dtype="uint16", shape=[RECORD * 32], shard_bytes=1 << 20)
    for threads in (0, 1):
        loader = store.loader("blocks", batch_size=64, order="sequential", output="numpy", tier_bytes=0,
                              verify_threads=threads, with_indices=True)
        for indices, batch in loader:
            assert np.array_equal(batch, np.stack([wide[i] for i in indices.tolist()]))
        metrics = loader.metrics()
        # A batch across two shards may leave a read under 64 KiB, which goes through a buffer.
        assert metrics["ops"] > 0 and metrics["ops_direct"] > metrics["ops"] // 2, metrics
        assert metrics["ops_offloaded"] == (metrics["ops_direct"] if threads else 0), metrics

def test_dtype_widens_integer_records_in_the_gather(tokens, store):
    _, data = tokens
    for dtype, expected in (("int64", np.int64), ("int32", np.int32), (np.int64, np.int64)):
        loader = store.loader("tokens", batch_size=100, order="sequential", output="numpy", dtype=dtype, with_indices=True)
        for indices, batch in loader:
            assert batch.dtype == expected and batch.shape == (100, RECORD)
            assert np.array_equal(batch, np.stack([data[i] for i in indices.tolist()]).astype(expected))
    # Refused where the loader is made: a dtype that is not a widening, records that are not
    # integers, a target too narrow for every value, byte records.
    with pytest.raises(ValueError, match="expected 'int64' or 'int32'"):
        store.loader("tokens", batch_size=10, output="numpy", dtype="float32")
    store.ingest("floats", [np.zeros(4, dtype=np.float32)], dtype="float32", shape=[4])
    with pytest.raises(ValueError, match="float32, which int64 cannot hold"):
        store.loader("floats", batch_size=1, output="numpy", dtype="int64")
    store.ingest("wide", [np.zeros(4, dtype=np.uint32)], dtype="uint32", shape=[4])
    with pytest.raises(ValueError, match="uint32, which int32 cannot hold"):
        store.loader("wide", batch_size=1, output="numpy", dtype="int32")
    store.ingest("bytes", [b"abc"])
    with pytest.raises(ValueError, match="fixed-size records"):
        store.loader("bytes", batch_size=1, output="numpy", dtype="int64")

@pytest.mark.skipif(granary.cuda_available()[0], reason="a CUDA device is here")
def test_a_gpu_that_is_not_there_is_a_device_error_where_the_loader_is_made(tokens):
    import pickle

    store, _ = tokens
    with pytest.raises(granary.DeviceError) as caught:
        store.loader("tokens", batch_size=10, device="cuda:0", output="numpy")
    assert caught.value.kind == "no_gpu" and "no usable GPU" in str(caught.value)
    again = pickle.loads(pickle.dumps(caught.value))
    assert type(again) is granary.DeviceError and again.kind == "no_gpu"
