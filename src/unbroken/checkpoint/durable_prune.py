"""Retention's I/O on the durable tier: delete what ``retention.plan_deletions`` chose.

A committed step is un-committed first (its manifest goes before its files), so a reader
never finds a commit record over missing files. A partial step is deleted only while no
other live writer claims it and nobody committed it since the listing: another job on
the same URL may be saving it, and its checkpoint is never ours to delete.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from unbroken.checkpoint.durable_index import DurableIndex
from unbroken.checkpoint.format.manifest import MANIFEST_NAME, step_dir
from unbroken.checkpoint.format.writers import other_holder
from unbroken.checkpoint.retention import plan_deletions
from unbroken.storage import Store

log = logging.getLogger(__name__)


def prune_durable(
    durable: Store,
    index: DurableIndex,
    *,
    keep_last: int | None,
    keep_every_steps: int | None,
    passed_over: Collection[int] = (),
) -> None:
    """Delete the durable tier's checkpoints retention gives up (coordinator only)."""
    checkpoints = index.checkpoints()
    partial = {c.step for c in checkpoints if not c.committed}
    doomed = plan_deletions(
        checkpoints,
        keep_last=keep_last,
        keep_every_steps=keep_every_steps,
        passed_over=passed_over,
    )
    for step in doomed:
        name = step_dir(step)
        if step in partial and not _partial_is_ours(durable, step):
            continue
        durable.delete(f"{name}/{MANIFEST_NAME}")  # uncommit first, then the rest
        durable.delete(name)
        index.forget(step)
        log.info("retention: deleted %s", durable.url_for(name))


def _partial_is_ours(durable: Store, step: int) -> bool:
    name = step_dir(step)
    holder = other_holder(durable, name)
    if holder is None and not durable.exists(f"{name}/{MANIFEST_NAME}"):
        return True
    log.info(
        "retention: left %s alone: %s",
        durable.url_for(name),
        f"claimed by {holder}, which may still be saving it" if holder else "committed",
    )
    return False
