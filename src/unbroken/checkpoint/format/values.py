"""Non-tensor values: only what ``torch.load(weights_only=True)`` accepts is ever loaded.

A save checks every value of the state's objects this way before it starts
(``check_loadable``: a value that could not be restored safely is refused at once, naming
it), the writer again as it writes, and the reader loads them only this way.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from typing import Any

import torch

from unbroken.checkpoint.json_values import how_to_store


class UnsafeValueError(ValueError):
    """The bytes are not loadable with weights_only=True; the message says which global."""


def load_weights_only(data: bytes | bytearray | memoryview) -> Any:
    """Unpickle ``data`` (a torch.save stream) with torch's restricted unpickler."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
        raise UnsafeValueError(_reason(exc)) from exc


def _reason(exc: BaseException) -> str:
    """The informative line of torch's long weights_only message (which global it refused)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:
        if "GLOBAL" in ln or "nsupported" in ln:  # names the global it refused
            return ln.split(". Please use")[0]  # not the allowlist advice: a reader must trust
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def check_items(items: dict[str, Any], checked: dict[str, type]) -> None:
    """``check_loadable`` on every item of a flat state that is not a tensor, on the
    training thread: once per key and type (``checked`` records them), so a large list
    in a sampler's state is walked at the first save, not at every one. A value that
    changes inside later is still checked as the writer writes it."""
    for key, value in items.items():
        if isinstance(value, torch.Tensor) or checked.get(key) is type(value):
            continue
        check_loadable(key, value)
        checked[key] = type(value)


def check_loadable(key: str, value: Any) -> None:
    """Raise TypeError naming ``key`` if ``value`` (a non-tensor item of the state's
    objects, an optimizer setting or a ``state_dict()`` entry) would not load back with
    ``weights_only=True``: every save of it would fail in the background, never heal."""
    if _plain(value):
        return
    data = io.BytesIO()
    try:
        torch.save(value, data)
        load_weights_only(data.getbuffer())
    except UnsafeValueError as exc:
        raise TypeError(
            f"state item {key!r} is a {how_to_store(value)[0]}, which a checkpoint cannot "
            f"give back without unpickling code ({exc}){how_to_store(value)[1]}"
        ) from None
    except Exception as exc:  # torch.save refused it (a module inside, say)
        raise TypeError(
            f"state item {key!r} is a {how_to_store(value)[0]}, which a checkpoint cannot "
            f"hold ({type(exc).__name__}: {exc}){how_to_store(value)[1]}"
        ) from None


def _plain(value: Any) -> bool:
    """Primitives and the containers of them that always load: the common case, at once."""
    if type(value) in _PLAIN:
        return True
    if type(value) in (list, tuple, set):
        return all(_plain(v) for v in value)
    if type(value) in (dict, OrderedDict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False
