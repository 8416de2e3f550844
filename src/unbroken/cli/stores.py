"""Opening the URL a verb was given, with an error a person can act on.

Every verb that reads a store takes the API's ``storage_options`` on its command line:
``--storage-options JSON`` (or ``@file.json``) for all of them, ``--storage-option
KEY=VALUE`` (repeatable, and applied after) for one at a time. Same names, same
mapping as ``open_store(url, **storage_options)``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

from unbroken.cli.errors import CliError
from unbroken.storage import LocalStore, Store, open_store


def add_storage_arguments(p: argparse.ArgumentParser) -> None:
    """``--storage-option`` and ``--storage-options`` on a verb's parser."""
    g = p.add_argument_group(
        "storage options",
        "What open_store(URL, **storage_options) takes: an S3-compatible server's "
        "endpoint_url, credentials, region, backend=fsspec... (docs/storage.md)",
    )
    g.add_argument(
        "--storage-options",
        metavar="JSON",
        help='a JSON object, or @FILE holding one: \'{"endpoint_url": "http://host:9000"}\'',
    )
    g.add_argument(
        "--storage-option",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="one option (repeatable; wins over --storage-options); VALUE is read as "
        'JSON where it is JSON (true, 8, {"a": 1}), else as a string',
    )


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options ``args`` give, from ``--storage-options`` then each ``--storage-option``."""
    return parse_storage_options(
        getattr(args, "storage_options", None), getattr(args, "storage_option", [])
    )


def parse_storage_options(blob: str | None, pairs: Sequence[str]) -> dict[str, Any]:
    """``blob`` (JSON or ``@file``) updated with ``KEY=VALUE`` ``pairs``; CliError (exit
    2) names what does not parse."""
    options: dict[str, Any] = {}
    if blob:
        text, where = blob, "--storage-options"
        if blob.startswith("@"):
            where = blob[1:]
            try:
                with open(where, encoding="utf-8") as f:
                    text = f.read()
            except OSError as exc:
                raise CliError(f"--storage-options: cannot read {where}: {exc}", code=2) from exc
        try:
            options = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CliError(f"{where}: not JSON ({exc})", code=2) from exc
        if not isinstance(options, dict):
            got = type(options).__name__
            raise CliError(f"{where}: a JSON object is needed, got {got}", code=2)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise CliError(f"--storage-option {pair!r}: KEY=VALUE is needed", code=2)
        options[key.strip()] = _value(value)
    return options


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def open_existing(url: str, options: dict[str, Any] | None = None) -> Store:
    """The store at ``url`` opened with ``options``; a local path must be an existing
    directory."""
    try:
        store = open_store(url, **(options or {}))
    except (ValueError, TypeError) as exc:  # the URL or its options: a bad argument
        hint = ""
        scalars = [v for v in (options or {}).values() if isinstance(v, (bool, int, float))]
        if isinstance(exc, TypeError) and scalars:  # 12345 or true was parsed as JSON
            hint = (
                " (a --storage-option VALUE that parses as JSON, a number or true, is passed"
                """ as such: quote a string as KEY='"12345"')"""
            )
        raise CliError(f"cannot open {url!r}: {exc}{hint}", code=2) from exc
    except ImportError as exc:  # a package this scheme needs is not installed
        raise CliError(f"cannot open {url!r}: {exc}") from exc
    if isinstance(store, LocalStore) and not os.path.isdir(store.root):
        what = "is a file, not a directory" if os.path.exists(store.root) else "does not exist"
        raise CliError(f"{store.root} {what}")
    return store
