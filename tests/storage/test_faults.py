"""Transient faults are retried until the bytes land; permanent ones surface at once."""

from __future__ import annotations

import hashlib
import math
import os
import random
import time

import pytest

from unbroken import open_store
from unbroken.storage import (
    EmulatedStore,
    ObjectNotFoundError,
    RemoteProfile,
    RetriesExhaustedError,
    RetryPolicy,
    StoreError,
)
from unbroken.storage.emulated import EMULATED_PREFIX

FAST_RETRY = RetryPolicy(max_attempts=12, base_delay=0.001, max_delay=0.02)


def faulty(store_url: tuple[str, dict], **profile) -> EmulatedStore:
    url, options = store_url
    profile.setdefault("latency", 0)
    profile.setdefault("bandwidth", None)
    store = open_store(EMULATED_PREFIX + url, retry=FAST_RETRY, **options, **profile)
    assert isinstance(store, EmulatedStore)
    return store


def _payload(i: int, size: int) -> bytes:
    seed = hashlib.sha256(str(i).encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


@pytest.mark.parametrize("store_url", ["local", "memory", "s3"], indirect=True)
def test_200_writes_through_a_20_percent_faulty_remote_all_land_intact(store_url):
    store = faulty(store_url, fail_rate=0.2, cut_rate=0.05, seed=7)
    rng = random.Random(42)
    # Log-uniform sizes from 0 B to 20 MB, both ends included.
    sizes = [0, 20_000_000] + [int(math.exp(rng.uniform(0, math.log(20e6)))) for _ in range(198)]
    for i, size in enumerate(sizes):
        store.write_bytes(f"obj/{i:03d}", _payload(i, size))
    assert store.faults_injected > 20
    listed = store.list("obj")
    assert [e.key for e in listed] == [f"obj/{i:03d}" for i in range(200)]
    assert [e.size for e in listed] == sizes
    for i, size in enumerate(sizes):
        assert store.read_bytes(f"obj/{i:03d}") == _payload(i, size), f"obj/{i:03d}"
    assert store.stats.retries >= store.faults_injected - 1  # every fault was retried


def test_permanent_error_surfaces_at_once_without_retries(tmp_path):
    store = faulty((str(tmp_path), {}), latency=0.0)
    start = time.monotonic()
    with pytest.raises(ObjectNotFoundError, match=r"read_bytes emulated::.*missing/key"):
        store.read_bytes("missing/key")
    assert store.stats.retries == 0
    assert time.monotonic() - start < FAST_RETRY.max_delay * FAST_RETRY.max_attempts


def test_permission_denied_is_permanent(tmp_path):
    if hasattr(__import__("os"), "geteuid") and __import__("os").geteuid() == 0:
        # root ignores file modes; use a path under a regular file instead (ENOTDIR).
        (tmp_path / "file").write_bytes(b"x")
        store = open_store(tmp_path / "file", retry=FAST_RETRY)
        with pytest.raises(OSError, match="write_bytes") as err:
            store.write_bytes("k", b"x")
        assert store.stats.retries == 0
        assert str(tmp_path) in str(err.value)
        return
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    store = open_store(ro, retry=FAST_RETRY)
    with pytest.raises(PermissionError, match="permission denied"):
        store.write_bytes("k", b"x")
    assert store.stats.retries == 0


def test_outage_exhausts_retries_with_a_named_error(tmp_path):
    policy = RetryPolicy(max_attempts=4, base_delay=0.001, max_delay=0.002)
    store = open_store(
        f"emulated::{tmp_path}", retry=policy, latency=0, bandwidth=None, outage_at=0.0
    )
    with pytest.raises(RetriesExhaustedError) as err:
        store.write_bytes("ckpt/manifest.json", b"{}")
    message = str(err.value)
    assert "write_bytes" in message and "ckpt/manifest.json" in message
    assert "4 attempts" in message and "outage" in message
    assert store.stats.retries == 3
    assert not (tmp_path / "ckpt").exists()


def test_outage_switch_file_takes_the_remote_down_and_back(tmp_path):
    switch = tmp_path / "down"
    store = open_store(
        f"emulated::{tmp_path}/remote",
        retry=RetryPolicy(max_attempts=2, base_delay=0.001),
        latency=0,
        bandwidth=None,
        outage_file=str(switch),
    )
    store.write_bytes("a", b"1")
    switch.touch()
    with pytest.raises(RetriesExhaustedError):
        store.read_bytes("a")
    switch.unlink()
    assert store.read_bytes("a") == b"1"


def test_deadline_bounds_total_time(tmp_path):
    policy = RetryPolicy(max_attempts=1000, base_delay=0.01, max_delay=0.05, deadline=0.3)
    store = open_store(f"emulated::{tmp_path}", retry=policy, latency=0, outage_at=0.0)
    with pytest.raises(RetriesExhaustedError):
        store.exists("k")
    assert store.stats.retries < 1000


def test_an_outage_past_a_few_seconds_is_reported_at_each_retry(tmp_path, monkeypatch, caplog):
    """A hung or down endpoint costs up to the deadline: past SLOW_SECONDS each retry is
    logged (what, where, how long so far, how long more), quick retries are not."""
    monkeypatch.setattr("unbroken.storage.retry.SLOW_SECONDS", 0.2)
    policy = RetryPolicy(max_attempts=100, base_delay=0.05, max_delay=0.05, deadline=1.0)
    store = open_store(f"emulated::{tmp_path}", retry=policy, latency=0, outage_at=0.0)
    with (
        caplog.at_level("WARNING", logger="unbroken.storage.retry"),
        pytest.raises(RetriesExhaustedError),
    ):
        store.read_bytes("ckpt/manifest.json")
    said = [r.getMessage() for r in caplog.records]
    assert said and len(said) < store.stats.retries, (said, store.stats.retries)
    assert all("read_bytes" in m and "ckpt/manifest.json" in m for m in said), said
    bounds = "up to 100 attempts, none begun after 1 s"
    assert all("outage" in m and bounds in m for m in said), said
    assert len(said) <= 1.0 / 0.2 + 1  # at most one line per SLOW_SECONDS
    caplog.clear()
    short = RetryPolicy(max_attempts=100, base_delay=0.01, max_delay=0.01, deadline=0.15)
    quick = open_store(f"emulated::{tmp_path}/q", retry=short, latency=0, outage_at=0.0)
    with (
        caplog.at_level("WARNING", logger="unbroken.storage.retry"),
        pytest.raises(RetriesExhaustedError),
    ):
        quick.exists("k")  # retried, but never past the threshold: quiet
    assert quick.stats.retries > 1 and caplog.records == []


@pytest.mark.parametrize("op", ["write_bytes", "upload"])
def test_cut_writes_and_uploads_leave_nothing_behind(tmp_path, op):
    store = open_store(
        f"emulated::{tmp_path / 'remote'}",
        retry=RetryPolicy(max_attempts=1),
        latency=0,
        bandwidth=None,
        cut_rate=1.0,
    )
    local = tmp_path / "f"
    local.write_bytes(b"x" * 1000)
    with pytest.raises(RetriesExhaustedError, match=f"{op} k cut off after 500 of 1000 bytes"):
        if op == "upload":
            store.upload(str(local), "k")
        else:
            store.write_bytes("k", local.read_bytes())
    assert store.inner.list() == []


def test_remote_profile_validation_and_defaults():
    standard = RemoteProfile()
    assert (standard.latency, standard.bandwidth) == (0.020, 200e6)
    assert "20 ms per request, 200 MB/s" in standard.describe()
    options = {"bandwidth": "50MB", "latency": 0.001, "endpoint_url": "x"}
    profile = RemoteProfile.pop_from(options)
    assert profile.bandwidth == 50e6 and options == {"endpoint_url": "x"}
    with pytest.raises(ValueError, match="fail_rate"):
        RemoteProfile(fail_rate=1.5)
    with pytest.raises(ValueError, match="not a byte size"):
        RemoteProfile.pop_from({"bandwidth": "fast"})


def test_a_failed_copy_into_the_emulated_remote_reaches_the_uploader(tmp_path):
    """The remote's copy runs beside the link transfer, in its own thread: its error must
    still be the upload's error, and the transfer must not report success."""
    root = tmp_path / "remote"
    root.mkdir()
    (root / "a").write_bytes(b"")  # a file where the key needs a directory
    store = open_store(f"emulated::{root}", retry=RetryPolicy(max_attempts=1), latency=0)
    local = tmp_path / "f"
    local.write_bytes(os.urandom(50_000))
    with pytest.raises(StoreError, match=r"upload .*a/b: FileExistsError") as err:
        store.upload(str(local), "a/b")
    assert isinstance(err.value.__cause__, FileExistsError)
    assert [e.key for e in store.inner.list()] == ["a"]
    store.upload(str(local), "c/d")  # and the store still works
    assert store.read_bytes("c/d") == local.read_bytes()


@pytest.mark.parametrize("inner", ["local", "memory"])
def test_an_upload_whose_transfer_fails_lands_nothing(tmp_path, monkeypatch, inner):
    """The remote's copy runs beside the transfer, but is published only after it
    (a local directory stages it under a temp name; other stores copy afterwards)."""
    root = tmp_path / "remote"
    url = str(root) if inner == "local" else f"memory://{tmp_path.name}-remote"
    store = open_store(f"emulated::{url}", retry=RetryPolicy(max_attempts=1), latency=0)
    local = tmp_path / "f"
    local.write_bytes(os.urandom(100_000))

    def link_down_mid_transfer(nbytes: int, ready: float) -> None:
        time.sleep(0.2)  # long enough for the copy beside it to have finished
        raise ConnectionResetError("emulated link down mid-transfer")

    monkeypatch.setattr(store, "_move", link_down_mid_transfer)
    with pytest.raises(StoreError, match="link down mid-transfer"):
        store.upload(str(local), "a/k")
    assert store.inner.list() == []
    assert [f for _, _, files in os.walk(root) for f in files] == []  # no temp file either
    monkeypatch.undo()
    store.upload(str(local), "a/k")
    assert store.read_bytes("a/k") == local.read_bytes()
