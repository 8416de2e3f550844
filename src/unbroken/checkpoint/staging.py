"""Staging: copy a state dict into reused host buffers at the cost of as little as possible.

The training loop pays for ``stage()``: it walks the state, copies the keys that forward
mutates (``first``, e.g. BatchNorm statistics) and deep-copies non-tensor values, then
returns. Every other tensor is copied on a background thread (CUDA: a side stream) while
the loop runs the next forward/backward. Parameters and optimizer state only change in
``optimizer.step()``, so an attached optimizer waits in a step pre-hook until the copy is
done; usually it already is. A source changed in place by anything else before its copy
finished makes ``StagedState.wait()`` raise ``TornSnapshotError``: the snapshot is
abandoned, never kept with mixed values.

Buffers come from a ``HostBufferPool`` and are reused save after save, so one snapshot is
staged at a time: the consumer calls ``StagedState.release()`` once it has written the
buffers, and the next ``stage()`` waits for that.
"""

from __future__ import annotations

import copy
import sys
import threading
import time
import weakref
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import torch

from unbroken.checkpoint.host_buffers import BufferSpec, HostBufferPool
from unbroken.checkpoint.staging_copy import DEFAULT_CHUNK_BYTES, CopyJob, Leaf, copy_now
from unbroken.checkpoint.staging_copy import version_of as _version_of
from unbroken.checkpoint.staging_errors import (
    CheckpointError,
    StagingBudgetError,
    StagingBusyError,
    TornSnapshotError,
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


_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def buffer_keys(module: torch.nn.Module, prefix: str = "") -> list[str]:
    """State-dict keys of a module's persistent buffers: what forward may change in place.

    Pass them as ``stage(first=...)``; ``prefix`` is the module's key in the staged state
    (e.g. ``"model"``). Names are given as ``get_state_dict`` writes them: without the
    prefixes of DDP, ``torch.compile``, activation checkpointing and FSDP wrappers.
    """
    persistent = {
        id(buf)
        for mod in module.modules()
        for name, buf in mod._buffers.items()
        if buf is not None and name not in mod._non_persistent_buffers_set
    }
    ddp_module = sys.modules.get("torch.nn.parallel.distributed")  # no DDP unless imported
    ddp = getattr(ddp_module, "DistributedDataParallel", ())
    keys = []
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) not in persistent:
            continue
        if isinstance(module, ddp) and key.startswith("module."):
            key = key[len("module.") :]
        for part in _WRAPPER_PARTS:
            key = key.replace(part, "")
        keys.append(f"{prefix}.{key}" if prefix else key)
    return keys


