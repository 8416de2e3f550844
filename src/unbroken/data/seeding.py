"""Per-sample RNG: decode and its augmentations draw from (seed, epoch, sample index);
``collate_fn`` (a batch's mixup) from (seed, epoch, the batch's position, rank).

While a sample is decoded, the global ``random``, ``numpy`` and ``torch`` (CPU) RNGs
are seeded from that triple; around each batch they are saved and put back. A random
crop of sample 17 in epoch 3 is therefore the same whatever the worker count, world
size or number of restarts, and decode running in the main process
(``num_workers=0``) leaves the training loop's RNG streams exactly where they were.
Saving and restoring once per batch, not per sample, keeps the cost near 20 us per
sample (the numpy state alone takes ~70 us to save and restore). CUDA generators are
left alone: decode runs on CPU, and touching CUDA in a forked worker is unsafe.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from unbroken.data.order import mix_seed

_SAMPLE_DOMAIN = 0x5A3B1E  # keeps sample seeds apart from the epoch-order key
_BATCH_DOMAIN = 0x5A3B1F


def batch_seed(seed: int, epoch: int, position: int, rank: int) -> int:
    """The 64-bit seed of one rank's collate of the global batch that ends at ``position``
    of ``epoch`` (a mixup's draws): the same whatever the worker count or restarts."""
    return mix_seed(_BATCH_DOMAIN, seed, epoch, position, rank)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of one sample in one epoch."""
    return mix_seed(_SAMPLE_DOMAIN, seed, epoch, index)


def seed_rngs(value: int) -> None:
    """Seed the global random / numpy / torch-CPU RNGs from one 64-bit value."""
    random.seed(value)
    # numpy's legacy seed from an int is a 32-bit init (~2 us); from an array it runs the
    # slower init_by_array (~30 us per sample between decodes, measured): fold the halves
    np.random.seed((value ^ (value >> 32)) & 0xFFFFFFFF)
    torch.default_generator.manual_seed(value & 0x7FFFFFFFFFFFFFFF)


@contextmanager
def preserved_rngs() -> Iterator[None]:
    """Whatever happens to the global RNGs inside, they are as before on exit."""
    py_state = random.getstate()
    np_state = np.random.get_state()
    torch_state = torch.default_generator.get_state()
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.default_generator.set_state(torch_state)


@contextmanager
def seeded_for_sample(seed: int, epoch: int, index: int) -> Iterator[None]:
    """RNGs seeded for ``index`` in ``epoch``, restored on exit (one sample on its own)."""
    with preserved_rngs():
        seed_rngs(sample_seed(seed, epoch, index))
        yield
