"""An fsspec store whose server cannot be reached fails to list; it is not empty."""

from __future__ import annotations

import socket

import pytest

from unbroken import open_store
from unbroken.storage import RetriesExhaustedError, RetryPolicy


def test_listing_an_unreachable_http_store_fails(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there once it is closed
    retry = RetryPolicy(max_attempts=2, base_delay=0.0, max_delay=0.0)
    store = open_store(f"http://127.0.0.1:{port}/run", retry=retry)
    with pytest.raises(RetriesExhaustedError, match=f"127.0.0.1:{port}"):
        store.list()
    assert store.stats.retries == 1


def test_listing_an_absent_prefix_is_still_empty():
    store = open_store("memory://unbroken-test-absent-prefix")
    assert store.list("nothing/here") == []
