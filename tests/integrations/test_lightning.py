"""Lightning + UnbrokenCheckpointIO: in one process (a run stopped and resumed by
fit(ckpt_path="last") equals an uninterrupted one; what needs pickle is refused; a load
unpickles nothing) and on 2 ranks under real torchrun (gloo, CPU, DDP), SIGKILLed
mid-epoch and then preempted by SIGTERM, each time restarted by --max-restarts, ending
bitwise equal to an uninterrupted run; the user's ModelCheckpoint saves through the
plugin and its folder stays unwritten."""

from __future__ import annotations

import argparse
import functools
import os
import pickle
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoint.distributed import check, torchrun, toy_volume
from tests.integrations.runs import (
    Run,
    check_killed_then_preempted,
    digest,
    launch_reference_and_faulted,
)

L = pytest.importorskip("lightning")

from tests.integrations.lightning_parts import Regressor, Volume  # noqa: E402
from unbroken.checkpoint.errors import NoCheckpointError  # noqa: E402
from unbroken.integrations import checkpoint_paths  # noqa: E402
from unbroken.integrations.checkpoint_dict import CheckpointDictError  # noqa: E402
from unbroken.integrations.lightning import UnbrokenCheckpointIO  # noqa: E402
from unbroken.storage import LocalStore  # noqa: E402

JOB = Path(__file__).with_name("_lightning_job.py")
STEPS, FILES, STEPS_PER_EPOCH = 32, 64, 16  # 64 files, 2 ranks x 2 per batch


def _launch(out: Path, volume: Path, script: Path = JOB, **kwargs) -> Run:
    return Run(check(torchrun(2, str(out), str(volume), str(STEPS), script=script, **kwargs)))


def _fit(
    tmp_path,
    volume,
    steps: int,
    *,
    every: int = 4,
    theirs: bool = False,
    limit: int | None = None,
    their_every: int | None = None,
    module: type = Regressor,
    accumulate: int = 1,
    more: tuple = (),
    epochs: int | None = None,
    data: type = Volume,
    **module_args,
) -> tuple[str, dict, int]:
    """One fit in this process, resumed from ``tmp_path/ckpt`` if anything is committed;
    the digest of the weights and optimizer state, the samples of each step (its last
    micro-batch's), and the epoch Lightning counts at the end. ``more``: callbacks after
    ours; ``epochs``: max_epochs (with ``steps=-1``, a fit Lightning counts in epochs)."""
    L.seed_everything(0, verbose=False)
    model, seen = module(**module_args), {}
    model.seen = lambda step, ids: seen.__setitem__(step, ids)
    io = UnbrokenCheckpointIO(
        tmp_path / "ckpt", staging_dir=tmp_path / "stage", every_steps=every, when_busy="wait"
    )
    callbacks = [io.callback, *more]
    if their_every:  # a ModelCheckpoint of the user's, listed first, saving through io
        theirs_cb = L.pytorch.callbacks.ModelCheckpoint(
            dirpath=tmp_path / "theirs", every_n_train_steps=their_every, save_last=True
        )
        callbacks.insert(0, theirs_cb)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, max_epochs=epochs, plugins=[io],
        callbacks=callbacks,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, limit_train_batches=limit, accumulate_grad_batches=accumulate,
    )  # fmt: skip
    if theirs:  # a torch DataLoader, shuffled, over the same samples
        loader = torch.utils.data.DataLoader(_Samples(), batch_size=4, shuffle=True)
        trainer.fit(model, train_dataloaders=loader, ckpt_path="last")
    else:
        trainer.fit(model, datamodule=data(str(volume), batch_size=4), ckpt_path="last")
    return digest(model, trainer.optimizers[0]), seen, trainer.current_epoch


