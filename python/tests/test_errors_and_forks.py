"""Errors and forks from Python: corruption as a structured error, counted; errors that name what
is wrong and pickle across processes; a started loader refused in a forked child, an unstarted
one working there; a forked child reading the store."""

import multiprocessing
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import granary

from conftest import RECORD, records


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

    # A child's own loader works when the fork caught no loader thread of this process running:
    # parking_lot's process-wide table of parked threads, copied by the fork while a parent
    # thread held one of its locks, would keep the child's threads waiting for good (seen once
    # in CI, with `started` still prefetching its next epoch). README.md says so; close first.
    started.close()
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
