"""A Python loader on a replicated store heals from its peers, as `granary get --cluster-key`
does: two real `granary serve` processes on loopback, a dataset replicated to both, one of its
shards removed and another damaged on the second node, and a loader there (GRANARY_CLUSTER_KEY
set, nothing else) reads every record right, in the same order as an intact store gives. And on
six nodes holding a 4+2 erasure coding, a node that holds only fragments reads every record from
Python, rebuilt from the fragments of its peers."""

import os
import socket
import subprocess
import time

import numpy as np
import pytest

import granary

from conftest import RECORD, records


def _granary_bin():
    path = os.environ.get("GRANARY_BIN")
    if not path or not os.path.exists(path):
        pytest.fail("the replication test runs `granary serve`: set GRANARY_BIN to the binary (make test does)")
    return path


def _free_ports(n):
    held = [socket.socket() for _ in range(n)]
    for s in held:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in held]
    for s in held:
        s.close()
    return ports


def _start_nodes(roots, key):
    """`granary serve` on each of `roots`, every other one its peer; returns the processes once
    each listens."""
    ports = _free_ports(len(roots))
    env = {k: v for k, v in os.environ.items() if k not in ("GRANARY_ROOT", "GRANARY_CLUSTER_KEY")}
    nodes = []
    for i, root in enumerate(roots):
        peers = ",".join(f"127.0.0.1:{port}" for j, port in enumerate(ports) if j != i)
        nodes.append(
            subprocess.Popen(
                [_granary_bin(), "--root", str(root), "serve", "--listen", f"127.0.0.1:{ports[i]}",
                 "--peers", peers, "--cluster-key", str(key), "--heartbeat-ms", "100", "--down-after-ms", "1500"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            )
        )
    deadline = time.monotonic() + 30
    for i, root in enumerate(roots):
        while not (root / "replication" / "listen").exists():
            if time.monotonic() > deadline or nodes[i].poll() is not None:
                _stop(nodes)
                pytest.fail(f"node {i} did not start")
            time.sleep(0.05)
    return nodes


def _stop(nodes):
    for node in nodes:
        node.kill()
        node.wait()


def _wait_all_up(roots, key):
    """Until every node's status shows all the others up (heartbeats take a few rounds): a coding
    placed while a node still counts fewer peers puts its fragments on fewer nodes, and is
    refused as unavailable."""
    import json

    deadline = time.monotonic() + 30
    for root in roots:
        while True:
            done = subprocess.run([_granary_bin(), "--root", str(root), "status", "--json", "--cluster-key", str(key)],
                                  capture_output=True, text=True, timeout=60)
            peers = json.loads(done.stdout).get("peers", []) if done.returncode == 0 and done.stdout else []
            if sum(1 for peer in peers if peer.get("up") is True) >= len(roots) - 1:
                break
            assert time.monotonic() < deadline, f"{root}: not every peer up: {done.stdout or done.stderr}"
            time.sleep(0.1)


def _read_checked(loader, data):
    """Every batch of one epoch of `loader` (with indices), each record checked against `data`;
    the batches' indices, in order."""
    seen = []
    for indices, batch in loader:
        for index, row in zip(indices.tolist(), batch):
            assert np.array_equal(row, data[index]), f"record {index}"
        seen.append(indices.tolist())
    return seen


def _replicate(root, key, *how):
    """`granary replicate tokens HOW`, asked again while it is refused because the nodes have not
    yet seen each other's heartbeats ("with 1 nodes up")."""
    deadline = time.monotonic() + 30
    command = [_granary_bin(), "--root", str(root), "replicate", "tokens", *how, "--mode", "sync",
               "--cluster-key", str(key)]
    while True:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            return done.stdout
        assert time.monotonic() < deadline and "nodes up" in done.stderr, done.stderr
        time.sleep(0.2)


def test_a_loader_on_a_replicated_store_repairs_from_its_peer(tmp_path, monkeypatch):
    secret = "a cluster secret of this test only, " + str(tmp_path)
    key = tmp_path / "cluster.key"
    key.write_text(secret)
    roots = [tmp_path / "node0", tmp_path / "node1"]
    data = records(1280)
    granary.Store(roots[0], create=True).ingest("tokens", data, dtype="uint16", shape=[RECORD], shard_bytes=16 << 10)
    monkeypatch.delenv("GRANARY_CLUSTER_KEY", raising=False)
    nodes = _start_nodes(roots, key)
    try:
        _replicate(roots[0], key, "--replicas", "2")

        here = granary.Store(roots[1])
        assert [d["name"] for d in here.datasets()] == ["tokens"]
        intact = [
            indices.tolist()
            for indices, _ in here.loader("tokens", batch_size=32, seed=4, output="numpy", with_indices=True,
                                          tier_bytes=0)
        ]
        shards = sorted((roots[1] / "shards").rglob("*.shard"))
        assert len(shards) >= 4
        shards[0].unlink()
        with open(shards[2], "r+b") as f:
            f.seek(4096 + 100)
            byte = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([byte[0] ^ 0x20]))

        # Without the key, the loader has no way to heal: the read fails, naming the shard.
        with pytest.raises(granary.Error):
            list(here.loader("tokens", batch_size=32, seed=4, output="numpy", tier_bytes=0))
        monkeypatch.setenv("GRANARY_CLUSTER_KEY", secret)
        loader = here.loader("tokens", batch_size=32, seed=4, output="numpy", with_indices=True, tier_bytes=0)
        seen = _read_checked(loader, data)
        assert seen == intact, "the same sample order as from the intact store"
        metrics = loader.metrics()
        assert metrics["shards_repaired"] >= 2 and metrics["verify_failures"] >= 1, metrics
        loader.close()
    finally:
        _stop(nodes)


def test_a_node_that_holds_only_fragments_reads_every_record_from_python(tmp_path, monkeypatch):
    secret = "a cluster secret of this test only, " + str(tmp_path)
    key = tmp_path / "cluster.key"
    key.write_text(secret)
    roots = [tmp_path / f"node{i}" for i in range(6)]
    data = records(2048, seed=3)
    granary.Store(roots[0], create=True).ingest("tokens", data, dtype="uint16", shape=[RECORD], shard_bytes=32 << 10)
    intact = [
        indices.tolist()
        for indices, _ in granary.Store(roots[0]).loader("tokens", batch_size=32, seed=4, output="numpy",
                                                          with_indices=True, tier_bytes=0)
    ]
    monkeypatch.delenv("GRANARY_CLUSTER_KEY", raising=False)
    nodes = _start_nodes(roots, key)
    try:
        _wait_all_up(roots, key)
        out = _replicate(roots[0], key, "--ec", "4+2")
        assert "4+2 fragments" in out, out
        reader = roots[3]
        assert not list((reader / "shards").rglob("*.shard")), "a node of the coding holds no whole shard"
        assert list((reader / "fragments").rglob("*.fragment")), "it holds fragments"
        here = granary.Store(reader)
        assert [d["name"] for d in here.datasets()] == ["tokens"]

        # Without the key, it names what it lacks instead of returning anything.
        with pytest.raises(granary.Error):
            list(here.loader("tokens", batch_size=32, seed=4, output="numpy", tier_bytes=0))
        monkeypatch.setenv("GRANARY_CLUSTER_KEY", secret)
        loader = here.loader("tokens", batch_size=32, seed=4, output="numpy", with_indices=True)
        seen = _read_checked(loader, data)
        assert seen == intact, "the same sample order as on the node that ingested"
        assert loader.metrics()["shards_repaired"] >= 1, loader.metrics()
        loader.close()
    finally:
        _stop(nodes)
