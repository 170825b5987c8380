"""Mixtures from Python: weighted datasets read as one stream, with every record's bytes, the
proportions at every prefix, the same global order on any world size, and a position saved on
three ranks after a change of weights resumed on two."""

import numpy as np
import pytest

import granary

from conftest import RECORD, in_global_order, records, resumed, save_after_a_weight_change

SIZES = {"web": 300, "code": 70, "math": 9}
WEIGHTS = [("web", 0.6), ("code", 0.3), ("math", 0.1)]


@pytest.fixture
def sources(store):
    """Three datasets of one layout; the mixture's record i is `data[i]` (sources in order)."""
    data = []
    for seed, (name, n) in enumerate(SIZES.items()):
        part = records(n, seed=100 + seed)
        store.ingest(name, part, dtype="uint16", shape=[RECORD], shard_bytes=8 << 10)
        data.extend(part)
    return store, data


def source_of(index):
    start = 0
    for s, n in enumerate(SIZES.values()):
        if index < start + n:
            return s
        start += n
    raise AssertionError(index)


def read_ranks(store, data, world_size, batch_size, **options):
    """Every rank's epoch, put back in global order (steps are full: ranks in order per step)."""
    per_rank = []
    for rank in range(world_size):
        loader = store.loader(WEIGHTS, batch_size, rank=rank, world_size=world_size, output="numpy",
                              with_indices=True, device="cpu", **options)
        batches = []
        for indices, batch in loader:
            for i, row in zip(indices.tolist(), batch):
                np.testing.assert_array_equal(row, data[i])
            batches.append(indices.tolist())
        per_rank.append(batches)
    assert len({len(b) for b in per_rank}) == 1, "full steps only"
    return in_global_order(per_rank)


def test_a_mixture_reads_in_proportion_at_every_prefix_with_every_records_bytes(sources):
    store, data = sources
    order = read_ranks(store, data, 1, 10, mixture_samples=400, seed=4)
    assert len(order) == 400
    counts = [0, 0, 0]
    for p, index in enumerate(order, 1):
        counts[source_of(index)] += 1
        for s, (_, weight) in enumerate(WEIGHTS):
            assert abs(counts[s] - weight * p) < 1, (p, counts)
    # math (9 records) is read in passes, each a permutation of its records.
    math = [i for i in order if source_of(i) == 2]
    for start in range(0, len(math) - 8, 9):
        assert sorted(math[start:start + 9]) == list(range(370, 379))


def test_every_world_size_reads_the_same_global_order(sources):
    store, data = sources
    one = read_ranks(store, data, 1, 24, mixture_samples=240, seed=9)
    assert read_ranks(store, data, 3, 8, mixture_samples=240, seed=9) == one
    assert read_ranks(store, data, 2, 4, mixture_samples=240, seed=9) == one


def test_a_state_saved_on_three_ranks_after_a_weight_change_resumes_on_two(sources):
    store, data = sources
    options = dict(mixture_samples=240, seed=2, output="numpy", with_indices=True, device="cpu")
    # The reference: one rank, steps of 12, new weights after 5 steps.
    ref = store.loader(WEIGHTS, 12, rank=0, world_size=1, **options)
    it = iter(ref)
    order = [i for _ in range(5) for i in next(it)[0].tolist()]
    ref.change_weights([0.2, 0.2, 0.6])
    order += [i for _ in range(5) for i in next(it)[0].tolist()]
    order += [i for indices, _ in it for i in indices.tolist()]
    assert len(order) == 240
    after = [source_of(i) for i in order[60:]]
    assert abs(after.count(2) / len(after) - 0.6) < 0.02, "the new weights are in force"

    # Three ranks do the same and save after 10 steps.
    states = save_after_a_weight_change(store, WEIGHTS, 4, 3, 5, [0.2, 0.2, 0.6], 5, **options)
    assert all(s == states[0] for s in states), "every rank saves the same state"
    assert (states[0]["epoch"], states[0]["cursor"]) == (0, 120)
    assert len(states[0]["mixture"]["changes"]) == 2

    # Two fresh ranks, made with the original weights only, resume from it.
    rest = resumed(store, WEIGHTS, 4, 2, states[0], lambda batch: batch[0].tolist(), **options)
    assert rest == order[120:]


