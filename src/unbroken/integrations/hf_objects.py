"""What the callback finds of a Trainer's: its objects as state entries, the dataset its
loader serves, the Trainer itself (the stock one hands its callbacks no reference), and
its state as plain values."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from transformers import TrainerState

from unbroken.data.dataset import VolumeDataset
from unbroken.data.loader import DataLoader

TRAINER_STATE_FIELDS = (
    "global_step",
    "epoch",
    "total_flos",
    "num_input_tokens_seen",
    "log_history",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
)


def volume_of(loader: Any) -> VolumeDataset | None:
    """The VolumeDataset a DataLoader (accelerate's wrappers included) serves, if any."""
    for _ in range(4):
        if isinstance(loader, VolumeDataset) or loader is None:
            return loader
        loader = getattr(loader, "dataset", None)
    return None


def entries(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The Trainer's objects as state entries: the model as the Trainer holds it (not DDP's
    wrapper), the torch optimizer and scheduler inside accelerate's wrappers, the loss
    scaler accelerate keeps beside the optimizer, and our loader."""
    entries: dict[str, Any] = {"model": kwargs["model"]}
    optimizer = kwargs.get("optimizer")
    if optimizer is not None:
        scaler = getattr(optimizer, "scaler", None)
        entries["optimizer"] = inner(optimizer, "optimizer")
        if scaler is not None:
            entries["scaler"] = scaler
    scheduler = kwargs.get("lr_scheduler")
    if scheduler is not None:
        entries["scheduler"] = inner(scheduler, "scheduler")
    loader = kwargs.get("train_dataloader")
    if isinstance(loader, DataLoader):
        entries["loader"] = loader
    return entries


def inner(wrapper: Any, attribute: str) -> Any:
    """What accelerate's AcceleratedOptimizer / AcceleratedScheduler wrap."""
    while type(wrapper).__module__.startswith("accelerate.") and hasattr(wrapper, attribute):
        wrapper = getattr(wrapper, attribute)
    return wrapper


def calling_trainer() -> Any:
    """The transformers.Trainer whose train() runs this hook, or None. The stock Trainer
    hands its callbacks no reference to itself, and it set the counters its loss average
    and throughput divide by before calling on_train_begin: left at 0, the first loss
    logged after a resume was divided by every step since 0 (a ninth of the true one)."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, transformers.Trainer):
            return candidate
        frame = frame.f_back
    return None


def trainer_state(state: TrainerState) -> dict[str, Any]:
    return {name: _plain(getattr(state, name)) for name in TRAINER_STATE_FIELDS}


def _plain(value: Any) -> Any:
    """A copy JSON gives back unchanged (log_history's entries are dicts of numbers)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def loader_epoch(loader: DataLoader) -> float:
    """The epoch as a fraction, from the loader's exact position."""
    position = loader.state_dict()
    per_epoch = len(loader) * loader.batch_size * loader.volume.world_size
    return position["epoch"] + position["position"] / max(1, per_epoch)
