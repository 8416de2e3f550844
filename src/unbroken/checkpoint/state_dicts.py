"""Turn the user's ``state`` mapping into one flat DCP state dict, and back.

A checkpoint holds one flat ``{key: tensor | DTensor | plain value}`` dict whose keys are
``<entry>.<path>`` joined with dots, exactly as DCP's own flattening would name them, so a
vanilla ``dcp.load({"model": get_model_state_dict(model)}, ...)`` finds the same keys.
JSON-able entries (``"epoch": 3``) travel as JSON in the manifest, not through DCP.

Entry kinds, in the order they are recognised:
- ``nn.Module`` (plain, DDP, FSDP2): ``get_model_state_dict`` / ``set_model_state_dict``.
- ``torch.optim.Optimizer``: paired with the module in ``state`` that owns its parameters,
  through ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``.
- ``torch.Tensor``: loaded in place.
- ``torch.Generator``: per rank, like the global RNGs: its ``get_state()`` bytes go into
  the rank's RNG record (``rng/rank-<r>.json``), not through DCP, so each rank gets its
  own back (``generators``; a checkpoint of an older unbroken kept one copy in DCP).
- anything with ``state_dict`` and ``load_state_dict`` (LR schedulers, GradScaler, loaders).
- JSON-able values.

A restore rebuilds each entry's state dict over the structure it was collected with
(empty mappings, ``Counter`` milestones and all), except an optimizer's per-parameter state,
which depends on the training so far (none before the first step, none for a parameter
that never had a gradient, LBFGS's growing history): that part is laid out from the
checkpoint (:func:`fit_to_saved`).
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from unbroken.checkpoint import json_values
from unbroken.checkpoint.errors import CheckpointMismatchError
from unbroken.checkpoint.staging.tree import alias_key, is_dcp_leaf, local_tensor


class Idx(int):
    """A list position inside a path (mapping keys keep their own type, even ints)."""


Path = tuple[Any, ...]

KIND_MODULE = "module"
KIND_OPTIMIZER = "optimizer"
KIND_TENSOR = "tensor"
KIND_GENERATOR = "generator"
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
    """Flat keys of module buffers (staged first): saved from the lowest rank holding them."""
    generators: dict[str, torch.Generator] = field(default_factory=dict)
    """Generator entries: per-rank state, saved in the rank's RNG record."""
    nested: dict[str, Any] = field(default_factory=dict)
    """Each entry's nested state dict as collected: the structure a restore rebuilds."""
    owners: dict[str, nn.Module] = field(default_factory=dict)
    """Optimizer entry -> the module in ``state`` that owns its parameters."""
    params: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Optimizer entry -> {parameter FQN as its state dict names it: the parameter}."""
    settings: dict[str, set[str]] = field(default_factory=dict)
    """Optimizer entry -> its kind's numeric ``defaults``: another kind's groups lack some."""


def entry_kind(name: str, value: Any) -> str:
    """The kind of one entry of ``state``; a clear TypeError for anything unusable."""
    if isinstance(value, nn.Module):
        return KIND_MODULE
    if isinstance(value, torch.optim.Optimizer):
        return KIND_OPTIMIZER
    if isinstance(value, torch.Tensor):
        return KIND_TENSOR
    if isinstance(value, torch.Generator):
        return KIND_GENERATOR
    if callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    ):
        return KIND_STATEFUL
    try:
        json_values.check(f"state[{name!r}]", value)
    except TypeError as e:
        raise TypeError(
            f"checkpoint state entry {name!r} ({type(value).__name__}) is not a module, "
            "optimizer, tensor, generator, object with state_dict()/load_state_dict(), or a "
            f"plain value that JSON gives back unchanged: {e}"
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
    held = set().union(*({id(p) for p in v.parameters()} for v in state.values()
                         if isinstance(v, nn.Module)))  # fmt: skip
    if owners and params - held:
        raise ValueError(
            f"checkpoint state entry {name!r}: {len(params - held)} of the optimizer's "
            "parameters belong to no module in the state (a learnable tensor of its own, "
            "a logit_scale, say): the optimizer's state is saved by parameter name, so make "
            "it an nn.Parameter of the model (model.logit_scale = nn.Parameter(...))"
        )
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


_PATCH_LOCK = threading.Lock()


@contextmanager
def _without_optimizer_steps() -> Iterator[None]:
    """Run torch's get/set_optimizer_state_dict without their first step.

    Both first step an optimizer that has no state yet (zero gradients, lr 0) so that its
    state dict is complete. On the user's own optimizer that changes training: Rprop's step
    sizes become 0 for good, Adam's step count runs one ahead; a save before the first step
    did it, and so did every ``restore()`` (its template was collected first), even one
    that then found no checkpoint. LBFGS (no closure) and SparseAdam (dense gradients)
    cannot take that step at all. The state dict is taken as it is instead; a restore lays the
    per-parameter state out from the checkpoint (``fit_to_saved``).
    """
    import torch.distributed.checkpoint.state_dict as dsd

    with _PATCH_LOCK:
        original = getattr(dsd, "_init_optim_state", None)
        if original is None:  # a torch without that step
            yield
            return
        dsd._init_optim_state = lambda optim: None  # leave its state as it is
        try:
            yield
        finally:
            dsd._init_optim_state = original


def _nested_state(flat: FlatState, name: str, value: Any, kind: str, state: Mapping) -> Any:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if kind == KIND_MODULE:
        return get_model_state_dict(value)
    if kind == KIND_OPTIMIZER:
        owner = owner_module(name, value, state)
        with _without_optimizer_steps():
            osd = get_optimizer_state_dict(owner, value)
        flat.owners[name] = owner
        flat.settings[name] = {k for k, v in value.defaults.items() if _number(v)}
        fqns = [fqn for group in osd["param_groups"] for fqn in group["params"]]
        params = [p for group in value.param_groups for p in group["params"]]
        flat.params[name] = dict(zip(fqns, params)) if len(fqns) == len(params) else {}
        return osd
    if kind == KIND_TENSOR:
        return value
    if kind == KIND_GENERATOR:
        return value.get_state()
    return value.state_dict()


def _number(v: Any) -> bool:
    """A number, or numbers (betas): not a switch (a bool, None)."""
    if isinstance(v, (tuple, list)):
        return bool(v) and all(map(_number, v))
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
        if kind == KIND_GENERATOR:
            flat.generators[name] = value
            continue
        nested = _nested_state(flat, name, value, kind, state)
        flat.nested[name] = nested
        _flatten_into(flat, (name,), nested)
        if kind == KIND_MODULE:
            flat.first.update(_buffer_keys(flat, name, value))
    return flat


def state_bytes(flat: FlatState) -> int:
    """Bytes of this rank's tensors in ``flat`` (a DTensor's local shard): what one
    snapshot of it takes in host memory."""
    total = 0
    for value in flat.tensors.values():
        if not isinstance(value, torch.Tensor):
            continue
        local = value.to_local() if hasattr(value, "to_local") else value
        total += local.numel() * local.element_size()
    return total


def load_generator_through_dcp(flat: FlatState, name: str) -> None:
    """A checkpoint of an older unbroken holds generator ``name`` as one DCP tensor (the
    lowest rank's): load it from there, as that version did."""
    nested = flat.generators[name].get_state()
    flat.nested[name] = nested
    _flatten_into(flat, (name,), nested)


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


def _key(path: Path) -> str:
    return ".".join(str(p) for p in path)


def _flatten_into(flat: FlatState, path: Path, value: Any) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten_into(flat, (*path, k), v)
        return
    if not is_dcp_leaf(value):
        for i, v in enumerate(value):
            _flatten_into(flat, (*path, Idx(i)), v)
        return
    key = _key(path)
    if key in flat.tensors:
        raise ValueError(
            f"checkpoint state: two entries flatten to the same key {key!r}; rename one"
        )
    flat.tensors[key] = value
    flat.paths[key] = path


def unflatten(flat: FlatState, name: str) -> Any:
    """The nested state dict of entry ``name``: its collected structure (empty mappings,
    mapping types such as ``Counter``) over the values in ``flat.tensors``."""
    return _rebuild(flat, (name,), flat.nested[name])


def _rebuild(flat: FlatState, path: Path, node: Any) -> Any:
    if isinstance(node, Mapping):
        out = copy.copy(node) if isinstance(node, MutableMapping) else {}
        for k, v in node.items():
            out[k] = _rebuild(flat, (*path, k), v)
        return out
    if not is_dcp_leaf(node):
        return [_rebuild(flat, (*path, Idx(i)), v) for i, v in enumerate(node)]
    return flat.tensors[_key(path)]


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


def fit_to_saved(flat: FlatState, saved: Mapping[str, Any]) -> FlatState:
    """``flat`` with each optimizer's per-parameter state laid out as checkpoint ``saved``
    (its DCP ``state_dict_metadata``) holds it, ready to be loaded into.

    That state is what the training so far made it, not what a fresh optimizer has (torch
    fills it in by stepping the optimizer, which LBFGS and SparseAdam cannot do and which
    gives state a checkpoint saved before the first step does not have). The optimizer's
    own tensors are loaded into where they match; the rest is allocated like the parameter
    it belongs to (device, dtype, sharding) or, where its shape is its own (a step count,
    LBFGS's history), on the CPU, for ``load_state_dict`` to place. Saved state of a
    parameter the optimizer does not have stays out, for ``check_compatible`` to name.
    """
    if KIND_OPTIMIZER not in flat.kinds.values():
        return flat
    fitted = FlatState(
        tensors={},
        values=flat.values,
        kinds=flat.kinds,
        first=flat.first,
        generators=flat.generators,
        owners=flat.owners,
        params=flat.params,
    )
    for name, kind in flat.kinds.items():
        if kind == KIND_VALUE or name not in flat.nested:
            continue
        nested = flat.nested[name]
        if kind == KIND_OPTIMIZER:
            nested = {**nested, "state": _saved_optimizer_state(flat, name, saved)}
        fitted.nested[name] = nested
        _flatten_into(fitted, (name,), nested)
    return fitted


def _saved_optimizer_state(flat: FlatState, name: str, saved: Mapping[str, Any]) -> dict:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"{name}.state."
    params = flat.params.get(name, {})
    state: dict[str, Any] = {}
    for key, md in saved.items():
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix) :]
        fqn = _owning_param(rest, params)
        if fqn is None:
            continue
        # Below the parameter: state names, and list positions (LBFGS's history lists).
        inner = [Idx(p) if p.isdigit() else p for p in rest[len(fqn) + 1 :].split(".")]
        path: Path = (fqn, *inner)
        template: Any = None  # a plain value: DCP sets the saved one in its place
        if isinstance(md, TensorStorageMetadata):
            template = _tensor_like(md, params[fqn], flat.tensors.get(key), inner[-1])
        node: Any = state
        for here, nxt in itertools.pairwise(path):
            node = _child(node, here, list if isinstance(nxt, Idx) else dict)
        _set(node, path[-1], template)
    return state