class StagedState:
    """One snapshot in host buffers. Valid until ``release()``; the stager then reuses them."""

    def __init__(
        self, state_dict: dict[str, Any], job: CopyJob, stats: dict[str, float], on_release
    ) -> None:
        self.state_dict = state_dict
        """Same structure and keys as the staged state; tensors are host buffers."""
        self._job = job
        self._stats = stats
        self._on_release = on_release
        self._released = False
        self._lock = threading.Lock()

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
        blocking_seconds (what the training loop paid), background_seconds."""
        out = dict(self._stats)
        out["background_seconds"] = self._job.seconds
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
                f"staging of {self._stats['bytes']} bytes still copying after {timeout} s"
            )
        job = self._job
        if job.error is not None:
            raise CheckpointError(f"staging failed while copying: {job.error!r}") from job.error
        if job.torn:
            raise TornSnapshotError(job.torn)
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
            self._job.join()
            self._released = True
        self._on_release(self)

    def __enter__(self) -> StagedState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _hook_wait(self) -> None:
        if not self._job.finished.is_set():
            began = time.perf_counter()
            self._job.join()
            self._stats["hook_wait_seconds"] += time.perf_counter() - began


class StateStager:
    """Copies state dicts into reused, bounded host buffers, overlapping training.

    ``max_bytes`` bounds the host buffers (None: whatever the state needs, never more);
    ``pin_memory`` None pins the buffers of CUDA sources; ``shared_memory`` puts CPU
    buffers in shared memory so another process can write them without a copy.
    """

    def __init__(
        self,
        *,
        max_bytes: int | None = None,
        pin_memory: bool | None = None,
        shared_memory: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.pool = HostBufferPool(
            max_bytes=max_bytes, shared_memory=shared_memory, pin_memory=pin_memory
        )
        self.chunk_bytes = chunk_bytes
        self._streams: dict[torch.device, object] = {}
        self._current: StagedState | None = None
        self._cond = threading.Condition()
        self._stage_lock = threading.Lock()
        self._hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._closed = False

    @property
    def busy(self) -> bool:
        """A staged state still holds the buffers: ``stage()`` would wait."""
        current = self._current
        return current is not None and not current.released

    def attach(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Make each optimizer's ``step()`` wait for an in-flight copy (once per optimizer)."""
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        me = weakref.ref(self)

        def wait_for_copy(_optimizer, _args, _kwargs) -> None:
            stager = me()
            current = stager._current if stager is not None else None
            if current is not None:
                current._hook_wait()

        for optimizer in optimizers:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"attach() takes torch optimizers, got {type(optimizer)!r}")
            if optimizer not in self._hooks:
                self._hooks[optimizer] = optimizer.register_step_pre_hook(wait_for_copy)

    def stage(
        self,
        state_dict: Mapping[str, Any],
        *,
        first: Collection[str | torch.Tensor] = (),
        timeout: float | None = None,
    ) -> StagedState:
        """Snapshot ``state_dict`` into host buffers; return before the bulk copy is done.

        Keys in ``first`` (and any key under them) are copied before this returns; a
        tensor in ``first`` selects the keys holding that memory (``model.buffers()``
        works whatever wrapper renamed them; a tensor not in the state is skipped). Waits
        up to ``timeout`` for the previous staged state to be released
        (``StagingBusyError`` after that).
        """
        began = time.perf_counter()
        if self._closed:
            raise CheckpointError("stage() on a closed StateStager")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"stage() takes a mapping, got {type(state_dict)!r}")
        with self._stage_lock:
            self._wait_released(timeout)
            found = _collect(state_dict)
            first_names = _match_first(first, found)
            leaves, staged_by_name, allocated = self._plan(found, first_names)
            sync = [leaf.name in first_names or _must_copy_now(leaf) for leaf in leaves]
            now = [leaf for leaf, s in zip(leaves, sync) if s]
            later = [leaf for leaf, s in zip(leaves, sync) if not s]
            torn = copy_now(now, self._streams)
            if torn:
                raise TornSnapshotError(torn)
            staged_dict = _rebuild(state_dict, (), staged_by_name)
            job = CopyJob(later, self._streams, self.chunk_bytes)
            stats = {
                "bytes": float(sum(leaf.nbytes for leaf in leaves)),
                "bytes_first": float(sum(leaf.nbytes for leaf in now)),
                "tensors": float(len(leaves)),
                "allocated_bytes": float(allocated),
                "hook_wait_seconds": 0.0,
                "stage_seconds": 0.0,
            }
            staged = StagedState(staged_dict, job, stats, self._released_one)
            with self._cond:
                self._current = staged
            job.start()
            stats["stage_seconds"] = time.perf_counter() - began
            return staged

    def close(self) -> None:
        """Stop any copy, detach from the optimizers and drop the buffers."""
        self._closed = True
        current = self._current
        if current is not None and not current.done:
            current._job.abort()
            current._job.join()
        for handle in list(self._hooks.values()):
            handle.remove()
        self._hooks.clear()
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
        self, found: list[tuple[str, torch.Tensor]], first: set[str]
    ) -> tuple[list[Leaf], dict[str, torch.Tensor], int]:
        """One leaf per distinct source; host buffers for them; the staged value per key."""
        by_alias: dict[tuple, str] = {}
        owner: dict[str, str] = {}  # key -> key whose buffer it shares
        specs: dict[str, BufferSpec] = {}
        sources: dict[str, torch.Tensor] = {}
        for name, value in found:
            local = _local(value)
            alias = _alias_key(local)
            if alias in by_alias:
                owner[name] = by_alias[alias]
                if name in first:
                    first.add(by_alias[alias])
                continue
            by_alias[alias] = owner[name] = name
            sources[name] = local
            specs[name] = BufferSpec(tuple(local.shape), local.dtype, pinned=local.is_cuda)
        buffers, allocated = self.pool.reserve(specs)
        leaves = [
            Leaf(name, sources[name], buffers[name], _version_of(sources[name])) for name in specs
        ]
        staged = {name: _wrap_like(value, buffers[owner[name]]) for name, value in found}
        return leaves, staged, allocated


