"""VolumeDataset: a directory of raw files on any store, served in a planned order.

Each worker knows, from pure functions, exactly which samples it will serve this
epoch and in which order (``order.py``, ``partition.py``). It tells the local cache
that future (for eviction), fetches ahead with the prefetcher, decodes each sample
under RNGs seeded for that sample (``seeding.py``), collates and hands over one
tagged batch at a time (``delivery.py``).
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from unbroken._util.world import require_group
from unbroken.data.cache.cache import CacheDirError, CacheWriteError, LocalCache, default_cache_dir
from unbroken.data.delivery import Delivery
from unbroken.data.fill_ahead import FillAhead
from unbroken.data.index import FileIndex, check_max_age, load_or_build_index
from unbroken.data.index_agreement import agree_on_index, spans_the_job
from unbroken.data.metrics import WorkerCounters
from unbroken.data.order import epoch_order
from unbroken.data.partition import Partition, worker_batches
from unbroken.data.prefetch import Prefetcher
from unbroken.data.seeding import batch_seed, preserved_rngs, sample_seed, seed_rngs
from unbroken.storage import Entry, RetryPolicy, Store, open_store
from unbroken.storage.errors import redact

log = logging.getLogger(__name__)

Decode = Callable[[bytes, str], Any]


class SampleReadError(RuntimeError):
    """A file of the volume could not be read or decoded; the message names it."""


def raw_bytes(data: bytes, path: str) -> bytes:
    """The default decode: the file's bytes as they are."""
    return data


