"""Loading a checkpoint without a manager: an evaluation, an export, a fine-tune's start.

A manager is a training job's: it claims a staging directory, records goodput attempts
in the run's log and saves. A job that only reads a run's URL (an evaluation beside the
live training, a read-only copy, credentials that can only read) must do none of that:
it would be refused the training's staging directory, and counted in the training's
goodput as a crashed attempt. ``load`` reads the durable tier alone, writes nothing, and
changes only what ``state`` names: the process's own RNG streams are left as they were.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

import torch.distributed as dist

from unbroken._util.collectives import Group
from unbroken.checkpoint.errors import NoCheckpointError
from unbroken.checkpoint.format.manifest import check_step
from unbroken.state.rng import capture_rng_state, restore_rng_state
from unbroken.storage import open_store, redact

_cached: list[tuple[Any, Group]] = []
"""(default process group, this module's group over it): an evaluation that loads every
new step must not make (and leak) a gloo group per call."""


def load(
    url: str | os.PathLike,
    state: MutableMapping[str, Any],
    *,
    step: int | None = None,
    strict: bool = True,
    storage_options: dict[str, Any] | None = None,
    timeout: float = 1800.0,
) -> int:
    """Load the newest committed checkpoint at ``url`` (or ``step``) into ``state``; its step.

    ``state`` may name only part of what was saved (``{"model": model}``). On several
    ranks, call it on every rank with the same ``step`` (or none): they agree on one
    listing, so a training job committing a new step meanwhile cannot split them.
    Raises NoCheckpointError when ``url`` holds no committed checkpoint.
    """
    from unbroken.checkpoint.recovery import restore

    if step is not None:
        check_step(step)
    store = open_store(os.fspath(url), **(storage_options or {}))
    own_rng = capture_rng_state()
    try:
        restored = restore(state, durable=store, staging=None, group=_group(timeout), step=step,
                           strict=strict)  # fmt: skip
    finally:
        restore_rng_state(own_rng)
    if restored is None:
        raise NoCheckpointError(f"no committed checkpoint at {redact(store.url)} to load")
    return restored.step


def _group(timeout: float) -> Group:
    if not (dist.is_available() and dist.is_initialized()):
        return Group(None)
    world = dist.group.WORLD
    if not _cached or _cached[0][0] is not world:  # first call, or a new default group
        _cached[:] = [(world, Group.create(timeout))]
    return _cached[0][1]
