"""Packed sequences from Python: a Megatron corpus read as windows of seq_len + 1 tokens with
their documents' boundaries; every token once per epoch but the overlaps, the same windows on
any world size, and a state saved on three ranks resumed on two."""

import numpy as np
import pytest

import granary

from conftest import resumed, save_after_a_weight_change, write_megatron

EOD = 2**31 - 1
SEQ = 32


@pytest.fixture
def corpus(store, tmp_path):
    """Megatron int32 documents; token t of document d is d * 1000 + t."""
    docs = [np.arange(d * 1000, d * 1000 + (d * 37 % 91) + 1, dtype=np.int32) for d in range(160)]
    prefix = str(tmp_path / "corpus_text_document")
    write_megatron(prefix, docs, np.int32, 4)
    store.ingest_megatron("corpus", prefix + ".bin")
    return store, docs


def read_windows(store, size, state=None, **options):
    """{window: (tokens, cu_seqlens within it, position_ids)} of every rank of `size`."""
    out = {}
    for rank in range(size):
        loader = store.loader("corpus", 4, seq_len=SEQ, eod=EOD, rank=rank, world_size=size, output="numpy",
                              with_indices=True, device="cpu", seed=3, **options)
        if state is not None:
            loader.load_state_dict(state)
        for windows, batch in loader:
            tokens, cu, ids = batch["tokens"], batch["cu_seqlens"], batch["position_ids"]
            assert tokens.shape == (len(windows), SEQ + 1) and tokens.dtype == np.int32
            assert cu[0] == 0 and cu[-1] == tokens.size
            flat = ids.reshape(-1)
            for lo, hi in zip(cu[:-1], cu[1:]):
                assert (flat[lo:hi] == np.arange(hi - lo)).all(), "position ids restart at each run"
            for k, w in enumerate(windows.tolist()):
                lo, hi = k * (SEQ + 1), (k + 1) * (SEQ + 1)
                inner = [c - lo for c in cu.tolist() if lo <= c <= hi]
                assert w not in out
                out[w] = (tokens[k].tolist(), inner, ids[k].tolist())
    return out


