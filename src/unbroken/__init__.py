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
    RetriesExhaustedError,
    RetryPolicy,
    Store,
    StoreError,
    StorePermissionError,
    open_store,
)

_LAZY = {
    "CheckpointManager": "unbroken.checkpoint",
    "CheckpointInfo": "unbroken.checkpoint",
    "VolumeDataset": "unbroken.data",
    "DataLoader": "unbroken.data",
    "load": "unbroken.checkpoint.read_only",
    # The errors users meet (docs/troubleshooting.md), importable from one place.
    **dict.fromkeys(
        [
            "CheckpointError",
            "CheckpointCorruptError",
            "CheckpointMismatchError",
            "ListingFailedError",
            "NewerFormatError",
            "NoCheckpointError",
            "OlderStepRestoredError",
            "OtherJobError",
            "OtherWriterError",
            "SaveFailedError",
            "SaveRefusedError",
            "StepBehindError",
            "StepsDisagreeError",
        ],
        "unbroken.checkpoint.errors",
    ),
    "TornSnapshotError": "unbroken.checkpoint.staging.errors",
    "StagingBudgetError": "unbroken.checkpoint.staging.errors",
    "StagingDirInUseError": "unbroken.checkpoint.staging.owner",
    "LoaderStateError": "unbroken.data.loader_state",
    "SampleReadError": "unbroken.data.dataset",
    "EmptyVolumeError": "unbroken.data.index",
    "CacheDirError": "unbroken.data.cache.cache",
    "CacheWriteError": "unbroken.data.cache.cache",
    "SourceChangedError": "unbroken.data.cache.cache",
}

__all__ = [
    "CacheDirError",
    "CacheWriteError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMismatchError",
    "DataLoader",
    "EmptyVolumeError",
    "Entry",
    "ListingFailedError",
    "LoaderStateError",
    "NewerFormatError",
    "NoCheckpointError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "OlderStepRestoredError",
    "OtherJobError",
    "OtherWriterError",
    "RemoteProfile",
    "RetriesExhaustedError",
    "RetryPolicy",
    "SampleReadError",
    "SaveFailedError",
    "SaveRefusedError",
    "SourceChangedError",
    "StagingBudgetError",
    "StagingDirInUseError",
    "StepBehindError",
    "StepsDisagreeError",
    "Store",
    "StoreError",
    "StorePermissionError",
    "TornSnapshotError",
    "VolumeDataset",
    "__version__",
    "load",
    "open_store",
]

__getattr__ = lazy_getattr("unbroken", _LAZY)
