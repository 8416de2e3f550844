"""Hugging Face Trainer + unbroken, with a 2-layer GPT-2 built from a config: in one
process (a run stopped mid-epoch and resumed equals an uninterrupted one) and on 2 ranks
under real torchrun (gloo, CPU), SIGKILLed mid-epoch and then preempted by SIGTERM, each
time restarted by --max-restarts, ending bitwise equal to an uninterrupted run."""

from __future__ import annotations

import functools
import time
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
from unbroken.integrations.hf_objects import inner as _inner  # noqa: E402

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
    out: Path,
    volume: Path,
    steps: int,
    stop_at: int | None = None,
    resume_from_checkpoint: bool | None = None,
    options: dict | None = None,
    **overrides,
) -> tuple[str, dict, Recording]:
    """One train() in this process, resumed from ``out/ckpt`` if anything is committed."""
    model, seen = gpt2(), {}
    options = {"staging_dir": out / "stage", "when_busy": "wait", **(options or {})}
    eval_dataset = overrides.pop("eval_dataset", None)
    trainer = Recording(
        model=model,
        args=training_args(str(out), steps, ddp_backend=None, **overrides),  # one process
        train_dataset=ub.VolumeDataset(volume, decode=decode, seed=0),
        eval_dataset=eval_dataset,
        callbacks=[_StopAt(stop_at), UnbrokenCallback(out / "ckpt", **options)],
    )
    trainer.seen = lambda step, ids: seen.__setitem__(step, ids)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return digest(model, trainer.optimizer.optimizer), seen, trainer


def _committed(out: Path) -> list[int]:
    return [c.step for c in ub.CheckpointManager(out / "ckpt").checkpoints() if c.committed]


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


def test_a_run_resumed_from_a_save_at_an_evaluation_step_equals_an_uninterrupted_one(tmp_path):
    """eval_steps == save_steps: the save was made before the Trainer's evaluation, whose
    DataLoader draws its seed from the global RNG. The resumed run, which does not
    evaluate that step again, drew one number less: other dropout masks from there on,
    and the step's logs were missing from log_history."""
    volume = toy_volume(tmp_path, files=FILES)
    evals = {"eval_strategy": "steps", "eval_steps": 4, "logging_steps": 2}
    run = functools.partial(_train, volume=volume, steps=10, eval_dataset=_Tokens(), **evals)
    reference, seen, done = run(tmp_path / "reference")
    _, first, _ = run(tmp_path / "job", stop_at=4)  # saved at 4, an evaluation step
    resumed, rest, trainer = run(tmp_path / "job")
    assert min(rest) == 5 and {**first, **rest} == seen
    assert resumed == reference
    logs = _untimed(trainer.state.log_history)  # the last, train_loss, is the run's own
    assert logs[:-1] == _untimed(done.state.log_history)[:-1] and len(logs) == 9


def _untimed(logs: list[dict]) -> list[dict]:
    """log_history less its clock readings (runtimes, rates)."""
    clock = ("runtime", "per_second")
    return [{k: v for k, v in e.items() if not any(c in k for c in clock)} for e in logs]


@pytest.mark.parametrize("strategy", ["eval_strategy", "logging_strategy"])
def test_a_run_resumed_from_an_epochs_last_step_equals_an_uninterrupted_one(tmp_path, strategy):
    """eval_strategy="epoch": the Trainer evaluates (or logs) the epoch after on_epoch_end,
    after the step's own logs: a save at the epoch's last step came before it."""
    volume = toy_volume(tmp_path, files=16)  # one rank: 8 steps an epoch
    per_epoch = {strategy: "epoch", "logging_steps": 1000}
    run = functools.partial(_train, volume=volume, steps=12, eval_dataset=_Tokens(), **per_epoch)
    reference, seen, done = run(tmp_path / "reference")
    _, first, _ = run(tmp_path / "job", stop_at=8)  # saved at 8, the epoch's last step
    resumed, rest, trainer = run(tmp_path / "job")
    assert min(rest) == 9 and {**first, **rest} == seen
    assert resumed == reference
    logs = _untimed(trainer.state.log_history)
    assert logs[:-1] == _untimed(done.state.log_history)[:-1]


def test_the_trainers_save_strategy_sets_the_cadence_when_no_every_steps_is_given(tmp_path):
    volume = toy_volume(tmp_path, files=FILES)  # one rank: 32 steps an epoch
    keep = {"keep_last": None}
    _train(tmp_path / "epoch", volume, 36, save_strategy="epoch", options=keep)
    assert _committed(tmp_path / "epoch") == [32, 36]  # the epoch's end, the last step
    _train(tmp_path / "ratio", volume, 12, save_steps=0.25, options=keep)  # 12 x 0.25
    assert _committed(tmp_path / "ratio") == [3, 6, 9, 12]
    _train(tmp_path / "no", volume, 6, save_strategy="no", options=keep)
    assert _committed(tmp_path / "no") == [6]
    _train(tmp_path / "own", volume, 6, save_strategy="epoch", options={**keep, "every_steps": 5})
    assert _committed(tmp_path / "own") == [5, 6]


