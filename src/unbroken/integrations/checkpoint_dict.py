"""A framework's checkpoint dict as tensors plus a JSON skeleton, so nothing is pickled.

Lightning's and Fabric's checkpoints are one nested dict of anything: weights, optimizer
states (int keys, tuples of betas), loop counters, callback states, hyperparameters. The
frameworks ``torch.save`` it whole, and loading that runs pickle. Here the dict is split:

- every tensor goes through DCP as a tensor (async, checksummed, resharded), under a key
  that spells its path (``state_dict.layer.weight``);
- everything else becomes a JSON skeleton (in the manifest's plain values) that records
  each container's kind (dict, OrderedDict, list, tuple), its keys (ints stay ints) and
  plain values, and the shape and dtype of each tensor, so a load can allocate the
  tensors before DCP fills them and rebuild the dict without a template.

What would need pickle (a ``Namespace`` in the hyperparameters, an enum, a numpy scalar)
is refused at the save, naming its path. Nothing read back is unpickled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

FORMAT = 1
_PLAIN = (bool, int, float, str, type(None))
# Single-key tagged mappings: no plain value of the skeleton is a dict, so no clash.
_TENSOR, _LIST, _TUPLE, _DICT, _ORDERED = "T", "l", "t", "d", "o"


class CheckpointDictError(TypeError):
    """A part of a checkpoint dict that only pickle could store; the message names it."""


@dataclass
class SplitCheckpoint:
    """A checkpoint dict taken apart."""

    tensors: dict[str, torch.Tensor]
    """Every tensor of the dict, by the key that spells its path."""
    skeleton: dict[str, Any]
    """JSON: the structure, the plain values and each tensor's shape and dtype."""


def split(
    checkpoint: Mapping[str, Any],
    *,
    name: str = "checkpoint",
    copy_now: Iterable[torch.Tensor] = (),
) -> SplitCheckpoint:
    """Take ``checkpoint`` apart; CheckpointDictError names what needs pickle.

    Tensors share memory with the live ones (the manager copies them while training goes
    on, and abandons a save whose source changed meanwhile), except those whose memory is
    one of ``copy_now``'s: module buffers, which the next forward changes in place, are
    copied here, as the manager does for a module's buffers.
    """
    tensors: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[Any]] = {}
    now = {_storage(t) for t in copy_now}
    tree = _encode(checkpoint, name, (), tensors, shapes, set())
    for key, tensor in tensors.items():
        if now and _storage(tensor) in now:
            tensors[key] = tensor.clone()
    return SplitCheckpoint(tensors, {"format": FORMAT, "tree": tree, "tensors": shapes})


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def templates(skeleton: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Empty CPU tensors of the saved shapes and dtypes, for DCP to load into."""
    _check_format(skeleton)
    out = {}
    for key, (shape, dtype) in skeleton["tensors"].items():
        out[key] = torch.empty([int(n) for n in shape], dtype=_dtype(dtype, key))
    return out


def join(skeleton: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The checkpoint dict again, from its skeleton and its loaded tensors."""
    _check_format(skeleton)
    return _decode(skeleton["tree"], tensors)


def _encode(
    value: Any,
    where: str,
    path: tuple[str, ...],
    tensors: dict[str, torch.Tensor],
    shapes: dict[str, list[Any]],
    open_containers: set[int],
) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise CheckpointDictError(f"{where} is a {value.layout} tensor; only dense ones")
        key = _unique(".".join(path) or "tensor", tensors)
        tensors[key] = value.detach()
        shapes[key] = [list(value.shape), str(value.dtype).removeprefix("torch.")]
        return {_TENSOR: key}
    if id(value) in open_containers:
        raise CheckpointDictError(f"{where} contains itself")
    open_containers.add(id(value))
    try:
        if isinstance(value, Mapping):
            tag = _ORDERED if isinstance(value, OrderedDict) else _DICT
            items = []
            for k, v in value.items():
                if not isinstance(k, _PLAIN):
                    raise CheckpointDictError(
                        f"{where} has the key {k!r} ({type(k).__name__}); keys must be "
                        "strings, numbers, booleans or None"
                    )
                here = f"{where}[{k!r}]"
                items.append(
                    [k, _encode(v, here, (*path, str(k)), tensors, shapes, open_containers)]
                )
            return {tag: items}
        if type(value) in (list, tuple, torch.Size):
            tag = _LIST if type(value) is list else _TUPLE
            return {
                tag: [
                    _encode(v, f"{where}[{i}]", (*path, str(i)), tensors, shapes, open_containers)
                    for i, v in enumerate(value)
                ]
            }
    finally:
        open_containers.discard(id(value))
    if isinstance(value, torch.utils.data.DataLoader):  # its position is what is wanted
        raise CheckpointDictError(
            f"{where} is a torch DataLoader, which has no position to save: an "
            "unbroken.DataLoader (over a VolumeDataset) saves and restores its own"
        )
    raise CheckpointDictError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which only pickle "
        "could store, and unbroken never unpickles what it reads. Keep tensors, numbers, "
        "strings, booleans, None and dicts, lists and tuples of them in the checkpoint "
        "(hyperparameters as a plain dict: vars(namespace); a numpy number: .item())"
    )


def _unique(key: str, taken: Mapping[str, Any]) -> str:
    if key not in taken:
        return key
    n = 1
    while f"{key}#{n}" in taken:
        n += 1
    return f"{key}#{n}"


def _decode(node: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if not isinstance(node, dict):
        return node
    ((tag, body),) = node.items()
    if tag == _TENSOR:
        return tensors[body]
    if tag == _LIST:
        return [_decode(v, tensors) for v in body]
    if tag == _TUPLE:
        return tuple(_decode(v, tensors) for v in body)
    if tag in (_DICT, _ORDERED):
        pairs = ((k, _decode(v, tensors)) for k, v in body)
        return OrderedDict(pairs) if tag == _ORDERED else dict(pairs)
    raise ValueError(f"checkpoint skeleton: unknown node {tag!r}")


def _dtype(name: Any, key: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"checkpoint skeleton: tensor {key!r} has an unknown dtype {name!r}")
    return dtype


def _check_format(skeleton: Mapping[str, Any]) -> None:
    if not isinstance(skeleton, Mapping) or skeleton.get("format") != FORMAT:
        found = skeleton.get("format") if isinstance(skeleton, Mapping) else type(skeleton)
        raise ValueError(f"checkpoint skeleton: format {found!r}, this unbroken reads {FORMAT}")
