"""The tier from Python: the memory tier and the page cache tier (the default) serving every
epoch and a new loader each epoch, the evictor plugin, and bad tier settings refused when the
loader is made."""

import pytest

import granary

from conftest import RECORD, read_epoch, records


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

def test_a_bad_tier_setting_in_the_environment_is_refused_when_the_loader_is_made(tokens, monkeypatch):
    store, _ = tokens
    monkeypatch.setenv("GRANARY_TIER_BYTES", "lots")
    with pytest.raises(granary.Error, match="GRANARY_TIER_BYTES"):
        store.loader("tokens", batch_size=16)
