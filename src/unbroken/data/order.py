"""The epoch order: which sample sits at each position of an epoch (pure numpy).

The order is a function of (seed, epoch, n) only, so every rank and every worker
computes the same permutation without talking to the others, and a job restarted
years later on another numpy computes it again bit for bit: it is built from a
fixed integer hash (splitmix64) and a stable sort, never from a numpy RNG stream,
whose algorithms numpy does not promise to keep.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, element-wise on uint64 (wrapping arithmetic)."""
    z = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MUL1
        z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


def _splitmix64_int(z: int) -> int:
    """``splitmix64`` on one Python int (a few times faster than a numpy scalar)."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_seed(*parts: int) -> int:
    """One 64-bit value from a tuple of integers (seed, epoch, index, ...)."""
    h = 0x6A09E667F3BCC909
    for part in parts:
        if part < 0:
            raise ValueError(f"mix_seed: parts must be >= 0, got {parts}")
        h = _splitmix64_int(h ^ (int(part) & _MASK64))
    return h


def epoch_order(seed: int, epoch: int, n: int, *, shuffle: bool = True) -> np.ndarray:
    """Sample index at each position of the epoch: a permutation of range(n), int64.

    Identity when ``shuffle`` is False; otherwise a permutation that changes with the
    epoch and the seed. Sorting n hashed keys costs O(n log n): ~0.1 s for a million.
    """
    if n < 0:
        raise ValueError(f"epoch_order: n must be >= 0, got {n}")
    if seed < 0 or epoch < 0:
        raise ValueError(f"epoch_order: seed and epoch must be >= 0, got {seed}, {epoch}")
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    key = np.uint64(mix_seed(seed, epoch))
    keys = splitmix64(np.arange(n, dtype=np.uint64) ^ key)
    return np.argsort(keys, kind="stable").astype(np.int64)
