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
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from unbroken._util.thread_names import name_native_thread
from unbroken.data.cache.cache import LocalCache
from unbroken.data.metrics import WorkerCounters
from unbroken.storage import Entry


class FillAhead:
    """Fetches the files of ``batches`` into ``cache`` on threads, in delivery order.

    ``batches`` holds this rank's sample indices per batch; ``entry(i)`` is sample
    ``i``'s file, made only when its turn comes (an epoch may hold a million).

    The file of batch ``k`` is fetched only once fewer than ``lead`` batches past ``k``
    remain undelivered, that is once the loop has received batch ``k - lead``:
    far enough ahead that the workers, with their queued batches and read-ahead, find
    it published; near enough that a bounded cache keeps what comes next.
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
        self._counters = WorkerCounters()
        self._counters.take(cache.stats.snapshot())  # count only this fill's work
        self._threads = [
            threading.Thread(target=self._work, name="unbroken-fill-ahead", daemon=True)
            for _ in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def advance(self, received: int) -> None:
        """The loop has received ``received`` batches of this plan."""
        with self._cond:
            if received > self._received:
                self._received = received
                self._cond.notify_all()

    def take_stats(self) -> dict[str, float]:
        """The cache counters (misses, bytes, fetch seconds) that moved since the last call."""
        return self._counters.take(self.cache.stats.snapshot())

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking files; wait up to ``timeout`` s for the fetches in flight."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)

    def _take(self) -> Entry | None:
        """The next file to fetch once the loop is near enough; None when done."""
        with self._cond:
            while True:
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
            except Exception:  # the worker's own read raises it, naming the file
                with self._cond:
                    self.failed += 1
