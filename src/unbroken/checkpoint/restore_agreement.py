"""What every rank agrees on before a restore: the step asked for, and the committed steps.

Each rank loads what the coordinator's listing names, so no two ranks can pick
different steps from listings taken moments apart; ranks asked for different steps are
refused before any loads anything.
"""

from __future__ import annotations

from typing import Any

from unbroken._util.collectives import Group
from unbroken.checkpoint.catalog import step_files
from unbroken.checkpoint.errors import CheckpointError, ListingFailedError
from unbroken.checkpoint.format.manifest import MANIFEST_NAME
from unbroken.checkpoint.save_job import describe
from unbroken.storage import Store


def agree_on_step(step: int | None, group: Group, durable: Store) -> None:
    """Every rank must ask for the same step: ranks that loaded different steps would train
    on a state no checkpoint ever held (or wait on each other's collectives forever)."""
    if group.world_size == 1:
        return
    asked = group.all_gather(step)
    if len(set(asked)) > 1:
        by_rank = ", ".join(
            f"rank {r}: {'newest' if s is None else s}" for r, s in enumerate(asked)
        )
        raise CheckpointError(
            f"ranks asked to restore different checkpoints of {durable.url} ({by_rank}); "
            "pass the same step= (or none) on every rank"
        )


def agreed_listing(durable: Store, group: Group) -> dict[int, dict[str, int]]:
    """The coordinator's listing on every rank; its failure raises on every rank."""
    error: BaseException | None = None
    payload: tuple[str, Any] | None = None
    if group.is_coordinator:
        try:
            payload = ("ok", _listed_commits(durable))
        except Exception as e:
            error, payload = e, ("error", describe(e))
    payload = group.broadcast(payload)
    if payload[0] != "ok":  # the same error on every rank, the cause chained where it is
        raise ListingFailedError(
            f"listing checkpoints at {durable.url} failed: {payload[1]}", op="list", url=durable.url
        ) from error
    return payload[1]


def _listed_commits(store: Store) -> dict[int, dict[str, int]]:
    """{step: {file: size}} for every step directory that holds a manifest."""
    by_step = step_files(store, include_temp=False)
    return {s: files for s, files in by_step.items() if MANIFEST_NAME in files}
