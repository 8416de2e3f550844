"""``dcp.load`` through a :class:`TierReader`, with the error that names the step and file.

DCP wraps every rank's failure in a ``CheckpointException`` (a ``BaseException``), which
hides our CheckpointError behind a list of every rank's tracebacks; a caller loading a
step without the manager (a tool, a test) wants the one error that says what is wrong.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner

from unbroken.checkpoint.errors import CheckpointError, CheckpointMismatchError
from unbroken.checkpoint.format.reader import TierReader

_PLANNER_MISMATCH = ("Size mismatch between saved", "Missing key in checkpoint")
"""How DCP's default load planner words a key or shape mismatch (ValueError/RuntimeError)."""


def first_checkpoint_error(exc: BaseException, *, step: int | None = None) -> BaseException:
    """The CheckpointError a rank raised inside DCP, else ``exc`` itself. The default
    planner's key and shape mismatches become CheckpointMismatchError."""
    if isinstance(exc, CheckpointException):
        inners = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        for inner in inners:
            if isinstance(inner, CheckpointError):
                return inner
        for inner in inners:
            if str(inner).startswith(_PLANNER_MISMATCH):
                where = f"checkpoint step {step}" if step is not None else "checkpoint"
                return CheckpointMismatchError(f"{where}: {inner}")
    return exc


def load_state_dict(
    state_dict: dict[str, Any],
    reader: TierReader,
    *,
    planner: LoadPlanner | None = None,
    process_group: Any = None,
) -> None:
    """``dcp.load`` through ``reader``; our CheckpointError surfaces unwrapped."""
    try:
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=planner,
            process_group=process_group,
            no_dist=not (dist.is_available() and dist.is_initialized()),
        )
    except CheckpointException as exc:
        inner = first_checkpoint_error(exc, step=reader.step)
        if inner is exc and reader.failure is not None:
            inner = reader.failure
        if inner is exc:
            raise
        raise inner from exc
