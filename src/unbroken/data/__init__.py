"""Raw files on a remote volume: index, order, partition, local cache, prefetch, loader."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "VolumeDataset": "unbroken.data.dataset",
    "DataLoader": "unbroken.data.loader",
    "LocalCache": "unbroken.data.cache",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'unbroken.data' has no attribute {name!r}")
