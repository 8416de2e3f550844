"""Distributed, asynchronous, tiered checkpoints with an atomic commit record."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "CheckpointManager": "unbroken.checkpoint.manager",
    "CheckpointInfo": "unbroken.checkpoint.catalog",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'unbroken.checkpoint' has no attribute {name!r}")
