"""Host buffers that staging copies into: one per state-dict key, reused across saves.

Allocating a fresh host copy of the state on every save costs the training loop page
faults (about 2 s per GB here) and lets memory grow or thrash. The pool keeps one buffer
per key and hands the same buffer back while the key's shape and dtype stay the same, so
steady-state saves allocate nothing. It is bounded: ``max_bytes`` caps what it holds, and
buffers of keys that disappear or change shape are dropped before new ones are made.

CPU sources get private, page-aligned memory with huge pages advised
(``unbroken._util.host_memory``): the worker writes it in place with O_DIRECT, and the
same write from shared memory cost compute-bound processes beside it more (0.14-0.17
core-s per GiB here, against 0.08-0.12 from private memory). Buffers smaller than a page
(scalars such as Adam's ``step``, biases, norms) share one private segment instead: a
mapping each would take a whole page for a few bytes (70,000 of them held 358 MiB), out
of sight of ``max_bytes``.
``shared_memory=True`` gives shared-memory buffers instead, for a caller that hands them
to another process (torch's default ``file_descriptor`` strategy unlinks the segment at
once, so nothing outlives a crash); tmpfs rarely has huge pages. They are views of one
segment for the whole pool: torch keeps a segment's descriptor open while it lives, and
a model of a few hundred parameters with Adam has over a thousand tensors, where 1,024
open files is a common limit (one segment per tensor failed with "Too many open files").
CUDA sources get page-locked (pinned) buffers so device-to-host copies run
asynchronously on a side stream; pinned buffers are neither.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from unbroken._util.host_memory import host_tensor
from unbroken.checkpoint.staging.errors import StagingBudgetError


@dataclass(frozen=True)
class BufferSpec:
    """What one key needs: a contiguous host tensor of this shape and dtype."""

    shape: tuple[int, ...]
    """Shape of the source tensor (its local shard for a DTensor)."""
    dtype: torch.dtype
    """Element type of the source tensor."""
    pinned: bool = False
    """Page-locked memory, for sources on a CUDA device."""
    own_storage: bool = False
    """A storage of its own, never a view of a shared segment: the tensor is pickled
    whole (inside a tuple, say), and torch.save writes a view's whole storage."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


