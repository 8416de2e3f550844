"""The local staging tier: a writable directory of its own, keeping between saves one
committed copy and the step being written, nothing else (disk on the training node is
bounded: two copies of a shard)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile

from unbroken.checkpoint.format.manifest import MANIFEST_NAME, parse_step_dir, step_dir
from unbroken.storage import LocalStore, Store

log = logging.getLogger(__name__)


def check_local_durable(durable: Store) -> None:
    """A durable path that is a file, or under one, can hold no checkpoint: refused here,
    by path, not found by a restore that quietly starts from scratch. One that does not
    exist is made here, so that one that cannot be made (a read-only mount, /proc) is
    refused now, not at the first due save hundreds of steps on. (An existing read-only
    one is fine: a manager may only restore.)"""
    if not isinstance(durable, LocalStore):
        return
    root = path = os.path.abspath(durable.url)
    while True:
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(
                f"CheckpointManager: the durable tier {durable.url} cannot hold checkpoints: "
                f"{path} is a file, not a directory"
            )
        parent = os.path.dirname(path)
        if parent == path or os.path.isdir(path):
            break
        path = parent
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"CheckpointManager: the durable tier {durable.url} cannot be created: "
            f"{exc.strerror or exc} (under {path}); give a path where directories can be made"
        ) from None


def check_staging_dir(path: str, durable: Store) -> None:
    """Create the staging directory and prove it writable, apart from the durable tier,
    so that a bad one is refused here, by path, rather than failing every save later."""
    if isinstance(durable, LocalStore):
        real_durable = os.path.realpath(durable.url)
        staging = os.path.realpath(path)
        if staging == real_durable or staging.startswith(real_durable + os.sep):
            raise ValueError(
                f"CheckpointManager: staging_dir {path} is inside the durable "
                f"tier {durable.url}; give it a directory of its own"
            )
    if os.path.islink(path) and not os.path.exists(path):
        raise ValueError(
            f"CheckpointManager: staging_dir {path} is a link to {os.readlink(path)}, "
            "which does not exist; create that directory or point the link elsewhere"
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"CheckpointManager: staging_dir {path} is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".unbroken-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(
            f"CheckpointManager: staging_dir {path} is not writable "
            f"({type(e).__name__}: {e.strerror or e})"
        ) from e


def tidy(staging_dir: str, current_step: int | None, *, writing: int | None = None) -> None:
    """Keep the copy of the step this run is at (``current_step``; before a commit or
    restore, the newest directory holding a manifest) and the step being written,
    nothing else: older copies, newer committed ones (a run that fell back past them)
    and partial ones a killed job left.

    After a commit (no ``writing``) a newer directory without a manifest stays: a rank of
    this node may have made it for its next save before the ranks agreed on that save.
    Before a local write every rank has agreed on ``writing``, so no rank can be making
    another step's directory then. A copy is un-committed first (its manifest goes),
    then deleted."""
    try:
        names = os.listdir(staging_dir)
    except OSError:
        return
    entries = {step: e for e in names if (step := parse_step_dir(e)) is not None}
    committed = {
        s for s, e in entries.items() if os.path.exists(os.path.join(staging_dir, e, MANIFEST_NAME))
    }
    keep = current_step if current_step is not None else max(committed, default=None)
    for step, entry in sorted(entries.items()):
        if step in (keep, writing):
            continue
        if writing is None and step not in committed and (keep is None or step > keep):
            continue
        if step not in committed:
            log.info("staging tier: removing %s, a save that did not finish", entry)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(staging_dir, entry, MANIFEST_NAME))
        shutil.rmtree(os.path.join(staging_dir, entry), ignore_errors=True)


def remove_unfinished(staging_dir: str, step: int) -> None:
    """A failed save's shard would stay until a later commit, and a store that stays
    down for a few saves would fill the disk with them. A directory that holds a
    manifest is left alone: that is a committed step's copy (the save failed because
    the step was already committed)."""
    path = os.path.join(staging_dir, step_dir(step))
    if not os.path.exists(os.path.join(path, MANIFEST_NAME)):
        shutil.rmtree(path, ignore_errors=True)


def free_bytes(path: str) -> int:
    """Free bytes on ``path``'s file system (unknown: as good as unlimited)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 2**62


def drop_copies(staging_dir: str, *, keep: int) -> list[str]:
    """Remove every step's copy but ``keep``'s (un-committed first); the names removed.
    A disk with room for one copy would otherwise fail every save after the first: the
    copy of the step committed before it takes the room."""
    dropped = []
    for entry in sorted(os.listdir(staging_dir)) if os.path.isdir(staging_dir) else []:
        step = parse_step_dir(entry)
        if step is None or step == keep:
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(staging_dir, entry, MANIFEST_NAME))
        shutil.rmtree(os.path.join(staging_dir, entry), ignore_errors=True)
        dropped.append(entry)
    return dropped
