"""A store as plain JSON, to open the same store in another process.

The checkpoint's save helper (``checkpoint/save_helper/``) runs a save's uploads in a
process of its own. It gets the durable store as this description, never as a pickle,
and opens its own client from it. A store with no description (a user's own subclass,
an in-process ``memory://`` file system) stays in the process that made it.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from unbroken.storage.base import Store
from unbroken.storage.emulated import EmulatedStore, RemoteProfile
from unbroken.storage.fsspec_store import FsspecStore
from unbroken.storage.local import LocalStore
from unbroken.storage.native_store import NativeStore
from unbroken.storage.retry import RetryPolicy

_PROCESS_LOCAL = ("memory://",)
"""fsspec file systems whose objects live in the process that wrote them."""


def store_spec(store: Store) -> dict[str, Any] | None:
    """``store`` as JSON-able fields another process opens with :func:`open_spec`; None
    where another process could not reach the same objects."""
    spec = _spec(store)
    if spec is None:
        return None
    try:
        json.dumps(spec)
    except (TypeError, ValueError):  # an option that only Python holds (a client object)
        return None
    return spec


def open_spec(spec: dict[str, Any]) -> Store:
    """The store ``spec`` (from :func:`store_spec`) describes, with its own client."""
    retry = RetryPolicy(**spec["retry"])
    kind = spec["kind"]
    if kind == "local":
        return LocalStore(spec["url"], retry=retry, uncached_uploads=spec["uncached_uploads"])
    if kind == "native":
        return NativeStore(spec["url"], retry=retry, storage_options=spec["options"])
    if kind == "fsspec":
        return FsspecStore(spec["url"], retry=retry, storage_options=spec["options"])
    if kind == "emulated":
        profile = RemoteProfile(**spec["profile"])
        return EmulatedStore(open_spec(spec["inner"]), profile, retry=retry)
    raise ValueError(f"unknown store kind {kind!r} in a store description")


def _spec(store: Store) -> dict[str, Any] | None:
    retry = asdict(store.retry)
    kind = type(store)
    if kind is LocalStore:
        return {
            "kind": "local",
            "url": store.url,
            "retry": retry,
            "uncached_uploads": store.uncached_uploads,
        }
    if kind is FsspecStore:
        if store.url.startswith(_PROCESS_LOCAL):
            return None
        return {"kind": "fsspec", "url": store.url, "retry": retry, "options": store.options}
    if kind is EmulatedStore:
        inner = _spec(store.inner)
        if inner is None:
            return None
        return {
            "kind": "emulated",
            "retry": retry,
            "inner": inner,
            "profile": store.profile.as_options(),
        }
    if kind is NativeStore:
        return {"kind": "native", "url": store.url, "retry": retry, "options": store.options}
    return None
