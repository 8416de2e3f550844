"""One save on its way from host buffers to a commit record, and how its failures travel."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from unbroken.checkpoint.errors import SaveFailedError
from unbroken.checkpoint.format.manifest import Manifest
from unbroken.storage.in_memory import FileInMemory


def rng_file(rank: int) -> str:
    """Name (inside a step directory) of one rank's RNG state file."""
    return f"rng/rank-{rank:05d}.json"


@dataclass
class SaveJob:
    """One save on its way from host buffers to a commit record."""

    step: int
    staged: Any
    """A StagedState (its ``state_dict`` is the flat DCP state dict in host buffers)."""
    values: dict[str, Any]
    """JSON-able entries of the state; they go into the manifest."""
    rng: dict[str, Any]
    """This rank's RNG states at the moment of the save."""
    pinned: frozenset[str] = frozenset()
    """Keys saved from the lowest rank that holds them (module buffers)."""
    submitted: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    error: SaveFailedError | None = None
    manifest: Manifest | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: staging, local, upload, commit, total."""
    direct_bytes: int = 0
    """Bytes of this rank's shard written to the staging tier with O_DIRECT, bypassing
    the page cache (0 where its file system refuses O_DIRECT)."""
    memory_bytes: int = 0
    """Bytes of this rank's files uploaded from the host buffers instead of being read
    back from the staging tier (0 where the durable store reads files)."""
    checksummed_in_copy_bytes: int = 0
    """Bytes of this rank's shard whose crc32c the staging copy had taken."""
    in_place_bytes: int = 0
    """Bytes of this rank's shard the staging copy wrote where the memory tier's file
    keeps them (``staging/arena.py``): the local write did not copy them again."""
    records: list[Any] = field(default_factory=list)
    """This rank's files of the step (FileRecords: name, size, crc32c), once written."""
    local_root: str | None = None
    """The node tier this save's local copy went to (the memory tier's directory or the
    disk staging directory); None before its local write."""


def lend_until_read(
    parts: dict[str, list[Any]], release: Callable[[], None]
) -> dict[str, FileInMemory]:
    """Each file's parts as a ``FileInMemory``; ``release`` runs once all are given back.

    The parts are views of the staging buffers, which the next save needs: they are lent
    to the uploads only until each store has read them, or its first attempt failed. For
    the emulated remote that is when its copy ends, long before its link transfer; for a
    path (a network mount) it is when the durable copy is written, so a save that falls
    due meanwhile finds the buffers busy (``when_busy``)."""
    if not parts:
        return {}
    left = [len(parts)]
    lock = threading.Lock()

    def returned() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            release()

    return {name: FileInMemory(views, returned) for name, views in parts.items()}


def drop_frame_locals(exc: BaseException) -> None:
    """Clear the locals of every frame in ``exc``'s tracebacks (its causes too), keeping the
    lines: a failure kept in ``CheckpointManager.failures`` must not keep the staging
    buffers its frames referenced alive."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


def describe(exc: BaseException) -> str:
    """A one-line cause that can travel to other ranks."""
    if isinstance(exc, CheckpointException):
        parts = [f"rank {r}: {type(e[0]).__name__}: {e[0]}" for r, e in exc.failures.items()]
        return "; ".join(parts) or str(exc)
    return f"{type(exc).__name__}: {exc}"
