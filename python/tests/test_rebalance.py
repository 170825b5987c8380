"""Rebalancing from Python: two rank threads of a loader whose slow rank reads less of each step,
a `state_dict` that carries the weights and the measures already exchanged, and its resume."""

import json
import threading
import time

import pytest


class _ThreadExchange:
    """The ranks' exchange of their measures for ranks that are threads of this process."""

    def __init__(self, world):
        self.barrier = threading.Barrier(world, timeout=30)
        self.lock = threading.Lock()
        self.points = {}

    def __call__(self, epoch, step, mine):
        with self.lock:
            self.points.setdefault((epoch, step), {})[mine[0]] = mine
        self.barrier.wait()
        return sorted(self.points[(epoch, step)].values())


def _rebalanced_ranks(store, exchange, slow_seconds_per_record, stop_after=None, states=None, dataset="tokens",
                      **options):
    """Two rank threads of a rebalancing loader (rank 1 slow); each rank's batches (indices,
    the position after) and its last state."""
    out = [None, None]

    def rank_thread(rank):
        loader = store.loader(
            dataset, batch_size=16, **options, seed=5, rank=rank, world_size=2, output="numpy", with_indices=True,
            rebalance_every=8, rebalance_exchange=exchange,
        )
        if states is not None:
            loader.load_state_dict(states[rank])
        batches = []
        for indices, _ in loader:
            batches.append((indices.tolist(), loader.position))
            time.sleep((slow_seconds_per_record if rank == 1 else 0.00004) * len(indices))
            if stop_after is not None and len(batches) == stop_after:
                break
        out[rank] = (batches, loader.state_dict())
        loader.close()

    threads = [threading.Thread(target=rank_thread, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(o is not None for o in out), "a rank did not finish"
    return out


def test_a_slow_rank_reads_less_of_each_step_and_a_resume_repeats_the_decisions(tokens):
    store, data = tokens
    # 1000 records, steps of 32: 32 steps (the last short), points at steps 8, 16 and 24.
    runs = _rebalanced_ranks(store, _ThreadExchange(2), 0.0012)
    fast, slow = runs[0][0], runs[1][0]
    assert sorted(i for batches, _ in runs for indices, _ in batches for i in indices) == list(range(1000))
    assert all(len(b[0]) == 16 for b in fast[:8] + slow[:8])
    assert len(slow[8][0]) < 16 < len(fast[8][0]), (len(slow[8][0]), len(fast[8][0]))
    assert len(slow[-2][0]) < 8, [len(b[0]) for b in slow]
    # Both ranks agree on every step's position; the state carries the weights.
    assert [p for _, p in fast] == [p for _, p in slow]
    state = runs[1][1]
    assert state["rebalance"]["weights"][1] < state["rebalance"]["weights"][0]
    # A state saved after step 6 holds the measures exchanged for point 8: resumed, step 8 is
    # split by the weights they give, as the uninterrupted run split it (the same measures).
    stopped = _rebalanced_ranks(store, _ThreadExchange(2), 0.0012, stop_after=7)
    # Written to JSON and read back (lists where the state had tuples), as a checkpoint may be.
    states = [json.loads(json.dumps(s)) for _, s in stopped]
    assert states[0]["rebalance"]["pending"] is not None and states[0]["rebalance"]["pending"][0] == 8
    resumed = _rebalanced_ranks(store, _ThreadExchange(2), 0.0012, stop_after=2, states=states)
    sizes = [len(resumed[rank][0][1][0]) for rank in range(2)]
    assert sum(sizes) == 32 and sizes[1] < 16, sizes
    read = [i for rank in range(2) for batches in (stopped[rank][0], resumed[rank][0]) for indices, _ in batches for i in indices]
    assert len(read) == len(set(read)), "a record read twice across the resume"
    # Bad arguments are refused at once.
    with pytest.raises(ValueError, match="rebalance_every"):
        store.loader("tokens", batch_size=16, rebalance_every=1)
    with pytest.raises(ValueError, match="rebalance_every too"):
        store.loader("tokens", batch_size=16, rebalance_exchange=_ThreadExchange(1))
    # Two ranks, no exchange given and no process group: refused when the loader is made (it
    # failed at the first rebalance point, an epoch's fraction into the run).
    with pytest.raises(ValueError, match="init_process_group"):
        store.loader("tokens", batch_size=16, rank=0, world_size=2, rebalance_every=8)
    # output="torch" without torch: refused when the loader is made, not at its first batch.
    try:
        import torch  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="output='numpy'"):
            store.loader("tokens", batch_size=16, output="torch")


def test_a_mixture_rebalances_and_reads_its_blend_in_order(tokens):
    store, _ = tokens
    from conftest import RECORD, records

    store.ingest("more", records(200, seed=9), dtype="uint16", shape=[RECORD], shard_bytes=16 << 10)
    mix = [("tokens", 0.8), ("more", 0.2)]
    runs = _rebalanced_ranks(store, _ThreadExchange(2), 0.0012, dataset=mix, mixture_samples=1024)
    fast, slow = runs[0][0], runs[1][0]
    assert len(slow[8][0]) < 16 < len(fast[8][0]), (len(slow[8][0]), len(fast[8][0]))
    # Step by step, rank 0's share then rank 1's is the mixture's order on one rank.
    read = [i for f, s in zip(fast, slow) for i in f[0] + s[0]]
    one = store.loader(mix, 32, seed=5, mixture_samples=1024, output="numpy", with_indices=True, device="cpu")
    assert read == [i for indices, _ in one for i in indices.tolist()]


def test_packed_windows_rebalance_and_every_window_is_read_once(tokens):
    store, _ = tokens
    runs = _rebalanced_ranks(store, _ThreadExchange(2), 0.0012, seq_len=63, eod=0)
    fast, slow = runs[0][0], runs[1][0]
    windows = store.loader("tokens", 16, seq_len=63, eod=0, output="numpy", device="cpu")._native.pack_windows
    read = sorted(w for batches, _ in runs for indices, _ in batches for w in indices)
    assert read == list(range(windows)), "every window of the epoch once"
    assert sum(len(b[0]) for b in slow) < sum(len(b[0]) for b in fast)
    assert runs[1][1]["rebalance"]["weights"][1] < runs[1][1]["rebalance"]["weights"][0]
