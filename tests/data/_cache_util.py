"""Helpers shared by the cache and prefetch tests (not fixtures: no conftest clash)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import uuid

from tests.link_names import private_link
from unbroken.storage import EmulatedStore, Entry, RemoteProfile, RetryPolicy, Store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def put_files(store: Store, n: int, size: int = 1000, prefix: str = "f") -> list[Entry]:
    """``n`` files of distinct random content; returns their listed entries, sorted."""
    for i in range(n):
        store.write_bytes(f"{prefix}/{i:04d}.bin", os.urandom(size))
    return store.list(prefix)


def slow(
    store: Store,
    *,
    latency: float = 0.02,
    bandwidth: float | None = None,
    retry: RetryPolicy | None = None,
    **profile: object,
) -> EmulatedStore:
    """``store`` behind an emulated network on a link of its own (no cross-test sharing)."""
    link = private_link("cache")
    remote = RemoteProfile(latency=latency, bandwidth=bandwidth, link=link, **profile)
    return EmulatedStore(store, remote, retry=retry)


FAST_RETRY = RetryPolicy(max_attempts=2, base_delay=0.001, max_delay=0.01)


def spawn(script: str, obj: object, tmp_path) -> subprocess.Popen:
    """Run ``script`` in a fresh interpreter with ``obj`` unpickled as ``OBJ``."""
    blob = tmp_path / f"obj-{uuid.uuid4().hex[:6]}.pkl"
    blob.write_bytes(pickle.dumps(obj))
    code = f"import pickle\nOBJ = pickle.load(open({str(blob)!r}, 'rb'))\n" + script
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + ROOT)
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def disk_bytes(cache_dir: str) -> int:
    """Bytes of regular files under the cache's objects/ directory, temp files included."""
    total = 0
    for dirpath, _dirs, files in os.walk(os.path.join(cache_dir, "objects")):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                total += os.path.getsize(path)
    return total
