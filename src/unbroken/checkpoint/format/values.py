"""Non-tensor values: only what ``torch.load(weights_only=True)`` accepts is ever loaded.

The writer checks every value this way when it saves (a value that could not be restored
safely fails the save, not the restart), and the reader loads them only this way.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch


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
            return ln
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
