"""Hugging Face Trainer + unbroken on 2 ranks under real torchrun (gloo, CPU): a 2-layer
GPT-2 built from a config, SIGKILLed mid-epoch and then preempted by SIGTERM, each time
restarted by --max-restarts, ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint.distributed import check, torchrun, toy_volume
from tests.integrations.runs import Run, each_sample_once_per_epoch

pytest.importorskip("transformers")
pytestmark = pytest.mark.multiprocess

JOB = Path(__file__).with_name("_hf_job.py")
STEPS, FILES, STEPS_PER_EPOCH = 32, 64, 16  # 64 files, 2 ranks x 2 per batch


def _launch(out: Path, volume: Path, **kwargs) -> Run:
    return Run(check(torchrun(2, str(out), str(volume), str(STEPS), script=JOB, **kwargs)))


def test_killed_and_preempted_trainer_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    volume = toy_volume(tmp_path, files=FILES)
    reference = _launch(tmp_path / "reference", volume, timeout=300)
    # attempt 0: rank 1 is SIGKILLed at step 10 (its save of step 8 committed); attempt 1:
    # rank 0 gets a SIGTERM at step 13; attempt 2 finishes.
    faults = "0:1:kill:10,1:0:term:13"
    job = _launch(tmp_path / "job", volume, max_restarts=2, env={"FAULTS": faults}, timeout=420)
    for rank in (0, 1):
        assert job.restored(rank, 0) == 0
        assert job.restored(rank, 1) == 8  # every_steps = the Trainer's save_steps, 4
        reached = job.last_step(rank, 1)
        assert 13 <= reached < STEPS  # the SIGTERM's save: the step reached, none lost
        assert job.restored(rank, 2) == reached
        assert job.trajectory(rank) == reference.trajectory(rank)
    each_sample_once_per_epoch(job, 2, STEPS_PER_EPOCH, FILES)
    assert len(reference.digests()) == 1  # both ranks hold the same weights
    assert job.digests() == reference.digests()  # weights and Adam's moments, bitwise
    for run in ("reference", "job"):  # save_steps=4 would have written checkpoint-4, ...
        assert list((tmp_path / run / "hf-output").iterdir()) == []
