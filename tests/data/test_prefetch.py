"""Prefetcher: order, bounded read-ahead, overlap of remote latency, errors by name."""

from __future__ import annotations

import pickle
import time

import pytest

from tests.data._cache_util import put_files, slow
from unbroken.data.cache.cache import LocalCache
from unbroken.data.prefetch import Prefetcher
from unbroken.storage import Entry, ObjectNotFoundError


def test_yields_every_entry_in_input_order(store, tmp_path):
    sizes = [1, 5000, 10, 70_000, 3, 900, 20_000, 0, 42]
    for i, n in enumerate(sizes):
        store.write_bytes(f"d/{i:02d}", bytes([i]) * n)
    entries = store.list("d")[::-1]  # not the listing order
    with Prefetcher(LocalCache(slow(store), str(tmp_path / "c")), depth=4, threads=3) as pf:
        got = list(pf.iterate(entries))
    assert [e for e, _ in got] == entries
    assert [data for _, data in got] == [store.read_bytes(e.key) for e in entries]


def test_reads_ahead_at_most_depth(store, tmp_path):
    entries = put_files(store, 20, size=100)
    cache = LocalCache(slow(store, latency=0.01), str(tmp_path / "c"))
    with Prefetcher(cache, depth=5, threads=5) as pf:
        it = pf.iterate(entries)
        next(it)
        time.sleep(0.3)  # the consumer is busy: read-ahead must stop at the window
        assert cache.stats.misses == 5
        next(it)
        time.sleep(0.3)
        assert cache.stats.misses == 6
        assert len(list(it)) == 18
    assert pf.max_in_flight <= 5


def test_hides_remote_latency(store, tmp_path):
    entries = put_files(store, 24, size=100)
    # the standard 20 ms; on S3, 50 ms: well above moto's own cost per request on a busy box
    remote = slow(store, latency=0.05 if store.url.startswith("s3://") else 0.02)
    one_by_one = LocalCache(remote, str(tmp_path / "seq"))
    started = time.monotonic()
    for e in entries:
        one_by_one.read(e)
    sequential = time.monotonic() - started

    with Prefetcher(LocalCache(remote, str(tmp_path / "pf")), depth=16, threads=8) as pf:
        for _ in pf.iterate(entries):
            pass
    assert pf.max_in_flight > 1  # fetches overlapped
    assert pf.wait_seconds < 0.5 * sequential  # wide margin: ideal is about 1/8


def test_error_names_the_file_after_yielding_those_before(store, tmp_path):
    good = put_files(store, 6, size=100)
    missing = Entry("f/lost.bin", 100, "x")
    entries = [*good[:3], missing, *good[3:]]
    cache = LocalCache(slow(store, latency=0.005), str(tmp_path / "c"))
    seen = []
    with Prefetcher(cache, depth=4, threads=2) as pf:
        with pytest.raises(ObjectNotFoundError, match=r"f/lost\.bin"):
            for entry, _ in pf.iterate(entries):
                seen.append(entry)
        assert seen == good[:3]
        assert [e for e, _ in pf.iterate(good)] == good  # still usable afterwards


def test_stopping_early_cancels_the_rest(store, tmp_path):
    entries = put_files(store, 40, size=100)
    cache = LocalCache(slow(store, latency=0.02), str(tmp_path / "c"))
    pf = Prefetcher(cache, depth=4, threads=2)
    it = pf.iterate(entries)
    next(it)
    it.close()
    pf.close()
    pf.close()
    assert cache.stats.misses <= 4


def test_picklable_and_validated(store, tmp_path):
    cache = LocalCache(store, str(tmp_path / "c"))
    pf = Prefetcher(cache, depth=3, threads=9)
    assert pf.threads == 3  # never more threads than the window
    list(pf.iterate(put_files(store, 2)))
    clone = pickle.loads(pickle.dumps(pf))
    assert (clone.depth, clone.threads, clone.max_in_flight) == (3, 3, 0)
    pf.close()
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(cache, depth=0)


def test_cached_files_are_read_by_the_consumer_without_threads(store, tmp_path):
    entries = put_files(store, 12, size=300)
    cache = LocalCache(slow(store, latency=0.005), str(tmp_path / "c"))
    with Prefetcher(cache, depth=4, threads=4) as pf:
        assert [d for _, d in pf.iterate(entries)] == [store.read_bytes(e.key) for e in entries]
    assert pf.max_in_flight > 0  # cold: fetched on the threads
    with Prefetcher(cache, depth=4, threads=4) as warm:
        it = warm.iterate(entries)
        first = next(it)
        # a file cached when the window was planned but gone by its turn is fetched then
        assert cache.layout.remove_if_unpinned(cache._name(entries[2])) == 300
        rest = list(it)
    assert [e for e, _ in [first, *rest]] == entries
    assert [d for _, d in [first, *rest]] == [store.read_bytes(e.key) for e in entries]
    assert warm.max_in_flight == 0  # every read ran on the consumer
    assert cache.stats.misses == 13  # 12 cold, then the one removed


def test_a_bad_entry_fails_at_its_own_turn_not_when_it_enters_the_window(store, tmp_path):
    good = put_files(store, 4, size=100)
    cache = LocalCache(store, str(tmp_path / "c"))
    seen = []
    with Prefetcher(cache, depth=8, threads=2) as pf, pytest.raises(TypeError, match="Entry"):
        for entry, _ in pf.iterate([good[0], good[1], "not-an-entry", good[2]]):
            seen.append(entry)
    assert seen == good[:2]


def test_an_unclosed_prefetcher_stops_its_threads_when_dropped(store, tmp_path):
    import gc
    import threading

    entries = put_files(store, 6, size=100)
    pf = Prefetcher(LocalCache(slow(store, latency=0.005), str(tmp_path / "c")), 4, 4)
    list(pf.iterate(entries))
    workers = [t for t in threading.enumerate() if t.name == "unbroken-prefetch"]
    assert workers
    del pf
    gc.collect()
    for t in workers:
        t.join(5)
    assert not any(t.is_alive() for t in workers)
