"""DCP planners: loading that never unpickles arbitrary objects, saving buffers from rank 0.

Saving also refuses a key whose tensor differs in shape or dtype between ranks.

DCP's ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(..., weights_only=False)`` on
every non-tensor item it reads, which runs whatever a planted pickle asks for. This
planner loads those items with ``weights_only=True``: primitives, containers and tensors
only; anything else is refused with an error naming the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import pickle
import warnings
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem, SavePlan

from unbroken.checkpoint.errors import CheckpointCorruptError
from unbroken.checkpoint.staging.copy import buffer_key

log = logging.getLogger(__name__)

# DCP says so on every single-process save and load; no group is our normal case there.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or")

_PRINTS = "unbroken-fingerprints"
_PRINT_BYTES = 1 << 20
"""Items up to this size that no staging copy checksummed are checksummed for the check."""
_warned: set[frozenset[str]] = set()


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

    def __init__(
        self,
        pinned: Collection[str] = (),
        known_checksums: Mapping[tuple[int, int], int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.pinned = frozenset(pinned)
        self.known_checksums = known_checksums or {}

    def create_local_plan(self) -> SavePlan:
        """The plan, and a fingerprint of each item some other rank may hold too (beside
        DCP's own ``planner_data``, which ``_dedup_save_plans`` puts back)."""
        plan = super().create_local_plan()
        prints = fingerprints(self.state_dict, self.pinned, self.known_checksums)
        return dataclasses.replace(plan, planner_data=(_PRINTS, plan.planner_data, prints))

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        prints = []
        for i, plan in enumerate(all_plans):
            data = plan.planner_data
            if isinstance(data, tuple) and len(data) == 3 and data[0] == _PRINTS:
                all_plans[i] = dataclasses.replace(plan, planner_data=data[1])
                prints.append(data[2])
        warn_unlike_values(prints)
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


def fingerprints(
    state_dict: Mapping[str, Any],
    pinned: Collection[str],
    known: Mapping[tuple[int, int], int],
) -> dict[str, int]:
    """A crc32c of each item of this rank that DCP saves once for every rank holding it:
    plain tensors (their staging copy's checksum, or their bytes up to ``_PRINT_BYTES``)
    and other values (pickled). Sharded tensors and pinned module buffers are left out:
    their copies are meant to differ."""
    import crc32c

    out = {}
    for key, value in state_dict.items():
        if key in pinned:
            continue
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor or value.device.type != "cpu":
                continue  # a DTensor's shard is its own; a device tensor costs a copy
            nbytes = value.numel() * value.element_size()
            crc = known.get(buffer_key(value.data_ptr(), nbytes))
            if crc is None and nbytes <= _PRINT_BYTES:
                with contextlib.suppress(Exception):  # a check, never a failed save
                    raw = value.detach().reshape(-1).contiguous().view(torch.uint8)
                    crc = crc32c.crc32c(raw.numpy().data) if nbytes else 0
            if crc is not None:
                out[key] = crc
        else:
            try:
                out[key] = crc32c.crc32c(pickle.dumps(value, protocol=4))
            except Exception:
                continue
    return out


def warn_unlike_values(prints: list[dict[str, int]]) -> None:
    """Warn, once per set of keys, where the ranks hold an item DCP saves once in other
    values: every rank restores one rank's copy (a per-rank counter or buffer inside a
    ``state_dict()``, a model the ranks trained apart)."""
    first: dict[str, tuple[int, int]] = {}
    unlike: dict[str, tuple[int, int]] = {}
    for rank, mine in enumerate(prints):
        for key, crc in mine.items():
            seen = first.setdefault(key, (rank, crc))
            if seen[1] != crc and key not in unlike:
                unlike[key] = (seen[0], rank)
    if not unlike or frozenset(unlike) in _warned:
        return
    _warned.add(frozenset(unlike))
    shown = ", ".join(f"{k!r} (ranks {a} and {b})" for k, (a, b) in sorted(unlike.items())[:8])
    more = f" and {len(unlike) - 8} more" if len(unlike) > 8 else ""
    log.warning(
        "state items that are one copy for the whole job hold other values on other ranks: "
        "%s%s. One rank's copy is saved, and every rank restores it. Keep per-rank state in "
        "a plain value or a torch.Generator at the top of the state (kept per rank), or "
        "under a key of its own per rank",
        shown, more,
    )  # fmt: skip
