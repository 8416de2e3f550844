"""Raw files on a remote volume: index, order, partition, local cache, prefetch, loader."""

from __future__ import annotations

from unbroken._util.lazy import lazy_getattr

_LAZY = {
    "VolumeDataset": "unbroken.data.dataset",
    "DataLoader": "unbroken.data.loader",
    "LocalCache": "unbroken.data.cache.cache",
}
__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr("unbroken.data", _LAZY)
