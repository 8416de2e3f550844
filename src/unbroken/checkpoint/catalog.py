"""The catalog of checkpoints under a store root: which exist, which are committed.

A checkpoint is committed iff its manifest parses and every file it lists exists with
the listed size. The catalog costs one ``store.list`` of the root plus one read per
manifest, never a request per file; ``verify_checkpoint(deep=True)`` re-checksums.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from unbroken.checkpoint.errors import CheckpointError, NewerFormatError
from unbroken.checkpoint.format.manifest import (
    MANIFEST_NAME,
    METADATA_JSON,
    STEP_DIRS_AFTER,
    Manifest,
    crc32c_bytes,
    odd_step_dir,
    parse_step_dir,
    read_manifest,
    step_dir,
)
from unbroken.storage import Store
from unbroken.storage.errors import ObjectNotFoundError, StoreError, StorePermissionError
from unbroken.storage.local import UNREADABLE

VERIFY_CHUNK = 64 << 20
"""Bytes per ranged read while re-checksumming a file."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One ``step-*`` directory of a store and whether it is a committed checkpoint."""

    step: int
    committed: bool
    nbytes: int
    """Bytes the manifest lists if committed, else bytes present under the directory."""
    created: float | None
    """Commit time from the manifest; None if not committed."""
    world_size: int | None
    url: str
    problem: str | None
    """Why the checkpoint is not committed; None if it is."""
    newer_format: bool = False
    """Its manifest is of a format newer than this unbroken reads (a newer unbroken
    committed it): not committed as far as this version can tell, but never deleted or
    overwritten; ``problem`` says which version wrote it."""
    damaged: bool = False
    """It has a commit record, but the record or the files it lists are not whole (a
    file deleted or cut short, a record edited): damage, not a save cut short."""


def list_checkpoints(
    store: Store,
    by_step: dict[int, dict[str, int]] | None = None,
    *,
    unreadable: dict[int, str] | None = None,
) -> list[CheckpointInfo]:
    """Every ``step-*`` directory under the store root, sorted by step (``by_step``: the
    listing, if the caller has made it). A step whose manifest the store refuses or does
    not answer for raises, or, given ``unreadable``, is left out and recorded there
    (``verify``: the other steps are still checked)."""
    # Temp files too: a step whose writer was killed mid-upload may hold nothing else,
    # and retention must still see (and remove) it.
    if by_step is None:
        by_step = step_files(store, include_temp=True)
    infos = []
    for step, sizes in sorted(by_step.items()):
        try:
            infos.append(_describe(store, step, sizes))
        except StoreError as exc:
            if unreadable is None or isinstance(exc, ObjectNotFoundError):
                raise
            unreadable[step] = f"{type(exc).__name__}: {exc}"
    return infos


def step_files(store: Store, *, include_temp: bool) -> dict[int, dict[str, int]]:
    """{step: {file name inside its directory: size}} from one listing of the root.

    A directory named like a step but not as unbroken names them (``step-0000000000099``)
    is left out, with a warning: nothing reads, counts or deletes it."""
    by_step: dict[int, dict[str, int]] = {}
    odd: set[str] = set()
    unlisted: list[tuple[str, str]] = []
    listed = store.list("", include_temp=include_temp, unlisted=unlisted, after=STEP_DIRS_AFTER)
    for key, why in unlisted:  # a folder of the user's beside the steps is not ours
        if parse_step_dir(key.partition("/")[0]) is not None and why.startswith(UNREADABLE):
            raise StorePermissionError(
                f"checkpoint folder {store.url_for(key)} {why}: its step cannot be read "
                "or counted", op="list", url=store.url_for(key),
            )  # fmt: skip
    for entry in listed:
        top, _, rest = entry.key.partition("/")
        step = parse_step_dir(top)
        if step is not None and rest:
            by_step.setdefault(step, {})[rest] = entry.size
        elif rest and odd_step_dir(top):
            odd.add(top)
    for top in sorted(odd):
        warnings.warn(
            f"{store.url_for(top)} is not a checkpoint directory unbroken wrote (a step's "
            f"directory is named like {step_dir(0)}); it is ignored, never read or deleted",
            RuntimeWarning,
            stacklevel=3,
        )
    return by_step


def newest_committed(store: Store) -> CheckpointInfo | None:
    """The committed checkpoint with the highest step, or None."""
    committed = [c for c in list_checkpoints(store) if c.committed]
    return committed[-1] if committed else None


