"""Distributed, asynchronous, tiered checkpoints with an atomic commit record."""

from __future__ import annotations

from unbroken._util.lazy import lazy_getattr

_LAZY = {
    "CheckpointManager": "unbroken.checkpoint.manager",
    "CheckpointInfo": "unbroken.checkpoint.catalog",
}
__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr("unbroken.checkpoint", _LAZY)