def _owning_param(rest: str, params: Mapping[str, Any]) -> str | None:
    """The longest parameter name that ``rest`` continues ("a.b" owns "a.b.x", not "a"):
    a lookup per dot, where a scan of every name per key made a restore of thousands of
    parameters take seconds (keys x parameters)."""
    parts = rest.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if (fqn := ".".join(parts[:end])) in params:
            return fqn
    return None


def _tensor_like(md: Any, param: torch.Tensor, live: Any, state_name: Any) -> torch.Tensor:
    size, dtype = torch.Size(md.size), md.properties.dtype
    if isinstance(live, torch.Tensor) and live.shape == size and live.dtype == dtype:
        return live  # the optimizer's own tensor, loaded in place
    # A step count stays on the CPU even beside a scalar parameter (a learnt temperature):
    # load_state_dict moves it only for fused/capturable optimizers, which want it moved.
    if param.shape == size and state_name != "step":
        return torch.empty_like(param, dtype=dtype, requires_grad=False)
    return torch.empty(size, dtype=dtype)


def restore_into(
    state: MutableMapping[str, Any],
    flat: FlatState,
    values: Mapping[str, Any],
    load: Callable[[dict[str, Any]], None],
) -> None:
    """Load a checkpoint into ``state``; ``load`` fills a flat dict from the checkpoint.

    Two passes, so that a part of the state that refuses the checkpoint (a user object's
    ``load_state_dict``, an optimizer) fails the restore before any module weight or tensor
    entry is overwritten: first every other entry is loaded, rebuilt and handed to its
    object; then the modules and tensors, which are loaded in place (no second copy of the
    model in memory); the plain values of ``state`` are replaced last.
    """
    in_place = (KIND_MODULE, KIND_TENSOR)
    early = [
        n
        for n, k in flat.kinds.items()
        if k not in (*in_place, KIND_VALUE) and n in flat.nested  # generators: the RNG record
    ]
    late = [n for n, k in flat.kinds.items() if k in in_place]
    _load_entries(flat, early, load)
    prepared = {n: unflatten(flat, n) for n in early}
    for name in early:
        if flat.kinds[name] == KIND_OPTIMIZER:
            check_param_groups(name, flat.nested[name], prepared[name])
    # User objects first, optimizers last: a refusal leaves the optimizers as they were too.
    for name in sorted(early, key=lambda n: flat.kinds[n] == KIND_OPTIMIZER):
        _apply_entry(state, flat, name, prepared[name])
    _load_entries(flat, late, load)
    prepared = {n: unflatten(flat, n) for n in late}
    for name in late:
        _apply_entry(state, flat, name, prepared[name])
    for name in flat.values:
        if name in values:
            state[name] = values[name]