def test_a_resume_from_checkpoint_is_left_to_the_callback(tmp_path):
    volume = toy_volume(tmp_path, files=FILES)
    reference, _, _ = _train(tmp_path / "reference", volume, 8)
    _train(tmp_path / "job", volume, 8, stop_at=5)
    with pytest.warns(UserWarning, match="resume_from_checkpoint=True ignored"):
        resumed, rest, _ = _train(tmp_path / "job", volume, 8, resume_from_checkpoint=True)
    assert min(rest) == 6 and resumed == reference
    # transformers' own Trainer, its checkpoints kept: it would load checkpoint-4 and
    # skip 4 batches on top of the callback's restore of step 5
    out = tmp_path / "theirs"
    for resume in (None, True):
        trainer = RecordingTheirs(
            model=gpt2(),
            args=training_args(str(out), 8, ddp_backend=None),
            train_dataset=_Tokens(),
            callbacks=[
                _StopAt(5 if resume is None else None),
                UnbrokenCallback(
                    out / "ckpt", staging_dir=out / "st", keep_trainer_checkpoints=True
                ),
            ],
        )
        if resume is None:
            trainer.train()
            continue
        with pytest.raises(RuntimeError, match=r"resumed its own checkpoint \(step 4\)"):
            trainer.train(resume_from_checkpoint=True)


def test_arguments_the_callback_would_defeat_are_refused_when_the_trainer_is_made(tmp_path):
    volume = toy_volume(tmp_path, files=FILES)
    evaluated = {"eval_strategy": "steps", "eval_steps": 4, "metric_for_best_model": "loss"}
    refused = [
        ({"load_best_model_at_end": True}, "keep_trainer_checkpoints=True"),
        ({"save_strategy": "best"}, "save_strategy='best'"),
    ]
    for overrides, message in refused:
        with pytest.raises(ValueError, match=message):
            Recording(
                model=gpt2(),
                args=training_args(str(tmp_path), 8, ddp_backend=None, **evaluated, **overrides),
                train_dataset=ub.VolumeDataset(volume, decode=decode, seed=0),
                eval_dataset=_Tokens(),
                callbacks=[UnbrokenCallback(tmp_path / "ckpt")],
            )
    with pytest.raises(TypeError, match=r"UnbrokenCallback got unknown options \['every_step'\]"):
        UnbrokenCallback(tmp_path / "ckpt", every_step=4)
    with pytest.raises(TypeError, match=r"UnbrokenCallback: target must be .* int 123"):
        UnbrokenCallback(123)


class _DigestAt(transformers.TrainerCallback):
    """The model and optimizer's digest at the end of ``step``."""

    def __init__(self, step: int) -> None:
        self.step, self.digest = step, None

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == self.step:
            self.digest = digest(model, _inner(optimizer, "optimizer"))


def test_the_last_step_is_saved_before_the_trainer_loads_the_best_model(tmp_path):
    """load_best_model_at_end writes the best step's weights in place once training
    ends: the last step's checkpoint holds that step's own weights, whole."""
    volume = toy_volume(tmp_path, files=FILES)
    best = {"eval_strategy": "steps", "eval_steps": 4, "load_best_model_at_end": True}
    best.update(metric_for_best_model="loss", greater_is_better=True)  # an early step's
    last = _DigestAt(10)  # not a step the cadence (4, 8) saves
    trainer = Recording(
        model=gpt2(),
        args=training_args(str(tmp_path), 10, ddp_backend=None, **best),
        train_dataset=ub.VolumeDataset(volume, decode=decode, seed=0),
        eval_dataset=_Tokens(),
        callbacks=[
            UnbrokenCallback(
                tmp_path / "ckpt",
                staging_dir=tmp_path / "stage",
                when_busy="wait",
                keep_trainer_checkpoints=True,
            ),
            last,
        ],
    )
    trainer.train()
    assert not trainer.state.best_model_checkpoint.endswith("-10")
    assert _committed(tmp_path) == [4, 8, 10]
    restored, seen, _ = _train(tmp_path, volume, 10)  # the finished run: restored at 10
    assert seen == {} and restored == last.digest


