"""Hugging Face ``transformers.Trainer`` through unbroken, keeping the user's code.

- :class:`UnbrokenCallback`: ``Trainer(..., callbacks=[UnbrokenCallback("s3://b/run")])``.
  ``on_train_begin`` restores the newest committed checkpoint (model, optimizer,
  scheduler, loss scaler, the Trainer's own counters, every rank's RNG and, with our
  loader, the data position); each step's ``maybe_save`` comes once the Trainer has
  logged and evaluated the step, so the manager's cadence, preemption (SIGTERM),
  goodput and MLflow work as in a loop of one's own.
- :class:`Trainer`: ``transformers.Trainer`` that serves a :class:`~unbroken.VolumeDataset`
  through :class:`~unbroken.DataLoader` (the exact global data position) instead of a
  torch DataLoader that accelerate re-shards and a resume fast-forwards batch by batch.

The Trainer's own checkpoints (``output_dir/checkpoint-*``: pickles written while the loop
waits) are switched off while the callback saves; ``keep_trainer_checkpoints=True`` keeps
them, for a hub export say, or for ``load_best_model_at_end``, which loads the best of them.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

try:
    import transformers
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError(
        "unbroken.integrations.hf needs transformers: pip install 'unbroken[hf]'"
    ) from e

import torch

from unbroken.checkpoint.config import check_option_names
from unbroken.checkpoint.manager import CheckpointManager
from unbroken.checkpoint.staging import step_gate
from unbroken.data.dataset import VolumeDataset
from unbroken.data.loader import DataLoader
from unbroken.integrations.hf_objects import (
    TRAINER_STATE_FIELDS,
    calling_trainer,
    entries,
    loader_epoch,
    trainer_state,
    volume_of,
)
from unbroken.integrations.live_state import LiveState

log = logging.getLogger(__name__)

__all__ = ["TRAINER_STATE_FIELDS", "Trainer", "UnbrokenCallback"]

"""The parts of ``TrainerState`` a resume needs (counters, logs, best metric), saved as
plain values; the rest (``max_steps``, ``logging_steps``, ...) comes from the arguments."""


class UnbrokenCallback(TrainerCallback):
    """Checkpoints of a ``transformers.Trainer`` through a :class:`CheckpointManager`.

    ``target`` is the manager's URL (the manager is made at ``on_train_begin``, on every
    rank, once the Trainer has joined the process group) or a manager of one's own.
    ``manager_options`` go to ``CheckpointManager``. Without ``every_steps`` or
    ``every_seconds`` the Trainer's ``save_strategy`` sets the cadence: ``"steps"`` every
    ``save_steps`` (a ratio too), ``"epoch"`` at each epoch's end, ``"no"`` only on
    preemption and at the end of training.
    """

    def __init__(
        self,
        target: str | os.PathLike | CheckpointManager,
        *,
        keep_trainer_checkpoints: bool = False,
        **manager_options: Any,
    ) -> None:
        if isinstance(target, CheckpointManager):
            if manager_options:
                raise TypeError(
                    "UnbrokenCallback: manager options "
                    f"{sorted(manager_options)} apply only when it makes the manager (give a URL)"
                )
        elif not isinstance(target, (str, os.PathLike)):
            raise TypeError(
                "UnbrokenCallback: target must be a checkpoint URL or path, or a "
                f"CheckpointManager; got {type(target).__name__} {target!r}"
            )
        else:  # a misspelt option is refused here, not once train() has begun
            check_option_names(manager_options, "UnbrokenCallback")
        self.manager: CheckpointManager | None = (
            target if isinstance(target, CheckpointManager) else None
        )
        self._url = None if self.manager is not None else target
        self._owns_manager = self.manager is None
        self._options = manager_options
        self.keep_trainer_checkpoints = keep_trainer_checkpoints
        self.trainer: transformers.Trainer | None = None
        """Set by :class:`Trainer`: lets a restore reset its logging counters too."""
        self.restored_step: int | None = None
        """The step ``on_train_begin`` restored, or None (a fresh start)."""
        self._entries: dict[str, Any] = {}
        self._loader: DataLoader | None = None
        self._save_at_epoch_end = False
        self._load_best = False
        self._pending: list[tuple[Callable[[], None], str]] = []
        """Saves put off until the Trainer has logged and evaluated the step, each with
        the hook that makes it ("trainer", "evaluate", "log", "epoch_end")."""

    # -- the Trainer's events --------------------------------------------------------

    def on_init_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Refuse, as the Trainer is made, arguments this callback would silently defeat,
        and a second UnbrokenCallback (two managers on one staging dir: the second closes
        the first, whose next save then fails as "closed")."""
        self._check_arguments(args)
        self._refuse_a_second(self.trainer or calling_trainer())

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Restore the newest committed checkpoint into the Trainer's objects."""
        self._check_arguments(args)
        self._refuse_a_second(self.trainer or calling_trainer())  # add_callback() since
        self._load_best = bool(args.load_best_model_at_end)
        if state.global_step > 0:  # the Trainer loaded a checkpoint-N of its own
            raise RuntimeError(
                f"transformers.Trainer resumed its own checkpoint (step {state.global_step}) "
                "before UnbrokenCallback could restore: drop train(resume_from_checkpoint=...)."
                " UnbrokenCallback restores the newest committed step itself, and the "
                "Trainer would skip batches for its own step on top of it"
            )
        if self.manager is None:
            options = self._manager_options(args, state)
            self.manager = CheckpointManager(self._url, **options)  # type: ignore[arg-type]
        self._entries = entries(kwargs)
        loader = kwargs.get("train_dataloader")
        self._loader = loader if isinstance(loader, DataLoader) else None
        if self._loader is None and volume_of(loader) is not None:
            warnings.warn(
                "UnbrokenCallback: transformers.Trainer serves the VolumeDataset through its "
                "own DataLoader, whose position is not saved: a resumed run replays its "
                "epoch from the start. unbroken.integrations.hf.Trainer serves it through "
                "ub.DataLoader and resumes at the exact sample",
                stacklevel=2,
            )
        saved = {**self._entries, "trainer_state": trainer_state(state)}
        self.restored_step = self.manager.restore(saved)
        if self.restored_step is None:
            return
        for name, value in saved["trainer_state"].items():
            setattr(state, name, value)
        state.global_step = self.restored_step
        trainer = self.trainer or calling_trainer()
        if trainer is not None:  # its loss average and throughput count from here
            trainer._globalstep_last_logged = self.restored_step
            trainer._initial_global_step = self.restored_step
            trainer._initial_num_input_tokens_seen = state.num_input_tokens_seen

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """``maybe_save`` after each optimizer step, once the Trainer has logged and
        evaluated it (the Trainer's state is built only when a save is due); the Trainer's
        own checkpoint is skipped unless kept."""
        # The epoch's last step: the Trainer logs and evaluates the epoch after on_epoch_end
        ended = state.epoch > 0 and abs(state.epoch - round(state.epoch)) < 1e-9
        if self._loader is not None:
            state.epoch = loader_epoch(self._loader)  # the Trainer counts from its restart
            ended = state.epoch == int(state.epoch)  # served to its end
        save = lambda: self._maybe_save(state)  # noqa: E731
        if ended or control.should_training_stop or control.should_epoch_stop:
            self._pending.append((save, "epoch_end"))
        else:
            self._after_logs(save, control)
        if not self.keep_trainer_checkpoints:
            control.should_save = False

    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """A save put off to a hook that did not come (a callback after this one switched
        the log or evaluation off) is dropped: the next step's batches are fetched by now,
        and a save of this position would skip them."""
        if self._pending:
            log.warning(
                "UnbrokenCallback: the save due at step %d was not made: the Trainer neither "
                "logged nor evaluated after it, as its control said",
                state.global_step,
            )
            self._pending = []

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        for i, (save, hook) in enumerate(self._pending):  # the evaluation switched off,
            if hook == "evaluate" and not control.should_evaluate:  # or on, since
                self._pending[i] = (save, "log")
            elif hook == "log" and control.should_evaluate:
                self._pending[i] = (save, "evaluate")
        self._save_put_off("log")

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """With ``load_best_model_at_end``, an evaluation may end the training (early
        stopping), and the Trainer then writes the best model's weights in place: the
        save in flight finishes its copy of them first (its upload goes on)."""
        self._save_put_off("evaluate")
        if args.load_best_model_at_end:
            step_gate.wait_for_copies()

    def on_epoch_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """``save_strategy="epoch"``: the save the Trainer asks for, through the manager.
        At the training's last step, its save, waited for: the Trainer's end may then
        write the model in place (``load_best_model_at_end``)."""
        assert self.manager is not None, "on_train_begin did not run"
        manager = self.manager
        last = control.should_training_stop or state.global_step >= state.max_steps

        def save() -> None:
            manager.save(state.global_step, self._live(state))
            if last:
                manager.wait()

        epoch_end = [s for s, hook in self._pending if hook == "epoch_end"]
        self._pending = [(s, hook) for s, hook in self._pending if hook != "epoch_end"]
        for put_off in epoch_end:  # the last step's: after the epoch's logs, evaluation
            self._after_logs(put_off, control)
        if last or (self._save_at_epoch_end and control.should_save):
            self._after_logs(save, control)
        if not self.keep_trainer_checkpoints:
            control.should_save = False

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Save the last step (a no-op if it is committed already) and wait for it; not
        once the Trainer loaded the best model: those weights are not the last step's."""
        assert self.manager is not None
        self._save_put_off(None)  # no batch was fetched since: its position still holds
        if not args.load_best_model_at_end:
            self.manager.save(state.global_step, self._live(state))
        if self._owns_manager:
            self.manager.close()
            self.manager = None
        else:
            self.manager.wait()

    # -- helpers -----------------------------------------------------------------------

    def _refuse_a_second(self, trainer: Any) -> None:
        """Two UnbrokenCallbacks in one Trainer: two managers on one staging dir, the
        second closing the first, whose next save then failed as "closed"."""
        handler = getattr(trainer, "callback_handler", None)
        ours = [c for c in getattr(handler, "callbacks", []) if isinstance(c, UnbrokenCallback)]
        if len(ours) > 1 and ours[0] is self:
            raise ValueError(
                f"transformers.Trainer was given {len(ours)} UnbrokenCallbacks "
                f"(for {', '.join(repr(c._url or c.manager.store.url) for c in ours)}): each "
                "would save every step through a manager of its own on one staging dir. Give "
                "it one"
            )

    @property
    def _own_cadence(self) -> bool:
        """The manager's options set a cadence (``save_strategy`` is then not followed)."""
        return bool({"every_steps", "every_seconds"} & set(self._options))

    def _check_arguments(self, args: TrainingArguments) -> None:
        if args.load_best_model_at_end and not self.keep_trainer_checkpoints:
            raise ValueError(
                "UnbrokenCallback: load_best_model_at_end=True loads the best of the "
                "Trainer's own checkpoints (output_dir/checkpoint-N), which this callback "
                "switches off: pass UnbrokenCallback(..., keep_trainer_checkpoints=True)"
            )
        if _strategy(args) == "best" and self.manager is None and not self._own_cadence:
            raise ValueError(
                "UnbrokenCallback: save_strategy='best' saves after an evaluation, where the "
                "Trainer writes its own checkpoint; give UnbrokenCallback(..., every_steps=N)"
                " for unbroken's saves (the Trainer still writes its best checkpoints)"
            )

    def _manager_options(self, args: TrainingArguments, state: TrainerState) -> dict[str, Any]:
        """The manager's options; the cadence from ``save_strategy`` where none is given."""
        options = dict(self._options)
        if self._own_cadence:
            return options
        strategy = _strategy(args)
        if strategy == "steps":  # the Trainer's own figure: a ratio of max_steps resolved
            options["every_steps"] = int(state.save_steps)
            return options
        options["every_steps"] = None  # saves at epoch ends, or only the last one
        self._save_at_epoch_end = strategy == "epoch"
        if strategy == "no":
            log.warning(
                "UnbrokenCallback: save_strategy='no' and no every_steps: unbroken saves only "
                "on preemption (SIGTERM) and at the end of training"
            )
        return options

    def _live(self, state: TrainerState) -> LiveState:
        return LiveState(self._entries, {"trainer_state": lambda: trainer_state(state)})

    def _after_logs(self, save: Callable[[], None], control: TrainerControl) -> None:
        """``save`` once the Trainer has logged and evaluated this step, as the next step
        starts from: an evaluation draws from the global RNG (its DataLoader's seed), the
        logs go into ``log_history``, and a resumed run repeats neither. With
        :class:`Trainer`, after all of it; with the Trainer of transformers, at the last
        hook the control says will come (``on_evaluate``, or ``on_log``)."""
        if self.trainer is not None:
            self._pending.append((save, "trainer"))
        elif control.should_evaluate:
            self._pending.append((save, "evaluate"))
        elif control.should_log:
            self._pending.append((save, "log"))
        else:
            save()

    def _save_put_off(self, hook: str | None) -> None:
        """Make the save put off to ``hook`` (None: whichever)."""
        due = [s for s, h in self._pending if hook is None or h == hook]
        self._pending = [(s, h) for s, h in self._pending if not (hook is None or h == hook)]
        for save in due:
            save()
        if due and self._load_best:  # the training may end here (early stopping), and
            step_gate.wait_for_copies()  # the Trainer then writes the best model in place

    def _maybe_save(self, state: TrainerState) -> None:
        assert self.manager is not None, "on_train_begin did not run"
        self.manager.maybe_save(state.global_step, self._live(state))


