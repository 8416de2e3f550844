"""Staging: copy a state dict into reused host buffers at the cost of as little as possible.

The training loop pays for ``stage()``: it walks the state, copies the keys that forward
mutates (``first``, e.g. BatchNorm statistics) and deep-copies non-tensor values, then
returns. Every other tensor is copied on a background thread (CUDA: a side stream) while
the loop runs the next forward/backward. Parameters and optimizer state only change in
``optimizer.step()``, so every optimizer's step waits in a global pre-hook until the copy
is done and checked (``step_gate``); usually it already is. A source changed in place by
anything else before its copy finished, through ``.data`` too (``verify``), makes
``StagedState.wait()`` raise ``TornSnapshotError``: the snapshot is abandoned, never kept
with mixed values.

Buffers come from a ``HostBufferPool`` and are reused save after save, so one snapshot is
staged at a time: the consumer calls ``StagedState.release()`` once it has written the
buffers, and the next ``stage()`` waits for that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping
from types import MappingProxyType
from typing import Any

import torch

from unbroken.checkpoint.format.shard_layout import TensorLayout
from unbroken.checkpoint.staging import step_gate
from unbroken.checkpoint.staging.arena import Arena
from unbroken.checkpoint.staging.copy import (
    DEFAULT_CHUNK_BYTES,
    CopyJob,
    Leaf,
    copy_now,
    version_of,
)
from unbroken.checkpoint.staging.errors import (
    CheckpointError,
    StagingBudgetError,
    StagingBusyError,
    TornSnapshotError,
)
from unbroken.checkpoint.staging.host_buffers import BufferSpec, HostBufferPool
from unbroken.checkpoint.staging.tree import (
    Found,
    buffer_keys,
    collect,
    match_first,
    rebuild,
    wrap_like,
)

__all__ = [
    "CheckpointError",
    "HostBufferPool",
    "StagedState",
    "StagingBudgetError",
    "StagingBusyError",
    "StateStager",
    "TornSnapshotError",
    "buffer_keys",
]


class StagedState:
    """One snapshot in host buffers. Valid until ``release()``; the stager then reuses them."""

    def __init__(
        self,
        state_dict: dict[str, Any],
        job: CopyJob,
        stats: dict[str, float],
        on_release,
        arena: Arena | None = None,
    ) -> None:
        self.state_dict = state_dict
        """Same structure and keys as the staged state; tensors are host buffers."""
        self.arena = arena
        """The memory tier's file that holds some of the buffers (None: all private)."""
        self._job = job
        self._stats = stats
        self._on_release = on_release
        self._released = False
        self._lock = threading.Lock()

    @property
    def checksums(self) -> Mapping[tuple[int, int], int]:
        """crc32c of each host buffer the background copy checksummed, by
        ``buffer_key(address, nbytes)``; empty until the copy is sealed whole (in the
        optimizer's step pre-hook or ``wait()``), for a torn or aborted copy, and after
        ``release()``.

        Buffers copied on the training thread (``first``) or from a device are not in it:
        their bytes are checksummed where they are written.
        """
        return MappingProxyType({} if self._released else self._job.checksums)

    @property
    def done(self) -> bool:
        """Every copy has ended (successfully or not); ``wait()`` will not block."""
        return self._job.finished.is_set()

    @property
    def released(self) -> bool:
        return self._released

    @property
    def stats(self) -> dict[str, float]:
        """bytes, bytes_first, tensors, allocated_bytes, stage_seconds, hook_wait_seconds,
        blocking_seconds (what the training loop paid), background_seconds, and of those
        verify_seconds (comparing the sources with their copies)."""
        out = dict(self._stats)
        out["background_seconds"] = self._job.seconds
        out["verify_seconds"] = self._job.verify_seconds
        out["bytes_copied"] = self._stats["bytes_first"] + self._job.bytes_copied
        out["blocking_seconds"] = out["stage_seconds"] + out["hook_wait_seconds"]
        return out

    def wait(self, timeout: float | None = None) -> None:
        """Block until every copy is done; raise if the snapshot cannot be used.

        ``TornSnapshotError`` names the keys changed in place before their copy finished;
        ``TimeoutError`` if the copy is still running after ``timeout`` seconds.
        """
        if not self._job.join(timeout):
            raise TimeoutError(
                f"staging of {int(self._stats['bytes'])} bytes still copying after {timeout} s"
            )
        job = self._job
        torn = self._seal()
        if job.error is not None:
            raise CheckpointError(f"staging failed while copying: {job.error!r}") from job.error
        if torn:
            raise TornSnapshotError(torn)
        if not job.complete:
            raise CheckpointError("staging was aborted (released or closed) before it finished")
        if self._released:
            raise CheckpointError("staged state was already released; its buffers are reused")

    def release(self) -> None:
        """Hand the buffers back for the next ``stage()``; stops a copy still running."""
        with self._lock:
            if self._released:
                return
            if not self._job.finished.is_set():
                self._job.abort()
            self._seal()
            self._released = True
            # Whoever still holds this object (a failure's traceback) must not hold the pool.
            self.state_dict = {}
            if self.arena is not None:
                self.arena.release()
        self._on_release(self)

    def __enter__(self) -> StagedState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _hook_wait(self) -> None:
        """In the step pre-hook, on the training thread: wait for the copy and seal it."""
        if self._job.sealed:
            step_gate.let_go(self)
            return
        began = time.perf_counter()
        self._seal()
        self._stats["hook_wait_seconds"] += time.perf_counter() - began

    def _seal(self) -> list[str]:
        """Wait for the copy, fix its verdict; optimizer steps no longer wait for it."""
        try:
            return self._job.seal()
        finally:
            step_gate.let_go(self)


