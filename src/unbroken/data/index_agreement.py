"""One listing for every rank: ranks that listed the volume apart agree on rank 0's.

Each node lists the volume when its dataset is made (a node's ranks share one listing,
or list again when they come later than its first). A file that lands between two of
those listings gave the ranks different indexes; each partitioned its own, so some
samples were trained on twice in an epoch and others never, and nothing said so. The
ranks now compare their files (keys and sizes), one small gather on a gloo group of
their own; where they differ, every rank takes rank 0's files, with a warning naming
what differs. Versions (etags) stay each rank's own where its file is the same: a copy
of the volume on each node's disk has other modification times, and each node's reads
are checked against its own copy's.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist

from unbroken._util.collectives import Group
from unbroken.data.index import FileIndex, fingerprint_columns

AGREE_TIMEOUT_SECONDS = 3600.0
"""How long a rank waits for the others' listings: the slowest node's listing of a large
volume takes minutes. A rank that never comes (the dataset made on some ranks only)
ends the wait with an error that says so."""

NAMED_RANKS = 4
"""Ranks named in the warning at most (a job of thousands would name hundreds)."""


def spans_the_job(rank: int, world_size: int) -> bool:
    """The dataset is partitioned over the job's ranks (every rank makes it)."""
    if world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return False
    return (rank, world_size) == (dist.get_rank(), dist.get_world_size())


def agree_on_index(index: FileIndex) -> FileIndex:
    """``index``, or rank 0's files where the ranks' differ (collective: every rank)."""
    files = index.files_digest()
    try:
        group = Group.create(AGREE_TIMEOUT_SECONDS)
        try:
            seen = group.all_gather((files, len(index)))
            if len({digest for digest, _ in seen}) == 1:
                return index
            theirs = group.broadcast(index.columns() if group.is_coordinator else None)
        finally:
            group.release()
    except RuntimeError as e:  # gloo's timeout, or a peer gone
        raise RuntimeError(
            f"VolumeDataset({index.url}): rank {dist.get_rank()} could not compare its "
            f"listing with the other ranks' ({e}). The dataset is split over the job's "
            "ranks, so every rank makes it, in the same order; for one rank alone, pass "
            "rank=0, world_size=1"
        ) from e
    others = [f"rank {r}: {n}" for r, (digest, n) in enumerate(seen) if digest != seen[0][0]]
    more = len(others) - NAMED_RANKS
    keys, sizes, etags = theirs if group.rank == 0 else index.columns()  # rank 0's: its own
    here = "" if group.rank == 0 or files == seen[0][0] else _differences(keys, sizes, theirs)
    warnings.warn(
        f"the ranks listed {index.url} at different moments and found different files "
        f"(files found by rank 0: {seen[0][1]}; {', '.join(others[:NAMED_RANKS])}"
        f"{f' and {more} more ranks' if more > 0 else ''}{here}): the volume changed while "
        "the job started, or a node reused a listing it made before a change (index_max_age;"
        " refresh_index=True lists anew). Every rank uses rank 0's listing, so that the "
        "ranks split one set of files; what changed after it is seen at the next start",
        RuntimeWarning,
        stacklevel=3,
    )
    if group.rank == 0:
        return index
    mine = {k: (size, etag) for k, size, etag in zip(keys, sizes, etags)}
    keys0, sizes0, etags0 = theirs
    versions = [  # this rank's own version of a file it holds alike, else rank 0's
        own[1] if (own := mine.get(k)) is not None and own[0] == size else etag
        for k, size, etag in zip(keys0, sizes0, etags0)
    ]
    fingerprint = fingerprint_columns(keys0, sizes0, versions)
    return FileIndex.from_columns(index.url, keys0, sizes0, versions, fingerprint)


def _differences(keys: list[str], sizes: list[int], theirs: tuple) -> str:
    """What this rank's files have that rank 0's lack and the other way (a few named)."""
    mine, first = dict(zip(keys, sizes)), dict(zip(theirs[0], theirs[1]))
    only_here = sorted(set(mine) - set(first))
    only_there = sorted(set(first) - set(mine))
    resized = sorted(k for k in set(mine) & set(first) if mine[k] != first[k])
    parts = [
        f"{len(names)} {label} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
        for label, names in (
            ("only in this rank's", only_here),
            ("only in rank 0's", only_there),
            ("of another size here", resized),
        )
        if names
    ]
    return "; here: " + ", ".join(parts)
