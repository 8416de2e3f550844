"""Which checkpoints to delete: a pure function of the catalog, no I/O.

Retention counts committed checkpoints only, and nothing at or above the newest committed
step is ever returned: an async save above it may still be in flight, and the newest
committed checkpoint is the one a restart needs. Partial checkpoints older than the newest
committed one are debris of crashed saves and are returned for deletion. A checkpoint a
newer unbroken committed (its manifest's format is newer) is neither: it is never returned,
nor is one a restore found unusable and went past (kept to be looked at, never counted).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol


class _Checkpoint(Protocol):
    @property
    def step(self) -> int: ...

    @property
    def committed(self) -> bool: ...

    @property
    def newer_format(self) -> bool: ...


def plan_deletions(
    checkpoints: Sequence[_Checkpoint],
    *,
    keep_last: int | None,
    keep_every_steps: int | None,
    passed_over: Collection[int] = (),
) -> list[int]:
    """Steps to delete, ascending.

    ``keep_last``: keep the newest this many committed checkpoints (None: keep all).
    ``keep_every_steps``: also keep every committed checkpoint whose step is a multiple
    of it (e.g. 10_000 keeps a permanent trail). Both must be >= 1 when given.
    ``passed_over``: committed steps a restore found unusable and went past: kept (to be
    looked at), but never counted, so they crowd out none of the run's own steps.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if keep_every_steps is not None and keep_every_steps < 1:
        raise ValueError(f"keep_every_steps must be >= 1 or None, got {keep_every_steps}")
    committed = sorted({c.step for c in checkpoints if c.committed})
    if not committed:
        return []
    skipped = {s for s in committed if s in passed_over}
    if len(skipped) < len(committed):
        committed = [s for s in committed if s not in skipped]
    else:
        skipped = set()
    newest = committed[-1]
    keep = {newest}
    if keep_last is None:
        keep.update(committed)
    else:
        keep.update(committed[-keep_last:])
    if keep_every_steps is not None:
        keep.update(s for s in committed if s % keep_every_steps == 0)
    newer = {c.step for c in checkpoints if c.newer_format}
    partial = {c.step for c in checkpoints if not c.committed} - set(committed) - newer
    doomed = {s for s in committed if s not in keep} | {s for s in partial if s < newest}
    return sorted(doomed)