def test_a_fit_stopped_and_resumed_from_last_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    volume = toy_volume(tmp_path, files=FILES)  # 16 steps an epoch of 4 samples
    reference, seen, epoch = _fit(tmp_path / "reference", volume, 22)
    _, first, _ = _fit(tmp_path / "job", volume, 7)  # stops mid-epoch; its last step is saved

    def refuse(*args, **kwargs):
        raise AssertionError("the load unpickled something")

    for module, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    resumed, rest, resumed_epoch = _fit(tmp_path / "job", volume, 22)  # through the plugin
    assert min(rest) == 8 and {**first, **rest} == seen
    assert resumed == reference
    assert resumed_epoch == epoch  # the save at the fit's end is mid-epoch, as at any step
    assert sorted(i for s in range(1, 17) for i in seen[s]) == list(range(FILES))
    assert not (tmp_path / "job" / "checkpoints").exists()  # Lightning's default folder


class _PullsBatches(Regressor):
    """A training_step that takes Lightning's dataloader_iter and fetches its batch."""

    def training_step(self, dataloader_iter):  # type: ignore[override]
        batch, idx, _ = next(dataloader_iter)
        return super().training_step(batch, idx)


@pytest.mark.parametrize(
    "saves",
    [{"every": 3}, {"every": 1000, "their_every": 3}, {"every": 3, "module": _PullsBatches}],
    ids=["ours", "theirs-first", "dataloader-iter"],
)
def test_a_fit_with_limit_train_batches_resumed_from_an_epochs_last_batch_goes_on_as_it_did(
    tmp_path, saves
):
    """3 of the 16 batches an epoch, a save every 3 steps (ours, or a ModelCheckpoint's
    listed before our callback): each at an epoch's last batch, after which Lightning
    starts the next epoch, and so must the resumed fit."""
    volume = toy_volume(tmp_path, files=FILES)
    fit = functools.partial(_fit, volume=volume, limit=3, **saves)
    reference, seen, epoch = fit(tmp_path / "reference", steps=11)
    _, first, _ = fit(tmp_path / "job", steps=6)
    resumed, rest, resumed_epoch = fit(tmp_path / "job", steps=11)
    assert min(rest) == 7 and {**first, **rest} == seen
    assert resumed == reference and resumed_epoch == epoch
    epochs = [sorted(i for s in range(e * 3 + 1, e * 3 + 4) for i in seen[s]) for e in range(3)]
    assert epochs[1] != epochs[0] and epochs[2] != epochs[1]  # each a new epoch's first batches


class _Crash(Exception):
    pass


