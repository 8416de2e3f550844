"""Loader metrics: how long the training loop waited, and what the workers did.

Workers count in their own process; each batch carries the counters that changed
since the worker's previous batch (a handful of numbers), and the main process adds
them up. ``fetch_seconds`` is measured where it matters: around the training loop's
``next()``. Everything is a few additions per batch, cheap enough to leave on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

WORKER_COUNTERS = (
    "samples",
    "skipped",
    "decode_seconds",
    "hits",
    "misses",
    "bytes_fetched",
    "remote_fetch_seconds",
    "retries",
    "evictions",
    "bytes_evicted",
    "waits",
)
"""Counters a worker ships with each batch, summed in the main process."""

_FROM_CACHE = {
    "hits": "hits",
    "misses": "misses",
    "bytes_fetched": "bytes_fetched",
    "fetch_seconds": "remote_fetch_seconds",
    "retries": "retries",
    "evictions": "evictions",
    "bytes_evicted": "bytes_evicted",
    "waits": "waits",
}
"""CacheStats field -> our counter name."""


class WorkerCounters:
    """A worker's running totals; ``take()`` gives what changed since the last call."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(WORKER_COUNTERS, 0)
        self._shipped: dict[str, float] = dict.fromkeys(WORKER_COUNTERS, 0)

    def add(self, name: str, value: float = 1) -> None:
        self.totals[name] += value

    def take(self, cache_stats: Mapping[str, Any] | None = None) -> dict[str, float]:
        """Deltas since the previous ``take``; ``cache_stats`` is the cache's snapshot."""
        if cache_stats:
            for theirs, ours in _FROM_CACHE.items():
                if theirs in cache_stats:
                    self.totals[ours] = cache_stats[theirs]
        delta = {k: v - self._shipped[k] for k, v in self.totals.items()}
        self._shipped = dict(self.totals)
        return {k: v for k, v in delta.items() if v}


class LoaderMetrics:
    """Totals since the loader was made, plus the recent per-batch waits."""

    def __init__(self, keep_last: int = 4096) -> None:
        self.batches = 0
        self.fetch_seconds = 0.0
        """Seconds the training loop spent blocked in ``next()``, in all."""
        self.batch_fetch_seconds: deque[float] = deque(maxlen=keep_last)
        """The wait of each recent batch, oldest first."""
        self.counters: dict[str, float] = dict.fromkeys(WORKER_COUNTERS, 0)

    def record_wait(self, seconds: float, *, counted_batch: bool) -> None:
        self.fetch_seconds += seconds
        if counted_batch:
            self.batches += 1
            self.batch_fetch_seconds.append(seconds)

    def add(self, delta: Mapping[str, float]) -> None:
        for k, v in delta.items():
            self.counters[k] = self.counters.get(k, 0) + v

    @property
    def last_fetch_seconds(self) -> float:
        return self.batch_fetch_seconds[-1] if self.batch_fetch_seconds else 0.0

    def __getattr__(self, name: str) -> float:
        counters = self.__dict__.get("counters", {})
        if name in counters:
            return counters[name]
        raise AttributeError(f"LoaderMetrics has no metric {name!r}")

    def snapshot(self) -> dict[str, float]:
        """All totals as a flat, JSON-able dict."""
        return {
            "batches": self.batches,
            "fetch_seconds": self.fetch_seconds,
            "last_fetch_seconds": self.last_fetch_seconds,
            **self.counters,
        }

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={v:.4g}" for k, v in self.snapshot().items())
        return f"LoaderMetrics({items})"
