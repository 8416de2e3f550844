"""DCP planners: loading that never unpickles arbitrary objects, saving buffers from rank 0.

Saving also refuses a key whose tensor differs in shape or dtype between ranks.

DCP's ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(..., weights_only=False)`` on
every non-tensor item it reads, which runs whatever a planted pickle asks for. This
planner loads those items with ``weights_only=True``: primitives, containers and tensors
only; anything else is refused with an error naming the key.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Collection
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem, SavePlan

from unbroken.checkpoint.errors import CheckpointCorruptError


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` with ``weights_only=True`` for non-tensor items."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointCorruptError(
                f"checkpoint item {fqn!r} is not a plain value (refused to unpickle it): {e}"
            ) from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class PinnedSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that saves the ``pinned`` keys from the lowest rank holding them.

    DCP writes each replicated item once, from whichever rank has written least so far,
    which spreads the work. That is right when replicas are equal, but module buffers are
    not: under DDP each rank's BatchNorm statistics drift until the next forward
    broadcasts rank 0's. Saving those from rank 0 makes a resumed run see exactly what
    the uninterrupted one would have; everything else stays load-balanced.
    """

    def __init__(self, pinned: Collection[str] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pinned = frozenset(pinned)

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        _refuse_unlike_copies(all_plans)
        if self.pinned and len(all_plans) > 1:
            owner: dict[MetadataIndex, int] = {}
            for rank, plan in enumerate(all_plans):
                for item in plan.items:
                    if item.index.fqn in self.pinned:
                        owner.setdefault(item.index, rank)
            all_plans = [
                dataclasses.replace(
                    plan,
                    items=[
                        i
                        for i in plan.items
                        if i.index.fqn not in self.pinned or owner[i.index] == rank
                    ],
                )
                for rank, plan in enumerate(all_plans)
            ]
        return super()._dedup_save_plans(all_plans)


class UnlikeCopiesError(ValueError):
    """The ranks hold one key's tensor in different shapes or dtypes (see below)."""


def unlike_copies_in(failed: BaseException) -> UnlikeCopiesError | None:
    """The UnlikeCopiesError behind a DCP ``CheckpointException`` (its ``failures`` map a
    rank to the exception, or to the exception and its traceback), if that is the cause."""
    for failure in getattr(failed, "failures", {}).values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, UnlikeCopiesError):
            return exc
    return None


def _refuse_unlike_copies(all_plans: list[SavePlan]) -> None:
    """A key whose tensor has another shape or dtype on another rank: one copy is written
    for the whole job, and the ranks it does not fit could never restore the step."""
    seen: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            if item.tensor_data is None:
                continue
            fqn = item.index.fqn
            mine = (tuple(item.tensor_data.size), item.tensor_data.properties.dtype)
            first = seen.setdefault(fqn, (rank, *mine))
            if first[1:] != mine:
                raise UnlikeCopiesError(
                    f"state key {fqn!r} is a tensor of shape {list(first[1])} ({first[2]}) on "
                    f"rank {first[0]} and {list(mine[0])} ({mine[1]}) on rank {rank}: a tensor "
                    "of the state is one copy for the whole job, the same shape and dtype on "
                    "every rank; keep a rank's own tensor under a key of its own"
                )