def _strategy(args: TrainingArguments) -> str:
    return str(getattr(args.save_strategy, "value", args.save_strategy))


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that iterates a :class:`VolumeDataset` through
    :class:`~unbroken.DataLoader`: each rank reads its part of each global batch, the
    position is exact and saved by :class:`UnbrokenCallback`, nothing is skipped or
    replayed on resume. Any other dataset gets the Trainer's own DataLoader.

    The loader keeps unbroken's defaults where the Trainer's would break exact resume:
    ``drop_last`` (ranks stay in lockstep), the order and partition of the dataset
    (``VolumeDataset(shuffle=, seed=)``), its own RNG for worker seeds.
    """

    _unbroken_loader: DataLoader | None = None

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """``resume_from_checkpoint`` is ignored, with a warning, when an
        :class:`UnbrokenCallback` restores: it restores the newest committed step by
        itself, and the Trainer's own resume would skip batches on top of it."""
        if resume_from_checkpoint and any(
            isinstance(c, UnbrokenCallback) for c in self.callback_handler.callbacks
        ):
            warnings.warn(
                f"unbroken.integrations.hf.Trainer: resume_from_checkpoint="
                f"{resume_from_checkpoint!r} ignored: UnbrokenCallback restores the newest "
                "committed step itself",
                stacklevel=2,
            )
            resume_from_checkpoint = None
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def get_train_dataloader(self) -> Any:
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, UnbrokenCallback):
                callback.trainer = self
        dataset = self.train_dataset
        if not isinstance(dataset, VolumeDataset):
            return super().get_train_dataloader()
        if self._unbroken_loader is None or self._unbroken_loader.volume is not dataset:
            args = self.args
            self._unbroken_loader = DataLoader(
                dataset,
                batch_size=self._train_batch_size,
                num_workers=args.dataloader_num_workers,
                collate_fn=self.data_collator,
                pin_memory=args.dataloader_pin_memory and torch.cuda.is_available(),
                prefetch_factor=args.dataloader_prefetch_factor,
                multiprocessing_context=args.dataloader_multiprocessing_context,
            )
        _check_accumulation(self._unbroken_loader, self.args.gradient_accumulation_steps)
        return self._unbroken_loader

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's logs, evaluation and best metric of the step, then the callback's
        save: the state the next step starts from."""
        super()._maybe_log_save_evaluate(*args, **kwargs)
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, UnbrokenCallback):
                callback._save_put_off("trainer")

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        """No batch once ``max_steps`` is reached: the Trainer decides to stop only after a
        step, so a job started again after it finished (restored at ``max_steps``) would
        train one step more."""
        if self.state.max_steps > 0 and self.state.global_step >= self.state.max_steps:
            return [], None
        return super().get_batch_samples(epoch_iterator, num_batches, device)


def _check_accumulation(loader: DataLoader, accumulation: int) -> None:
    """The Trainer counts micro-batches from its own start of an epoch: resumed mid-epoch,
    a last accumulation shorter than the others would get no optimizer step. Refuse that
    shape up front rather than fail a resume later."""
    batches = len(loader)
    if accumulation > 1 and batches % accumulation:
        raise ValueError(
            f"unbroken.integrations.hf.Trainer: gradient_accumulation_steps={accumulation} "
            f"does not divide the {batches} batches per rank of an epoch; a run resumed "
            "mid-epoch would drop the optimizer step of the epoch's last, shorter "
            "accumulation. Choose a per-device batch size or accumulation that divides it"
        )
