"""Per-sample seeding restores the caller's RNG streams and repeats per sample."""

from __future__ import annotations

import random

import numpy as np
import torch

from unbroken.data.seeding import sample_seed, seeded_for_sample


def draws():
    return torch.rand(2).tolist(), np.random.rand(2).tolist(), random.random()


def test_same_sample_same_draws_and_caller_rng_untouched():
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    expected_after = draws()
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    with seeded_for_sample(3, 2, 17):
        first = draws()
    with seeded_for_sample(3, 2, 17):
        again = draws()
    with seeded_for_sample(3, 2, 18):
        other = draws()
    assert first == again and first != other
    assert draws() == expected_after


def test_seeds_differ_by_seed_epoch_and_index():
    seeds = {sample_seed(s, e, i) for s in range(3) for e in range(3) for i in range(50)}
    assert len(seeds) == 3 * 3 * 50
