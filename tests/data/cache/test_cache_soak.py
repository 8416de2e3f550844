"""Soak (slow): processes killed at random while they fill and evict a small shared cache."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from tests.data._cache_util import disk_bytes, slow, spawn
from unbroken import open_store
from unbroken.data.cache.cache import LocalCache

READER = """
import json, random, sys
cache, entries, seed = OBJ
rng = random.Random(seed)
order = [rng.choice(entries) for _ in range(400)]
cache.plan(order)
for e in order:
    data = cache.read(e)
    print(json.dumps([e.key, data.hex()[:16], len(data)]), flush=True)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_random_kills_never_serve_wrong_bytes_and_the_ledger_recovers(tmp_path):
    store = open_store(str(tmp_path / "store"))
    rng = random.Random(1234)
    entries = []
    for i in range(40):
        size = rng.choice([10, 1000, 30_000, 120_000])
        store.write_bytes(f"s/{i:03d}", os.urandom(size))
    entries = store.list("s")
    digests = {e.key: store.read_bytes(e.key).hex()[:16] for e in entries}
    sizes = {e.key: e.size for e in entries}
    limit = 400_000
    remote = slow(store, latency=0.003, bandwidth=20e6)
    cache = LocalCache(remote, str(tmp_path / "cache"), limit=limit)
    cache.small_file = 50_000  # both fill paths: in memory and streamed to disk
    served = 0
    for round_ in range(6):
        procs = [spawn(READER, (cache, entries, round_ * 10 + k), tmp_path) for k in range(4)]
        time.sleep(rng.uniform(0.3, 1.5))
        for p in procs[:2]:  # two of them die mid-work
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode in (0, -signal.SIGKILL), err.decode()
            for line in out.decode().splitlines():
                try:
                    key, digest, n = json.loads(line)
                except ValueError:  # a line cut by the kill
                    continue
                assert digest == digests[key] and n == sizes[key]
                served += 1
        if not cache.layout.fillers.dead_reserved():  # no crash evidence left:
            assert cache.used_bytes == disk_bytes(cache.cache_dir)  # exact with no recount
        recovered = LocalCache(store, cache.cache_dir, limit=limit)
        assert recovered.used_bytes == disk_bytes(cache.cache_dir)
        assert disk_bytes(cache.cache_dir) <= limit + 4 * max(sizes.values())
    assert served > 400
