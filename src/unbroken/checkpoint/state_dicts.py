"""Turn the user's ``state`` mapping into one flat DCP state dict, and back.

A checkpoint holds one flat ``{key: tensor | DTensor | plain value}`` dict whose keys are
``<entry>.<path>`` joined with dots, exactly as DCP's own flattening would name them, so a
vanilla ``dcp.load({"model": get_model_state_dict(model)}, ...)`` finds the same keys.
JSON-able entries (``"epoch": 3``) do not go through DCP at all: they travel as JSON in
the manifest and are restored by replacing the entry in the mapping.

Entry kinds, in the order they are recognised:
- ``nn.Module`` (plain, DDP, FSDP2): ``get_model_state_dict`` / ``set_model_state_dict``.
- ``torch.optim.Optimizer``: paired with the module in ``state`` that owns its parameters,
  through ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``.
- ``torch.Tensor``: loaded in place.
- anything with ``state_dict`` and ``load_state_dict`` (LR schedulers, data loaders).
- JSON-able values.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from unbroken.checkpoint import json_values
from unbroken.checkpoint.staging.tree import alias_key, is_dcp_leaf, local_tensor


class Idx(int):
    """A list position inside a path (mapping keys keep their own type, even ints)."""


Path = tuple[Any, ...]

KIND_MODULE = "module"
KIND_OPTIMIZER = "optimizer"
KIND_TENSOR = "tensor"
KIND_STATEFUL = "stateful"
KIND_VALUE = "value"


@dataclass
class FlatState:
    """What one save (or one restore template) is made of."""

    tensors: dict[str, Any]
    """Flat DCP state dict: tensors, DTensors and plain values, keyed ``entry.path``."""
    values: dict[str, Any]
    """JSON-able entries of ``state``; stored in the manifest, not through DCP."""
    kinds: dict[str, str]
    """Kind of each entry of ``state`` (module, optimizer, tensor, stateful, value)."""
    paths: dict[str, Path] = field(default_factory=dict)
    """Flat key -> path inside the nested state dict (``(entry, k1, k2, ...)``)."""
    first: set[str] = field(default_factory=set)
    """Flat keys of module buffers: forward may change them, so they are staged first."""


def entry_kind(name: str, value: Any) -> str:
    """The kind of one entry of ``state``; a clear TypeError for anything unusable."""
    if isinstance(value, nn.Module):
        return KIND_MODULE
    if isinstance(value, torch.optim.Optimizer):
        return KIND_OPTIMIZER
    if isinstance(value, torch.Tensor):
        return KIND_TENSOR
    if callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    ):
        return KIND_STATEFUL
    try:
        json_values.check(f"state[{name!r}]", value)
    except TypeError as e:
        raise TypeError(
            f"checkpoint state entry {name!r} ({type(value).__name__}) is not a module, "
            "optimizer, tensor, object with state_dict()/load_state_dict(), or a plain value "
            f"that JSON gives back unchanged: {e}"
        ) from None
    return KIND_VALUE


def owner_module(name: str, optim: torch.optim.Optimizer, state: Mapping[str, Any]) -> nn.Module:
    """The module in ``state`` whose parameters the optimizer steps."""
    params = {id(p) for group in optim.param_groups for p in group["params"]}
    owners = []
    for mod_name, value in state.items():
        if isinstance(value, nn.Module):
            mine = {id(p) for p in value.parameters()}
            if params & mine:
                owners.append((mod_name, value, params <= mine))
    whole = [o for o in owners if o[2]]
    if len(whole) >= 1:
        return whole[0][1]
    if owners:
        names = ", ".join(repr(o[0]) for o in owners)
        raise ValueError(
            f"checkpoint state entry {name!r}: the optimizer's parameters are spread over "
            f"modules {names}; put one module that owns all of them in the state"
        )
    raise ValueError(
        f"checkpoint state entry {name!r}: no module in the state owns this optimizer's "
        "parameters; add the model to the state (e.g. state={'model': model, 'optim': optim})"
    )


def _nested_state(name: str, value: Any, kind: str, state: Mapping[str, Any]) -> Any:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if kind == KIND_MODULE:
        return get_model_state_dict(value)
    if kind == KIND_OPTIMIZER:
        return get_optimizer_state_dict(owner_module(name, value, state), value)
    if kind == KIND_TENSOR:
        return value
    return value.state_dict()


def collect(state: Mapping[str, Any]) -> FlatState:
    """The flat state of ``state`` right now (tensors share storage with the live ones)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"checkpoint state must be a mapping, got {type(state).__name__}")
    flat = FlatState(tensors={}, values={}, kinds={})
    for name, value in state.items():
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(
                f"checkpoint state entry {name!r}: names must be non-empty strings without '.'"
            )
        kind = entry_kind(name, value)
        flat.kinds[name] = kind
        if kind == KIND_VALUE:
            flat.values[name] = value
            continue
        nested = _nested_state(name, value, kind, state)
        _flatten_into(flat, (name,), nested)
        if kind == KIND_MODULE:
            flat.first.update(_buffer_keys(flat, name, value))
    return flat


