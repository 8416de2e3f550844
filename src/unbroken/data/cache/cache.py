"""A node-local disk cache of remote files, shared by every worker and rank on the node.

``read(entry)`` serves a file from the cache directory, fetching it from the store on
first access. A fill is atomic (temp file + rename) and deduplicated across processes
by a fill lock, so no file is fetched twice at the same time; a crashed filler leaves
its record of reserved bytes and maybe a temp file, cleaned up by the next process that
finds them.
With a ``limit``, bytes are reserved before a fetch and files are evicted to make
room, furthest-future use first (see ``eviction.py``). The on-disk protocol lives in
``cache_files.py``; this module decides what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence

from unbroken._util.sizes import parse_size
from unbroken.data.cache.access_plan import PlanReader, PlanWriter
from unbroken.data.cache.eviction import evict_until, next_use
from unbroken.data.cache.files import CacheLayout, Ledger, close_inherited, object_name
from unbroken.data.cache.stats import CacheStats
from unbroken.storage import Entry, Store
from unbroken.storage.errors import redact

SMALL_FILE = 8 << 20
"""Files up to this size are fetched in one request into memory; larger ones stream."""
EVICT_SLACK = 0.02
"""When the cache is full, evict this fraction of the limit beyond what is needed, so
that the directory scan behind an eviction is paid once per batch, not once per file."""
_POLL_MIN, _POLL_MAX = 0.002, 0.05
log = logging.getLogger(__name__)
_ABSENT = object()


class SourceChangedError(OSError):
    """The remote object no longer matches the size the index recorded for it."""


class CacheWriteError(OSError):
    """The local disk refused a cache write (full, over quota, read-only)."""


class CacheDirError(OSError):
    """The cache directory cannot be made or written (a file in the way, read-only)."""


def cache_limit_bytes(limit: int | str | None, cache_dir: str) -> int | None:
    """``limit`` in bytes (None: unbounded); refused, naming the cache, unless >= 1 byte."""
    try:
        nbytes = parse_size(limit)
    except ValueError as exc:
        raise ValueError(f"cache_limit for the cache at {cache_dir}: {exc}") from None
    if nbytes is not None and nbytes < 1:
        raise ValueError(
            f"cache_limit {limit!r} for the cache at {cache_dir} holds no file; give a size "
            "such as '200GB', or None for no limit"
        )
    return nbytes


class LocalCache:
    """Remote files copied to ``cache_dir`` on first access and served from there.

    Picklable: create it in the main process and use it in DataLoader workers (forked
    or spawned). Each process counts its own work in :attr:`stats`.
    """

    small_file: int = SMALL_FILE
    """Files up to this size are fetched in one request; larger ones stream to disk."""

    def __init__(
        self, store: Store, cache_dir: str | None = None, limit: int | str | None = None
    ) -> None:
        self.store = store
        self.cache_dir = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir(store)))
        self.limit = cache_limit_bytes(limit, self.cache_dir)
        self._setup()
        self.swept = self._sweep()
        if self.limit is not None:  # a limit lowered since the files were cached
            with self.layout.ledger() as ledger:
                if ledger.used > self.limit:
                    self._evict(ledger.used - self.limit, ledger)

    def _sweep(self) -> int:
        """Clean up after crashed fillers; returns how many leftovers were removed.

        A filler's record holds bytes from before it creates its temp file until after
        it publishes, so a dead process's record with bytes reserved is the sign of a
        crash: only then (or for a new cache) are temp files swept and the ledger
        recounted from the disk.
        """
        self._plans.sweep_dead()
        fresh = not self.layout.has_ledger()  # before ledger() creates it
        with self.layout.ledger() as ledger:  # one hold: the evidence goes with the recount
            if self.layout.check_boot(ledger):
                fresh = True
            crashed, _ = self.layout.fillers.sweep_dead()
            if not crashed and not fresh:
                return 0
            removed = crashed + self.layout.sweep_temps()
            self._recount_into(ledger)
        return removed

    def _setup(self) -> None:
        try:
            self.layout = CacheLayout(self.cache_dir)
        except OSError as exc:  # a file in the way, a read-only or full disk
            raise CacheDirError(
                f"LocalCache: cache_dir {self.cache_dir} cannot hold the data cache: "
                f"{exc.strerror or exc} ({exc.filename or self.cache_dir}); give a "
                "directory on a writable local disk"
            ) from exc
        self._stats = CacheStats()
        self._retries_base = self.store.stats.retries
        self._plan: PlanWriter | None = None
        self._plans = PlanReader(self.layout.plans)
        self._local_fills: dict[str, threading.Event] = {}
        self._mutex = threading.Lock()
        self._touch = self.limit is not None  # mtimes only order evictions
        self._compare_versions = True  # until the store names versions two ways
        _live.add(self)

    def __getstate__(self) -> dict:
        keep = ("store", "cache_dir", "limit", "small_file")
        return {k: self.__dict__[k] for k in keep if k in self.__dict__}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup()

    def __repr__(self) -> str:
        return f"LocalCache({self.store!r}, cache_dir={self.cache_dir!r}, limit={self.limit})"

    @property
    def stats(self) -> CacheStats:
        """This process's counters (retries read from the store's retry stats)."""
        self._stats.retries = self.store.stats.retries - self._retries_base
        return self._stats

    @property
    def used_bytes(self) -> int:
        """Bytes the node-wide ledger says the cache holds (published + being filled)."""
        with self.layout.ledger() as ledger:
            return ledger.used

    # -- public surface -------------------------------------------------------------

    def read(self, entry: Entry) -> bytes:
        """The file's bytes: from disk on a hit; fetched (once per node) on a miss."""
        name = self._name(entry)
        data = self.layout.read_pinned(name, entry.size, touch=self._touch)
        if data is None:
            data = self._fill(entry, name, want=True)
        else:
            self._stats.add(hits=1)
        if self._plan is not None:
            self._plan.advance(name)
        return data

    def fetch(self, entry: Entry) -> None:
        """Make sure the file is cached (counts a miss only if it had to be fetched)."""
        name = self._name(entry)
        if not self.layout.is_published(name, entry.size):
            self._fill(entry, name, want=False)

    def contains(self, entry: Entry) -> bool:
        """True if this version of the file is in the cache (no remote request)."""
        return self.layout.is_published(self._name(entry), entry.size)

    def plan(self, upcoming: Sequence[Entry]) -> None:
        """Publish this process's future access order; eviction keeps what comes soon.

        Without a limit nothing is ever evicted, so nothing is published.
        """
        if self.limit is None:
            return
        if self._plan is None or self._plan.pid != os.getpid():
            self._plan = PlanWriter(self.layout.plans)
        with self._local_write(f"this process's read order ({len(upcoming)} files)"):
            self._plan.publish([self._name(e) for e in upcoming])

    def close(self) -> None:
        """Withdraw this process's plan and record. The cached files stay."""
        if self._plan is not None and self._plan.pid == os.getpid():
            self._plan.close()
        self._plan = None
        with self.layout.ledger():
            self.layout.fillers.release()
        self.layout.close()

    # -- fills ------------------------------------------------------------------------

    def _name(self, entry: Entry) -> str:
        if not isinstance(entry, Entry):
            raise TypeError(f"LocalCache needs a storage Entry, got {type(entry).__name__}")
        return object_name(self.store.url, entry.key, entry.size, entry.etag)

    def _fill(self, entry: Entry, name: str, *, want: bool) -> bytes | None:
        """Fetch ``entry`` unless another thread or process is already doing it."""
        with self._mutex:
            event = self._local_fills.get(name)
            mine = event is None
            if mine:
                event = self._local_fills[name] = threading.Event()
        if not mine:  # another thread of this process fills it
            event.wait()
            served = self._serve_published(entry, name, want, waited=True)
            return self._fill(entry, name, want=want) if served is _ABSENT else served
        try:
            return self._fill_as_owner(entry, name, want)
        finally:
            with self._mutex:
                del self._local_fills[name]
            event.set()

    def _fill_lock(self, name: str) -> int | None:
        try:
            return self.layout.try_lock(name)
        except FileNotFoundError as exc:  # the lock file's directory is gone
            raise CacheDirError(
                f"LocalCache: the cache directory {self.cache_dir} was removed while this "
                "process used it (a tmp cleaner, or rm?): give cache_dir a place that "
                "nothing cleans while the job runs"
            ) from exc

    def _fill_as_owner(self, entry: Entry, name: str, want: bool) -> bytes | None:
        """Take the node-wide fill lock and fetch, or serve what another process filled."""
        delay = _POLL_MIN
        waited = False
        removed = 0
        while True:
            fd = self._fill_lock(name)
            if fd is None:  # another process fills it: poll for its result
                waited = True
                time.sleep(delay)
                delay = min(delay * 2, _POLL_MAX)
                if self.layout.is_published(name, entry.size):
                    served = self._serve_published(entry, name, want, waited=True)
                    if served is not _ABSENT:
                        return served
                continue
            try:
                served = self._serve_published(entry, name, want, waited)
                if served is not _ABSENT:
                    return served
                return self._fetch_and_publish(entry, name, want)
            except OSError:
                if removed >= 2 or not self.layout.shard_removed(name):
                    raise
                removed += 1  # a cleaner took the folder, the temp with it: fill again
            finally:
                self.layout.unlock(name, fd)

    def _serve_published(self, entry: Entry, name: str, want: bool, waited: bool) -> object:
        """The published copy (its bytes, or None if not ``want``ed); _ABSENT if none."""
        if want:
            data = self.layout.read_pinned(name, entry.size, touch=self._touch)
            if data is None:
                return _ABSENT
        elif self.layout.is_published(name, entry.size):
            data = None
        else:
            return _ABSENT
        self._stats.add(hits=int(want), waits=int(waited))
        return data

    def _fetch_and_publish(self, entry: Entry, name: str, want: bool) -> bytes | None:
        """Download into the temp file, check its size, rename into place.

        Runs under the fill lock of ``name``. Every change of the ledger happens together
        with the change on disk and of this process's record of reserved bytes, under
        the ledger's lock, so a recount at any moment agrees with the ledger.
        """
        path = self.layout.object_path(name)
        with self._local_write(entry):  # its record of reserved bytes is a file too
            self._reserve(entry.size)
        started = time.monotonic()
        pin = None
        published = False
        tmp = None
        try:
            with self._local_write(entry):
                tmp, fd = self.layout.create_temp(name)
            try:
                if self.layout.crash_seen:  # a filler died mid-fill: clean up after it
                    self.layout.crash_seen = False
                    self._recover()
                if entry.size <= self.small_file:
                    data, version = self.store.read_versioned(entry.key)
                    self._check_size(entry, len(data))
                    self._check_version(entry, version)
                    with self._local_write(entry):
                        _write_all(fd, data)
            finally:
                self.layout.close_temp(fd)
            if entry.size > self.small_file:
                self.store.download(entry.key, tmp, sync=False)  # a copy: see module doc
                self._check_size(entry, os.path.getsize(tmp))
                # ranged reads name no version: the object's, once they are all in
                self._check_version(entry, self.store.info(entry.key).etag)
                data = None
                if want:
                    pin = self.layout.pin(tmp)  # so it cannot vanish before it is read
            with self.layout.ledger() as ledger:
                replaced = self.layout.size_on_disk(path)  # a damaged copy it replaces
                os.replace(tmp, path)
                published = True
                ledger.used -= replaced
                self.layout.fillers.add(-entry.size)
                if self.limit is not None and ledger.used > self.limit:
                    # fills in flight may have reserved past the limit (nothing published
                    # was left to evict then); now that one landed, get back under it
                    self._evict(ledger.used - self.limit, ledger)
            if pin is not None:
                data = self.layout.read_fd(pin)
        except BaseException:
            if not published:
                with self.layout.ledger() as ledger:
                    if tmp is not None:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(tmp)
                    ledger.used -= entry.size
                    self.layout.fillers.add(-entry.size)
            raise
        finally:
            if pin is not None:
                os.close(pin)
        self._stats.add(
            misses=1, bytes_fetched=entry.size, fetch_seconds=time.monotonic() - started
        )
        return data

    @contextlib.contextmanager
    def _local_write(self, what: Entry | str):
        """Name what was being stored and the cache when the local disk refuses a write
        (full, quota, read-only)."""
        if isinstance(what, Entry):
            what = f"{what.key!r} ({what.size} bytes)"
        try:
            yield
        except OSError as exc:
            raise CacheWriteError(
                f"LocalCache: cannot store {what} in the cache at {self.cache_dir}: "
                f"{exc.strerror or exc}"
            ) from exc

    def _check_version(self, entry: Entry, version: str | None) -> None:
        """Bytes of another version than the index's must not be kept under its name:
        they would be served whenever the listing names that version again.

        Some servers name a version one way in listings and another in a GET's answer
        (an MD5 against an opaque id, an empty etag): where a new listing of the file
        still says the listed version, the GET's is taken for such a quirk, and this
        process stops comparing them."""
        listed = _plain_etag(entry.etag)
        if listed is None or not self._compare_versions or _plain_etag(version) in (None, listed):
            return
        again = [e for e in self.store.list(entry.key) if e.key == entry.key]
        now = _plain_etag(again[0].etag) if again else None
        if now == listed:
            self._compare_versions = False
            log.warning(
                "LocalCache: %s names %r in its listing and %r in a read of the same version "
                "of %s; its reads are not compared with the listing from now on",
                self.store.url, entry.etag, version, entry.key,
            )  # fmt: skip
            return
        raise SourceChangedError(
            f"{redact(self.store.url_for(entry.key))}: the remote file is now version "
            f"{now or version!r} but the index says {entry.etag!r}; it changed since the "
            f"index was built (the next start lists the volume again; with index_max_age "
            f"set, pass refresh_index=True)"
        )

    def _check_size(self, entry: Entry, got: int) -> None:
        if got != entry.size:
            raise SourceChangedError(
                f"{redact(self.store.url_for(entry.key))}: the remote file has {got} bytes "
                f"but the index says {entry.size}; it changed since the index was built "
                f"(the next start lists the volume again; with index_max_age set, pass "
                f"refresh_index=True)"
            )

    # -- byte accounting and eviction ---------------------------------------------------

    def _reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` before they land, evicting first if the limit needs it.

        If every remaining file is pinned, the fill proceeds anyway: the overshoot is at
        most the files being read or filled at that moment.
        """
        with self.layout.ledger() as ledger:
            if self.limit is not None and ledger.used + nbytes > self.limit:
                need = ledger.used + nbytes - self.limit + int(self.limit * EVICT_SLACK)
                self._evict(need, ledger)
            self.layout.fillers.add(nbytes)
            ledger.used += nbytes

    def _evict(self, need: int, ledger: Ledger) -> None:
        """Free at least ``need`` bytes if unpinned files allow, counting each in ``ledger``
        as it goes (an error midway leaves the count right for what was removed)."""
        candidates = self.layout.scan_objects()
        on_disk = sum(c.size for c in candidates) + self.layout.fillers.live_reserved()
        if on_disk != ledger.used:  # files or fill records removed from outside (a tmp
            # cleaner, rm): counted files gone thrashed the cache for ever; a fill record
            # gone left its bytes uncounted, and the cache grew past its limit for ever
            need += on_disk - ledger.used
            log.info("cache %s: counted %d bytes where the disk holds %d (files removed "
                     "from outside); recounted", self.cache_dir, ledger.used, on_disk)  # fmt: skip
            ledger.used = on_disk
            if need <= 0:
                return
        upcoming = next_use(self._plans.load())
        sizes: dict[str, int] = {}

        def evict(c) -> bool:
            lock = self.layout.try_lock(c.name)  # never race a fill replacing that file
            if lock is None:
                return False
            try:
                size = self.layout.remove_if_unpinned(c.name)
            finally:
                self.layout.unlock(c.name, lock)
            if size is None:
                return False
            sizes[c.name] = size
            ledger.used -= size
            return True

        evicted = evict_until(candidates, upcoming, need, evict)
        self._stats.add(evictions=len(evicted), bytes_evicted=sum(sizes.values()))

    def _recover(self) -> None:
        """After a filler died mid-fill: drop its record and temp files, recount."""
        with self.layout.ledger() as ledger:
            self.layout.fillers.sweep_dead()
            self.layout.sweep_temps()
            self._recount_into(ledger)

    def _recount_into(self, ledger: Ledger) -> None:
        """Set ``ledger`` (held) from the disk: published files plus live reservations.

        Exact even while other processes fill and evict: each of them changes the disk
        and the ledger together under the ledger's lock, which the caller holds.
        """
        published = sum(c.size for c in self.layout.scan_objects())
        ledger.used = published + self.layout.fillers.live_reserved()
        if self.limit is not None and ledger.used > self.limit:
            self._evict(ledger.used - self.limit, ledger)


def _write_all(fd: int, data: bytes) -> None:
    """Write ``data`` to ``fd``: raw syscalls, fewest GIL hand-offs in a busy worker."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def default_cache_dir(store: Store) -> str:
    """``$UNBROKEN_CACHE_DIR`` or ``~/.cache/unbroken/data``, one subdirectory per store."""
    base = os.environ.get("UNBROKEN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "unbroken", "data"
    )
    return os.path.join(base, hashlib.sha1(store.url.encode()).hexdigest()[:16])


_live: weakref.WeakSet[LocalCache] = weakref.WeakSet()


def _after_fork() -> None:
    """A forked child gets fresh locks: a parent thread may have held one at the fork."""
    caches = list(_live)
    for cache in caches:
        cache._mutex = threading.Lock()
        cache._local_fills = {}
        cache._plan = None  # the parent's plan and cursor are not this process's
        cache._stats._lock = threading.Lock()
        cache.layout.after_fork()
    close_inherited(cache.layout for cache in caches)


os.register_at_fork(after_in_child=_after_fork)


def _plain_etag(etag: str | None) -> str | None:
    """An etag without its quotes or weak mark (``W/"x"`` and ``x`` name one version)."""
    if not etag:
        return None
    etag = etag.strip()
    return (etag[2:] if etag.startswith("W/") else etag).strip('"') or None
