"""Lightning's and Fabric's strategies made to hand every rank's checkpoint to the plugin
(their base ``save_checkpoint`` calls it on rank 0 alone)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies import Strategy


def save_on_every_rank(strategy: Any, base: type, save_checkpoint: Callable) -> None:
    """Lightning's and Fabric's base ``Strategy.save_checkpoint`` call the plugin on rank
    0 only (its file is rank 0's to write); unbroken's save is every rank's. Strategies
    that save in a way of their own (FSDP, DeepSpeed) are refused: they bypass the plugin."""
    if type(strategy).save_checkpoint is not base.save_checkpoint:
        raise RuntimeError(
            f"UnbrokenCheckpointIO: {type(strategy).__name__} writes its checkpoints its "
            "own way; the plugin supports strategies that save through CheckpointIO "
            "(single device, DDP). With it, save the state with a CheckpointManager of "
            "your own on fabric_state(state) (unbroken.integrations.lightning; "
            "docs/integrations.md)"
        )
    strategy.save_checkpoint = types.MethodType(save_checkpoint, strategy)


def trainer_save(self: Strategy, checkpoint: Any, filepath: Any, storage_options=None) -> None:
    self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