def test_a_state_altered_after_it_was_saved_is_refused_and_the_loader_keeps_its_own(sources):
    # Issue 55: a state whose changes were rewritten to read one source, or whose mixture id was
    # zeroed, was believed (the rest of the epoch read only that source), as was a cursor of
    # 10**12. The id digests the sources, the weights and the changes.
    import copy

    store, _ = sources
    options = dict(mixture_samples=240, seed=2, output="numpy", with_indices=True, device="cpu")
    state = save_after_a_weight_change(store, WEIGHTS, 4, 1, 5, [0.2, 0.2, 0.6], 5, **options)[0]
    untouched = resumed(store, WEIGHTS, 4, 1, state, lambda batch: batch[0].tolist(), **options)
    one_source = copy.deepcopy(state)
    one_source["mixture"]["changes"][1] = [0, 20, [0.0, 0.0, 1.0]]
    zeroed = copy.deepcopy(state)
    zeroed["mixture"]["id"] = "0" * 64
    for altered, says in ((one_source, "altered after it was saved"), (zeroed, "altered after it was saved")):
        loader = store.loader(WEIGHTS, 4, **options)
        with pytest.raises(ValueError, match=says):
            loader.load_state_dict(altered)
        assert loader.mixture["changes"] == store.loader(WEIGHTS, 4, **options).mixture["changes"]
        # Refused whole: the loader resumes the true state afterwards as a fresh one does.
        loader.load_state_dict(state)
        assert [i for batch in loader for i in batch[0].tolist()] == untouched
    # A cursor moved after the save: the digest of the state's fields no longer matches.
    past = copy.deepcopy(state)
    past["cursor"] = 10**12
    with pytest.raises(ValueError, match="altered after it was saved"):
        store.loader(WEIGHTS, 4, **options).load_state_dict(past)
    # A state saved before states had a digest (or whose digest is None) is still checked field
    # by field.
    past["digest"] = None
    with pytest.raises(ValueError, match="past the end of an epoch of 240"):
        store.loader(WEIGHTS, 4, **options).load_state_dict(past)
    del past["digest"]
    with pytest.raises(ValueError, match="past the end of an epoch of 240"):
        store.loader(WEIGHTS, 4, **options).load_state_dict(past)
    # Written to JSON and read back (lists where tuples were), it resumes the same.
    import json

    loader = store.loader(WEIGHTS, 4, **options)
    loader.load_state_dict(json.loads(json.dumps(state)))
    assert [i for batch in loader for i in batch[0].tolist()] == untouched


def test_a_mixture_is_refused_what_it_cannot_read(sources, store):
    data = records(3, seed=7)
    store.ingest("bytes", [row.tobytes() for row in data])
    with pytest.raises(granary.Error, match="layout"):
        store.loader([("web", 1.0), ("bytes", 1.0)], 4, output="numpy", device="cpu").state_dict()
    with pytest.raises(ValueError, match="ordered by its weights"):
        store.loader(WEIGHTS, 4, order="sequential", output="numpy", device="cpu")
    loader = store.loader(WEIGHTS, 4, output="numpy", device="cpu")
    other = store.loader([("web", 0.5), ("code", 0.4), ("math", 0.1)], 4, output="numpy", device="cpu")
    with pytest.raises(ValueError, match="mixture"):
        loader.load_state_dict(other.state_dict())
    single = store.loader("web", 4, output="numpy", device="cpu")
    with pytest.raises(ValueError, match="mixture"):
        single.load_state_dict(loader.state_dict())
    # An epoch whose plan would not fit in memory is refused when the loader is made (2**63
    # samples grew the process past 17 GB in 100 s; 10**9 was killed under a 6 GB limit).
    for samples in (2**63, 10**12):
        with pytest.raises(granary.Error, match="held whole"):
            store.loader(WEIGHTS, 8, mixture_samples=samples, output="numpy", device="cpu")
