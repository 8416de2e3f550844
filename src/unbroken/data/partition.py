"""Which positions of the epoch order each rank and worker serves (pure numpy).

Positions ``[start, num_samples)`` of the epoch order remain to be served (``start``
is the global position a resumed job continues from; 0 for a fresh epoch).

* Global batch ``g`` is positions ``[start + g*G, start + (g+1)*G)``, ``G = B * W``
  (batch size times world size); rank ``r`` takes the ``r``-th run of ``B`` of them.
  Every rank batch is therefore a contiguous range of positions.
* The tail that does not fill a global batch is dropped by default, the same on every
  rank. With ``drop_last=False`` it is served as one smaller last batch: each rank
  takes ``tail // W`` consecutive positions, and the last ``tail % W`` (fewer than
  the ranks) are dropped so every rank gets the same batch size and the ranks stay in
  lockstep. Nothing is ever padded or repeated.
* A rank's batches ``0..K-1`` are dealt to its DataLoader workers round-robin
  (worker ``w`` makes ``w, w+N, w+2N, ...``); torch's DataLoader collects them in that
  same round-robin order, so the training loop sees batch 0, 1, 2, ... whatever N is.
* After every rank has consumed its batch ``k``, the global position is
  ``position_after(k)``. A job resumed from position ``p`` with any world size and
  batch size partitions ``[p, num_samples)`` afresh: the positions before ``p`` were
  served before the restart, the ones after it are served after, each exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Partition:
    """How the rest of one epoch, from global position ``start``, is split."""

    num_samples: int
    """Samples in the epoch (the length of the epoch order)."""
    start: int
    """Global position the epoch continues from (samples consumed before)."""
    batch_size: int
    """Samples per rank batch."""
    world_size: int
    """Number of ranks."""
    drop_last: bool = True
    """Drop the tail that does not fill a global batch (else serve it smaller)."""

    def __post_init__(self) -> None:
        if self.num_samples < 0:
            raise ValueError(f"Partition: num_samples must be >= 0, got {self.num_samples}")
        if not 0 <= self.start <= self.num_samples:
            raise ValueError(
                f"Partition: start position {self.start} is outside the epoch "
                f"of {self.num_samples} samples"
            )
        if self.batch_size < 1:
            raise ValueError(f"Partition: batch_size must be >= 1, got {self.batch_size}")
        if self.world_size < 1:
            raise ValueError(f"Partition: world_size must be >= 1, got {self.world_size}")

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def num_full(self) -> int:
        """Global batches of full size."""
        return (self.num_samples - self.start) // self.global_batch

    @property
    def tail_per_rank(self) -> int:
        """Samples each rank gets in the smaller last batch (0: no such batch)."""
        if self.drop_last:
            return 0
        tail = self.num_samples - self.start - self.num_full * self.global_batch
        return tail // self.world_size

    @property
    def num_batches(self) -> int:
        """Batches every rank serves (the same on all ranks)."""
        return self.num_full + (1 if self.tail_per_rank else 0)

    @property
    def end(self) -> int:
        """Global position once every batch is consumed; the rest is dropped."""
        return self.start + self.num_full * self.global_batch + self.tail_per_rank * self.world_size

    def batch_range(self, k: int, rank: int) -> tuple[int, int]:
        """Positions ``[lo, hi)`` of ``rank``'s batch ``k``."""
        self._check(k, rank)
        if k < self.num_full:
            lo = self.start + k * self.global_batch + rank * self.batch_size
            return lo, lo + self.batch_size
        tail_start = self.start + self.num_full * self.global_batch
        lo = tail_start + rank * self.tail_per_rank
        return lo, lo + self.tail_per_rank

    def position_after(self, k: int) -> int:
        """Global position once every rank has consumed its batch ``k``."""
        self._check(k, 0)
        if k < self.num_full:
            return self.start + (k + 1) * self.global_batch
        return self.end

    def rank_ranges(self, rank: int) -> np.ndarray:
        """``(num_batches, 2)`` int64 array: ``[lo, hi)`` of each of ``rank``'s batches."""
        return np.array(
            [self.batch_range(k, rank) for k in range(self.num_batches)], dtype=np.int64
        ).reshape(-1, 2)

    def _check(self, k: int, rank: int) -> None:
        if not 0 <= k < self.num_batches:
            raise IndexError(f"batch {k} outside 0..{self.num_batches - 1}")
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside 0..{self.world_size - 1}")


def worker_batches(num_batches: int, worker: int, num_workers: int) -> range:
    """The rank batches worker ``worker`` of ``num_workers`` makes, in order."""
    if num_workers < 1 or not 0 <= worker < num_workers:
        raise ValueError(f"worker {worker} of {num_workers} workers")
    return range(worker, num_batches, num_workers)
