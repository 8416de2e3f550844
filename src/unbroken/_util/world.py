"""A rank of several that never joined a process group, refused before it works alone.

torchrun (and Slurm's or Kubernetes' launchers) tell each worker its place in the job
through ``WORLD_SIZE`` and ``RANK``; ``srun`` through ``SLURM_STEP_NUM_TASKS`` and
``SLURM_PROCID``. A script that never calls
``torch.distributed.init_process_group`` still sees torch.distributed uninitialized, and
would act as a world of one: every rank writes rank 0's checkpoint files into one
staging directory, and reads every sample of the volume instead of its own share.
Nothing fails at once; the job trains on the wrong data. So it is refused where the
world is decided.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

INIT = 'torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")'


def missing_group(who: str, environ: Mapping[str, str], initialized: bool) -> str | None:
    """Why ``who`` must not act as a world of one here, or None (pure: reads only its
    arguments). ``initialized``: whether torch.distributed has a default group."""
    if initialized:
        return None
    if "WORLD_SIZE" not in environ and "SLURM_PROCID" in environ:
        return _slurm_task_alone(who, environ)
    try:
        world = int(environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return None  # not a launcher's value: nothing to go by
    if world <= 1:
        return None
    rank = environ.get("RANK", "?")
    return (
        f"{who} was created on rank {rank} of {world} (WORLD_SIZE={world}, set by torchrun "
        "or your launcher) before torch.distributed.init_process_group(), so it would work "
        "as a world of one beside the other ranks. Call "
        f"{INIT} first, on every rank"
    )


def _slurm_task_alone(who: str, environ: Mapping[str, str]) -> str | None:
    """``srun python train.py`` starts one process per task and sets no WORLD_SIZE: a
    script that starts its group only under torchrun trains alone in every task."""
    try:
        tasks = int(environ.get("SLURM_STEP_NUM_TASKS", "1"))
    except ValueError:
        return None
    if tasks <= 1:
        return None
    task = environ["SLURM_PROCID"]
    return (
        f"{who} was created in task {task} of {tasks} of a Slurm step (srun started {tasks} "
        "processes: SLURM_STEP_NUM_TASKS) with no torch.distributed process group, so it "
        "would work as a world of one beside the other tasks. For one job across the "
        "tasks, set RANK=$SLURM_PROCID, WORLD_SIZE=$SLURM_STEP_NUM_TASKS, "
        "LOCAL_RANK=$SLURM_LOCALID, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, then "
        f"call {INIT} first, on every task (docs/launch.md, 'Slurm without torchrun'; "
        "with Lightning, make it once fit joined the group: in train_dataloader()). For a "
        "run of its own in each task (a sweep, an evaluation a task starts, a shell), set "
        "WORLD_SIZE=1"
    )


def require_group(who: str, environ: Mapping[str, str] | None = None) -> None:
    """Raise ``RuntimeError`` where :func:`missing_group` finds a rank without its group."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    why = missing_group(who, os.environ if environ is None else environ, initialized)
    if why is not None:
        raise RuntimeError(why)
