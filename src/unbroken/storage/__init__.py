"""Where bytes live: local paths, fsspec object stores, and an emulated remote."""

from __future__ import annotations

import os
from typing import Any

from unbroken.storage.base import Entry, Store
from unbroken.storage.emulated import EMULATED_PREFIX, EmulatedStore, RemoteProfile
from unbroken.storage.errors import (
    ObjectNotFoundError,
    RetriesExhaustedError,
    StoreError,
    StorePermissionError,
    TransientStoreError,
)
from unbroken.storage.fsspec_store import FsspecStore
from unbroken.storage.local import LocalStore
from unbroken.storage.retry import NO_RETRY, RetryPolicy

__all__ = [
    "EMULATED_PREFIX",
    "EmulatedStore",
    "Entry",
    "FsspecStore",
    "LocalStore",
    "ObjectNotFoundError",
    "RemoteProfile",
    "RetriesExhaustedError",
    "RetryPolicy",
    "Store",
    "StoreError",
    "StorePermissionError",
    "TransientStoreError",
    "open_store",
]


def open_store(
    url: str | os.PathLike, *, retry: RetryPolicy | None = None, **storage_options: Any
) -> Store:
    """A store for a path, a ``file://`` URL or any fsspec URL (``s3://``, ``memory://``).

    ``emulated::<url>`` wraps the store at ``<url>`` in the emulated remote; its
    :class:`RemoteProfile` fields (``latency``, ``bandwidth``, ``fail_rate``, ...) may be
    given as keyword arguments, and the rest go to the inner store.
    """
    if isinstance(url, Store):
        return url
    url = os.fspath(url)
    if not url:
        raise ValueError("open_store: empty URL")
    if url.startswith(EMULATED_PREFIX):
        options = dict(storage_options)
        profile = RemoteProfile.pop_from(options)
        inner = open_store(url[len(EMULATED_PREFIX) :], retry=NO_RETRY, **options)
        if isinstance(inner, LocalStore):
            # The bytes would land on the remote's disks, not in this machine's memory.
            inner.uncached_uploads = True
        return EmulatedStore(inner, profile, retry=retry)
    if url.startswith("file://"):
        url = url[len("file://") :]
    if "://" not in url and "::" not in url:
        if storage_options:
            raise TypeError(
                f"open_store({url!r}): a local path takes no storage options, "
                f"got {sorted(storage_options)}"
            )
        return LocalStore(url, retry=retry)
    return FsspecStore(url, retry=retry, storage_options=storage_options)
