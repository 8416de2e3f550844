"""Plain values of the state (``"epoch": 3``): checked at save, so they come back as given.

They travel in the manifest, which is strict JSON so that any tool can read it. Strict
JSON would change two kinds of value without a word: a tuple comes back as a list, and
a mapping key that is not a string (``{3: ...}``) comes back as a string (``{"3": ...}``).
A job restored that way reads the wrong thing later, far from the cause, so both are
refused at the save, by path, and so are subclasses of dict and list (a ``defaultdict``
or ``Counter`` would come back as a dict, and raise KeyError later). Subclasses of int,
float and str (``numpy.float64``, a str enum) come back as the base type, equal to them.
Non-finite floats (``"best_loss": float("inf")``, common), which strict JSON has no
words for, are written as ``{"__float__": "inf"}`` and read back as floats.
"""

from __future__ import annotations

import math
from typing import Any

FLOAT_TAG = "__float__"
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def check(path: str, value: Any) -> None:
    """Raise TypeError naming the first part of ``value`` that JSON would not give back."""
    _check(path, value, set())


def _check(path: str, value: Any, open_containers: set[int]) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, tuple):
        raise TypeError(
            f"{path} is a tuple, which would come back from the checkpoint as a list; store a list"
        )
    if not isinstance(value, (list, dict)):
        kind, hint = how_to_store(value)
        if type(value).__name__ in ("Tensor", "Parameter"):
            hint = (
                "; a plain value is JSON. Give tensors entries of their own in the state "
                "(state['ema_weight'] = t), or put them in a module (an EMA as an nn.Module)"
            )
        raise TypeError(f"{path} is {_a(kind)}, which JSON cannot hold{hint}")
    if type(value) not in (list, dict):  # its own behaviour would not come back with it
        base = "list" if isinstance(value, list) else "dict"
        raise TypeError(
            f"{path} is {_a(type(value).__name__)}, which would come back from the "
            f"checkpoint as a plain {base}; store {base}(value) and rebuild it after restore"
        )
    if id(value) in open_containers:
        raise TypeError(f"{path} contains itself")
    open_containers.add(id(value))
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check(f"{path}[{i}]", item, open_containers)
    else:
        if list(value) == [FLOAT_TAG]:
            raise TypeError(
                f"{path} is a mapping whose only key is {FLOAT_TAG!r}, which the checkpoint "
                "uses for non-finite floats; rename the key"
            )
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{path} has the key {key!r} ({type(key).__name__}), which would come back "
                    "from the checkpoint as a string; use string keys"
                )
            _check(f"{path}[{key!r}]", item, open_containers)
    open_containers.discard(id(value))


def how_to_store(value: Any) -> tuple[str, str]:
    """What ``value`` is, and how to store it instead ("; store ...", or "")."""
    import dataclasses

    kind = type(value).__name__
    if type(value).__module__ == "numpy":
        if kind == "ndarray":
            return "numpy.ndarray", "; store value.tolist(), or a tensor (torch.from_numpy)"
        return f"numpy.{kind}", "; store value.item(), the Python number"
    if dataclasses.is_dataclass(value):
        return kind, "; store dataclasses.asdict(value) and rebuild it after restore"
    return kind, ""


def _a(noun: str) -> str:
    """The noun with its article: an OrderedDict, a UserList (a U, in type names, sounds
    "you")."""
    return f"{'an' if noun[:1] in 'AEIOaeio' else 'a'} {noun}"


def encode(value: Any) -> Any:
    """A strict-JSON copy of a checked value (non-finite floats tagged)."""
    if isinstance(value, float) and not math.isfinite(value):
        return {FLOAT_TAG: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    return value


def decode(doc: Any) -> Any:
    """The value ``encode`` was given, from its parsed JSON."""
    if isinstance(doc, list):
        return [decode(v) for v in doc]
    if isinstance(doc, dict):
        if list(doc) == [FLOAT_TAG] and doc[FLOAT_TAG] in _NON_FINITE:
            return _NON_FINITE[doc[FLOAT_TAG]]
        return {k: decode(v) for k, v in doc.items()}
    return doc


def rank_values(values: dict[str, Any], per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """{rank: {name: value}} for each rank whose encoded plain values differ from
    ``values`` (rank 0's, the manifest's), naming only the entries that differ: a value
    kept per rank (a rank's own counter) comes back to that rank."""
    out: dict[str, Any] = {}
    for rank, theirs in enumerate(per_rank):
        differ = {k: v for k, v in theirs.items() if values.get(k, _MISSING) != v}
        if differ:
            out[str(rank)] = differ
    return out


_MISSING = object()