def test_windows_cover_every_token_once_with_the_documents_runs(corpus):
    store, docs = corpus
    windows = read_windows(store, 1)
    n = len(windows)
    assert sorted(windows) == list(range(n))
    stream = []
    for w in range(n):
        tokens, cu, _ = windows[w]
        stream.extend(tokens if w == n - 1 else tokens[:-1])
        for lo, hi in zip(cu[:-1], cu[1:]):
            run = [t for t in tokens[lo:hi] if t != EOD]
            assert len({t // 1000 for t in run}) <= 1, "a run is one document's"
            assert all(b == a + 1 for a, b in zip(run, run[1:])), "consecutive tokens"
    parts, doc = [], []
    for t in stream:
        if t == EOD:
            parts.append(doc)
            doc = []
        else:
            doc.append(t)
    seen = set()
    for part in parts:
        d = part[0] // 1000
        assert part == docs[d].tolist() and d not in seen
        seen.add(d)
    total = sum(len(d) + 1 for d in docs)
    assert n == (total - 1) // SEQ and total - len(stream) < SEQ


def test_every_world_size_reads_the_same_windows_and_resumes_from_three_ranks_on_two(corpus):
    store, _ = corpus
    one = read_windows(store, 1)
    assert read_windows(store, 3) == one
    # Three ranks save after 4 steps of 12 windows; two resume.
    states = []
    for rank in range(3):
        loader = store.loader("corpus", 4, seq_len=SEQ, eod=EOD, rank=rank, world_size=3, output="numpy",
                              device="cpu", seed=3)
        it = iter(loader)
        for _ in range(4):
            next(it)
        states.append(loader.state_dict())
    assert all(s == states[0] for s in states) and states[0]["cursor"] == 48
    rest = read_windows(store, 2, state=states[0])
    assert rest == {w: v for w, v in one.items() if w >= 48}


def test_windows_within_documents_are_padded_and_packing_refuses_what_it_cannot_cut(corpus):
    store, docs = corpus
    loader = store.loader("corpus", 8, seq_len=SEQ, within_documents=True, pad=0, output="numpy", device="cpu")
    covered = {}
    for batch in loader:
        for tokens, real in zip(batch["tokens"], batch["real_tokens"]):
            d = tokens[0] // 1000
            assert (tokens[:real] // 1000 == d).all() and (tokens[real:] == 0).all()
            covered.setdefault(d, set()).update(tokens[:real].tolist())
    for d, doc in enumerate(docs):
        if len(doc) > 1:
            assert covered[d] == set(doc.tolist())
    store.ingest("images", [np.zeros(4, dtype=np.float32)], dtype="float32", shape=[4])
    with pytest.raises(granary.Error, match="integer tokens"):
        next(iter(store.loader("images", 2, seq_len=8, output="numpy", device="cpu")))
    with pytest.raises(ValueError, match="seq_len"):
        store.loader("corpus", 2, eod=1, output="numpy", device="cpu")
    # Issue 55: an eod the int32 tokens cannot hold arrived as -2**31; a seq_len longer than the
    # corpus gave empty epochs without a word.
    for option in ({"eod": 2**31}, {"pad": 2**31, "within_documents": True}):
        with pytest.raises(granary.Error, match=r"does not fit the dataset's i32 tokens \(at most 2147483647\)"):
            next(iter(store.loader("corpus", 2, seq_len=SEQ, output="numpy", device="cpu", **option)))
    total = sum(len(d) for d in docs)
    with pytest.raises(granary.Error, match=rf"a seq_len of {total + 1} makes no window of this corpus \(160 documents, {total} tokens\)"):
        next(iter(store.loader("corpus", 2, seq_len=total + 1, output="numpy", device="cpu")))


def test_a_mixture_of_packed_sources_blends_windows_and_resumes_after_a_weight_change(store, tmp_path):
    for name, first, n in (("a", 0, 120), ("b", 1000, 30)):
        docs = [np.arange(d * 1000, d * 1000 + (d * 37 % 91) + 2, dtype=np.int32) for d in range(first, first + n)]
        write_megatron(str(tmp_path / name), docs, np.int32, 4)
        store.ingest_megatron(name, tmp_path / name)
    mix = [("a", 0.7), ("b", 0.3)]
    options = dict(seq_len=SEQ, eod=EOD, mixture_samples=96, output="numpy", device="cpu", seed=5)

    def source(tokens):
        ids = {int(t) // 1000 >= 1000 for t in tokens if t != EOD}
        assert len(ids) == 1, "a window is one source's"
        return ids.pop()

    ref = store.loader(mix, 12, **options)
    it = iter(ref)
    windows = [w for _ in range(3) for w in next(it)["tokens"]]
    ref.change_weights([0.2, 0.8])
    windows += [w for batch in it for w in batch["tokens"]]
    assert len(windows) == 96
    counts = [0, 0]
    for p, w in enumerate(windows[:36], 1):
        counts[source(w)] += 1
        assert abs(counts[0] - 0.7 * p) < 1 and abs(counts[1] - 0.3 * p) < 1
    after = [source(w) for w in windows[36:]]
    assert abs(sum(after) / len(after) - 0.8) < 0.05

    # Three ranks make the same change after 3 steps and save after 5; two resume.
    states = save_after_a_weight_change(store, mix, 4, 3, 3, [0.2, 0.8], 2, **options)
    assert states[0]["cursor"] == 60 and all(s == states[0] for s in states)
    rest = resumed(store, mix, 6, 2, states[0], lambda batch: batch["tokens"], **options)
    assert len(rest) == 36
    assert all((x == y).all() for x, y in zip(rest, windows[60:]))