def _buffer_keys(flat: FlatState, name: str, module: nn.Module) -> set[str]:
    """Keys of entry ``name`` that hold a module buffer, found by memory: key names differ
    from buffer names under wrappers (DDP, activation checkpointing, a child called
    ``module``), but the state dict's tensors are the buffers themselves."""
    buffers = {alias_key(local_tensor(b)) for b in module.buffers()}
    if not buffers:
        return set()
    return {
        key
        for key, path in flat.paths.items()
        if path[0] == name
        and isinstance(flat.tensors[key], torch.Tensor)
        and alias_key(local_tensor(flat.tensors[key])) in buffers
    }


def _flatten_into(flat: FlatState, path: Path, value: Any) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten_into(flat, (*path, k), v)
        return
    if not is_dcp_leaf(value):
        for i, v in enumerate(value):
            _flatten_into(flat, (*path, Idx(i)), v)
        return
    key = ".".join(str(p) for p in path)
    if key in flat.tensors:
        raise ValueError(
            f"checkpoint state: two entries flatten to the same key {key!r}; rename one"
        )
    flat.tensors[key] = value
    flat.paths[key] = path


def unflatten(flat: FlatState, name: str) -> Any:
    """The nested state dict of entry ``name`` rebuilt from ``flat.tensors``."""
    root: dict[str, Any] = {}
    for key, path in flat.paths.items():
        if path[0] != name:
            continue
        if len(path) == 1:
            return flat.tensors[key]
        node: Any = root
        for here, nxt in itertools.pairwise(path[1:]):
            node = _child(node, here, list if isinstance(nxt, Idx) else dict)
        _set(node, path[-1], flat.tensors[key])
    return root


def _child(node: Any, key: str | int, make: type) -> Any:
    if isinstance(node, list):
        while len(node) <= key:  # type: ignore[operator]
            node.append(None)
        if node[key] is None:  # type: ignore[index]
            node[key] = make()  # type: ignore[index]
        return node[key]  # type: ignore[index]
    if key not in node:
        node[key] = make()
    return node[key]


def _set(node: Any, key: str | int, value: Any) -> None:
    if isinstance(node, list):
        while len(node) <= key:  # type: ignore[operator]
            node.append(None)
    node[key] = value


def apply(state: MutableMapping[str, Any], flat: FlatState, values: Mapping[str, Any]) -> None:
    """Push loaded values back into the live objects of ``state``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    strict = StateDictOptions(strict=True)
    # Modules before optimizers: the optimizer state is keyed by the module's parameters.
    order = sorted(state, key=lambda n: flat.kinds[n] != KIND_MODULE)
    for name in order:
        kind = flat.kinds[name]
        value = state[name]
        if kind == KIND_VALUE:
            if name in values:
                state[name] = values[name]
        elif kind == KIND_MODULE:
            set_model_state_dict(value, unflatten(flat, name), options=strict)
        elif kind == KIND_OPTIMIZER:
            owner = owner_module(name, value, state)
            set_optimizer_state_dict(owner, value, unflatten(flat, name), options=strict)
        elif kind == KIND_TENSOR:
            loaded = unflatten(flat, name)
            if loaded is not value:
                with torch.no_grad():
                    value.copy_(loaded)
        else:
            value.load_state_dict(unflatten(flat, name))
