"""Where a ``ub.DataLoader`` stands around Lightning's epochs.

Lightning ends an epoch at ``num_training_batches`` (``limit_train_batches``), not where
the loader runs out, and on a resume counts an epoch saved at its end as finished,
leaving the loaders' saved states unloaded: both would put the loader's position one
epoch off the uninterrupted fit's. A save at an epoch's start must hold the epoch loop as
its reset leaves it, or a resume takes the new epoch for the old one, done.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from unbroken.data.loader import DataLoader


def pulls_batches(pl_module: Any) -> bool:
    """A ``training_step(self, dataloader_iter)``: Lightning hands it the iterator."""
    return is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True)


def load_positions_lightning_left(fit_loop: Any) -> None:
    """The data position of a step saved at an epoch's end (a ``ModelCheckpoint`` after
    validation): Lightning counts that epoch finished, so it is not restarting, and it
    leaves the loaders' saved states unloaded. A ``ub.DataLoader`` would then serve
    epoch 0's order again; it gets its state (the next epoch, from its start) here."""
    states = getattr(fit_loop, "_combined_loader_states_to_load", None)
    combined = getattr(fit_loop, "_combined_loader", None)
    if not states or combined is None:
        return
    stateful = [loader for loader in combined.flattened if isinstance(loader, _Stateful)]
    if len(stateful) != len(states):
        return  # Lightning's own check refuses this where it loads them
    for loader, state in zip(stateful, states):
        if isinstance(loader, DataLoader):
            loader.load_state_dict(state)
    fit_loop._combined_loader_states_to_load = []


def end_epoch_of(loaders: Any) -> None:
    """Tell each ``ub.DataLoader`` among ``loaders`` that Lightning takes no more of its
    epoch (``limit_train_batches``): a save at this batch then resumes at the next epoch,
    as the uninterrupted fit goes on. A loader served to its end is not changed."""
    if isinstance(loaders, DataLoader):
        loaders.end_epoch()
    elif isinstance(loaders, Mapping):
        for loader in loaders.values():
            end_epoch_of(loader)
    elif isinstance(loaders, (list, tuple)):
        for loader in loaders:
            end_epoch_of(loader)


def at_epoch_start(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The epoch loop's per-epoch counters as its reset at the new epoch leaves them.

    At ``on_train_epoch_start`` Lightning has begun the epoch (its ``ready`` count) but
    not yet reset the epoch loop, which still holds the last epoch's batches: resumed
    from that, the new epoch took them for done and served the next epoch's batches
    after one (a save at every_steps dividing the epoch trained on the wrong data)."""
    loops = checkpoint.get("loops", {}).get("fit_loop", {})
    for key, value in loops.items():
        if key.startswith("epoch_loop.") and isinstance(value, dict):
            _zero_current(value)
    batches = loops.get("epoch_loop.batch_progress")
    if isinstance(batches, dict) and "is_last_batch" in batches:
        batches["is_last_batch"] = False
    return checkpoint


def epochs_begun_as_started(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """An epoch started is an epoch begun (``ready >= started``), as in a fit never resumed.

    Resumed from a save at an epoch's start, Lightning sets the epoch's ``ready`` back to
    its ``completed`` count and does not count it again, so every later save of that fit
    held ``ready`` one behind ``started``: a fit resumed from one of them (its last, to
    train on with a larger max_epochs) took the ended epoch for unfinished, served one
    batch of it and skipped the next epoch."""
    loops = checkpoint.get("loops", {}).get("fit_loop", {})
    epochs = loops.get("epoch_progress") if isinstance(loops, Mapping) else None
    for part in ("total", "current"):
        counts = epochs.get(part) if isinstance(epochs, dict) else None
        if isinstance(counts, dict) and isinstance(counts.get("started"), int):
            counts["ready"] = max(counts.get("ready", 0), counts["started"])
    return checkpoint


def _zero_current(progress: dict[str, Any]) -> None:
    for key, value in progress.items():
        if key == "current" and isinstance(value, dict):
            progress[key] = dict.fromkeys(value, 0)
        elif isinstance(value, dict):
            _zero_current(value)
