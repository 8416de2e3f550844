"""Where each tensor record of a shard file sits, decided before any byte is written (pure).

A shard holds this rank's tensor records first, in plan order, then its bytes values. A
tensor record's place depends only on the records before it (their dtypes and shapes),
never on a value's length, so the same state saved again lands at the same offsets: the
memory tier can hand the staging copy a buffer that already is the next shard's payload
(``staging/arena.py``), and the writer then writes only the envelopes around it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from unbroken.checkpoint.format.tensor_record import envelope, record_start


@dataclass(frozen=True)
class TensorSlot:
    """One tensor record of a shard: the item it holds and its byte ranges in the file."""

    fqn: str
    """The state-dict key (DCP's fully qualified name)."""
    offset: tuple[int, ...]
    """The chunk's offset in the whole tensor (zeros unless sharded)."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Where the record (its envelope's header) starts."""
    payload_start: int
    """Where the tensor's raw bytes start."""
    payload_bytes: int
    end: int
    """Where the record (its envelope's trailer) ends."""


@dataclass(frozen=True)
class TensorLayout:
    """The tensor records of one shard; ``end`` is where the bytes values begin."""

    slots: tuple[TensorSlot, ...]
    end: int

    @property
    def payload_bytes(self) -> int:
        return sum(s.payload_bytes for s in self.slots)

    def by_fqn(self) -> dict[str, TensorSlot]:
        """The slot of each key held by exactly one record (a key chunked twice on this
        rank is left out: no single buffer is its payload)."""
        seen: dict[str, TensorSlot | None] = {}
        for slot in self.slots:
            seen[slot.fqn] = None if slot.fqn in seen else slot
        return {k: s for k, s in seen.items() if s is not None}


def lay_out(
    tensors: Iterable[tuple[str, tuple[int, ...], torch.dtype, tuple[int, ...]]],
) -> TensorLayout:
    """The records of ``(fqn, chunk offset, dtype, shape)`` in this order, from offset 0."""
    slots: list[TensorSlot] = []
    pos = 0
    for fqn, offset, dtype, shape in tensors:
        header, trailer = envelope(dtype, tuple(shape))
        nbytes = _numel(shape) * dtype.itemsize
        start = record_start(pos, len(header), nbytes)
        payload_start = start + len(header)
        pos = payload_start + nbytes + len(trailer)
        slots.append(
            TensorSlot(fqn, tuple(offset), dtype, tuple(shape), start, payload_start, nbytes, pos)
        )
    return TensorLayout(tuple(slots), pos)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