class HostBufferPool:
    """Reused host buffers keyed by state-dict key, bounded by ``max_bytes``.

    ``reserve(specs)`` returns one buffer per key: the buffer it already holds when the
    spec is unchanged, a new one otherwise. Keys not in ``specs`` are dropped, so the pool
    never holds more than the last state it staged.
    """

    def __init__(
        self,
        *,
        max_bytes: int | None = None,
        shared_memory: bool = False,
        pin_memory: bool | None = None,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.max_bytes = max_bytes
        self.shared_memory = shared_memory
        # None: pin exactly the buffers of CUDA sources, when CUDA is there.
        self.pin_memory = pin_memory
        self._buffers: dict[str, tuple[BufferSpec, torch.Tensor]] = {}
        """Buffers of their own mapping (or pinned), by key."""
        self._segment: dict[str, tuple[BufferSpec, torch.Tensor]] = {}
        """Buffers that are views of one segment (``_in_segment``), by key."""
        self._segment_bytes = 0
        self._lock = threading.Lock()
        """``forget`` comes from the save worker while ``reserve`` runs on the loop."""
        self.allocations = 0
        """How many buffers this pool has ever allocated (a leak or thrash shows here)."""

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the pool holds now (the segment with its alignment)."""
        with self._lock:
            own = sum(spec.nbytes for spec, _ in self._buffers.values())
            return own + self._segment_bytes

    def __len__(self) -> int:
        return len(self._buffers) + len(self._segment)

    def __contains__(self, key: object) -> bool:
        return key in self._buffers or key in self._segment

    def reserve(self, specs: Mapping[str, BufferSpec]) -> tuple[dict[str, torch.Tensor], int]:
        """Buffers for exactly these keys, and how many bytes had to be newly allocated.

        Raises ``StagingBudgetError`` (and changes nothing) when the specs need more than
        ``max_bytes``.
        """
        with self._lock:
            return self._reserve(specs)

    def forget(self, placed: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
        """Drop the buffers of their own mapping whose key, shape and dtype are in
        ``placed``: the next snapshot stages those keys elsewhere (a memory-tier arena),
        and holding them meanwhile would keep a third copy of the state. Pinned buffers
        and the small ones' segment stay. Returns the bytes dropped (memory returns once
        no staged state holds them)."""
        with self._lock:
            gone = [
                key
                for key, (spec, _) in self._buffers.items()
                if not self._pins(spec) and placed.get(key) == (spec.shape, spec.dtype)
            ]
            dropped = sum(self._buffers[key][0].nbytes for key in gone)
            for key in gone:
                del self._buffers[key]
            return dropped

    def _reserve(self, specs: Mapping[str, BufferSpec]) -> tuple[dict[str, torch.Tensor], int]:
        in_segment = {k: s for k, s in specs.items() if self._in_segment(s)}
        needed = segment_layout(in_segment)[1] + sum(
            s.nbytes for k, s in specs.items() if k not in in_segment
        )
        if self.max_bytes is not None and needed > self.max_bytes:
            largest = sorted(((k, s.nbytes) for k, s in specs.items()), key=lambda kv: -kv[1])
            raise StagingBudgetError(needed, self.max_bytes, largest[:5])
        # Drop stale buffers first so the peak stays within the budget.
        for key in [k for k, (spec, _) in self._buffers.items() if specs.get(k) != spec]:
            del self._buffers[key]
        if {key: spec for key, (spec, _) in self._segment.items()} != in_segment:
            self._clear_segment()  # the old one goes once no staged state holds it
        allocated = self._lay_out_segment(in_segment) if in_segment and not self._segment else 0
        out: dict[str, torch.Tensor] = {}
        for key, spec in specs.items():
            held = self._segment.get(key) or self._buffers.get(key)
            if held is None:
                held = (spec, self._allocate(spec))
                self._buffers[key] = held
                allocated += spec.nbytes
                self.allocations += 1
            out[key] = held[1]
        return out, allocated

    def clear(self) -> None:
        """Drop every buffer (memory returns once no staged state references it)."""
        with self._lock:
            self._buffers.clear()
            self._clear_segment()

    def _clear_segment(self) -> None:
        self._segment.clear()
        self._segment_bytes = 0

    def _in_segment(self, spec: BufferSpec) -> bool:
        """Shared memory: every buffer (one descriptor for the pool); private: those under
        a page. Pinned buffers never (they come from the CUDA host allocator), nor those
        that are pickled whole."""
        if not spec.nbytes or spec.own_storage or self._pins(spec):
            return False
        return self.shared_memory or spec.nbytes < SEGMENT_BELOW_BYTES

    def _lay_out_segment(self, specs: Mapping[str, BufferSpec]) -> int:
        """One segment for ``specs``, each buffer a view of it; the bytes allocated.
        Its layout holds while every spec is unchanged (specs rarely change in a run)."""
        offsets, total = segment_layout(specs)
        if self.shared_memory:  # straight into shared memory: share_memory_() would copy
            storage = torch.UntypedStorage._new_shared(total)
        else:
            storage = host_tensor((total,), torch.uint8).untyped_storage()
        for key, spec in specs.items():
            buf = torch.empty(0, dtype=spec.dtype)
            buf.set_(
                storage,
                offsets[key] // _itemsize(spec.dtype),
                spec.shape,
                _contiguous_stride(spec.shape),
            )
            self._segment[key] = (spec, buf)
        self.allocations += len(specs)
        self._segment_bytes = total
        return total

    def _pins(self, spec: BufferSpec) -> bool:
        pin = spec.pinned if self.pin_memory is None else self.pin_memory
        return bool(pin) and torch.cuda.is_available()

    def _allocate(self, spec: BufferSpec) -> torch.Tensor:
        """One buffer of its own: pinned when asked and CUDA is there, else shared or
        private huge-page memory (small private buffers and, in shared memory, all but
        those pickled whole go in the segment instead)."""
        if self._pins(spec):
            return torch.empty(spec.shape, dtype=spec.dtype, pin_memory=True)
        if spec.nbytes == 0:
            return torch.empty(spec.shape, dtype=spec.dtype)
        if self.shared_memory:
            return torch.empty(spec.shape, dtype=spec.dtype).share_memory_()
        return host_tensor(spec.shape, spec.dtype)


SEGMENT_BELOW_BYTES = 4096
"""Private buffers smaller than this (a page) share one segment instead of a mapping each."""


def segment_layout(specs: Mapping[str, BufferSpec], page: int = 4096) -> tuple[dict[str, int], int]:
    """Byte offsets of buffers packed into one segment, and its length. A buffer of a page
    or more starts on a page (O_DIRECT writes it in place); smaller ones on 64 bytes, the
    alignment of any dtype and of a cache line."""
    offsets, end = {}, 0
    for key, spec in specs.items():
        align = page if spec.nbytes >= page else 64
        end = -(-end // align) * align
        offsets[key] = end
        end += spec.nbytes
    return offsets, end


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))
