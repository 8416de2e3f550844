"""How a nested state dict becomes keyed tensors for staging, and back.

Pure structure, no copying: ``collect`` flattens nested mappings, lists and tuples into
dotted keys (``optim.state.0.exp_avg``, the convention DCP uses), checking every tensor;
``rebuild`` makes the same structure over staged tensors, deep-copying everything else.
DTensors stage their local shard and come back as DTensors with the source's spec.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch

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


def is_dcp_leaf(value: Any) -> bool:
    """DCP's rule for what it saves as one item: anything but a mapping, and a list
    unless it holds tensors, mappings or lists that are not leaves (a tuple always is)."""
    if isinstance(value, Mapping):
        return False
    if isinstance(value, list):
        return not any(isinstance(v, (torch.Tensor, Mapping)) or not is_dcp_leaf(v) for v in value)
    return True


class Found(NamedTuple):
    """One tensor of a state: its dotted key, the value, the memory to copy."""

    name: str
    value: torch.Tensor
    """As found in the state (a DTensor stays a DTensor)."""
    local: torch.Tensor
    """The memory to copy: the value, or a DTensor's local shard."""
    alias: tuple
    """Equal for values that are the same memory (``alias_key``)."""
    pickled: bool = False
    """Inside a value DCP pickles whole (``is_dcp_leaf``: a tuple, say): torch.save writes
    the whole storage of a view, so its buffer must be a storage of its own."""


def collect(state: Any) -> list[Found]:
    """Every tensor in nested mappings, lists and tuples, in traversal order."""
    found: list[Found] = []
    _collect_into(state, (), found, set(), _dtensor_type(), False)
    return found


def _collect_into(
    obj: Any, path: tuple, found: list, names: set, dtensor: type | None, pickled: bool
) -> None:
    if isinstance(obj, torch.Tensor):
        name = ".".join(map(str, path))
        local = obj._local_tensor if dtensor is not None and isinstance(obj, dtensor) else obj
        _check_tensor(name, obj, local)
        if name in names:
            raise ValueError(f"state dict key {name!r} appears twice once flattened")
        names.add(name)
        found.append(Found(name, obj, local, alias_key(local), pickled))
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _collect_into(value, (*path, key), found, names, dtensor, pickled)
    elif type(obj) in (list, tuple):
        pickled = pickled or is_dcp_leaf(obj)
        for index, value in enumerate(obj):
            _collect_into(value, (*path, index), found, names, dtensor, pickled)


def rebuild(obj: Any, staged: Iterator[torch.Tensor]) -> Any:
    """The same structure with the tensors replaced, in ``collect`` order, by ``staged``;
    everything else deep-copied."""
    if isinstance(obj, torch.Tensor):
        return next(staged)
    if isinstance(obj, Mapping):
        return {key: rebuild(value, staged) for key, value in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)([rebuild(value, staged) for value in obj])
    return copy.deepcopy(obj)


def match_first(first: Iterable[str | torch.Tensor], found: list[Found]) -> set[str]:
    """Keys chosen by ``first``: names (exactly or as a prefix; each must match a key) and
    tensors (by memory; buffers left out of the state dict match nothing)."""
    if isinstance(first, (str, torch.Tensor)):
        first = [first]
    chosen: set[str] = set()
    by_memory: dict[tuple, list[str]] | None = None
    for want in first:
        if isinstance(want, torch.Tensor):
            if by_memory is None:
                by_memory = {}
                for f in found:
                    by_memory.setdefault(f.alias, []).append(f.name)
            chosen.update(by_memory.get(alias_key(local_tensor(want)), ()))
            continue
        if not isinstance(want, str):
            raise TypeError(f"stage(first=...) takes keys or tensors, got {type(want)!r}")
        hits = [f.name for f in found if f.name == want or f.name.startswith(f"{want}.")]
        if not hits:
            raise ValueError(f"stage(first=...) names {want!r}, which is no tensor key")
        chosen.update(hits)
    return chosen


def _dtensor_type() -> type | None:
    """DTensor's class, if it was ever imported (no DTensor exists otherwise)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        return value._local_tensor
    return value


def wrap_like(value: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """A DTensor over the host buffer for a DTensor source (same mesh and placements)."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        # The constructor, not from_local: from_local would move the buffer back to the
        # mesh's device.
        return dtensor(buffer, value._spec, requires_grad=False)
    return buffer


def _check_tensor(name: str, value: torch.Tensor, t: torch.Tensor) -> None:
    if t is value and type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"state dict key {name!r}: cannot stage tensor type {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(
            f"state dict key {name!r}: cannot stage a {t.layout} tensor; store "
            "value.to_dense() (and .to_sparse() it after restore)"
        )
    if t.is_meta:
        raise ValueError(f"state dict key {name!r} is a meta tensor with no data to stage")


def alias_key(t: torch.Tensor) -> tuple:
    """Equal for tensors that are the same memory (tied weights share one buffer)."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