def verify_checkpoint(
    store: Store,
    step: int,
    *,
    deep: bool = False,
    on_bytes: Callable[[int], None] | None = None,
) -> list[str]:
    """Problems of checkpoint ``step`` (empty if it is sound), each ``"FILE: why"`` with
    FILE relative to the step directory: the file at fault, ``manifest.json`` only when the
    commit record itself is.

    Shallow: the manifest parses and every listed file is present with its size. Deep:
    also re-checksum every file against the manifest and decode ``metadata.json``;
    ``on_bytes(n)`` is told each chunk checksummed (a progress bar's feed).
    """
    try:
        manifest = read_manifest(store, step)
    except CheckpointError as exc:
        return [f"{MANIFEST_NAME}: {_reason(exc)}"]
    prefix = step_dir(step)
    sizes = {
        e.key[len(prefix) + 1 :]: e.size
        for e in store.list(prefix)
        if e.key.startswith(prefix + "/")
    }
    problems = missing_or_short(manifest, sizes)
    if deep and not problems:
        for record in manifest.files.values():
            crc = _crc32c_of(store, f"{prefix}/{record.name}", record.size, on_bytes)
            if crc != record.crc32c:
                problems.append(
                    f"{record.name}: crc32c {crc:#010x}, manifest says {record.crc32c:#010x}"
                )
        if not problems and METADATA_JSON in manifest.files:
            from unbroken.checkpoint.format.dcp_json import metadata_from_json  # imports torch

            key = f"{prefix}/{METADATA_JSON}"
            try:
                metadata_from_json(store.read_bytes(key), where=store.url_for(key))
            except CheckpointError as exc:
                problems.append(f"{METADATA_JSON}: {_reason(exc)}")
    return problems


def _reason(exc: CheckpointError) -> str:
    """The error's message without the URL it starts with (the caller names the file)."""
    text, url = str(exc), getattr(exc, "url", None)
    return text[len(url) + 2 :] if url and text.startswith(f"{url}: ") else text


def missing_or_short(manifest: Manifest, sizes: Mapping[str, int]) -> list[str]:
    """Files the manifest lists that ``sizes`` (name -> bytes present) lacks or differs on."""
    problems = []
    folders: set[str] | None = None
    for name, record in sorted(manifest.files.items()):
        present = sizes.get(name)
        if present is None and folders is None:  # paths that hold other files
            folders = {k.rsplit("/", i)[0] for k in sizes for i in range(1, k.count("/") + 1)}
        if present is None and name in (folders or ()):
            problems.append(f"{name}: a directory, not a file")
        elif present is None:
            problems.append(f"{name}: missing")
        elif present != record.size:
            problems.append(f"{name}: {present} bytes, manifest says {record.size}")
    return problems


def _describe(store: Store, step: int, sizes: dict[str, int]) -> CheckpointInfo:
    url = store.url_for(step_dir(step))
    present = sum(sizes.values())
    if MANIFEST_NAME not in sizes:
        return CheckpointInfo(step, False, present, None, None, url, "no manifest (not committed)")
    try:
        manifest = read_manifest(store, step)
    except CheckpointError as exc:  # a store failure propagates: unknown is not partial
        newer = isinstance(exc, NewerFormatError)
        return CheckpointInfo(
            step, False, present, None, None, url, str(exc), newer, damaged=not newer
        )
    problems = missing_or_short(manifest, sizes)
    if problems:
        why = "incomplete: " + "; ".join(problems[:5])
        if len(problems) > 5:
            why += f"; and {len(problems) - 5} more"
        return CheckpointInfo(
            step, False, present, None, manifest.world_size, url, why, damaged=True
        )
    created = manifest.created if math.isfinite(manifest.created) else None  # hand-edited
    return CheckpointInfo(step, True, manifest.nbytes, created, manifest.world_size, url, None)


def _crc32c_of(
    store: Store, key: str, size: int, on_bytes: Callable[[int], None] | None = None
) -> int:
    crc = 0
    for start in range(0, size, VERIFY_CHUNK):
        end = min(size, start + VERIFY_CHUNK)
        crc = crc32c_bytes(store.read_bytes(key, start, end), crc)
        if on_bytes is not None:
            on_bytes(end - start)
    return crc
