"""unbroken: keep large PyTorch training jobs productive through failures and slow storage.

``import unbroken`` stays cheap: torch-heavy parts load on first use.
"""

from __future__ import annotations

from unbroken._util.lazy import lazy_getattr
from unbroken._version import __version__
from unbroken.storage import (
    Entry,
    ObjectExistsError,
    ObjectNotFoundError,
    RemoteProfile,
    RetryPolicy,
    Store,
    StoreError,
    open_store,
)

_LAZY = {
    "CheckpointManager": "unbroken.checkpoint",
    "CheckpointInfo": "unbroken.checkpoint",
    "VolumeDataset": "unbroken.data",
    "DataLoader": "unbroken.data",
}

__all__ = [
    "CheckpointInfo",
    "CheckpointManager",
    "DataLoader",
    "Entry",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "RemoteProfile",
    "RetryPolicy",
    "Store",
    "StoreError",
    "VolumeDataset",
    "__version__",
    "open_store",
]

__getattr__ = lazy_getattr("unbroken", _LAZY)
