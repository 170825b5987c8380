"""The Python bindings, end to end on a store each test makes, with NumPy only (the torch tests
are in `test_torch.py`, rebalancing in `test_rebalance.py`)."""

import gc
import multiprocessing
import os
import subprocess
import sys
import tarfile
import textwrap
import threading
import time

import numpy as np
import pytest

import granary

from conftest import RECORD, records


def read_epoch(loader):
    """(indices, arrays) of one epoch, copied out of the batches."""
    got = []
    for indices, batch in loader:
        got.extend(zip(indices.tolist(), [row.copy() for row in batch]))
    return got


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


def test_corruption_is_a_structured_error_and_counted(tokens, tmp_path):
    store, _ = tokens
    shards = sorted((tmp_path / "store" / "shards").rglob("*.shard"))
    assert shards
    victim = shards[len(shards) // 2]
    raw = bytearray(victim.read_bytes())
    raw[4096 + 10] ^= 0x40
    os.chmod(victim, 0o644)
    victim.write_bytes(bytes(raw))
    loader = store.loader("tokens", batch_size=100, order="sequential", output="numpy", hold=16)
    with pytest.raises(granary.CorruptionError) as caught:
        for _ in loader:
            pass
    assert caught.value.kind == "checksum_mismatch"
    assert loader.metrics()["verify_failures"] == 1


def test_errors_name_what_is_wrong(store, tmp_path):
    with pytest.raises(granary.NotFoundError) as missing:
        granary.Store(tmp_path / "nowhere")
    assert missing.value.kind == "not_a_store"
    with pytest.raises(granary.NotFoundError) as absent:
        store.loader("absent", batch_size=4, output="numpy")
    assert absent.value.kind == "not_found"
    with pytest.raises(ValueError, match="dtype"):
        store.ingest("x", [b"ab"], dtype="complex64", shape=[1])
    with pytest.raises(ValueError, match="device"):
        store.loader("x", batch_size=1, device="tpu")
    with pytest.raises(ValueError, match="rank"):
        store.loader("x", batch_size=1, rank=3, world_size=2)
    with pytest.raises(granary.Error) as bad:
        store.ingest("../escape", [b"x"])
    assert bad.value.kind == "invalid_name"
    with pytest.raises(granary.Error) as wrong_size:
        store.ingest("sized", [bytes(RECORD * 2), bytes(3)], dtype="uint16", shape=[RECORD])
    assert wrong_size.value.kind == "invalid_input"


def _use_after_fork(loader, queue):
    try:
        next(loader)
        queue.put("no error")
    except granary.ForkError as e:
        queue.put("ForkError: " + str(e))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put(f"{type(e).__name__}: {e}")


def _fresh_after_fork(loader, queue):
    try:
        queue.put(sum(len(b) for b in loader))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put(f"{type(e).__name__}: {e}")


def test_a_started_loader_refuses_a_forked_child_and_an_unstarted_one_works_there(tokens):
    store, _ = tokens
    ctx = multiprocessing.get_context("fork")
    started = store.loader("tokens", batch_size=100, output="numpy", device="cpu")
    it = iter(started)
    next(it)
    queue = ctx.Queue()
    child = ctx.Process(target=_use_after_fork, args=(it, queue))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    message = queue.get(timeout=5)
    assert message.startswith("ForkError") and "fork" in message and "__iter__" in message, message
    # The parent's loader is unaffected.
    assert sum(len(b) for b in it) == 900

    fresh = store.loader("tokens", batch_size=100, output="numpy", device="cpu")
    child = ctx.Process(target=_fresh_after_fork, args=(fresh, queue))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == 1000


def _store_in_forked_child(root, queue):
    results = []
    store = granary.Store(root)  # files only: works in the child
    granary.Store(root, create=True)  # an existing store: the same
    results.append(sum(len(b) for b in store.loader("tokens", batch_size=100, output="numpy", device="cpu")))
    results.append([d["name"] for d in store.datasets()])
    try:
        store.ingest("more", [np.zeros(RECORD, dtype=np.uint16)], dtype="uint16", shape=[RECORD])
        results.append("ingested")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.append(f"{type(e).__name__}: {e}")
    queue.put(results)


def test_a_forked_child_reads_the_store_and_gets_an_error_not_a_hang_for_writes(tokens):
    # The parent has written (the catalog's I/O threads started); a child forked now (a
    # DataLoader worker, by default) opens the store and reads, and a write there, which would
    # wait forever for the parent's catalog threads, is a ForkError that says what to do.
    store, _ = tokens
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_store_in_forked_child, args=(store.path, queue))
    child.start()
    child.join(60)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0, "the child hung"
    records, names, write = queue.get(timeout=5)
    assert records == 1000 and names == ["tokens"]
    assert write.startswith("ForkError") and "forked" in write and "spawn" in write, write
    # The parent goes on writing.
    store.ingest("more", [np.zeros(RECORD, dtype=np.uint16)], dtype="uint16", shape=[RECORD])