class _CrashAt(L.pytorch.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise _Crash(self.step)


@pytest.mark.parametrize("length", ["max_epochs", "max_steps"])
def test_a_fit_in_epochs_resumed_from_a_save_at_an_epochs_end_serves_the_next_epoch(
    tmp_path, length
):
    """A ModelCheckpoint's save at epoch 0's end, then a crash: Lightning counts that
    epoch finished and did not load the loader's state, so the resumed fit served
    epoch 0's order again as epoch 1, and every epoch after was one behind. (Under
    max_steps with no validation, it resumed one batch into epoch 1's data as epoch 0's
    and served each epoch after one ahead.)"""
    volume = toy_volume(tmp_path, files=FILES)
    steps, epochs = (-1, 3) if length == "max_epochs" else (3 * STEPS_PER_EPOCH, None)

    def fit(root: Path, *crash: L.pytorch.Callback) -> tuple[str, dict, int]:
        at_epoch_end = L.pytorch.callbacks.ModelCheckpoint(root / "theirs", every_n_epochs=1)
        return _fit(root, volume, steps, every=1000, epochs=epochs, more=(at_epoch_end, *crash))

    reference, seen, epoch = fit(tmp_path / "reference")
    with pytest.raises(_Crash):
        fit(tmp_path / "job", _CrashAt(STEPS_PER_EPOCH + 2))
    resumed, rest, resumed_epoch = fit(tmp_path / "job")
    assert min(rest) == STEPS_PER_EPOCH + 1 and rest == {s: seen[s] for s in rest}
    assert resumed == reference and resumed_epoch == epoch


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_fit_resumed_from_our_save_at_an_epochs_natural_end_serves_the_next_epoch(
    tmp_path, accumulate
):
    """every_steps dividing the epoch: our save at its last step (taken at the next
    epoch's start) held the ended epoch's batch counters, and the resumed fit took the
    new epoch for done after one batch, then served the epoch after it."""
    volume = toy_volume(tmp_path, files=FILES)
    every = STEPS_PER_EPOCH // accumulate
    fit = functools.partial(_fit, volume=volume, every=every, accumulate=accumulate)
    reference, seen, epoch = fit(tmp_path / "reference", steps=every * 2 + 3)
    with pytest.raises(_Crash):
        fit(tmp_path / "job", steps=every * 2 + 3, more=(_CrashAt(every + 2),))
    resumed, rest, resumed_epoch = fit(tmp_path / "job", steps=every * 2 + 3)
    assert min(rest) == every + 1 and rest == {s: seen[s] for s in rest}
    assert resumed == reference and resumed_epoch == epoch


def test_a_longer_fit_after_a_fit_resumed_at_an_epochs_start_goes_on_as_it_did(tmp_path):
    """fit(max_epochs=2) crashed in epoch 1 and resumed from our save at its start: its
    later saves held the epoch begun one count behind (Lightning's restart), so a fit
    trained on to max_epochs=4 took epoch 1 for unfinished and skipped epoch 2."""
    volume = toy_volume(tmp_path, files=FILES)
    fit = functools.partial(_fit, volume=volume, steps=-1, every=STEPS_PER_EPOCH)
    reference, seen, epoch = fit(tmp_path / "reference", epochs=4)
    with pytest.raises(_Crash):
        fit(tmp_path / "job", epochs=2, more=(_CrashAt(STEPS_PER_EPOCH + 1),))
    fit(tmp_path / "job", epochs=2)
    resumed, rest, resumed_epoch = fit(tmp_path / "job", epochs=4)
    assert min(rest) == 2 * STEPS_PER_EPOCH + 1 and rest == {s: seen[s] for s in rest}
    assert resumed == reference and resumed_epoch == epoch


class _Validated(Regressor):
    def validation_step(self, x, idx):
        loss = (self.net(x / 255).squeeze(1) - (x / 255).mean(1)).square().mean()
        self.log("val_loss", loss)


class _ValidatedVolume(Volume):
    """Validation at each epoch's end, through a torch DataLoader: its iterator draws a
    seed from the global RNG, and dropout draws after it."""

    def val_dataloader(self):
        fixed = torch.arange(128, dtype=torch.float32).reshape(8, 16)
        return torch.utils.data.DataLoader(fixed, batch_size=4)


def test_a_save_at_an_epochs_last_step_comes_after_its_validation(tmp_path):
    """The cadence saved the epoch's last step before validation: the ModelCheckpoint's
    own save there became an alias of that state (its scores of before), and a resumed fit
    never validated the epoch and drew one number less."""
    volume = toy_volume(tmp_path, files=FILES)

    def fit(root: Path, *crash: L.pytorch.Callback) -> tuple[str, dict, dict]:
        best = L.pytorch.callbacks.ModelCheckpoint(root / "mc", monitor="val_loss", save_top_k=2)
        out = _fit(root, volume, -1, every=5, epochs=3, module=_Validated, limit=10,
                   data=_ValidatedVolume, more=(best, *crash))  # fmt: skip
        return out[0], out[1], {Path(k).name: float(v) for k, v in best.best_k_models.items()}

    reference, seen, best = fit(tmp_path / "reference")
    with pytest.raises(_Crash):
        fit(tmp_path / "job", _CrashAt(12))  # 10 batches an epoch: 10 saved, validated
    io = UnbrokenCheckpointIO(tmp_path / "job" / "ckpt", staging_dir=tmp_path / "look")
    saved = io.load_checkpoint(str(tmp_path / "job" / "ckpt" / "step-000000000010"))
    io.teardown()
    kept = [v["best_k_models"] for k, v in saved["callbacks"].items() if "ModelCheckpoint" in k]
    assert [len(k) for k in kept] == [1]  # the epoch's validation was in it
    resumed, rest, resumed_best = fit(tmp_path / "job")
    assert min(rest) == 11 and rest == {s: seen[s] for s in rest}
    assert resumed == reference and resumed_best == best


class _Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return FILES

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((16,), float(i))


def test_with_a_torch_loader_a_resume_sees_samples_twice_and_says_how_many(tmp_path):
    """What docs/integrations.md states for a loader that is not ub.DataLoader: Lightning
    starts its epoch again, reshuffled from the restored RNG. Measured: samples of the
    interrupted epoch trained on twice, and as many never reached."""
    _, seen, _ = _fit(tmp_path / "reference", None, 22, theirs=True)
    _, first, _ = _fit(tmp_path / "job", None, 7, theirs=True)
    _, rest, _ = _fit(tmp_path / "job", None, 22, theirs=True)
    assert min(rest) == 8  # the model resumed after step 7
    epoch = [i for step in range(1, 17) for i in seen[step]]
    interrupted = [i for step in range(1, 8) for i in first[step]]
    interrupted += [i for step in range(8, 17) for i in rest[step]]
    twice = len(interrupted) - len(set(interrupted))
    missed = len(set(epoch) - set(interrupted))
    assert sorted(epoch) == list(range(FILES))  # uninterrupted: each sample once
    assert [rest[s] for s in range(8, 17)] != [seen[s] for s in range(8, 17)]
    assert twice == missed == 17, (twice, missed)  # of 64; docs/integrations.md says so
    print(f"torch loader, resumed after 7 of 16 steps: {twice} samples twice, {missed} missed")


def test_what_only_pickle_could_store_is_refused_naming_it(tmp_path):
    volume = toy_volume(tmp_path, files=FILES)
    with pytest.raises(CheckpointDictError, match=r"\['hyper_parameters'\]\['extra'\] is a "
                       r"argparse.Namespace, which only pickle could store"):  # fmt: skip
        _fit(tmp_path, volume, 6, every=2, extra=argparse.Namespace(depth=3))


class _TermMidAccumulation(L.Callback):
    """SIGTERM to this process after the first micro-batch past optimizer step ``at``,
    before our callback's hook (Lightning runs checkpoint callbacks last)."""

    def __init__(self, at: int) -> None:
        self.at, self.ends_at_step = at, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, idx):
        if trainer.global_step == self.at:
            self.ends_at_step += 1
            if self.ends_at_step == 2:  # the first was the micro-batch that stepped
                os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_mid_accumulation_saves_at_the_next_optimizer_step_and_resumes_bitwise(
    tmp_path,
):
    """accumulate_grad_batches=2: a save between the two micro-batches of a step would
    resume without the first (Lightning does not save the accumulated gradients)."""
    volume = toy_volume(tmp_path, files=FILES)
    fit = functools.partial(_fit, volume=volume, every=1000, accumulate=2)
    reference, seen, epoch = fit(tmp_path / "reference", steps=10)
    with pytest.raises(SystemExit):  # the manager's preemption: saved, then the exit
        fit(tmp_path / "job", steps=10, more=(_TermMidAccumulation(at=5),))
    last = UnbrokenCheckpointIO(tmp_path / "job" / "ckpt").last_checkpoint()
    assert last is not None and "step-000000000006" in last  # not 5 and a half
    resumed, rest, resumed_epoch = fit(tmp_path / "job", steps=10)
    assert min(rest) == 7 and {s: seen[s] for s in rest} == rest
    assert resumed == reference and resumed_epoch == epoch


