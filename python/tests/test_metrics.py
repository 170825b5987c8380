"""The process's metrics from Python: a scrape of `serve_metrics` follows what its loaders
delivered, and a forked child (a DataLoader worker) neither sees the parent's loaders nor keeps
its port."""

import multiprocessing
import threading

import pytest

import granary
from conftest import RECORD


def _scraped(port, name):
    """The sum of `name`'s samples in a scrape of the endpoint on `port` (0 when absent)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_a_scrape_of_the_process_counts_what_its_loaders_delivered(tokens, monkeypatch):
    store, _ = tokens
    monkeypatch.setenv("LOCAL_RANK", "0")
    endpoint = granary.serve_metrics(0, "127.0.0.1")
    try:
        assert endpoint.port > 0 and endpoint.host == "127.0.0.1"
        # Other tests' loaders ran in this process too: what this epoch adds is measured.
        before = _scraped(endpoint.port, "granary_loader_delivered_bytes_total")
        batches_before = _scraped(endpoint.port, "granary_loader_batches_total")
        loader = store.loader("tokens", batch_size=100, output="numpy")
        for _ in loader:
            pass
        assert _scraped(endpoint.port, "granary_loader_delivered_bytes_total") - before == 1000 * RECORD * 2
        assert _scraped(endpoint.port, "granary_loader_batches_total") - batches_before == 10
        assert "granary_loader_step_stall_seconds_bucket" in granary.metrics_text()
    finally:
        endpoint.close()
    with pytest.raises(OSError):
        _scraped(endpoint.port, "granary_loader_batches_total")


def _metrics_in_child(queue):
    queue.put(granary.metrics_text())


def test_a_forked_child_has_its_own_metrics_and_never_the_parent_s_loaders(tokens):
    store, _ = tokens
    loader = store.loader("tokens", batch_size=100, output="numpy")
    for _ in loader:
        pass
    assert "granary_loader_batches_total" in granary.metrics_text()
    # A scrape running in another thread while the fork happens must not leave the child's
    # registry locked.
    stop = threading.Event()

    def scrape():
        while not stop.is_set():
            granary.metrics_text()

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        context = multiprocessing.get_context("fork")
        for _ in range(3):
            queue = context.Queue()
            child = context.Process(target=_metrics_in_child, args=(queue,))
            child.start()
            text = queue.get(timeout=60)
            child.join(timeout=60)
            assert child.exitcode == 0
            assert "granary_loader_batches_total" not in text, "the parent's loaders are not the child's"
    finally:
        stop.set()
        scraper.join()


def _wait_in_child(started, release):
    started.put(granary.metrics_text())
    release.get(timeout=60)


def test_a_forked_child_does_not_keep_the_parent_s_metrics_port(tokens):
    endpoint = granary.serve_metrics(0, "127.0.0.1")
    port = endpoint.port
    context = multiprocessing.get_context("fork")
    started, release = context.Queue(), context.Queue()
    child = context.Process(target=_wait_in_child, args=(started, release))
    child.start()
    try:
        started.get(timeout=60)
        endpoint.close()
        # The child is alive; its copy of the listening socket was closed at the fork, so the
        # port is free again.
        again = granary.serve_metrics(port, "127.0.0.1", offset_by_local_rank=False)
        assert again.port == port
        again.close()
    finally:
        release.put(None)
        child.join(timeout=60)
    assert child.exitcode == 0
