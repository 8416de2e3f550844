"""A dedicated gloo group for the library's coordination (checkpoints, the data index's
agreement), or nothing in a single process.

Background saves must never issue collectives on the default process group: the training
loop's own collectives run there, and two threads interleaving collectives on one group
deadlock. Each :class:`CheckpointManager` makes its own groups in ``__init__`` (a
collective call, so every rank constructs its managers in the same order).

The tensors a collective used stay referenced here until gloo's thread has let go of
them (:func:`keep_until_released`). Dropped sooner, the last reference falls to that
thread, which must then take the GIL from a thread Python does not know: it makes a
thread state under CPython's thread-state lock, without the GIL, and a DataLoader forking
at that instant on CPython before 3.11.10 leaves a worker hung in ``fork()``
(gh-112275; ``data/worker_births.py``). The object collectives are written here for
that reason: torch's own drop the tensors they make inside.
"""

from __future__ import annotations

import pickle
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

MAX_KEPT = 256
"""Tensors kept at most; past it the oldest go whether gloo let go or not (a hung peer)."""
KEPT_BYTES_WAIT = 1 << 20
"""Past this many bytes held, a call waits (up to ``RELEASE_WAIT_SECONDS``) for gloo to let
go, so that a large object's buffers are not held until the next collective."""
RELEASE_WAIT_SECONDS = 0.05

_kept: list[torch.Tensor] = []
_kept_lock = threading.Lock()


def keep_until_released(*tensors: torch.Tensor) -> None:
    """Hold ``tensors`` (which a collective used) until nothing but this holds them; let
    go of every held tensor gloo has released."""
    global _kept
    deadline = time.monotonic() + RELEASE_WAIT_SECONDS
    with _kept_lock:
        _kept = [t for t in (*_kept, *tensors) if t._use_count() > 1][-MAX_KEPT:]
        while _nbytes(_kept) > KEPT_BYTES_WAIT and time.monotonic() < deadline:
            time.sleep(0.0005)  # gloo's thread frees a finished work within microseconds
            _kept = [t for t in _kept if t._use_count() > 1]


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Group:
    """Object collectives over one dedicated group; identity functions without one."""

    def __init__(self, pg: Any | None) -> None:
        self.pg = pg
        self.rank = dist.get_rank(pg) if pg is not None else 0
        self.world_size = dist.get_world_size(pg) if pg is not None else 1
        self.global_rank = dist.get_rank() if pg is not None else 0
        self.released = False

    @classmethod
    def create(cls, timeout: float) -> Group:
        """A new gloo group over every rank, or a process-local stand-in if not distributed."""
        if not _initialized():
            return cls(None)
        return cls(dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)))

    def release(self) -> None:
        """Free the group's gloo context (its threads, a socket per peer): a process that
        makes a manager per ``fit()`` or per evaluation kept every one, about 15 file
        descriptors and 9 threads a manager. Only once no collective of this process
        can still use it; its peers may release theirs later (it is local)."""
        pg, self.pg = self.pg, None  # the last reference: its threads end now, not at a gc
        if pg is None or self.released:
            return
        self.released = True
        if not _initialized():
            return  # the default group went first, and every group with it
        try:
            dist.destroy_process_group(pg)
        except ValueError:  # no longer known to torch (the default group was remade)
            pass

    def _refuse_if_released(self) -> None:
        if self.released:  # torch would skip it as if this rank were not in the group
            raise RuntimeError("a collective on a released group (its manager is closed)")

    def refuse_if_alone(self, what: str) -> None:
        """Refuse to act alone on one rank of several (each would write rank 0's files):
        ``what`` was made before ``init_process_group``."""
        alone = self.pg is None and not self.released and _initialized()
        if alone and dist.get_world_size() > 1:
            raise RuntimeError(
                f"{what} was created before torch.distributed.init_process_group(), so it "
                f"works as a single process, but this is rank {dist.get_rank()} of "
                f"{dist.get_world_size()}: create the {what} after init_process_group, on "
                "every rank"
            )

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in group-rank order (objects travel pickled between ranks)."""
        self._refuse_if_released()
        if self.pg is None:
            return [obj]
        mine = _to_bytes(obj)
        size = torch.tensor([mine.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        padded, gathered = mine, []
        try:
            dist.all_gather(sizes, size, group=self.pg)
            longest = max(int(s) for s in sizes)
            padded = torch.zeros(longest, dtype=torch.uint8)
            padded[: mine.numel()] = mine
            gathered = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
            dist.all_gather(gathered, padded, group=self.pg)
            return [_from_bytes(t, int(n)) for t, n in zip(gathered, sizes, strict=True)]
        finally:
            keep_until_released(size, *sizes, padded, *gathered)

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every rank."""
        self._refuse_if_released()
        if self.pg is None:
            return obj
        mine = _to_bytes(obj) if self.is_coordinator else None
        size = torch.tensor([mine.numel() if mine is not None else 0], dtype=torch.int64)
        payload = mine
        try:
            dist.broadcast(size, group=self.pg, group_src=0)
            if payload is None:
                payload = torch.empty(int(size), dtype=torch.uint8)
            dist.broadcast(payload, group=self.pg, group_src=0)
            return obj if self.is_coordinator else _from_bytes(payload, int(size))
        finally:
            keep_until_released(size, *([payload] if payload is not None else []))

    def any(self, *flags: bool) -> tuple[bool, ...]:
        """For each flag, whether it is true on any rank (one small all_reduce)."""
        self._refuse_if_released()
        if self.pg is None:
            return tuple(bool(f) for f in flags)
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
            return tuple(bool(v) for v in t.tolist())
        finally:
            keep_until_released(t)


def release(*groups: Group | None) -> None:
    """:meth:`Group.release` each group given."""
    for group in groups:
        if group is not None:
            group.release()


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _from_bytes(t: torch.Tensor, size: int) -> Any:
    return pickle.loads(t[:size].numpy().tobytes())
