"""Soak: many random stops and restarts with random job shapes, exactly once per epoch."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from tests.data.helpers import flatten, same_state


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(20))
def test_random_restarts_serve_each_sample_at_most_once_per_epoch(make_volume, trial):
    rng = random.Random(trial)
    n = rng.randint(20, 60)
    vol = make_volume(n)
    seen: dict[int, list[int]] = defaultdict(list)
    reached: dict[int, int] = {}  # per epoch: the global position it was left at
    state = None
    epochs = 3
    while state is None or state["epoch"] < epochs:
        world = rng.randint(1, 3)
        batch = rng.randint(1, 4)
        if batch * world > n:
            continue
        ranks = vol.ranks(world, batch_size=batch, num_workers=rng.randint(0, 2), seed=trial)
        if state is not None:
            for ld in ranks:
                ld.load_state_dict(state)
        start = (state["epoch"], state["position"]) if state else (0, 0)
        its = [iter(ld) for ld in ranks]
        for _ in range(rng.randint(1, 12)):
            batches = [next(it, None) for it in its]
            if batches[0] is None:
                assert all(b is None for b in batches)
                break
            epoch = ranks[0].epoch
            now = ranks[0].state_dict()
            if now["epoch"] == epoch:
                reached[epoch] = now["position"]
            else:  # that was the epoch's last batch for this job shape
                begin = start[1] if epoch == start[0] else 0
                reached[epoch] = ranks[0].volume.partition(begin, batch).end
            for b in batches:
                seen[epoch] += flatten(b)
        state = same_state(ranks)
        for ld in ranks:
            it = getattr(ld, "_iterator", None)
            if it is not None:
                it._shutdown_workers()
    for epoch in range(epochs):
        served = seen[epoch]
        assert len(served) == len(set(served)), f"epoch {epoch}: a sample was served twice"
        # every position before the one the epoch was left at, and only a tail after it
        # (smaller than the largest global batch, 4 x 3) that the next job shape dropped
        assert len(served) == reached[epoch], (epoch, len(served), reached[epoch], n)
        assert n - reached[epoch] < 12, (epoch, reached[epoch], n)
