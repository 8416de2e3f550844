"""Where a node keeps the snapshots its peers send it, and what it can serve (no sockets).

Layout, inside the node's memory tier directory (so the tier's sweep, its clean-end
removal and its owner records cover replicas too)::

    <tier>/replicas/rank-<r>/step-<N>/{__<r>_0.distcp, rng/rank-<r>.json, manifest.json}

One directory per sending rank, laid out as a step directory of the tier, so the node's
own restore reads a replica like its own copy (``recovery.py``). Files arrive under a
temp name, are checked against the crc32c the sender gives and renamed into place; the
manifest comes last and makes the replica count. A sealed step replaces the rank's
older ones (manifest first). A replica counts against the tier's room: one that does
not fit is refused, and the node's own saves drop replicas first when short.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid

from unbroken.checkpoint.format.manifest import MANIFEST_NAME, parse_step_dir, step_dir
from unbroken.checkpoint.memory_tier import space
from unbroken.storage.base import check_key

REPLICAS = "replicas"


class NoRoom(Exception):
    """The tmpfs cannot take a replica file and keep the tier's reserve free."""


def replicas_root(tier: str) -> str:
    return os.path.join(tier, REPLICAS)


def rank_dir(tier: str, rank: int) -> str:
    return os.path.join(replicas_root(tier), f"rank-{rank:05d}")


def replica_dirs(tier: str) -> list[str]:
    """Every sending rank's directory this node holds."""
    root = replicas_root(tier)
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [os.path.join(root, n) for n in names if n.startswith("rank-")]


INCOMING = ".incoming"
"""The suffix of a file still arriving (never served, listed or sent over)."""


def check_name(name: str) -> str:
    """A file name inside a step directory, refused if it could leave it or names a file
    still arriving."""
    key = check_key(str(name))
    parts = key.split("/")
    if len(parts) > 2 or key.endswith(INCOMING):
        raise ValueError(f"{name!r} is not a checkpoint file name")
    return key


def inventory(tier: str, step: int) -> list[dict]:
    """The committed copies of ``step`` this node holds: its own and each replica, each
    as its manifest's text and the sizes of the files beside it."""
    found = []
    for root in [tier, *replica_dirs(tier)]:
        folder = os.path.join(root, step_dir(step))
        try:
            with open(os.path.join(folder, MANIFEST_NAME), encoding="utf-8") as f:
                manifest = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        sizes = {}
        for parent, _, names in os.walk(folder):
            for n in names:
                rel = os.path.relpath(os.path.join(parent, n), folder).replace(os.sep, "/")
                if rel != MANIFEST_NAME and not n.endswith(INCOMING):
                    with contextlib.suppress(OSError):
                        sizes[rel] = os.path.getsize(os.path.join(parent, n))
        found.append({"manifest": manifest, "files": sizes})
    return found


def find(tier: str, step: int, name: str) -> str | None:
    """The path of file ``name`` of a committed copy of ``step`` here: the node's own
    copy first, then the replicas."""
    name = check_name(name)
    for root in [tier, *replica_dirs(tier)]:
        folder = os.path.join(root, step_dir(step))
        path = os.path.join(folder, name)
        if os.path.exists(os.path.join(folder, MANIFEST_NAME)) and os.path.isfile(path):
            return path
    return None


def incoming(
    tier: str, rank: int, step: int, name: str, size: int, *, promised: int = 0
) -> tuple[str, str]:
    """(temp path, final path) for a file a peer sends; NoRoom where it does not fit with
    ``promised`` (bytes of other files still arriving) counted. The first file of a new
    step removes the rank's unsealed copies of other steps (a sender that died midway,
    a seal that failed): only the sealed one and this one stay."""
    name = check_name(name)
    if name == MANIFEST_NAME:
        raise ValueError(f"{name} comes with the seal, not as a file")
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"bad size {size!r}")
    folder = os.path.join(rank_dir(tier, rank), step_dir(step))
    if not os.path.isdir(folder):
        drop_rank(tier, rank, keep=step, sealed=False)
    room = space(tier)
    if not room.room_for(size + promised):
        raise NoRoom(
            f"no room for {size} more bytes in {tier} ({room.free} free, {promised} "
            f"promised to files arriving, keeping {room.reserve})"
        )
    final = os.path.join(folder, name)
    os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
    base = os.path.basename(final)
    tmp = os.path.join(os.path.dirname(final), f".{base}.{uuid.uuid4().hex[:8]}{INCOMING}")
    return tmp, final


def seal(tier: str, rank: int, step: int, manifest: bytes) -> None:
    """The replica of ``rank`` at ``step`` is whole: its manifest goes in last, and the
    rank's other steps go (each manifest first, so none is ever half there and counted)."""
    folder = os.path.join(rank_dir(tier, rank), step_dir(step))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no files of rank {rank} at step {step} arrived")
    tmp = os.path.join(folder, f".{MANIFEST_NAME}.{uuid.uuid4().hex[:8]}{INCOMING}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(manifest)
    os.replace(tmp, os.path.join(folder, MANIFEST_NAME))
    drop_rank(tier, rank, keep=step)


def drop_rank(tier: str, rank: int, *, keep: int | None = None, sealed: bool = True) -> None:
    """Remove the rank's replica steps other than ``keep`` (``sealed=False``: only those
    without a manifest), each manifest first."""
    root = rank_dir(tier, rank)
    try:
        names = os.listdir(root)
    except OSError:
        return
    for n in names:
        s = parse_step_dir(n)
        manifest = os.path.join(root, n, MANIFEST_NAME)
        if s is None or s == keep or (not sealed and os.path.exists(manifest)):
            continue
        with contextlib.suppress(OSError):
            os.unlink(manifest)
        shutil.rmtree(os.path.join(root, n), ignore_errors=True)


def drop_all(tier: str) -> int:
    """Remove every replica this node holds (its own saves need the room); bytes freed.
    Each manifest goes first, so no half-removed replica is ever counted."""
    from unbroken.checkpoint.memory_tier import tree_bytes

    root = replicas_root(tier)
    if not os.path.isdir(root):
        return 0
    freed = tree_bytes(root)
    for folder in replica_dirs(tier):
        with contextlib.suppress(OSError):
            for n in os.listdir(folder):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, n, MANIFEST_NAME))
    shutil.rmtree(root, ignore_errors=True)
    return freed