def _load_step(url: Path, path: str) -> int:
    """The global_step of the checkpoint ``path`` names, read by a new plugin."""
    io = UnbrokenCheckpointIO(url)
    try:
        return io.load_checkpoint(path)["global_step"]
    finally:
        io.teardown()


@pytest.mark.parametrize(
    ("theirs", "steps"),
    [({"every_n_train_steps": 4, "save_top_k": -1}, (4, 8)), ({"every_n_train_steps": 2}, ())],
    ids=["same-steps", "last-only"],
)
def test_a_model_checkpoint_path_at_a_step_already_saved_loads_that_step(tmp_path, theirs, steps):
    """A ModelCheckpoint (after our callback) saving at steps ours saved already: each of
    its paths, last.ckpt too, loads the step it was saved at, not an older one (last-only:
    last.ckpt is saved under its own name at steps 2 and 6, and named for 4 and 8)."""
    mc = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "theirs", save_last=True, **{"save_top_k": 0, **theirs}
    )
    _fit(tmp_path, toy_volume(tmp_path, files=FILES), 8, every=4, more=(mc,))
    paths = {str(tmp_path / "theirs" / f"epoch=0-step={n}.ckpt"): n for n in steps}
    assert mc.best_model_path == (max(paths) if paths else "")
    for path, step in {**paths, mc.last_model_path: 8}.items():
        assert _load_step(tmp_path / "ckpt", path) == step, path
        relative = os.path.relpath(path)  # as a user types it: Lightning takes it
        assert _load_step(tmp_path / "ckpt", relative) == step, relative
    assert not (tmp_path / "theirs").exists()


