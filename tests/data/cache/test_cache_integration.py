"""The loader with the local cache: warm epochs, outages, the size limit, shared caches."""

from __future__ import annotations

import os
import stat

import pytest

from tests.data.helpers import flatten, serve
from unbroken.data.dataset import SampleReadError
from unbroken.storage import RetryPolicy, StoreError

QUICK_RETRY = RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.02, deadline=2.0)


def cache_bytes(cache_dir: str) -> int:
    """Bytes of the cached files (regular files under objects/), what cache_limit bounds."""
    total = 0
    for d, _, files in os.walk(os.path.join(cache_dir, "objects")):
        for f in files:
            st = os.lstat(os.path.join(d, f))
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def test_second_epoch_is_served_from_cache_with_the_remote_down(make_volume, tmp_path):
    vol = make_volume(16)
    outage = tmp_path / "remote-is-down"
    url = "emulated::" + vol.url
    options = {"latency": 0.0, "bandwidth": None, "outage_file": str(outage)}
    vol.url, vol.options = url, options

    def loader(cache: str):
        return vol.loader(
            batch_size=4, num_workers=2, seed=3, cache_dir=str(tmp_path / cache), retry=QUICK_RETRY
        )

    ld = loader("cache")
    first = sorted(s for b in ld for s in flatten(b))
    outage.touch()
    second = sorted(s for b in ld for s in flatten(b))
    assert first == second == list(range(16))
    assert ld.metrics.misses == 16 and ld.metrics.hits >= 16
    # proof that the remote really is down: it cannot be listed, and with the index
    # known, a cold cache cannot serve a single file
    with pytest.raises(StoreError, match=r"cannot list the volume emulated::.*outage"):
        loader("cold-cache")
    cold = vol.loader(
        batch_size=4,
        cache_dir=str(tmp_path / "cold-cache"),
        index_dir=str(tmp_path / "cache" / "index"),
        retry=QUICK_RETRY,
    )
    with pytest.raises(SampleReadError, match=r"cannot read 'd\d/s\d+.txt' from emulated::"):
        list(cold)


@pytest.mark.s3
def test_second_epoch_is_served_from_cache_with_the_bucket_emptied(make_volume):
    vol = make_volume(12, "s3")
    ld = vol.loader(batch_size=3, num_workers=1, retry=QUICK_RETRY)
    first = sorted(s for b in ld for s in flatten(b))
    vol.store.delete("d0")
    vol.store.delete("d1")
    vol.store.delete("d2")
    assert vol.store.list() == []
    assert sorted(s for b in ld for s in flatten(b)) == first == list(range(12))


def test_cache_limit_is_respected(make_volume, tmp_path):
    vol = make_volume(0)
    for i in range(30):
        vol.store.write_bytes(f"f{i:03d}.bin", i.to_bytes(2, "big") * 500)  # 1000 bytes
    limit = 8000
    cache_dir = str(tmp_path / "small-cache")

    def decode(data: bytes, path: str) -> int:
        assert len(data) == 1000
        return int.from_bytes(data[:2], "big")

    ld = vol.loader(
        batch_size=2, num_workers=1, decode=decode, cache_dir=cache_dir, cache_limit=limit
    )
    for _ in range(2):
        assert sorted(s for b in ld for s in flatten(b)) == list(range(30))
        assert cache_bytes(cache_dir) <= limit
    assert ld.metrics.evictions > 0


def test_in_process_ranks_share_cache_too(make_volume):
    vol = make_volume(12)
    ranks = vol.ranks(2, batch_size=3, num_workers=1)
    serve(ranks)
    serve(ranks)
    assert sum(ld.metrics.misses for ld in ranks) == 12


def test_transient_remote_faults_are_retried_and_counted(make_volume):
    vol = make_volume(20)
    vol.url = "emulated::" + vol.url
    vol.options = {"latency": 0.0, "bandwidth": None, "fail_rate": 0.3, "seed": 5}
    patient = RetryPolicy(max_attempts=30, base_delay=0.001, max_delay=0.005, deadline=10.0)
    ld = vol.loader(batch_size=4, num_workers=2, retry=patient)
    assert sorted(s for b in ld for s in flatten(b)) == list(range(20))
    assert ld.metrics.retries > 0 and ld.metrics.misses == 20