class StateStager:
    """Copies state dicts into reused, bounded host buffers, overlapping training.

    ``max_bytes`` bounds the host buffers (None: whatever the state needs, never more);
    ``pin_memory`` None pins the buffers of CUDA sources; ``shared_memory`` puts CPU
    buffers in shared memory so another process can use them without a copy (default:
    private memory with huge pages advised, cheaper to write out);
    ``chunk_bytes`` is the CPU copy's step between tearing/abort checks; ``copy_threads``
    the intra-op threads of the background copy (kept apart from the training loop's);
    ``copy_nice`` how far that copy's thread is reniced (0: training's priority);
    ``checksum`` has that copy take each buffer's crc32c too (``StagedState.checksums``).
    """

    def __init__(
        self,
        *,
        max_bytes: int | None = None,
        pin_memory: bool | None = None,
        shared_memory: bool = False,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        copy_threads: int = 1,
        copy_nice: int = 10,
        checksum: bool = True,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if copy_threads <= 0:
            raise ValueError(f"copy_threads must be positive, got {copy_threads}")
        if not 0 <= copy_nice <= 19:
            raise ValueError(f"copy_nice must be between 0 and 19, got {copy_nice}")
        self.copy_threads = copy_threads
        self.copy_nice = copy_nice
        self.checksum = checksum
        self.pool = HostBufferPool(
            max_bytes=max_bytes, shared_memory=shared_memory, pin_memory=pin_memory
        )
        self.chunk_bytes = chunk_bytes
        self._streams: dict[torch.device, object] = {}
        self._current: StagedState | None = None
        self._seen: frozenset[tuple[str, tuple[int, ...], torch.dtype]] = frozenset()
        """Each tensor of the last snapshot: what a new one holds that it did not."""
        self._cond = threading.Condition()
        self._stage_lock = threading.Lock()
        self._closed = False
        step_gate.open_gate()  # until close(): every optimizer's step waits for a copy

    @property
    def busy(self) -> bool:
        """A staged state still holds the buffers: ``stage()`` would wait."""
        current = self._current
        return current is not None and not current.released

    def stage(
        self,
        state_dict: Mapping[str, Any],
        *,
        first: Collection[str | torch.Tensor] = (),
        timeout: float | None = None,
        arena: Callable[[], Arena | None] | None = None,
    ) -> StagedState:
        """Snapshot ``state_dict`` into host buffers; return before the bulk copy is done.

        Keys in ``first`` (and any key under them) are copied before this returns; a
        tensor in ``first`` selects the keys holding that memory (``model.buffers()``
        works whatever wrapper renamed them; a tensor not in the state is skipped). Waits
        up to ``timeout`` for the previous staged state to be released
        (``StagingBusyError`` after that). ``arena``: asked, once the previous staged
        state is released, for a memory-tier file to copy the keys it has a place for
        into (``arena.py``) instead of into the pool's buffers; it stays busy until this
        staged state is released.
        """
        began = time.perf_counter()
        if self._closed:
            raise CheckpointError("stage() on a closed StateStager")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"stage() takes a mapping, got {type(state_dict)!r}")
        with self._stage_lock:
            self._wait_released(timeout)
            taken = arena() if arena is not None else None
            try:
                return self._stage(state_dict, first, taken, began)
            except BaseException:  # Ctrl-C included
                if taken is not None:
                    taken.release()
                current = self._current
                if current is not None and not current.released:  # this call's: the
                    current.release()  # previous one was released before it began
                raise

    def _stage(
        self,
        state_dict: Mapping[str, Any],
        first: Collection[str | torch.Tensor],
        arena: Arena | None,
        began: float,
    ) -> StagedState:
        """``stage()``'s work once the buffers are free (under its lock)."""
        found = collect(state_dict)
        first_names = match_first(first, found)
        leaves, staged_values, allocated, in_place = self._plan(found, first_names, arena)
        if arena is not None and not in_place:
            arena.release()  # nothing of this state has a place in it
        sync = [leaf.name in first_names or _must_copy_now(leaf) for leaf in leaves]
        now = [leaf for leaf, s in zip(leaves, sync) if s]
        later = [leaf for leaf, s in zip(leaves, sync) if not s]
        torn, first_events = copy_now(now, self._streams)
        if torn:
            raise TornSnapshotError(torn)
        staged_dict = rebuild(state_dict, iter(staged_values))
        # The job also waits for the device copies of `first` before it is done.
        job = CopyJob(
            later,
            self._streams,
            chunk_bytes=self.chunk_bytes,
            threads=self.copy_threads,
            nice=self.copy_nice,
            checksum=self.checksum,
            events=first_events,
        )
        keys = [(leaf.name, tuple(leaf.src.shape), leaf.src.dtype) for leaf in leaves]
        new_bytes = sum(leaf.nbytes for leaf, k in zip(leaves, keys) if k not in self._seen)
        self._seen = frozenset(keys)
        stats = {
            "bytes": float(sum(leaf.nbytes for leaf in leaves)),
            # of them, tensors the last snapshot did not hold (all of them at the first)
            "bytes_new": float(new_bytes),
            "bytes_first": float(sum(leaf.nbytes for leaf in now)),
            "tensors": float(len(leaves)),
            "allocated_bytes": float(allocated),
            "bytes_in_place": float(in_place),
            "hook_wait_seconds": 0.0,
            "stage_seconds": 0.0,
        }
        staged = StagedState(
            staged_dict, job, stats, self._released_one, arena if in_place else None
        )
        with self._cond:
            self._current = staged
        job.start()
        step_gate.hold(staged)  # no step runs on this thread in between
        stats["stage_seconds"] = time.perf_counter() - began
        return staged

    def forget(self, layout: TensorLayout) -> int:
        """Drop the pool's buffers of the tensors ``layout`` has a place for: the next
        snapshots stage them in an arena of that layout. Safe from another thread; the
        bytes dropped."""
        return self.pool.forget({s.fqn: (s.shape, s.dtype) for s in layout.slots})

    def close(self) -> None:
        """Stop any copy and drop the buffers; the last stager to close removes the
        optimizer step hook. Call it on the training thread (not during a step)."""
        if not self._closed:
            self._closed = True
            step_gate.close_gate()
        current = self._current
        if current is not None:
            if not current.done:
                current._job.abort()
            current._seal()
            self._current = None  # the staged views would keep the buffers alive
        self.pool.clear()

    def _wait_released(self, timeout: float | None) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: not self.busy, timeout)
        if not ok:
            raise StagingBusyError(
                f"the previous staged state still holds the buffers after {timeout} s; "
                "call StagedState.release() once it is written"
            )

    def _released_one(self, staged: StagedState) -> None:
        with self._cond:
            self._cond.notify_all()

    def _plan(
        self, found: list[Found], first: set[str], arena: Arena | None
    ) -> tuple[list[Leaf], list[torch.Tensor], int, int]:
        """One leaf per distinct memory; its host buffer; the staged value per found
        tensor; bytes newly allocated; bytes staged in ``arena``."""
        owner: dict[tuple, str] = {}  # memory -> key of the leaf that copies it
        specs: dict[str, BufferSpec] = {}
        sources: dict[str, torch.Tensor] = {}
        pickled = {f.alias for f in found if f.pickled}  # a tied copy pickled: all of them
        for f in found:
            if f.alias in owner:  # tied: shares the earlier key's buffer
                if f.name in first:
                    first.add(owner[f.alias])
                continue
            owner[f.alias] = f.name
            sources[f.name] = f.local
            specs[f.name] = BufferSpec(
                tuple(f.local.shape), f.local.dtype, f.local.is_cuda, f.alias in pickled
            )
        placed: dict[str, torch.Tensor] = {}
        if arena is not None:
            placed = arena.views(
                {k: (s.shape, s.dtype, s.pinned) for k, s in specs.items() if not s.own_storage}
            )
        private, allocated = self.pool.reserve(
            {k: s for k, s in specs.items() if k not in placed}
        )
        buffers = {**private, **placed}
        leaves = [Leaf(name, src, buffers[name], version_of(src)) for name, src in sources.items()]
        staged = [wrap_like(f.value, buffers[owner[f.alias]]) for f in found]
        in_place = sum(t.numel() * t.element_size() for t in placed.values())
        return leaves, staged, allocated, in_place


def _must_copy_now(leaf: Leaf) -> bool:
    """Sources whose tearing cannot be detected, or that no side stream serves."""
    return leaf.version is None or leaf.src.device.type not in ("cpu", "cuda")