def test_a_path_model_checkpoint_removes_no_longer_loads_and_no_checkpoint_is_deleted(tmp_path):
    """save_top_k=1: Lightning removes step 4's and 8's files as it saves the next; their
    aliases go, the checkpoints stay (retention's). An alias naming a step that is not
    committed names nothing."""
    mc = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "theirs", every_n_train_steps=4)
    _fit(tmp_path, toy_volume(tmp_path, files=FILES), 12, every=4, more=(mc,))
    newest, removed = (str(tmp_path / "theirs" / f"epoch=0-step={n}.ckpt") for n in (12, 8))
    assert mc.best_model_path == newest and _load_step(tmp_path / "ckpt", newest) == 12
    with pytest.raises(NoCheckpointError, match=r"no committed .* steps at .*: \[4, 8, 12\]"):
        _load_step(tmp_path / "ckpt", removed)
    assert len(list((tmp_path / "ckpt" / checkpoint_paths.FOLDER).iterdir())) == 1  # 12's
    checkpoint_paths.record_alias(LocalStore(str(tmp_path / "ckpt")), removed, 5)
    with pytest.raises(
        NoCheckpointError, match=r"named step 5, no longer committed \(retention removed it"
    ):
        _load_step(tmp_path / "ckpt", removed)


def test_the_plugin_without_its_callback_on_one_device_is_refused_at_the_first_save(tmp_path):
    """plugins=[io] alone ran on one device with no save at every_steps, none at a
    SIGTERM, and no data position at a resume, without a word (on several ranks the
    first save was refused)."""
    io = UnbrokenCheckpointIO(tmp_path / "ckpt", staging_dir=tmp_path / "stage")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, plugins=[io], logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    volume = toy_volume(tmp_path, files=FILES)
    with pytest.raises(RuntimeError, match=r"without callbacks=\[io.callback\]"):
        trainer.fit(Regressor(), datamodule=Volume(str(volume), batch_size=4))
    io.teardown()
    assert not list((tmp_path / "ckpt").glob("step-*/manifest.json"))  # nothing committed


def test_enable_checkpointing_stays_true_and_adds_no_model_checkpoint_of_lightnings(tmp_path):
    """What the docs say about enable_checkpointing: False is refused by Lightning (the
    callback is a Checkpoint); True, the default, adds none of Lightning's beside it."""
    io = UnbrokenCheckpointIO(tmp_path / "ckpt")
    trainer = L.Trainer(accelerator="cpu", plugins=[io], callbacks=[io.callback], logger=False)
    assert trainer.checkpoint_callbacks == [io.callback]
    with pytest.raises(L.fabric.utilities.exceptions.MisconfigurationException,
                       match="enable_checkpointing=False"):  # fmt: skip
        L.Trainer(enable_checkpointing=False, plugins=[io], callbacks=[io.callback])


def test_a_misspelt_manager_option_or_a_url_of_another_type_is_refused_at_construction():
    with pytest.raises(
        TypeError, match=r"UnbrokenCheckpointIO got unknown options \['every_step'\]"
    ):
        UnbrokenCheckpointIO("ckpt", every_step=4)
    with pytest.raises(TypeError, match=r"UnbrokenCheckpointIO: url must be a str or os.PathLike"):
        UnbrokenCheckpointIO(None)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_killed_and_preempted_lightning_run_ends_bitwise_equal_to_an_uninterrupted_one(
    tmp_path,
):
    volume = toy_volume(tmp_path, files=FILES)
    reference, job = launch_reference_and_faulted(_launch, tmp_path, volume)
    check_killed_then_preempted(reference, job, STEPS, STEPS_PER_EPOCH)
    assert "Restoring states from the checkpoint path at" in job.text  # Lightning's load
    for run in ("reference", "job"):
        assert not (tmp_path / run / "lightning-checkpoints").exists()
        assert not (tmp_path / run / "checkpoints").exists()  # Lightning's default folder


