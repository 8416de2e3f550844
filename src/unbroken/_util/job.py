"""Which job this process belongs to: the identity every attempt of one job shares.

A restart under ``torchrun --max-restarts``, a Slurm requeue or a pod rescheduled on
another node is the same job in a new process, often on another host: its claims and
its goodput are its own. Two jobs pointed at one URL are not. The launchers already
name the job; this reads their names, most specific first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

JOB_ID_ENV = "UNBROKEN_JOB_ID"
"""Set it to name the job yourself (any launcher, or none)."""


def job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The job's identity from the launcher's environment, or None where nothing names it.

    ``UNBROKEN_JOB_ID``; else Slurm's job id (with the array task, which is a job of its
    own), stable across requeues; else torchrun's rendezvous id (``--rdzv-id``, a fresh
    uuid per ``--standalone`` launch, shared by its restarts), unless it is torchrun's
    placeholder ``none``."""
    env = os.environ if environ is None else environ
    own = env.get(JOB_ID_ENV, "").strip()
    if own:
        return own
    slurm = env.get("SLURM_JOB_ID", "").strip()
    if slurm:
        task = env.get("SLURM_ARRAY_TASK_ID", "").strip()
        return f"slurm-{slurm}" + (f"-{task}" if task else "")
    run = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if run and run.lower() != "none":
        return f"torchrun-{run}"
    return None
