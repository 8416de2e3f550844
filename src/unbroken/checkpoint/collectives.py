"""A dedicated gloo group for checkpoint coordination, or nothing in a single process.

Background saves must never issue collectives on the default process group: the training
loop's own collectives run there, and two threads interleaving collectives on one group
deadlock. Each :class:`CheckpointManager` makes its own groups in ``__init__`` (a
collective call, so every rank constructs its managers in the same order).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class Group:
    """Object collectives over one dedicated group; identity functions without one."""

    def __init__(self, pg: Any | None) -> None:
        self.pg = pg
        self.rank = dist.get_rank(pg) if pg is not None else 0
        self.world_size = dist.get_world_size(pg) if pg is not None else 1
        self.global_rank = dist.get_rank() if pg is not None else 0

    @classmethod
    def create(cls, timeout: float) -> Group:
        """A new gloo group over every rank, or a process-local stand-in if not distributed."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(None)
        return cls(dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)))

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in group-rank order (objects travel pickled between ranks)."""
        if self.pg is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every rank."""
        if self.pg is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, group_src=0)
        return box[0]

    def any(self, *flags: bool) -> tuple[bool, ...]:
        """For each flag, whether it is true on any rank (one small all_reduce)."""
        if self.pg is None:
            return tuple(bool(f) for f in flags)
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return tuple(bool(v) for v in t.tolist())
