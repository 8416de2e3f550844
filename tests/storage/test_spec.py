"""A store described as JSON opens the same objects in another process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import unbroken as ub
from unbroken.storage import LocalStore, RetryPolicy
from unbroken.storage.spec import open_spec, store_spec


def reopened(store):
    spec = store_spec(store)
    assert spec is not None
    return open_spec(json.loads(json.dumps(spec)))


def test_a_path_and_its_retry_policy_round_trip(tmp_path):
    store = ub.open_store(tmp_path, retry=RetryPolicy(max_attempts=3, deadline=9.0))
    store.write_bytes("a/b", b"x")
    again = reopened(store)
    assert isinstance(again, LocalStore) and again.url == store.url
    assert again.retry == store.retry
    assert again.read_bytes("a/b") == b"x"


def test_the_emulated_remote_keeps_its_profile(tmp_path):
    store = ub.open_store(f"emulated::{tmp_path}", latency=0.001, bandwidth="10MB", seed=3)
    again = reopened(store)
    assert again.url == store.url and again.profile == store.profile
    assert again.inner.uncached_uploads


def test_s3_through_both_backends(s3_server):
    root = s3_server.new_root()
    for backend in ("native", "fsspec"):
        store = ub.open_store(f"s3://{root}", backend=backend, **s3_server.storage_options)
        store.write_bytes(f"{backend}/k", backend.encode())
        again = reopened(store)
        assert type(again) is type(store)
        assert again.read_bytes(f"{backend}/k") == backend.encode()


def test_another_process_reads_what_this_one_wrote(tmp_path):
    store = ub.open_store(f"emulated::{tmp_path}", latency=0.0)
    store.write_bytes("k", b"seen")
    code = (
        "import json, sys; from unbroken.storage.spec import open_spec; "
        "print(open_spec(json.loads(sys.argv[1])).read_bytes('k').decode())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(store_spec(store))],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "seen"


def test_what_another_process_cannot_reach_has_no_description(tmp_path):
    class Mine(LocalStore):
        pass

    assert store_spec(ub.open_store("memory://bucket/x")) is None  # lives in this process
    assert store_spec(Mine(str(tmp_path))) is None  # a user's own class
    assert store_spec(ub.open_store(f"emulated::{tmp_path}", latency=0.0)) is not None


def test_an_option_only_python_holds_has_no_description(s3_server):
    options = {**s3_server.storage_options, "client_kwargs": {"x": object()}}
    store = ub.open_store(f"s3://{s3_server.new_root()}", backend="fsspec", **options)
    assert store_spec(store) is None


def test_an_unknown_kind_is_named():
    with pytest.raises(ValueError, match="unknown store kind 'tape'"):
        open_spec({"kind": "tape", "retry": {}})
