"""Read ahead: fetch the next files of a worker's slice on a bounded pool of threads.

``iterate`` yields (entry, bytes) in input order while up to ``depth`` fetches are in
flight, so the remote's per-request latency overlaps with the consumer's decode. The
threads call ``LocalCache.read``: a miss is a fetch shared with every other process on
the node. A file already cached is read by the consumer itself at its turn: a local
read costs less than handing it to a thread and back. Memory is bounded by ``depth``
files.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from unbroken.data.cache import LocalCache
from unbroken.storage import Entry


class Prefetcher:
    """Reads entries through ``cache`` up to ``depth`` ahead on ``threads`` I/O threads."""

    def __init__(self, cache: LocalCache, depth: int = 16, threads: int = 8) -> None:
        if depth < 1 or threads < 1:
            raise ValueError(f"Prefetcher: depth and threads must be >= 1, got {depth}, {threads}")
        self.cache = cache
        self.depth = depth
        self.threads = min(threads, depth)
        self._pool: ThreadPoolExecutor | None = None
        self._setup_counters()

    def _setup_counters(self) -> None:
        self._lock = threading.Lock()
        self.in_flight = 0
        """Reads running right now."""
        self.max_in_flight = 0
        """The most reads that ran at the same time: > 1 means fetches overlapped."""
        self.wait_seconds = 0.0
        """Seconds ``iterate`` blocked waiting for a read: latency not hidden."""

    def __getstate__(self) -> dict:
        return {"cache": self.cache, "depth": self.depth, "threads": self.threads}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._pool = None
        self._setup_counters()

    def iterate(self, entries: Iterable[Entry]) -> Iterator[tuple[Entry, bytes]]:
        """Yield ``(entry, data)`` in the order given, reading ahead by ``depth``.

        An error reading a file (missing, unreadable, changed) is raised at that file's
        turn, after the files before it were yielded; the reads behind it are cancelled.
        """
        pool = self._ensure_pool()
        source = iter(entries)
        window: deque[tuple[Entry, Future[bytes] | None]] = deque()
        try:
            while True:
                while len(window) < self.depth:
                    entry = next(source, None)
                    if entry is None:
                        break
                    cached = self.cache.contains(entry)
                    window.append((entry, None if cached else pool.submit(self._read, entry)))
                if not window:
                    return
                entry, future = window.popleft()
                if future is None:  # cached when planned (or, if evicted since, fetched now)
                    data = self.cache.read(entry)
                elif not future.done():
                    started = time.monotonic()
                    data = future.result()
                    self.wait_seconds += time.monotonic() - started
                else:
                    data = future.result()
                yield entry, data
        finally:
            for _, future in window:
                if future is not None:
                    future.cancel()

    def _read(self, entry: Entry) -> bytes:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return self.cache.read(entry)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _ensure_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="unbroken-prefetch")
        return self._pool

    def close(self) -> None:
        """Stop the I/O threads (waits for the reads already running)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