def _ranks_on_this_node() -> int:
    """torchrun's LOCAL_WORLD_SIZE (the ranks sharing this node's cache); 1 without it,
    or where it is not a positive number (a launcher that sets it otherwise)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


class VolumeDataset(IterableDataset):
    """Raw files under ``url`` (a path or any fsspec URL), one sample per file.

    Sample ``i`` is the ``i``-th file of the sorted index. Iterated directly (or by a
    stock torch DataLoader) it yields this rank's samples of epoch ``self.epoch``
    one by one; :class:`unbroken.DataLoader` drives it batch by batch with exact
    resume.

    Each process fetches up to ``prefetch_threads`` files at once, at most
    ``prefetch_depth`` files ahead of its decode. To hide a remote's latency a worker
    needs about (its samples/s) x (seconds per request) fetches in flight: 16 covers
    500 samples/s per worker at 30 ms per request. Idle fetch threads cost nothing.

    The index is the volume as listed when the dataset is made: files added, deleted
    or rewritten before then are seen, and a saved loader state from before such a
    change is refused. Ranks of a node that start together share one listing (the
    first lists, the others wait for it); ``index_max_age`` (seconds) reuses a
    listing of the node up to that old instead, ``None`` however old (a volume that
    never changes; ``refresh_index=True`` still lists anew). Split over the job's ranks
    (``rank`` and ``world_size`` torch.distributed's), it is made on every rank: ranks
    whose listings differ (a file landed between them) all take rank 0's, with a warning.
    """

    def __init__(
        self,
        url: str | os.PathLike | Store,
        decode: Decode | None = None,
        *,
        cache_dir: str | None = None,
        cache_limit: int | str | None = None,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        on_error: str = "raise",
        storage_options: dict[str, Any] | None = None,
        prefetch_depth: int = 32,
        prefetch_threads: int = 16,
        index_dir: str | None = None,
        refresh_index: bool = False,
        index_max_age: float | None = 0.0,
        retry: RetryPolicy | None = None,
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"VolumeDataset: on_error must be 'raise' or 'skip', got {on_error!r}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"VolumeDataset: seed must be an int >= 0, got {seed!r}")
        if prefetch_depth < 1 or prefetch_threads < 1:
            raise ValueError("VolumeDataset: prefetch_depth and prefetch_threads must be >= 1")
        self.decode: Decode = decode or raw_bytes
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.on_error = on_error
        self.prefetch_depth = prefetch_depth
        self.prefetch_threads = prefetch_threads
        # One int in shared memory: the DataLoader's workers see what the loop sets,
        # persistent ones too (each keeps the copy of this dataset it started with).
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        index_max_age = check_max_age(index_max_age)
        self._store = open_store(url, retry=retry, **(storage_options or {}))
        self._owner_pid = os.getpid()
        if cache_dir is None:
            cache_dir = default_cache_dir(self._store)
        # made now, before a listing that can take minutes: a cache that cannot work
        # (a file in the way, a limit of 0) is refused here, not in a worker later
        self._local: _PerProcess | None = _PerProcess(
            self._owner_pid, self._store, os.fspath(cache_dir), cache_limit
        )
        self.cache_dir = self._local.cache.cache_dir
        self.cache_limit = self._local.cache.limit
        if index_dir is None:  # beside the cached files; the cache never touches it
            index_dir = os.path.join(self.cache_dir, "index")
        self.index: FileIndex = load_or_build_index(
            self._store, index_dir, include, exclude,
            refresh=refresh_index, max_age=index_max_age,
        )  # fmt: skip
        if spans_the_job(self.rank, self.world_size):  # ranks that listed apart: rank 0's
            self.index = agree_on_index(self.index)

    # -- what the volume holds ------------------------------------------------------

    @property
    def store(self) -> Store:
        """The store the volume is read from (the one this dataset was made with)."""
        return self._store

    @property
    def epoch(self) -> int:
        """Epoch served when the dataset is iterated directly or by a stock torch
        DataLoader (:class:`unbroken.DataLoader` counts its own): set it before each
        epoch. Workers already running, persistent ones included, see the new value."""
        return int(self._epoch)

    @epoch.setter
    def epoch(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"VolumeDataset: epoch must be an int >= 0, got {value!r}")
        self._epoch.fill_(int(value))

    def set_epoch(self, epoch: int) -> None:
        """``self.epoch = epoch``, by the name samplers use (Hugging Face's accelerate
        calls it on a DataLoader's dataset at each epoch)."""
        self.epoch = epoch

    @property
    def url(self) -> str:
        return redact(self._store.url)

    @property
    def fingerprint(self) -> str:
        return self.index.fingerprint

    def __len__(self) -> int:
        """Files in the volume (samples per epoch before partitioning)."""
        return len(self.index)

    def order(self, epoch: int) -> np.ndarray:
        """Sample index at each position of ``epoch``."""
        return epoch_order(self.seed, epoch, len(self.index), shuffle=self.shuffle)

    def partition(self, start: int, batch_size: int, drop_last: bool = True) -> Partition:
        return Partition(len(self.index), start, batch_size, self.world_size, drop_last)

    def batch_indices(
        self, epoch: int, start: int, batch_size: int, drop_last: bool = True
    ) -> list[np.ndarray]:
        """Sample indices of each of this rank's batches, from global position ``start``."""
        part = self.partition(start, batch_size, drop_last)
        order = self.order(epoch)
        return [order[slice(*part.batch_range(k, self.rank))] for k in range(part.num_batches)]

    # -- serving ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """This rank's samples of ``self.epoch``, split over torch workers if any."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        if len(self.index) < self.world_size:  # as ub.DataLoader refuses it
            raise ValueError(
                f"VolumeDataset: {len(self.index)} files at {self.url} for {self.world_size} "
                f"ranks: rank {self.rank} gets none, and every epoch would be empty"
            )
        deliveries = self.iter_batches(
            self.epoch, 0, batch_size=1, drop_last=True, collate_fn=list,
            worker=worker, num_workers=workers, in_step=False,
        )  # fmt: skip
        served = 0
        for d in deliveries:
            if d.batch:
                served += 1
                yield d.batch[0]
        if not served and info is None:  # this process saw the whole epoch
            raise SampleReadError(self.nothing_served(self.epoch))

    def iter_batches(
        self,
        epoch: int,
        start: int,
        *,
        batch_size: int,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any],
        worker: int = 0,
        num_workers: int = 1,
        generation: int = 0,
        in_step: bool = True,
    ) -> Iterator[Delivery]:
        """This worker's batches of this rank, from global position ``start`` of ``epoch``.

        ``in_step``: the ranks take a step per batch together (``ub.DataLoader``), so a
        batch of only skipped files is an error where there are several ranks."""
        part = self.partition(start, batch_size, drop_last)
        every = self.batch_indices(epoch, start, batch_size, drop_last)
        batches = [(k, every[k]) for k in worker_batches(part.num_batches, worker, num_workers)]
        local = self._per_process()
        counters = local.counters
        samples = self._decoded(epoch, np.concatenate([b for _, b in batches] or [[]]), counters)
        for k, indices in batches:
            position = part.position_after(k)
            with preserved_rngs():  # decode reseeds them per sample; put them back
                items = [s for s in (next(samples) for _ in indices) if s is not _SKIP]
                if items:  # a batch-level augmentation draws as in an uninterrupted run
                    seed_rngs(batch_seed(self.seed, epoch, position, self.rank))
                    batch = collate_fn(items)
            if in_step and not items and len(indices) and self.world_size > 1:
                raise SampleReadError(self._whole_batch_skipped(epoch, k))
            yield Delivery(
                batch=batch if items else None,
                epoch=epoch,
                batch_id=k,
                position=position,
                generation=generation,
                stats=counters.take(local.cache_snapshot()),
            )

    def fill_ahead(
        self,
        epoch: int,
        start: int,
        *,
        batch_size: int,
        drop_last: bool,
        lead: int,
        hold: int = 0,
        threads: int | None = None,
    ) -> FillAhead | None:
        """Start fetching this rank's files of ``epoch`` into the cache, ``lead`` batches
        ahead of the loop, on ``threads`` threads (default ``prefetch_threads``); see
        ``fill_ahead.py``. The caller advances and closes it.

        With a ``cache_limit`` the lead is cut to this rank's share of a quarter of it
        (the ranks of a node share one cache); None (no fill) where that share holds
        no more than the ``hold`` batches the workers have in hand already: filling
        would then only evict what they read next.
        """
        cache = self._per_process().cache
        if cache.limit is not None and len(self.index):
            ranks_here = _ranks_on_this_node()
            batch_bytes = max(1, self.index.total_bytes // len(self.index)) * batch_size
            room = cache.limit // 4 // ranks_here // batch_bytes
            if room <= hold:
                log.debug("no fill ahead: the cache limit leaves room for %d batches", room)
                return None
            lead = min(lead, room)
        batches = self.batch_indices(epoch, start, batch_size, drop_last)
        threads = threads or self.prefetch_threads
        return FillAhead(cache, batches, self.index.__getitem__, lead=lead, threads=threads)

    def _decoded(self, epoch: int, indices: np.ndarray, counters: WorkerCounters) -> Iterator[Any]:
        """Decoded samples of ``indices`` in order; ``_SKIP`` for a skipped one.

        Reseeds the global RNGs for each sample: consume it inside ``preserved_rngs``.
        """
        entries = [self.index[int(i)] for i in indices]
        for i, (entry, data) in zip(indices, self._fetched(entries)):
            if isinstance(data, BaseException):
                yield self._failed(entry, "read", data, counters)
                continue
            t0 = time.perf_counter()
            try:
                seed_rngs(sample_seed(self.seed, epoch, int(i)))
                sample = self.decode(data, entry.key)
            except Exception as exc:
                sample = self._failed(entry, "decode", exc, counters)
            else:
                counters.add("samples")
            counters.add("decode_seconds", time.perf_counter() - t0)
            yield sample

    def _fetched(self, entries: list[Entry]) -> Iterator[tuple[Entry, bytes | BaseException]]:
        """(entry, bytes) in order, fetched ahead; (entry, error) for one that failed.

        After a failure the prefetcher starts again from the next entry, so one bad
        file costs one restart of the read-ahead, not the rest of the epoch.
        """
        cache = self._per_process().cache
        cache.plan(entries)
        pos = 0
        while pos < len(entries):
            prefetcher = Prefetcher(cache, depth=self.prefetch_depth, threads=self.prefetch_threads)
            try:
                for entry, data in prefetcher.iterate(entries[pos:]):
                    pos += 1
                    yield entry, data
            except Exception as exc:
                pos += 1
                yield entries[pos - 1], exc
            finally:
                prefetcher.close()
        cache.close()  # withdraw this process's access plan: nothing more is coming

    def _failed(self, entry: Entry, what: str, exc: BaseException, counters: WorkerCounters):
        if isinstance(exc, (CacheWriteError, CacheDirError)):  # the local disk: never skipped
            raise exc
        message = f"VolumeDataset: cannot {what} {entry.key!r} from {self.url}: {exc}"
        if self.on_error == "raise":
            raise SampleReadError(message) from exc
        counters.add("skipped")
        log.warning("%s (skipped: on_error='skip')", message)
        return _SKIP

    def nothing_served(self, epoch: int) -> str:
        """Why a whole epoch of skipped files is an error: a loop counting steps would
        ask for the next epoch for ever, never training nor ending."""
        return (
            f"VolumeDataset: epoch {epoch} on rank {self.rank} served nothing: every one of "
            f"its files failed to read or decode (warned about above), and on_error='skip' "
            f"skipped them all. Is {self.url} reachable, and are its files what decode "
            "expects?"
        )

    def _whole_batch_skipped(self, epoch: int, batch: int) -> str:
        """No batch at all on one rank would put it a step behind the others: their next
        collective waits for it (a hang), or they average gradients of other steps."""
        return (
            f"VolumeDataset: every file of batch {batch} of epoch {epoch} on rank "
            f"{self.rank} of {self.world_size} failed (warned about above); on_error='skip' "
            f"skips files, not whole batches, where ranks must stay in step. Fix or remove "
            f"those files in {self.url} (the index is rebuilt at the next start), or use a "
            f"larger batch_size"
        )

    # -- per-process resources -------------------------------------------------------

    def _per_process(self) -> _PerProcess:
        """This process's store, cache and counters; a forked worker makes its own."""
        pid = os.getpid()
        if self._local is None or self._local.pid != pid:
            store = self._store
            if pid != self._owner_pid:  # fsspec clients are not fork-safe: rebuild
                store = pickle.loads(pickle.dumps(store))
            self._local = _PerProcess(pid, store, self.cache_dir, self.cache_limit)
        return self._local

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_local"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if not self._epoch.is_shared():  # a copy (pickle, deepcopy): its own shared epoch,
            self._epoch.share_memory_()  # which its fork-started workers see too


class _PerProcess:
    """What each process (main or worker) owns: a store client, the cache, counters."""

    def __init__(self, pid: int, store: Store, cache_dir: str, limit: int | None) -> None:
        self.pid = pid
        self.store = store
        self.cache = LocalCache(store, cache_dir, limit)
        self.counters = WorkerCounters()

    def cache_snapshot(self) -> dict[str, Any]:
        return self.cache.stats.snapshot()


class _Skip:
    def __repr__(self) -> str:
        return "<skipped sample>"


_SKIP = _Skip()


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values, else torch.distributed's, else a single process."""
    dist = torch.distributed
    if rank is None or world_size is None:
        require_group("VolumeDataset (given no rank and world_size)")
    initialized = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialized else 1
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"VolumeDataset: rank {rank} is outside world_size {world_size}")
    return rank, world_size
