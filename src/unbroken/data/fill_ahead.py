"""Fill the node cache ahead of the workers, from the training process.

A fork-started worker cannot run obstore (its runtime does not survive ``fork()``), so
a worker's miss travels through the fork relay: the training process fetches, and the
bytes cross a socket to the worker, which then writes them into the cache. Each file
is copied twice more than it needs to be, and the worker, whose core is decode's,
spends its own CPU on the socket and the write.

Here the training process, which holds the store client, fetches this rank's files
of the epoch in the order the loop will receive them, straight into the cache files,
a bounded number of batches ahead of the batch the loop has received. The workers find
them published and only read local files. A file a worker reaches first it fetches
itself, as before; the node-wide fill lock makes sure no file is fetched twice. A
fetch that fails here is left to the worker, whose error names the file at its turn.

It pays only where the workers would otherwise relay (``pays_off``): a native store and
fork-started workers. Elsewhere the workers fetch on their own, in their own processes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from unbroken._util.procs import start_method
from unbroken._util.thread_names import name_native_thread
from unbroken.data.cache.cache import CacheWriteError, LocalCache
from unbroken.data.metrics import WorkerCounters
from unbroken.storage import Entry, Store
from unbroken.storage.fork_relay import in_forked_child
from unbroken.storage.native_store import NativeStore

log = logging.getLogger(__name__)

MAX_THREADS = 32
"""Fetch threads per rank at most: enough for ~1,000 files/s at 30 ms per request."""
GIVE_UP_AFTER = 4
"""Failures in a row after which the fill stops (a remote that is down, a disk that is
full): the workers then fetch alone instead of every file being tried twice."""
THREAD_NAME = "unbroken-fill-ahead"
CLOSE_SECONDS = 1.0
"""How long ``close`` waits, in all, for the fetches in flight (they finish on their own)."""


def pays_off(store: Store, multiprocessing_context: Any) -> bool:
    """Whether workers started this way would fetch through this process's relay."""
    if not isinstance(store, NativeStore) or in_forked_child():
        return False
    return start_method(multiprocessing_context) == "fork"


class FillAhead:
    """Fetches the files of ``batches`` into ``cache`` on threads, in delivery order.

    ``batches`` holds this rank's sample indices per batch; ``entry(i)`` is sample
    ``i``'s file, made only when its turn comes (an epoch may hold a million).

    The file of batch ``k`` is fetched only once the loop has received batch
    ``k - lead``: far enough ahead that the workers, with their queued batches and
    read-ahead, find it published; near enough that a bounded cache keeps what comes
    next. A batch the loop has received is never fetched: a fill that fell behind
    jumps ahead instead of fetching again what a bounded cache has already evicted.
    """

    def __init__(
        self,
        cache: LocalCache,
        batches: Sequence[np.ndarray],
        entry: Callable[[int], Entry],
        *,
        lead: int,
        threads: int,
    ) -> None:
        if lead < 1 or threads < 1:
            raise ValueError(f"FillAhead: lead and threads must be >= 1, got {lead}, {threads}")
        self.cache = cache
        self.lead = lead
        self._batches = batches
        self._entry = entry
        self._batch, self._offset = 0, 0  # the next file to take
        self._received = 0
        self._stopped = False
        self._cond = threading.Condition()
        self.failed = 0
        """Fetches that raised here (each left to the worker that reads the file)."""
        self._in_a_row = 0
        self._counters = WorkerCounters()
        self._counters.take(cache.stats.snapshot())  # count only this fill's work
        self._threads: list[threading.Thread] = []
        try:
            for _ in range(min(threads, MAX_THREADS)):
                thread = threading.Thread(target=self._work, name=THREAD_NAME, daemon=True)
                thread.start()
                self._threads.append(thread)
        except BaseException:  # no threads left waiting for a loop that never comes
            self.close()
            raise

    def advance(self, received: int) -> None:
        """The loop has received ``received`` batches of this plan."""
        with self._cond:
            if received > self._received:
                per_batch = len(self._batches[0]) if len(self._batches) else 0
                newly = (received - self._received) * max(1, per_batch)
                self._received = received
                self._cond.notify(min(newly, len(self._threads)))

    def take_stats(self) -> dict[str, float]:
        """What moved since the last call: the cache's counters, and ``fill_failed``."""
        delta = self._counters.take(self.cache.stats.snapshot())
        with self._cond:
            failed, self.failed = self.failed, 0
        if failed:
            delta["fill_failed"] = failed
        return delta

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Stop taking files; wait up to ``timeout`` s in all for the fetches in flight."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in self._threads):
            self.cache.layout.end_fills()

    def _take(self) -> Entry | None:
        """The next file to fetch once the loop is near enough; None when done."""
        with self._cond:
            while True:
                if self._batch < self._received:  # behind the loop: never fetch the past
                    self._batch, self._offset = self._received, 0
                while self._batch < len(self._batches) and self._offset >= len(
                    self._batches[self._batch]
                ):
                    self._batch, self._offset = self._batch + 1, 0
                if self._stopped or self._batch >= len(self._batches):
                    return None
                if self._batch < self._received + self.lead:
                    self._offset += 1
                    return self._entry(int(self._batches[self._batch][self._offset - 1]))
                self._cond.wait()

    def _work(self) -> None:
        name_native_thread()
        while (entry := self._take()) is not None:
            try:
                self.cache.fetch(entry)
            except Exception as exc:  # the worker's own read raises it, naming the file
                self._failed(entry, exc)
            else:
                with self._cond:
                    self._in_a_row = 0

    def _failed(self, entry: Entry, exc: Exception) -> None:
        with self._cond:
            self.failed += 1
            self._in_a_row += 1
            give_up = isinstance(exc, CacheWriteError) or self._in_a_row >= GIVE_UP_AFTER
            if give_up and not self._stopped:
                self._stopped = True
                self._cond.notify_all()
                log.warning(
                    "unbroken.DataLoader: filling the cache ahead of the workers stopped "
                    "for this epoch (%s); the workers fetch their files themselves",
                    exc,
                )
            else:
                log.debug("fill ahead: %r failed: %s", entry.key, exc)