def test_an_early_stop_lets_the_save_in_flight_copy_before_the_best_model_loads(
    tmp_path, monkeypatch
):
    """Early stopping decides at the epoch's evaluation, after the epoch's save began;
    the Trainer then loads the best model in place. The copy is slowed to widen the
    window: the save must not be torn, and the last epoch's step is committed."""
    from unbroken.checkpoint.staging import copy as staging_copy

    run = staging_copy.CopyJob._run
    monkeypatch.setattr(staging_copy.CopyJob, "_run", lambda job: time.sleep(1.5) or run(job))
    volume = toy_volume(tmp_path, files=16)  # 8 steps an epoch
    epochs = {"save_strategy": "epoch", "eval_strategy": "epoch", "num_train_epochs": 4}
    best = {"load_best_model_at_end": True, "metric_for_best_model": "loss"}
    trainer = Recording(
        model=gpt2(),
        args=training_args(
            str(tmp_path), -1, ddp_backend=None, greater_is_better=True, **epochs, **best
        ),
        train_dataset=ub.VolumeDataset(volume, decode=decode, seed=0),
        eval_dataset=_Tokens(),
        callbacks=[
            UnbrokenCallback(
                tmp_path / "ckpt", staging_dir=tmp_path / "st", keep_trainer_checkpoints=True
            ),
            transformers.EarlyStoppingCallback(early_stopping_patience=1),
        ],
    )
    trainer.train()  # raised SaveFailedError (a torn snapshot) at close
    assert trainer.state.global_step < 32  # stopped early
    assert _committed(tmp_path)[-1] == trainer.state.global_step


def test_a_volume_served_by_transformers_own_loader_is_warned_about(tmp_path):
    volume = toy_volume(tmp_path, files=FILES)
    trainer = transformers.Trainer(
        model=gpt2(),
        args=training_args(str(tmp_path), 2, ddp_backend=None),
        train_dataset=ub.VolumeDataset(volume, decode=decode, seed=0),
        callbacks=[UnbrokenCallback(tmp_path / "ckpt", staging_dir=tmp_path / "st")],
    )
    with pytest.warns(UserWarning, match="own DataLoader, whose position is not saved"):
        trainer.train()


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


def test_the_stock_trainers_loss_and_throughput_count_from_the_resume(tmp_path):
    """transformers.Trainer with the callback alone: its counters were left at 0, so the
    first loss logged after a resume at step 5 was divided by 6 steps, not 1, and
    train_loss by 12 (the callback reached only unbroken's Trainer)."""
    out = tmp_path / "job"
    for stop_at in (5, None):
        trainer = transformers.Trainer(
            model=gpt2(),
            args=training_args(str(out), 12, ddp_backend=None, logging_steps=1),
            train_dataset=_Tokens(),
            callbacks=[_StopAt(stop_at), UnbrokenCallback(out / "ckpt", staging_dir=out / "st")],
        )
        result = trainer.train()
    steps = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert steps == list(range(1, 13))  # the first run's history restored, then 6-12
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert min(logged) > 0.5 * max(logged)  # step 6's not divided by 6
    assert result.training_loss == pytest.approx(sum(logged[5:]) / 7, rel=1e-3)


def test_a_second_unbroken_callback_is_refused_when_the_trainer_is_made(tmp_path):
    """Added twice (a shared helper and the script), the second manager closed the first
    on their staging dir, and step 1 failed with "CheckpointManager ... is closed"."""
    twice = [UnbrokenCallback(tmp_path / "ckpt", staging_dir=tmp_path / "st") for _ in "ab"]
    with pytest.raises(ValueError, match="given 2 UnbrokenCallbacks"):
        transformers.Trainer(
            model=gpt2(), args=training_args(str(tmp_path), 4, ddp_backend=None),
            train_dataset=_Tokens(), callbacks=twice,
        )  # fmt: skip
    trainer = transformers.Trainer(
        model=gpt2(), args=training_args(str(tmp_path), 4, ddp_backend=None),
        train_dataset=_Tokens(), callbacks=twice[:1],
    )  # fmt: skip
    trainer.add_callback(twice[1])  # after the Trainer was made: refused at train()
    with pytest.raises(ValueError, match="given 2 UnbrokenCallbacks"):
        trainer.train()
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("step-*"))


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


def test_a_loader_accelerate_prepares_says_to_iterate_it_as_it_is(tmp_path):
    """accelerate's prepare(loader) rebuilds a DataLoader from ours: it raised a TypeError
    about a Delivery (one process), served internal records as batches, or on 2 ranks
    served nothing, and the recipe's `while step < 8` spun for ever."""
    accelerate = pytest.importorskip("accelerate")
    volume = toy_volume(tmp_path, files=8)
    loader = ub.DataLoader(
        ub.VolumeDataset(str(volume), decode=lambda d, k: torch.tensor(list(d))), batch_size=2
    )
    prepared = accelerate.Accelerator(cpu=True).prepare(loader)
    with pytest.raises(TypeError, match=r"accelerate's prepare\(loader\).*itself"):
        next(iter(prepared))
    assert sum(len(b) for b in loader) == 8  # ours, iterated as it is
