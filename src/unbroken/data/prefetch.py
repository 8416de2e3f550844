"""Read ahead: fetch the next files of a worker's slice on a bounded pool of threads.

``iterate`` yields (entry, bytes) in input order while up to ``depth`` fetches are in
flight, so the remote's per-request latency overlaps with the consumer's decode. The
threads call ``LocalCache.read``: a miss is a fetch shared with every other process on
the node. A file already cached is read by the consumer itself at its turn: a local
read costs less than handing it to a thread and back. Memory is bounded by ``depth``
files. Threads and results meet on two C-level ``SimpleQueue``s, not futures: on a
busy worker every lock and condition of a ``ThreadPoolExecutor`` hand-off is CPU taken
from decode.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from queue import SimpleQueue

from unbroken._util.thread_names import name_native_thread
from unbroken.data.cache.cache import LocalCache
from unbroken.storage import Entry


class Prefetcher:
    """Reads entries through ``cache`` up to ``depth`` ahead on ``threads`` I/O threads."""

    def __init__(self, cache: LocalCache, depth: int = 16, threads: int = 8) -> None:
        if depth < 1 or threads < 1:
            raise ValueError(f"Prefetcher: depth and threads must be >= 1, got {depth}, {threads}")
        self.cache = cache
        self.depth = depth
        self.threads = min(threads, depth)
        self._setup()

    def _setup(self) -> None:
        self._pool = _Pool(self.cache, self.threads)
        # the threads hold the pool, not this object: dropping an unclosed prefetcher
        # still stops them
        self._finalizer = weakref.finalize(self, self._pool.stop, False)
        self.wait_seconds = 0.0
        """Seconds ``iterate`` blocked waiting for a read: latency not hidden."""

    @property
    def in_flight(self) -> int:
        """Reads running right now."""
        return self._pool.in_flight

    @property
    def max_in_flight(self) -> int:
        """The most reads that ran at the same time: > 1 means fetches overlapped."""
        return self._pool.max_in_flight

    def __getstate__(self) -> dict:
        return {"cache": self.cache, "depth": self.depth, "threads": self.threads}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup()

    def iterate(self, entries: Iterable[Entry]) -> Iterator[tuple[Entry, bytes]]:
        """Yield ``(entry, data)`` in the order given, reading ahead by ``depth``.

        An error reading a file (missing, unreadable, changed) is raised at that file's
        turn, after the files before it were yielded; the reads behind it are dropped.
        """
        run = _Run()
        source = iter(entries)
        window: deque[tuple[int, Entry, bool]] = deque()  # (key, entry, fetched remotely)
        key = 0
        try:
            while True:
                while len(window) < self.depth:
                    entry = next(source, None)
                    if entry is None:
                        break
                    remote = not self._cached(entry)
                    if remote:
                        self._pool.submit(run, key, entry)
                    window.append((key, entry, remote))
                    key += 1
                if not window:
                    return
                k, entry, remote = window.popleft()
                # cached when planned (or, if evicted since, fetched now)
                yield entry, (self._take(run, k) if remote else self.cache.read(entry))
        finally:
            run.cancelled = True

    def _cached(self, entry: Entry) -> bool:
        """Whether to read ``entry`` here at its turn; an error is left to that read."""
        try:
            return self.cache.contains(entry)
        except Exception:  # raised by the read at the entry's own turn, naming it
            return True

    def _take(self, run: _Run, want: int) -> bytes:
        """The result of entry ``want``, waiting for it if it has not landed yet."""
        ready, results = run.ready, run.results
        while want not in ready and not results.empty():  # landed already: no waiting
            key, data, error = results.get()
            ready[key] = (data, error)
        if want not in ready:
            started = time.monotonic()
            while want not in ready:
                key, data, error = results.get()
                ready[key] = (data, error)
            self.wait_seconds += time.monotonic() - started
        data, error = ready.pop(want)
        if error is not None:
            raise error
        return data

    def close(self) -> None:
        """Stop the I/O threads (waits for the reads already running)."""
        self._pool.stop(True)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Run:
    """One ``iterate`` call: its results, and whether its consumer went away."""

    def __init__(self) -> None:
        self.results: SimpleQueue = SimpleQueue()
        self.ready: dict[int, tuple[bytes | None, BaseException | None]] = {}
        self.cancelled = False


class _Pool:
    """The I/O threads and what they count. Threads start on demand, up to ``size``."""

    def __init__(self, cache: LocalCache, size: int) -> None:
        self.cache = cache
        self.size = size
        self.tasks: SimpleQueue = SimpleQueue()
        self.workers: list[threading.Thread] = []
        self.idle = 0
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0

    def submit(self, run: _Run, key: int, entry: Entry) -> None:
        with self.lock:  # a thread waiting for work takes it; else start one, up to the cap
            if self.idle:
                self.idle -= 1
                start = False
            else:
                start = len(self.workers) < self.size
        if start:
            worker = threading.Thread(target=self._work, name="unbroken-prefetch", daemon=True)
            self.workers.append(worker)
            worker.start()
        self.tasks.put((run, key, entry))

    def _work(self) -> None:
        name_native_thread()
        tasks = self.tasks
        while True:
            task = tasks.get()
            if task is None:
                return
            run, key, entry = task
            if not run.cancelled:
                self._read_into(run, key, entry)
            with self.lock:
                self.idle += 1

    def _read_into(self, run: _Run, key: int, entry: Entry) -> None:
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            run.results.put((key, self.cache.read(entry), None))
        except BaseException as exc:  # delivered at this entry's turn
            run.results.put((key, None, exc))
        finally:
            with self.lock:
                self.in_flight -= 1

    def stop(self, wait: bool) -> None:
        """Tell every thread to exit after its current read; ``wait`` joins them."""
        workers, self.workers = self.workers, []
        for _ in workers:
            self.tasks.put(None)
        if wait:
            for worker in workers:
                if worker is not threading.current_thread():
                    worker.join()
        self.idle = 0