def test_fabric_save_and_load_on_one_device_go_through_the_plugin(tmp_path):
    io = UnbrokenCheckpointIO(tmp_path / "ckpt", staging_dir=tmp_path / "stage")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
    model = torch.nn.Linear(4, 2)
    model, optim = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    model(torch.ones(3, 4)).sum().backward()
    optim.step()
    fabric.save(tmp_path / "fabric.ckpt", {"model": model, "optim": optim, "step": 3})
    io.manager.wait()
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model, "optim": optim, "step": 0}
    fabric.load(tmp_path / "fabric.ckpt", state)
    assert state["step"] == 3 and io.restored_step == 3
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
    assert optim.optimizer.state[next(model.parameters())]["step"] == 1
    assert not (tmp_path / "fabric.ckpt").exists()  # the name Fabric gave it, not a file
    # another run's step folder names that run's step 3, not this one's: it loaded this
    # run's step 3 without a word
    other = tmp_path / "other-run" / "step-000000000003" / "manifest.json"
    with pytest.raises(NoCheckpointError, match="other-run"):
        fabric.load(other, state)
    inside = tmp_path / "ckpt" / "step-000000000003" / "manifest.json"
    fabric.load(os.path.relpath(inside), state)  # this run's, as last_checkpoint() names it
    assert state["step"] == 3
    link = tmp_path / "scratch"  # /scratch -> /lustre/...: the same folder, spelled apart
    link.symlink_to(tmp_path / "ckpt")
    state["step"] = 0
    fabric.load(link / "step-000000000003" / "manifest.json", state)
    assert state["step"] == 3
    io.teardown()


FABRIC_JOB = Path(__file__).with_name("_fabric_job.py")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_killed_and_preempted_fabric_loop_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    """fabric.save/fabric.load through the plugin on 2 ranks (io.attach(fabric)): every
    rank saves, the restart loads the newest committed step, and Fabric's path stays
    unwritten."""
    volume = toy_volume(tmp_path, files=FILES)
    launch = functools.partial(_launch, script=FABRIC_JOB)
    reference, job = launch_reference_and_faulted(launch, tmp_path, volume)
    check_killed_then_preempted(reference, job, STEPS, STEPS_PER_EPOCH)
    for run in ("reference", "job"):
        assert not (tmp_path / run / "fabric-checkpoints").exists()


def test_a_step_that_is_not_an_int_is_named_with_its_type(tmp_path):
    io = UnbrokenCheckpointIO(tmp_path / "ckpt", staging_dir=tmp_path / "stage")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
    model = fabric.setup(torch.nn.Linear(4, 2))
    for step, name in ((np.int64(3), "int64"), (torch.tensor(3), "Tensor")):
        with pytest.raises(ValueError, match=rf"'step' is .* \({name}\); pass int\(step\)"):
            fabric.save(tmp_path / "x.ckpt", {"model": model, "step": step})
    with pytest.raises(ValueError, match=r"has no 'global_step' or 'step'"):
        fabric.save(tmp_path / "x.ckpt", {"model": model})
    io.teardown()