def check_param_groups(name: str, mine: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    """Raise CheckpointMismatchError unless each parameter group of the optimizer holds the
    parameters its saved group held. torch would load another grouping without a word and
    leave a group without its hyperparameters (no ``lr``: the next step fails, far away)."""
    ours = [set(g["params"]) for g in mine["param_groups"]]
    theirs = [set(g["params"]) for g in saved["param_groups"]]
    if ours == theirs:
        return
    differ = [
        f"group {i}: {sorted(t)} in the checkpoint, {sorted(o)} in the state"
        for i, (o, t) in enumerate(itertools.zip_longest(ours, theirs, fillvalue=set()))
        if o != t
    ]
    raise CheckpointMismatchError(
        f"checkpoint state entry {name!r}: the optimizer's parameter groups are not the "
        f"checkpoint's ({'; '.join(differ[:4])}); build the optimizer with the parameter "
        "groups of the run that saved it"
    )


def _load_entries(flat: FlatState, names: list[str], load: Callable[[dict], None]) -> None:
    mine = set(names)
    part = {k: flat.tensors[k] for k, path in flat.paths.items() if path[0] in mine}
    if part:  # the same on every rank: the state's structure is
        load(part)
        flat.tensors.update(part)  # DCP puts plain values into the dict it is given


def _apply_entry(state: MutableMapping[str, Any], flat: FlatState, name: str, loaded: Any) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    kind, value = flat.kinds[name], state[name]
    if kind == KIND_MODULE:
        set_model_state_dict(value, loaded, options=StateDictOptions(strict=True))
    elif kind == KIND_OPTIMIZER:
        # torch's strict check wants state for every parameter that requires grad, which a
        # checkpoint saved before the first step (or of an unused layer) lacks;
        # check_compatible has already held the checkpoint to the state's structure.
        with _without_optimizer_steps():
            set_optimizer_state_dict(
                flat.owners[name], value, loaded, options=StateDictOptions(strict=False)
            )
    elif kind == KIND_TENSOR:
        if loaded is not value:
            with torch.no_grad():
                value.copy_(loaded)
    elif kind == KIND_GENERATOR:
        value.set_state(loaded)
    else:
        try:
            value.load_state_dict(loaded)
        except Exception as e:  # its own words may not say which entry refused (a loader's)
            e.add_note(f"(raised by the state's entry {name!r} loading its state)")
            raise
