"""The reusable save/load check, in the spirit of torchdata's run_test_save_load_state.

``check_save_load`` serves one epoch to every rank in lockstep, stops after
``stop_after`` steps, saves rank 0's state, builds the resumed job (possibly another
world size, batch size or worker count), loads the state on every rank and serves
the rest. It returns what each part saw so a test can assert exactly-once delivery
and equality with an uninterrupted run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from unbroken.data import DataLoader


def flatten(batch: Any) -> list[Any]:
    if hasattr(batch, "tolist"):
        return batch.tolist()
    if isinstance(batch, (list, tuple)) and batch and hasattr(batch[0], "tolist"):
        # default_collate of tuples: a tuple of tensors, one per field
        return list(zip(*(f.tolist() for f in batch)))
    return list(batch)


def serve(loaders: Sequence[DataLoader], steps: int | None = None) -> list[list[Any]]:
    """Step every rank's loader in lockstep; per rank, the samples it saw in order."""
    its = [iter(ld) for ld in loaders]
    seen: list[list[Any]] = [[] for _ in loaders]
    step = 0
    while steps is None or step < steps:
        batches = [next(it, None) for it in its]
        if all(b is None for b in batches):
            break
        assert all(b is not None for b in batches), "ranks fell out of lockstep"
        for r, b in enumerate(batches):
            seen[r].extend(flatten(b))
        step += 1
    return seen


def same_state(loaders: Sequence[DataLoader]) -> dict:
    states = [ld.state_dict() for ld in loaders]
    assert all(s == states[0] for s in states), f"ranks disagree on the position: {states}"
    return states[0]


@dataclass
class SaveLoadRun:
    before: list[list[Any]]
    """Per rank of the first job: samples served before the save."""
    state: dict
    after: list[list[Any]]
    """Per rank of the resumed job: samples served after the load."""

    @property
    def all_samples(self) -> list[Any]:
        return [s for rank in self.before + self.after for s in rank]


def check_save_load(
    make_job: Callable[[], list[DataLoader]],
    make_resumed: Callable[[], list[DataLoader]],
    stop_after: int,
    *,
    key: Callable[[Any], Any] = lambda s: s,
) -> SaveLoadRun:
    """Stop after ``stop_after`` steps, resume elsewhere; assert nothing is seen twice."""
    job = make_job()
    before = serve(job, stop_after)
    state = same_state(job)
    resumed = make_resumed()
    for ld in resumed:
        ld.load_state_dict(state)
    after = serve(resumed)
    run = SaveLoadRun(before, state, after)
    counts = Counter(key(s) for s in run.all_samples)
    twice = [k for k, c in counts.items() if c > 1]
    assert not twice, f"samples served twice across the restart: {twice}"
    return run
