"""What a worker hands the main process: one batch, tagged with where it came from.

Pairing each batch with its epoch, batch number, the global position after it and the
worker's counter deltas is what lets the loader count batches the training loop has
*consumed* (never those still sitting in prefetch queues), as torchdata's
StatefulDataLoader pairs a worker's state with the batch actually yielded.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory


class Delivery:
    """One batch (``None`` if every sample of it was skipped) and its provenance."""

    __slots__ = ("batch", "batch_id", "epoch", "generation", "position", "stats")

    def __init__(
        self,
        *,
        batch: Any,
        epoch: int,
        batch_id: int,
        position: int,
        generation: int,
        stats: dict[str, float],
    ) -> None:
        self.batch = batch
        self.epoch = epoch
        self.batch_id = batch_id
        """The rank batch number k within this (possibly resumed) epoch."""
        self.position = position
        """Global position of the epoch once every rank has consumed this batch."""
        self.generation = generation
        """Which plan (loader start or restart) this batch was made for."""
        self.stats = stats
        """Worker counter deltas since that worker's previous delivery."""

    def pin_memory(self, device: Any = None) -> Delivery:
        """torch's pin-memory thread calls this: pin the batch, keep the tags."""
        if self.batch is not None:
            self.batch = _pin_memory(self.batch, device)
        return self

    def __repr__(self) -> str:
        return (
            f"Delivery(epoch={self.epoch}, batch_id={self.batch_id}, "
            f"position={self.position}, generation={self.generation})"
        )
