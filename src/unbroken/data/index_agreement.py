"""One listing for every rank: ranks that listed the volume apart agree on rank 0's.

Each node lists the volume when its dataset is made (a node's ranks share one listing,
or list again when they come later than its first). A file that lands between two of
those listings gave the ranks different indexes; each partitioned its own, so some
samples were trained on twice in an epoch and others never, and nothing said so. The
ranks now compare fingerprints, one small gather on a gloo group of their own; where
they differ, rank 0's index goes to every rank, with a warning naming the counts.
"""

from __future__ import annotations

import warnings
from datetime import timedelta

import torch.distributed as dist

from unbroken._util.collectives import Group
from unbroken.data.index import FileIndex

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
    """``index``, or rank 0's where the ranks' listings differ (collective: every rank)."""
    try:
        wait = timedelta(seconds=AGREE_TIMEOUT_SECONDS)
        group = Group(dist.new_group(backend="gloo", timeout=wait))
        try:
            seen = group.all_gather((index.fingerprint, len(index)))
            if len({fp for fp, _ in seen}) == 1:
                return index
            columns = group.broadcast(index.columns() if group.is_coordinator else None)
        finally:
            group.release()
    except RuntimeError as e:  # gloo's timeout, or a peer gone
        raise RuntimeError(
            f"VolumeDataset({index.url}): rank {dist.get_rank()} could not compare its "
            f"listing with the other ranks' ({e}). The dataset is split over the job's "
            "ranks, so every rank makes it, in the same order; for one rank alone, pass "
            "rank=0, world_size=1"
        ) from e
    others = [f"rank {r}: {n}" for r, (fp, n) in enumerate(seen) if fp != seen[0][0]]
    more = len(others) - NAMED_RANKS
    warnings.warn(
        f"the ranks listed {index.url} at different moments and found different files "
        f"(files found by rank 0: {seen[0][1]}; {', '.join(others[:NAMED_RANKS])}"
        f"{f' and {more} more ranks' if more > 0 else ''}): the volume changed while the job "
        "started. Every rank uses rank 0's listing, so that the ranks split one set of "
        "files; what changed after it is seen at the next start",
        RuntimeWarning,
        stacklevel=3,
    )
    if group.is_coordinator:
        return index
    return FileIndex.from_columns(index.url, *columns, seen[0][0])
