"""A rank of several that never joined a process group is refused, not left to train
alone: the manager and the dataset say what to call."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from unbroken._util.world import missing_group

from .distributed import check, torchrun

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
    ],
)
def test_nothing_is_refused_where_a_world_of_one_is_right(environ, initialized):
    assert missing_group("CheckpointManager", environ, initialized) is None


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