def _must_copy_now(leaf: Leaf) -> bool:
    """Sources whose tearing cannot be detected, or that no side stream serves."""
    return leaf.version is None or leaf.src.device.type not in ("cpu", "cuda")


def _collect(obj: Any, path: tuple = (), out: dict | None = None) -> list[tuple[str, Any]]:
    """(dotted key, tensor) for every tensor in nested mappings, lists and tuples."""
    found: dict[str, torch.Tensor] = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        name = ".".join(str(p) for p in path)
        _check_tensor(name, obj)
        if name in found:
            raise ValueError(f"state dict key {name!r} appears twice once flattened")
        found[name] = obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _collect(value, (*path, key), found)
    elif type(obj) in (list, tuple):
        for index, value in enumerate(obj):
            _collect(value, (*path, index), found)
    return list(found.items())


def _rebuild(obj: Any, path: tuple, staged: dict[str, torch.Tensor]) -> Any:
    """The same structure with tensors replaced by staged ones, everything else deep-copied."""
    if isinstance(obj, torch.Tensor):
        return staged[".".join(str(p) for p in path)]
    if isinstance(obj, Mapping):
        return {key: _rebuild(value, (*path, key), staged) for key, value in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_rebuild(value, (*path, i), staged) for i, value in enumerate(obj))
    return copy.deepcopy(obj)


def _match_first(
    first: Iterable[str | torch.Tensor], found: list[tuple[str, torch.Tensor]]
) -> set[str]:
    """Keys chosen by ``first``: names (exactly or as a prefix; each must match a key) and
    tensors (by memory; buffers left out of the state dict match nothing)."""
    if isinstance(first, (str, torch.Tensor)):
        first = [first]
    names = [name for name, _ in found]
    by_memory: dict[tuple, list[str]] = {}
    for name, value in found:
        by_memory.setdefault(_alias_key(_local(value)), []).append(name)
    chosen: set[str] = set()
    for want in first:
        if isinstance(want, torch.Tensor):
            chosen.update(by_memory.get(_alias_key(_local(want)), ()))
            continue
        if not isinstance(want, str):
            raise TypeError(f"stage(first=...) takes keys or tensors, got {type(want)!r}")
        hits = [n for n in names if n == want or n.startswith(f"{want}.")]
        if not hits:
            raise ValueError(f"stage(first=...) names {want!r}, which is no tensor key")
        chosen.update(hits)
    return chosen


def _dtensor_type() -> type | None:
    """DTensor's class, if it was ever imported (no DTensor exists otherwise)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _local(value: torch.Tensor) -> torch.Tensor:
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        return value._local_tensor
    return value


def _wrap_like(value: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """A DTensor over the host buffer for a DTensor source (same mesh and placements)."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        # The constructor, not from_local: from_local would move the buffer back to the
        # mesh's device.
        return dtensor(buffer, value._spec, requires_grad=False)
    return buffer


def _check_tensor(name: str, t: torch.Tensor) -> None:
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        t = t._local_tensor
    elif type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"state dict key {name!r}: cannot stage tensor type {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"state dict key {name!r}: cannot stage a {t.layout} tensor")
    if t.is_meta:
        raise ValueError(f"state dict key {name!r} is a meta tensor with no data to stage")


def _alias_key(t: torch.Tensor) -> tuple:
    """Equal for tensors that are the same memory (tied weights share one buffer)."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
