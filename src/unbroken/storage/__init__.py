"""Where bytes live: local paths, fsspec object stores, and an emulated remote."""

from __future__ import annotations

import os
import re
from typing import Any

from unbroken.storage.base import Entry, Store
from unbroken.storage.emulated import EMULATED_PREFIX, EmulatedStore, RemoteProfile
from unbroken.storage.errors import (
    ObjectExistsError,
    ObjectNotFoundError,
    RetriesExhaustedError,
    StoreError,
    StorePermissionError,
    TransientStoreError,
    redact,
)
from unbroken.storage.fsspec_store import FsspecStore
from unbroken.storage.local import LocalStore
from unbroken.storage.native_options import native_kind
from unbroken.storage.retry import NO_RETRY, RetryPolicy

__all__ = [
    "EMULATED_PREFIX",
    "EmulatedStore",
    "Entry",
    "FsspecStore",
    "LocalStore",
    "ObjectExistsError",
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

    ``s3://``, ``gs://`` and ``az://`` (``abfs://``) go through the native backend
    (:class:`NativeStore`, obstore); its options take the fsspec names (``endpoint_url``,
    ``key``, ``secret``, ``anon``, ``client_kwargs``...) or obstore's own. Pass
    ``backend="fsspec"`` to use s3fs / gcsfs / adlfs instead. Every other URL goes
    through fsspec.

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
    elif url.startswith("file:/"):  # RFC 8089's short form
        url = url[len("file:") :]
    if "://" not in url and "::" not in url:
        if _ONE_SLASH.match(url):
            raise ValueError(
                f"open_store({url!r}): this looks like a URL with one slash after its scheme "
                f"(did you mean {url.replace(':/', '://', 1)!r}?); a local folder so named "
                f"is written ./{url}"
            )
        if storage_options:
            raise TypeError(
                f"open_store({url!r}): a local path takes no storage options, "
                f"got {sorted(storage_options)}"
            )
        return LocalStore(url, retry=retry)
    options = dict(storage_options)
    backend = options.pop("backend", "native")
    if backend not in ("native", "fsspec"):
        raise ValueError(
            f"open_store({redact(url)!r}): backend must be 'native' or 'fsspec', got {backend!r}"
        )
    if backend == "native" and native_kind(url) is not None:
        from unbroken.storage.native_store import NativeStore

        return NativeStore(url, retry=retry, storage_options=options)
    _check_scheme(url)
    return FsspecStore(url, retry=retry, storage_options=options)


def _check_scheme(url: str) -> None:
    """A typo in a scheme (``s4://``, also inside a chain) named as such, not as fsspec's
    bare "Protocol not known: s4"."""
    import fsspec

    known = set(fsspec.available_protocols()) | set(fsspec.registry)  # registered classes too
    *wrappers, target = url.split("::")  # simplecache::s3://b/x; the target may be a path
    for link in [*wrappers, *([target] if "://" in target else [])]:
        scheme = link.split("://", 1)[0]
        if scheme not in known:
            raise ValueError(
                f"open_store({redact(url)!r}): unknown URL scheme {scheme!r}. Use a local "
                "path, file://, s3://, gs://, az:// or another scheme fsspec knows "
                "(fsspec.available_protocols())"
            )


_ONE_SLASH = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:/(?!/)")
"""``s3:/bucket``: a URL short of a slash, which would otherwise be a local folder."""
