"""Counters of the local cache, cheap enough to leave on.

Each process counts its own work; DataLoader workers ship deltas of snapshots to the
main process, which adds them up. Snapshots are plain dicts so they pickle and JSON.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields


@dataclass
class CacheStats:
    """What the cache did in this process since it was created (or unpickled)."""

    hits: int = 0
    """Reads served from the cache directory (including files another process filled)."""
    misses: int = 0
    """Files this process fetched from the remote."""
    waits: int = 0
    """Times this process waited for another process (or thread) to fill a file."""
    bytes_fetched: int = 0
    """Bytes this process downloaded from the remote."""
    fetch_seconds: float = 0.0
    """Seconds spent in remote fetches, summed over threads (may exceed wall time)."""
    retries: int = 0
    """Transient remote failures the storage layer retried during this process's fetches."""
    evictions: int = 0
    """Files this process removed from the cache to respect its limit."""
    bytes_evicted: int = 0
    """Bytes those evictions freed."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: float) -> None:
        """Add to several counters at once, thread-safely."""
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def snapshot(self) -> dict[str, float]:
        """The counters as a plain dict (picklable, JSON-able)."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.init and f.repr}

    def merge(self, delta: Mapping[str, float]) -> None:
        """Add a snapshot delta shipped by another process (e.g. a DataLoader worker)."""
        self.add(**{k: v for k, v in delta.items() if k in _NAMES})

    def __getstate__(self) -> dict:
        state = asdict(self)
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


_NAMES = {f.name for f in fields(CacheStats) if f.repr}


def snapshot_delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    """``after - before``, counter by counter: what happened between two snapshots."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in _NAMES}


def snapshot_sum(*snapshots: Mapping[str, float]) -> dict[str, float]:
    """The counter-wise sum of snapshots (or deltas) from several processes."""
    return {k: sum(s.get(k, 0) for s in snapshots) for k in _NAMES}
