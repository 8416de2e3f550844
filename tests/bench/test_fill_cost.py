"""bench/data/fill_cost.py: each layer of a fill measured, over the real S3 server."""

from __future__ import annotations

import os

import pytest

from bench.data import fill_cost
from unbroken import open_store


def test_every_layer_is_measured_and_the_cache_fetch_leaves_the_files_cached(tmp_path, s3_server):
    store = open_store(f"s3://{s3_server.new_root()}", **s3_server.storage_options)
    entries = fill_cost.put_files(store, 12, 5_000)
    assert len(entries) == 12 and {e.size for e in entries} == {5_000}
    rows = fill_cost.measure(store, entries, 5_000, 4, str(tmp_path))
    assert sorted(rows) == ["cache fetch", "disk write", "get"]
    assert all(ms > 0 for ms in rows.values()), rows
    assert os.listdir(tmp_path) == [], "the cache and the disk files are removed"


def test_cpu_per_item_counts_every_item_once_none_included():
    seen = []
    items = [*range(50), None, 0]
    ms = fill_cost.cpu_ms_per_item(items, seen.append, threads=3)
    assert sorted(seen, key=repr) == sorted(items, key=repr) and ms >= 0


def test_an_item_that_fails_fails_the_measurement():
    def work(item: object) -> None:
        if item == 3:
            raise OSError("the fetch of item 3 failed")

    with pytest.raises(OSError, match="item 3"):
        fill_cost.cpu_ms_per_item(list(range(20)), work, threads=2)


def test_a_cache_fetch_that_caches_nothing_fails_the_measurement(tmp_path, s3_server, monkeypatch):
    store = open_store(f"s3://{s3_server.new_root()}", **s3_server.storage_options)
    entries = fill_cost.put_files(store, 3, 1_000)
    monkeypatch.setattr(fill_cost.LocalCache, "fetch", lambda self, entry: None)
    with pytest.raises(RuntimeError, match="left 3 files uncached"):
        fill_cost.measure(store, entries, 1_000, 2, str(tmp_path))
