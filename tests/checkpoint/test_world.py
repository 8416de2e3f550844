"""A rank of several that never joined a process group is refused, not left to train
alone: the manager and the dataset say what to call."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken._util.world import missing_group

from .distributed import ROOT, check, torchrun

WORKER = Path(__file__).with_name("_no_group_worker.py")


def test_a_rank_of_two_without_a_group_is_told_what_to_call():
    why = missing_group("CheckpointManager", {"WORLD_SIZE": "2", "RANK": "1"}, False)
    assert why is not None
    assert "rank 1 of 2" in why and "init_process_group(" in why and '"gloo"' in why


@pytest.mark.parametrize(
    "environ, initialized",
    [
        ({}, False),  # no launcher: a single process
        ({"WORLD_SIZE": "1", "RANK": "0"}, False),  # torchrun --nproc-per-node 1
        ({"WORLD_SIZE": "2", "RANK": "1"}, True),  # the group exists
        ({"WORLD_SIZE": "two"}, False),  # not a launcher's value
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, False),  # srun -n 1
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, False),  # a batch script's one process
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4", "WORLD_SIZE": "1"}, False),  # said
        ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4"}, True),  # the script mapped them
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "WORLD_SIZE": "8"}, True),  # torchrun
    ],
)
def test_nothing_is_refused_where_a_world_of_one_is_right(environ, initialized):
    assert missing_group("CheckpointManager", environ, initialized) is None


def test_srun_tasks_of_a_script_that_starts_its_group_only_under_torchrun_are_refused(tmp_path):
    """``srun python train.py`` sets SLURM_PROCID and SLURM_STEP_NUM_TASKS, no WORLD_SIZE:
    the README's script (a group only under torchrun) trained alone in every task, each
    on every sample, until a clash of staging dirs or commits stopped one of them."""
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "a.bin").write_bytes(b"x")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = str(ROOT / "src")
    args = [sys.executable, str(WORKER), str(volume), str(tmp_path / "ck"), str(tmp_path / "st")]
    slurm = [{**env, "SLURM_PROCID": str(t), "SLURM_STEP_NUM_TASKS": "2"} for t in range(2)]
    tasks = [subprocess.Popen(args, env=e, stdout=subprocess.PIPE, text=True) for e in slurm]
    out = "".join(task.communicate(timeout=120)[0] for task in tasks)
    said = sorted(re.findall(r"(manager|dataset) (\d) (ACCEPTED|REFUSED)", out))
    assert said == [(what, t, "REFUSED") for what in ("dataset", "manager") for t in "01"], out
    assert "task 1 of 2 of a Slurm step" in out and "RANK=$SLURM_PROCID" in out, out
    assert "(a sweep, an evaluation a task starts, a shell), set WORLD_SIZE=1" in out, out


@pytest.mark.multiprocess
def test_a_real_torchrun_script_without_init_process_group_is_refused_on_every_rank(tmp_path):
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "a.bin").write_bytes(b"x")
    args = [str(volume), str(tmp_path / "ckpt"), str(tmp_path / "stage")]
    out = check(torchrun(2, *args, script=WORKER))
    said = sorted(re.findall(r"(manager|dataset) (\d) (ACCEPTED|REFUSED)", out))
    assert said == [(what, r, "REFUSED") for what in ("dataset", "manager") for r in "01"], out
    assert "Call torch.distributed.init_process_group(" in out
