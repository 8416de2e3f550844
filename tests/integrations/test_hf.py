"""Hugging Face Trainer + unbroken, with a 2-layer GPT-2 built from a config: in one
process (a run stopped mid-epoch and resumed equals an uninterrupted one) and on 2 ranks
under real torchrun (gloo, CPU), SIGKILLed mid-epoch and then preempted by SIGTERM, each
time restarted by --max-restarts, ending bitwise equal to an uninterrupted run."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.checkpoint.distributed import check, torchrun, toy_volume
from tests.integrations.runs import (
    Run,
    check_killed_then_preempted,
    digest,
    launch_reference_and_faulted,
)

transformers = pytest.importorskip("transformers")

import unbroken as ub  # noqa: E402
from tests.integrations.hf_parts import (  # noqa: E402
    Recording,
    RecordingTheirs,
    decode,
    gpt2,
    training_args,
)
from unbroken.integrations.hf import UnbrokenCallback  # noqa: E402

JOB = Path(__file__).with_name("_hf_job.py")
STEPS, FILES, STEPS_PER_EPOCH = 32, 64, 16  # 64 files, 2 ranks x 2 per batch


def _launch(out: Path, volume: Path, script: Path = JOB, **kwargs) -> Run:
    return Run(check(torchrun(2, str(out), str(volume), str(STEPS), script=script, **kwargs)))


class _StopAt(transformers.TrainerCallback):
    """Ends train() after ``step`` (as a loop that stops itself would), max_steps unchanged:
    the learning-rate schedule depends on it."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _train(
    out: Path, volume: Path, steps: int, stop_at: int | None = None, **overrides
) -> tuple[str, dict, Recording]:
    """One train() in this process, resumed from ``out/ckpt`` if anything is committed."""
    model, seen = gpt2(), {}
    callback = UnbrokenCallback(out / "ckpt", staging_dir=out / "stage", when_busy="wait")
    trainer = Recording(
        model=model,
        args=training_args(str(out), steps, ddp_backend=None, **overrides),  # one process
        train_dataset=ub.VolumeDataset(volume, decode=decode, seed=0),
        callbacks=[_StopAt(stop_at), callback],
    )
    trainer.seen = lambda step, ids: seen.__setitem__(step, ids)
    trainer.train()
    return digest(model, trainer.optimizer.optimizer), seen, trainer


def test_a_run_stopped_mid_epoch_and_resumed_equals_an_uninterrupted_one(tmp_path):
    volume = toy_volume(tmp_path, files=FILES)  # one rank: 32 steps an epoch
    reference, seen, _ = _train(tmp_path / "reference", volume, 12)
    _, first, _ = _train(tmp_path / "job", volume, 12, stop_at=5)  # on_train_end saves 5
    resumed, rest, trainer = _train(tmp_path / "job", volume, 12)
    assert min(rest) == 6 and {**first, **rest} == seen
    assert resumed == reference
    assert trainer.state.global_step == 12
    assert abs(trainer.state.epoch - 12 / 32) < 1e-9  # the loader's epoch, not the restart's
    again, more, trainer = _train(tmp_path / "job", volume, 12)  # a finished job, rerun
    assert more == {} and again == reference and trainer.state.global_step == 12
    for run in ("reference", "job"):  # save_steps=4 would have written checkpoint-4, ...
        assert list((tmp_path / run / "hf-output").iterdir()) == []


class _Tokens(torch.utils.data.Dataset):
    """The toy volume's samples as a map-style dataset: the Trainer's own DataLoader."""

    def __len__(self) -> int:
        return FILES

    def __getitem__(self, i: int) -> dict:
        ids = torch.full((16,), i, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}


def test_with_the_trainers_own_loader_a_resume_sees_samples_twice_and_says_how_many(tmp_path):
    """What docs/integrations.md states for a dataset that is not a VolumeDataset: the
    model and RNG resume, the data position cannot: the Trainer's epoch starts again from
    its first batch, in the same order, so the samples before the interruption are
    trained on twice and as many at the end of the run are never reached."""
    runs = {}
    for name, stop_at in (("reference", None), ("first", 5), ("resumed", None)):
        seen: dict[int, list[int]] = {}
        out = tmp_path / ("reference" if name == "reference" else "job")
        trainer = RecordingTheirs(
            model=gpt2(),
            args=training_args(str(out), 12, ddp_backend=None),
            train_dataset=_Tokens(),
            callbacks=[_StopAt(stop_at), UnbrokenCallback(out / "ckpt", staging_dir=out / "st")],
        )
        trainer.seen = lambda step, ids, seen=seen: seen.__setitem__(step, ids)
        trainer.train()
        runs[name] = seen
    assert min(runs["resumed"]) == 6  # the model resumed at step 5
    epoch = [i for step in range(1, 13) for i in runs["reference"][step]]
    interrupted = [i for step in range(1, 6) for i in runs["first"][step]] + [
        i for step in range(6, 13) for i in runs["resumed"][step]
    ]
    twice = len(interrupted) - len(set(interrupted))
    missed = len(set(epoch) - set(interrupted))
    assert len(set(epoch)) == len(epoch) == 24  # uninterrupted: each sample once
    replayed = [runs["resumed"][step] for step in range(6, 11)]
    assert replayed == [runs["reference"][step] for step in range(1, 6)]
    assert twice == missed == 5 * 2, (twice, missed)  # 5 steps of 2 samples
    print(f"own loader, resumed after 5 of 12 steps: {twice} samples twice, {missed} missed")


def test_an_accumulation_that_a_resume_would_cut_short_is_refused(tmp_path):
    volume = toy_volume(tmp_path, files=FILES)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3 does not divide the 32"):
        _train(tmp_path, volume, 4, gradient_accumulation_steps=3)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_killed_and_preempted_trainer_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    volume = toy_volume(tmp_path, files=FILES)
    reference, job = launch_reference_and_faulted(_launch, tmp_path, volume)
    check_killed_then_preempted(reference, job, STEPS, STEPS_PER_EPOCH)
    for run in ("reference", "job"):  # save_steps=4 would have written checkpoint-4, ...
        assert list((tmp_path / run / "hf-output").iterdir()) == []


ACCELERATE_JOB = Path(__file__).with_name("_accelerate_job.py")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_killed_and_preempted_accelerate_recipe_ends_bitwise_equal_to_an_uninterrupted_one(
    tmp_path,
):
    """docs/integrations.md's accelerate recipe on 2 ranks: what accelerate prepared (DDP,
    AcceleratedOptimizer, AcceleratedScheduler) saved through the manager, unwrapped."""
    volume = toy_volume(tmp_path, files=FILES)
    launch = functools.partial(_launch, script=ACCELERATE_JOB)
    reference, job = launch_reference_and_faulted(launch, tmp_path, volume)
    check_killed_then_preempted(reference, job, STEPS, STEPS_PER_EPOCH)
