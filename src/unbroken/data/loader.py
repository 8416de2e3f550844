"""DataLoader: torch's DataLoader over a VolumeDataset, with epochs and exact resume.

The position is global: (epoch, samples consumed) of the epoch order, the same on
every rank. It advances only when the training loop receives a batch, from the tag
that batch carries (``Delivery.position``), so batches prefetched by workers never
count. Workers learn where an epoch starts from a small shared-memory plan written
before each torch iterator starts (or restarts, with persistent workers), so loading
a state mid-iteration restarts the workers at the loaded position.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch
import torch.utils.data
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from unbroken._util.procs import start_method
from unbroken._util.worker_sigterm import defer_sigterm_in_this_worker
from unbroken.data.dataset import SampleReadError, VolumeDataset
from unbroken.data.delivery import Delivery
from unbroken.data.fill_ahead import FillAhead, pays_off
from unbroken.data.loader_state import STATE_FORMAT, check_state
from unbroken.data.metrics import LoaderMetrics
from unbroken.data.order import mix_seed
from unbroken.data.partition import Partition
from unbroken.data.worker_births import MarkBirth, WorkerBirths
from unbroken.goodput.recorder import note_data_wait

log = logging.getLogger(__name__)

MAX_REFORKS = 3
"""Times the workers are forked again after one was found stuck in ``fork()``."""


class DataLoader(torch.utils.data.DataLoader):
    """Batches of a :class:`VolumeDataset`; each ``for batch in loader`` is one epoch.

    ``batch_size`` is per rank. Defaults suit fetch-and-cache: worker processes that
    persist across epochs (the cache and its read-ahead stay warm), pinned memory
    when CUDA is present, and the loader's own RNG for worker seeds, so iterating it
    never moves the training loop's ``torch`` RNG.

    With workers, this process also fetches the rank's next files into the node cache
    (``fill_ahead=True``, the default then), so that workers read local files instead
    of receiving each file's bytes from this process over the fork relay.
    """

    def __init__(
        self,
        dataset: VolumeDataset,
        batch_size: int = 1,
        *,
        drop_last: bool = True,
        num_workers: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool | None = None,
        persistent_workers: bool | None = None,
        prefetch_factor: int | None = None,
        generator: torch.Generator | None = None,
        fill_ahead: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(dataset, VolumeDataset):
            raise TypeError(
                f"unbroken.DataLoader serves a VolumeDataset, got {type(dataset).__name__}; "
                "use torch.utils.data.DataLoader for other datasets"
            )
        for name in ("shuffle", "sampler", "batch_sampler"):
            if name in kwargs:
                raise TypeError(
                    f"unbroken.DataLoader: {name!r} is not supported; order and partition "
                    "come from VolumeDataset(shuffle=..., seed=..., rank=..., world_size=...)"
                )
        if kwargs.get("in_order", True) is not True:
            raise ValueError("unbroken.DataLoader: in_order=False would break exact resume")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"unbroken.DataLoader: batch_size must be an int >= 1, got {batch_size!r}"
            )
        full = dataset.partition(0, batch_size, drop_last)
        if full.num_batches == 0:
            raise ValueError(
                f"unbroken.DataLoader: {len(dataset)} files at {dataset.url} do not fill one "
                f"global batch of {full.global_batch} (batch_size {batch_size} x world_size "
                f"{dataset.world_size}); every epoch would be empty"
                + (" (pass drop_last=False to serve a smaller batch)" if drop_last else "")
            )
        if num_workers is None:
            num_workers = default_num_workers()
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        if prefetch_factor is None and num_workers > 0:
            prefetch_factor = 2
        if fill_ahead is None:
            fill_ahead = num_workers > 0 and pays_off(
                dataset.store, kwargs.get("multiprocessing_context")
            )
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(mix_seed(dataset.seed, 0x10AD) & 0x7FFFFFFFFFFFFFFF)
        self._plan = torch.zeros(3, dtype=torch.int64).share_memory_()
        self._births: WorkerBirths | None = None
        if num_workers > 0 and start_method(kwargs.get("multiprocessing_context")) == "fork":
            self._births = WorkerBirths(num_workers)  # worker_init_fn is wrapped from here
        self._born_pids: tuple[int, ...] = ()
        stream = _PlannedStream(dataset, self._plan, batch_size, drop_last, collate_fn)
        super().__init__(
            stream,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=_as_is,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            generator=generator,
            **kwargs,
        )
        # torch's own batching is off (workers make whole batches); expose ours.
        object.__setattr__(self, "batch_size", batch_size)
        object.__setattr__(self, "drop_last", drop_last)
        self.volume = dataset
        self.metrics = LoaderMetrics()
        self.epoch = 0
        """The epoch being served, from its first batch on (``iter(loader)`` alone starts
        nothing); before the first iteration, the next one."""
        self._next_start = (0, 0)
        self._active: Partition | None = None
        self._consumed = 0
        self._restart_requested = False
        self._state_taken_in: tuple[int, int] | None = None
        self._iter_id = 0
        self._generation = 0
        self.fill_ahead = bool(fill_ahead)
        """Whether this process fills the cache ahead of the workers (``fill_ahead.py``):
        on by default with workers, so that a worker's miss is a local read."""
        self._filler: FillAhead | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        """A ``worker_init_fn``, given or set later, runs after the worker marks its start
        (``worker_births.py``)."""
        births = self.__dict__.get("_births")
        if name == "worker_init_fn" and births is not None and not isinstance(value, MarkBirth):
            value = MarkBirth(births, self._plan, value)
        super().__setattr__(name, value)

    def __len__(self) -> int:
        """Batches per rank in a whole epoch."""
        return self.volume.partition(0, self.batch_size, self.drop_last).num_batches

    # -- iteration ----------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._iter_id += 1
        return self._serve(self._iter_id)

    def _serve(self, iter_id: int) -> Iterator[Any]:
        """One epoch (or the rest of one); restarts the workers if a state is loaded."""
        epoch, start = self._take_next_start()
        while True:
            began = time.perf_counter()  # the loop waits for this too (workers forking)
            it = self._start(epoch, start)
            filler = self._filler
            try:
                served = yield from self._batches(it, iter_id, epoch, began)
            finally:
                if self._filler is filler:  # not a newer iterator's
                    self._stop_filling()
                if not self._persistent_workers_on():
                    _shutdown(it)
            if not self._restart_requested:
                if served == 0 and start == 0 and self._active is not None and len(self):
                    raise SampleReadError(self.volume.nothing_served(epoch))
                self._finish(epoch)
                return
            epoch, start = self._take_next_start()

    def _batches(
        self, it: Iterator[Delivery], iter_id: int, epoch: int, began: float
    ) -> Generator[Any, None, int]:
        """The batches of one plan, timing each wait (the first from ``began``, the plan's
        start) and moving the position with each; returns how many it served."""
        served = 0
        for expected in itertools.count():
            if self._iter_id != iter_id:
                raise RuntimeError(
                    "unbroken.DataLoader: this iterator was superseded by a newer "
                    "`iter(loader)`; iterate one at a time"
                )
            if self._restart_requested or self._active is None:  # load_state / end_epoch
                return served
            t0 = began if expected == 0 else time.perf_counter()
            d = next(it, None)
            wait = time.perf_counter() - t0
            if d is None:
                return served
            self._accept(d, epoch, expected)
            self.metrics.add(d.stats)
            if self._filler is not None:
                self._filler.advance(expected + 1)
                self.metrics.add(self._filler.take_stats())
            self.metrics.record_wait(wait, counted_batch=d.batch is not None)
            note_data_wait(wait, self.metrics)
            self._consumed = d.position
            if d.batch is not None:
                served += 1
                yield d.batch
        return served  # (never reached: the count has no end)

    def end_epoch(self) -> None:
        """Take no more batches from the epoch being served: its iterator stops, and the
        state and the next ``for`` both start the next epoch.

        After a ``break`` the state stays where the loop stopped (a save there resumes
        mid-epoch, as a run that stopped at a step count and goes on wants), while the
        next ``for`` of this loader starts the next epoch. A loop that ends its epochs
        early on purpose (a fixed number of batches each, Lightning's
        ``limit_train_batches``) calls this where it does, before it saves: otherwise a
        run resumed from that save serves the rest of an epoch this run left out.
        """
        if self._active is not None and not self._restart_requested:
            self._active = None

    def _take_next_start(self) -> tuple[int, int]:
        """Where the next epoch (or the restart) begins; skips an already-finished epoch."""
        epoch, start = self._next_start
        if self.volume.partition(start, self.batch_size, self.drop_last).num_batches == 0:
            epoch, start = epoch + 1, 0
        return epoch, start

    def _start(self, epoch: int, start: int) -> Iterator[Delivery]:
        self._stop_filling()  # a superseded iterator's, if it was never closed
        self._warn_if_a_saved_position_was_left(epoch)
        self._write_plan(epoch, start)
        self.epoch = epoch
        self._active = self.volume.partition(start, self.batch_size, self.drop_last)
        self._consumed = start
        self._next_start = (epoch + 1, 0)
        self._restart_requested = False
        # forks the workers, if new (a fill thread still finishing a fetch is harmless: a
        # child resets the cache's locks and closes what it inherited, cache.py)
        stream = self.dataset
        stream.starting = True  # what iterates it, or forks workers that do, is ours
        try:
            it = super().__iter__()
            self._start_filling(epoch, start)  # now, not once they are born: they start at once
            try:
                return self._replace_stuck_workers(it, epoch, start)
            except BaseException:
                self._stop_filling()
                raise
        finally:
            stream.starting = False

    def _start_filling(self, epoch: int, start: int) -> None:
        if self.fill_ahead and self.num_workers > 0:
            hold, lead = self._fill_window()
            self._filler = self.volume.fill_ahead(
                epoch, start, batch_size=self.batch_size, drop_last=self.drop_last,
                lead=lead, hold=hold, threads=self.volume.prefetch_threads * self.num_workers,
            )  # fmt: skip

    def _write_plan(self, epoch: int, start: int) -> None:
        """A new generation: what workers deliver under an older one is refused."""
        self._generation += 1
        self._plan.copy_(torch.tensor([self._generation, epoch, start], dtype=torch.int64))

    def _replace_stuck_workers(self, it: Any, epoch: int, start: int) -> Any:
        """Wait for the workers just forked to start; one stuck in ``fork()``
        (``worker_births.py``) is killed and every worker forked again."""
        for attempt in itertools.count():
            workers = getattr(it, "_workers", None)
            if self._births is None or not workers:
                return it
            pids = tuple(w.pid for w in workers)
            if pids == self._born_pids:  # persistent workers resumed: nothing was forked
                return it
            stuck = self._births.await_births(workers, self._generation)
            if not stuck:
                self._born_pids = pids
                return it
            named = ", ".join(f"worker {workers.index(p)} (pid {p.pid})" for p in stuck)
            python = ".".join(str(v) for v in sys.version_info[:3])
            if attempt == MAX_REFORKS:
                _kill_workers(it, stuck)
                self._iterator = None  # the next iter(loader) forks afresh
                raise RuntimeError(
                    f"unbroken.DataLoader: {named} never started after fork(), "
                    f"{MAX_REFORKS + 1} times in a row (asleep, using no CPU); a "
                    "worker_init_fn that blocks, or a lock held across fork() "
                    f"(Python {python}: CPython before 3.11.10 can hang there, gh-112275)"
                )
            log.warning(
                "unbroken.DataLoader: %s has not started after fork() and sleeps using no "
                "CPU: killed, and the workers are forked again (Python %s; CPython before "
                "3.11.10 can hang a child in fork(), gh-112275)", named, python,
            )  # fmt: skip
            _kill_workers(it, stuck)
            self._iterator = None  # persistent workers: fork a new set
            self._write_plan(epoch, start)
            it = super().__iter__()  # the fill goes on: same plan, and forks are safe
        raise AssertionError("unreachable")

    def _fill_window(self) -> tuple[int, int]:
        """(hold, lead) in batches: what the workers hold queued and being made; and how
        far ahead of the loop to fill: that, their read-ahead, and one round of slack."""
        workers = self.num_workers
        hold = workers * ((self.prefetch_factor or 2) + 1)
        read_ahead = -(-self.volume.prefetch_depth // self.batch_size)
        return hold, hold + workers * (read_ahead + 1)

    def _stop_filling(self) -> None:
        filler, self._filler = self._filler, None
        if filler is not None:
            filler.close()
            self.metrics.add(filler.take_stats())

    def _accept(self, d: Any, epoch: int, expected: int) -> None:
        """A batch must be the next one of the current plan, or the position is wrong."""
        if not isinstance(d, Delivery):
            raise TypeError(f"unbroken.DataLoader: a worker returned {type(d).__name__}")
        if (d.generation, d.epoch, d.batch_id) != (self._generation, epoch, expected):
            raise RuntimeError(
                f"unbroken.DataLoader: expected batch {expected} of epoch {epoch} "
                f"(plan {self._generation}), got {d!r}"
            )

    def _finish(self, epoch: int) -> None:
        part = self._active
        if part is not None and self._consumed != part.end:
            raise RuntimeError(
                f"unbroken.DataLoader: epoch {epoch} ended at position {self._consumed}, "
                f"expected {part.end}; batches were lost"
            )
        self._active = None

    def _warn_if_a_saved_position_was_left(self, epoch: int) -> None:
        """A state was taken mid-epoch, and this run then left that epoch for the next
        one (a ``break`` without ``end_epoch``): a run resumed from it would serve what
        this one skipped. Said once per such epoch, when it happens."""
        left, self._state_taken_in = self._state_taken_in, None
        if left is None or self._restart_requested or self._active is None:
            return
        if self._consumed >= self._active.end:  # served to its end: nothing was skipped
            return
        if left[0] < epoch:
            log.warning(
                "unbroken.DataLoader: epoch %d was left at position %d of %d for epoch %d, "
                "after a state was taken in it at position %d; a run resumed from that "
                "state serves the rest of epoch %d, which this run skipped. Where a loop "
                "ends its epochs early, call loader.end_epoch() there, before the save",
                left[0], self._consumed, self._active.end, epoch, left[1], left[0],
            )  # fmt: skip

    def _persistent_workers_on(self) -> bool:
        return bool(self.persistent_workers and self.num_workers > 0)

    # -- state --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The global position (small, JSON-able): the same on every rank."""
        if self._active is not None and not self._restart_requested:
            epoch, position = self.epoch, self._consumed
            if position >= self._active.end:  # end of epoch: resume at the next one
                epoch, position = epoch + 1, 0
            else:
                self._state_taken_in = (epoch, position)
        else:
            epoch, position = self._next_start
        return {
            "format": STATE_FORMAT,
            "epoch": epoch,
            "position": position,
            "seed": self.volume.seed,
            "shuffle": self.volume.shuffle,
            "num_samples": len(self.volume),
            "fingerprint": self.volume.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; mid-iteration, the workers restart at that position."""
        check_state(state, self.volume)
        self._next_start = (int(state["epoch"]), int(state["position"]))
        self._warn_if_tail_lost(self._next_start[1])
        if self._active is not None:
            self._restart_requested = True
        else:  # the next one: a rest of the epoch too short for one batch is skipped
            self.epoch = self._take_next_start()[0]

    def _warn_if_tail_lost(self, position: int) -> None:
        """A position saved at another global batch size (world size, batch size): the
        rest of its epoch may not fill whole batches of this one, and ``drop_last``
        drops what is left over, samples the epoch never serves."""
        batch = self.batch_size * self.volume.world_size
        lost = (len(self.volume) - position) % batch
        if self.drop_last and position % batch and lost:
            log.warning(
                "unbroken.DataLoader: resuming at position %d of the epoch with a global "
                "batch of %d, which does not divide it (saved at another world size or "
                "batch size): the epoch's last %d samples do not fill a batch and are "
                "dropped (drop_last), served again from the next epoch on",
                position, batch, lost,
            )  # fmt: skip


class _PlannedStream(IterableDataset):
    """What torch's workers iterate: this worker's batches of the current plan."""

    def __init__(
        self,
        dataset: VolumeDataset,
        plan: torch.Tensor,
        batch_size: int,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any] | None,
    ) -> None:
        self.dataset = dataset
        self.plan = plan
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.starting = False
        """Set while its DataLoader starts an epoch (its workers inherit it as forked)."""

    def __iter__(self) -> Iterator[Delivery]:
        if not self.starting:  # a loader rebuilt from this one: internal records, no order
            raise TypeError(
                "an unbroken.DataLoader's dataset is iterated by another DataLoader made "
                "from it (accelerate's prepare(loader), a wrapper that rebuilds it): it "
                "yields internal records, not batches. Iterate the unbroken.DataLoader "
                "itself; it already gives each rank its part (prepare the model and "
                "optimizer only)"
            )
        generation, epoch, start = (int(v) for v in self.plan.tolist())
        info = get_worker_info()
        if info is not None:  # outlive a SIGTERM meant for the rank (see worker_sigterm)
            defer_sigterm_in_this_worker()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        return self.dataset.iter_batches(
            epoch,
            start,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            collate_fn=self.collate_fn or default_collate,
            worker=worker,
            num_workers=workers,
            generation=generation,
        )


def default_num_workers() -> int:
    """One worker per core, up to 8: decode is the CPU work; fetch runs in threads."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def _as_is(item: Any) -> Any:
    return item


def _kill_workers(it: Any, stuck: list[Any]) -> None:
    """SIGKILL ``stuck`` (a child stuck in ``fork()`` never runs the Python handler it
    inherited for SIGTERM), then shut the iterator down; torch's SIGCHLD handler must not
    take the kills for a crash."""
    from torch.utils.data._utils import signal_handling

    if getattr(it, "_worker_pids_set", False):
        signal_handling._remove_worker_pids(id(it))
        it._worker_pids_set = False
    for proc in stuck:
        proc.kill()
        proc.join(timeout=5)
    _shutdown(it)


def _shutdown(it: Any) -> None:
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