def test_fabric_attached_maybe_save_takes_fabric_state_and_save_keeps_its_filter(tmp_path):
    io = UnbrokenCheckpointIO(tmp_path / "ckpt", staging_dir=tmp_path / "stage", every_steps=2)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
    io.attach(fabric)
    model, optim = fabric.setup(torch.nn.Linear(4, 2), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    state = {"model": model, "optim": optim, "note": "plain values stay values"}
    for step in (1, 2, 3):  # the wrappers as they are: step 2 is due
        with torch.no_grad():
            model.weight.add_(1.0)
        assert io.maybe_save(step, lambda: state) == (step == 2)
        io.manager.wait()  # the writes above are not the optimizer's: not during a save
        if step == 2:
            at_two = model.weight.detach().clone()
    loaded = fabric.load(io.last_checkpoint())  # no state: the checkpoint, whole
    assert torch.equal(loaded["model"]["weight"], at_two) and loaded["note"] == state["note"]
    fabric.save(
        tmp_path / "x.ckpt", {**state, "step": 5}, filter={"model": lambda k, v: k != "bias"}
    )
    io.manager.wait()
    assert set(fabric.load(tmp_path / "x.ckpt")["model"]) == {"weight"}
    io.teardown()


def test_attach_refuses_a_fabric_made_without_the_plugin_and_a_strategy_that_bypasses_it(
    tmp_path,
):
    io = UnbrokenCheckpointIO(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match=r"this Fabric's checkpoint_io is TorchCheckpointIO"):
        io.attach(L.Fabric(accelerator="cpu", devices=1))

    class OwnFiles(L.fabric.strategies.SingleDeviceStrategy):  # as FSDP's and DeepSpeed's
        def save_checkpoint(self, path, state, storage_options=None, filter=None):
            torch.save(state, path)

    own = L.Fabric(strategy=OwnFiles(torch.device("cpu")), plugins=[io])
    with pytest.raises(RuntimeError, match=r"OwnFiles writes its checkpoints .*fabric_state"):
        io.attach(own)


def test_fabric_save_at_a_step_maybe_save_saved_loads_by_its_path(tmp_path):
    """The docs' Fabric loop: maybe_save saved the last step, then fabric.save names it."""
    io = UnbrokenCheckpointIO(tmp_path / "ckpt", staging_dir=tmp_path / "stage", every_steps=2)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
    io.attach(fabric)
    model = fabric.setup(torch.nn.Linear(4, 2))
    state = {"model": model, "step": 2}
    assert io.maybe_save(2, lambda: state)
    fabric.save(tmp_path / "final.ckpt", state)  # step 2: in flight, not saved again
    io.teardown()
    again = UnbrokenCheckpointIO(tmp_path / "ckpt")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[again])
    again.attach(fabric)
    fabric.load(tmp_path / "final.ckpt", {"model": fabric.setup(torch.nn.Linear(4, 2))})
    assert again.restored_step == 2
    again.teardown()


def test_a_step_folder_is_inside_the_checkpoint_root_however_the_path_is_spelled(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "lustre" / "ck").mkdir(parents=True)
    (tmp_path / "scratch").symlink_to(tmp_path / "lustre")
    for url in ("~/scratch/ck", str(tmp_path / "lustre" / "ck")):
        store = LocalStore(url)
        for path in ("~/scratch/ck/step-000000000004", f"{tmp_path}/lustre/ck/step-000000000004"):
            assert checkpoint_paths.inside(store, path), (url, path)
        assert not checkpoint_paths.inside(store, f"{tmp_path}/lustre/other/step-000000000004")


def test_a_fabric_checkpoint_loads_under_any_spelling_of_the_path_it_was_saved_under(
    tmp_path, monkeypatch
):
    """Saved through a link (or relative) and loaded by the resolved (or absolute) path,
    it was 'no committed checkpoint was saved under this path': only the load's side
    was resolved."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lustre").mkdir()
    (tmp_path / "scratch").symlink_to(tmp_path / "lustre")
    io = UnbrokenCheckpointIO(tmp_path / "ckpt", staging_dir=tmp_path / "stage")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
    model = torch.nn.Linear(4, 2)
    model, optim = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step, path in [(3, "scratch/a.ckpt"), (3, "scratch/b.ckpt"), (5, "rel.ckpt")]:
        fabric.save(path, {"model": model, "optim": optim, "step": step})  # b: an alias
        io.manager.wait()
    for path, step in [
        (tmp_path / "lustre" / "a.ckpt", 3),
        (tmp_path / "lustre" / "b.ckpt", 3),
        (tmp_path / "rel.ckpt", 5),
        ("lustre/../scratch/a.ckpt", 3),
    ]:
        state = {"model": model, "optim": optim, "step": 0}
        fabric.load(path, state)
        assert state["step"] == step, path
    io.teardown()