def test_a_parent_whose_open_failed_leaves_its_children_free_to_write(tmp_path):
    # Only a catalog actually opened ties writing to the process: a failed open (here, a
    # directory with a foreign marker) must not. In a fresh process, which has opened none.
    script = textwrap.dedent(f"""
        import multiprocessing, numpy as np, granary
        (bogus := __import__("pathlib").Path({str(tmp_path / "bogus")!r})).mkdir()
        (bogus / "granary-store").write_text("something else")
        try:
            granary.Store(bogus, create=True)
            raise SystemExit("a foreign store opened")
        except granary.NotFoundError:
            pass
        def child(root):
            store = granary.Store(root, create=True)
            store.ingest("t", [np.zeros(4, dtype=np.uint16)], dtype="uint16", shape=[4])
        process = multiprocessing.get_context("fork").Process(target=child, args=({str(tmp_path / "s")!r},))
        process.start()
        process.join(60)
        raise SystemExit(process.exitcode)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


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


def test_the_memory_tier_serves_every_epoch_and_can_be_turned_off(tokens, tmp_path, monkeypatch):
    monkeypatch.setenv("GRANARY_TIER_DIR", str(tmp_path / "tier"))
    store, data = tokens
    loader = store.loader("tokens", batch_size=100, output="numpy", with_indices=True, tier_bytes=64 << 20)
    for _ in range(2):
        for index, row in read_epoch(loader):
            assert (row == data[index]).all()
    m = loader.metrics()
    # The batches planned before the first is out (the read depth's, and one more) come from
    # disk while the fills start (issue 44); every later one from the tier.
    first = 3 * 100
    assert m["tier_records"] >= 2000 - first and m["tier_hit_ratio"] >= 0.85, m
    assert m["bytes_read"] <= first * 4096, m  # a block at most per record
    assert m["tier_extents_loaded"] > 0 and m["blocks_verified"] > 0, m
    assert 0 < m["tier_bytes_held"] <= 64 << 20, m
    loader.close()

    off = store.loader("tokens", batch_size=100, output="numpy", with_indices=True, tier_bytes=0)
    for index, row in read_epoch(off):
        assert (row == data[index]).all()
    m = off.metrics()
    assert m["tier_records"] == 0 and m["bytes_read"] > 0 and "tier_bytes_held" not in m, m


def test_the_page_cache_tier_is_the_default_and_a_new_loader_each_epoch_reads_from_memory(tokens, tmp_path, monkeypatch):
    # As a trainer that rebuilds its loader each epoch (an evaluation pass between epochs, a
    # framework's own loaders): the page cache keeps the data across loaders and processes.
    for name in ("GRANARY_TIER", "GRANARY_TIER_DIR", "GRANARY_TIER_BYTES"):
        monkeypatch.delenv(name, raising=False)
    store, data = tokens
    for _ in range(2):
        loader = store.loader("tokens", batch_size=100, output="numpy", with_indices=True)
        for index, row in read_epoch(loader):
            assert (row == data[index]).all()
        m = loader.metrics()
        loader.close()
    # The second loader's records all came from memory, checked, none read from disk.
    assert m["tier_hit_ratio"] == 1.0 and m["bytes_read"] == 0 and m["verify_failures"] == 0, m
    assert m["tier_extents_loaded"] == 0 and m["tier_bytes_held"] > 0, m
    with pytest.raises(ValueError, match="page-cache"):
        store.loader("tokens", batch_size=100, tier="tmpfs")
    # The memory tier, asked for by name, in a directory of the test's.
    monkeypatch.setenv("GRANARY_TIER_DIR", str(tmp_path / "tier"))
    memory = store.loader("tokens", batch_size=100, output="numpy", with_indices=True, tier="memory")
    for index, row in read_epoch(memory):
        assert (row == data[index]).all()
    assert memory.metrics()["tier_extents_loaded"] > 0
    memory.close()


def test_the_tier_evictor_plugin_makes_room_and_a_missing_one_is_refused(store, tmp_path, monkeypatch):
    # The plan's rules over the plugin are tested in Rust (tests/memory_tier.rs); here: the
    # option reaches the tier, and a window moving over the shards (the default partitioner's,
    # from its options alone) is served from a tier of half the data, the plugin making room.
    monkeypatch.setenv("GRANARY_TIER_DIR", str(tmp_path / "tier"))
    data = records(8000)
    store.ingest("window", data, dtype="uint16", shape=[RECORD], shard_bytes=16 << 10)
    half = sum(row.nbytes for row in data) // 2
    loader = store.loader("window", batch_size=50, output="numpy", with_indices=True, tier_bytes=half,
                          tier_evictor="lru", partitioner_options={"window-shards": 2, "chunk-records": 4})
    for _ in range(2):
        for index, row in read_epoch(loader):
            assert (row == data[index]).all()
    m = loader.metrics()
    assert m["tier_evictor_chosen"] > 0 and m["tier_evictor_failures"] == 0, m
    assert m["tier_bytes_held"] <= half and m["tier_hit_ratio"] >= 0.9, m
    assert loader.state_dict()["plan"]["partitioner"] == "default"
    loader.close()
    with pytest.raises(granary.Error, match="no-such-evictor"):
        next(iter(store.loader("window", batch_size=50, tier_bytes=half, tier_evictor="no-such-evictor")))
    # Named in the environment, with the default tier: refused too, not the tier silently off.
    monkeypatch.setenv("GRANARY_TIER_EVICTOR", "no-such-evictor")
    with pytest.raises(granary.Error, match="no-such-evictor"):
        next(iter(store.loader("window", batch_size=50)))
    monkeypatch.delenv("GRANARY_TIER_EVICTOR")
    with pytest.raises(ValueError, match="partitioner_options"):
        store.loader("window", batch_size=50, order="sequential", partitioner_options={"window-shards": 2})


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


def _read_missing(path):
    """In a pool worker: read a dataset that does not exist (raises granary.NotFoundError)."""
    granary.Store(path).loader("no-such-dataset", batch_size=1)


def test_errors_pickle_and_reach_the_parent_as_themselves(tokens):
    import multiprocessing
    import pickle

    store, _ = tokens
    with pytest.raises(granary.NotFoundError) as caught:
        store.loader("no-such-dataset", batch_size=1)
    error = caught.value
    assert type(error).__module__ == "granary" and error.kind == "not_found"
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is granary.NotFoundError and str(again) == str(error) and again.kind == "not_found"

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        with pytest.raises(granary.NotFoundError) as from_worker:
            pool.apply(_read_missing, (store.path,))
    assert "no-such-dataset" in str(from_worker.value) and from_worker.value.kind == "not_found"


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


def test_dtypes_take_the_cli_names_too(store):
    data = records(4)
    store.ingest("short-names", data, dtype="u16", shape=[RECORD])
    loader = store.loader("short-names", batch_size=4, output="numpy", order="sequential")
    (batch,) = list(loader)
    assert batch.dtype == np.uint16 and (batch == np.stack(data)).all()


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


def _write_megatron(prefix, sequences, dtype, code, documents=None, modes=False):
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
    _write_megatron(prefix, sequences, np.uint16, 8, documents=[0, 3, 100, 257])
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
    _write_megatron(str(tmp_path / "wide"), [np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int32)], np.int32, 4)
    store.ingest_megatron("wide", tmp_path / "wide")
    data, offsets = next(iter(store.loader("wide", batch_size=2, order="sequential", output="numpy")))
    assert data.dtype == np.int32 and offsets.tolist() == [0, 5, 8]


def test_a_damaged_or_unsupported_megatron_index_is_refused_before_anything_is_written(store, tmp_path):
    prefix = str(tmp_path / "c")
    _write_megatron(prefix, [np.arange(10, dtype=np.uint16)] * 4, np.uint16, 8)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(40)
    with pytest.raises(granary.Error, match="not a Megatron index"):
        store.ingest_megatron("c", prefix)
    _write_megatron(prefix, [np.arange(10, dtype=np.uint16)] * 4, np.uint16, 8)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(50)
    with pytest.raises(granary.Error, match="runs past the end"):
        store.ingest_megatron("c", prefix)
    _write_megatron(prefix, [np.arange(10, dtype=np.uint16)] * 4, np.uint16, 8, modes=True)
    with pytest.raises(granary.Error, match="multimodal"):
        store.ingest_megatron("c", prefix)
    _write_megatron(prefix, [], np.uint16, 8)
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


def test_a_bad_tier_setting_in_the_environment_is_refused_when_the_loader_is_made(tokens, monkeypatch):
    store, _ = tokens
    monkeypatch.setenv("GRANARY_TIER_BYTES", "lots")
    with pytest.raises(granary.Error, match="GRANARY_TIER_BYTES"):
        store.loader("tokens", batch_size=16)
