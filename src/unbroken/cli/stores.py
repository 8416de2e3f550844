"""Opening the URL a verb was given, with an error a person can act on."""

from __future__ import annotations

import os

from unbroken.cli.errors import CliError
from unbroken.storage import LocalStore, Store, open_store


def open_existing(url: str) -> Store:
    """The store at ``url``; a local path must be an existing directory."""
    try:
        store = open_store(url)
    except (ValueError, TypeError, ImportError) as exc:
        raise CliError(f"cannot open {url!r}: {exc}") from exc
    if isinstance(store, LocalStore) and not os.path.isdir(store.root):
        what = "is a file, not a directory" if os.path.exists(store.root) else "does not exist"
        raise CliError(f"{store.root} {what}")
    return store
