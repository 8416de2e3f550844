"""Arithmetic of the interleaved save probe (bench/checkpoint/pairs.py); pure, no I/O.

A pair is two blocks of training steps from one job: one with a save issued after its
first step, one without. Per step position, the block with the save minus the block
without is what the save cost that step; averaged over pairs, with a standard error.

The first step's difference is not the save's: all of that step but the save call ran
before the save existed. So every figure counts from the call: the call's own seconds,
then the differences of the steps after it (in flight: those that started before the
commit; the whole block: all of them, so in flight plus after the commit).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Pair:
    """One pair's per-step seconds, position by position."""

    with_save: tuple[float, ...]
    """The block whose first step ends with the save call."""
    without: tuple[float, ...]
    """The block without a save (same number of steps)."""
    in_flight: int
    """Leading steps of ``with_save`` that ran while the save was in flight (the first
    one, which makes the save call, included)."""
    call: float = 0.0
    """Seconds the save call itself took, at the end of the first step."""

    def __post_init__(self) -> None:
        if len(self.with_save) != len(self.without) or not self.with_save:
            raise ValueError(
                f"a pair needs two blocks of the same, nonzero length; got "
                f"{len(self.with_save)} and {len(self.without)} steps"
            )
        if not 1 <= self.in_flight <= len(self.with_save):
            raise ValueError(f"in_flight must be 1..{len(self.with_save)}, got {self.in_flight}")

    @property
    def deltas(self) -> list[float]:
        return [a - b for a, b in zip(self.with_save, self.without)]


@dataclass(frozen=True)
class Estimate:
    """A mean over pairs, its standard error (None from a single pair), and the median:
    one pair disturbed by something else on the machine moves the mean, not the median."""

    mean: float
    se: float | None
    median: float
    n: int

    def __str__(self) -> str:
        se = "n/a" if self.se is None else f"{self.se:.3f}"
        return f"{self.mean:+.3f} ± {se} (median {self.median:+.3f})"


def estimate(values: Sequence[float]) -> Estimate:
    if not values:
        raise ValueError("no values to estimate from")
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return Estimate(statistics.fmean(values), se, statistics.median(values), len(values))


def steps_in_flight(step_seconds: Sequence[float], save_at: float, commit_s: float) -> int:
    """How many leading steps of a block started before its save committed.

    ``save_at``: seconds from the block's start to the end of the save call (the end of
    the first step); ``commit_s``: from the save call to its commit."""
    committed_at = save_at + commit_s
    started = 0.0
    count = 0
    for seconds in step_seconds:
        if started >= committed_at:
            break
        count += 1
        started += seconds
    return max(1, count)


def summarize(pairs: Sequence[Pair]) -> dict[str, Estimate | list[Estimate]]:
    """Seconds one save adds per save: while in flight, after its commit, over the block.

    Each counts from the save call: the first step's difference before the call is
    noise (module docstring). ``per_position`` is the mean difference at each step
    position, the first one whole."""
    if not pairs:
        raise ValueError("no pairs to summarize")
    width = len(pairs[0].with_save)
    if any(len(p.with_save) != width for p in pairs):
        raise ValueError("every pair's blocks must have the same number of steps")
    deltas = [p.deltas for p in pairs]
    return {
        "in_flight": estimate([p.call + sum(d[1 : p.in_flight]) for d, p in zip(deltas, pairs)]),
        "after_commit": estimate([sum(d[p.in_flight :]) for d, p in zip(deltas, pairs)]),
        "whole_block": estimate([p.call + sum(d[1:]) for d, p in zip(deltas, pairs)]),
        "per_position": [estimate([d[i] for d in deltas]) for i in range(width)],
    }


def _rounds(records: Sequence[dict]) -> dict[int, dict[str, dict]]:
    """The records by pair index, then by kind."""
    blocks: dict[int, dict[str, dict]] = {}
    for rec in records:
        blocks.setdefault(int(rec["pair"]), {})[rec["kind"]] = rec
    return blocks


def whole_rounds(records: Sequence[dict]) -> list[dict]:
    """The records of the rounds that hold a block of every kind in the log: a report then
    compares every way of saving over the same rounds (a job stopped mid-round leaves
    its last one short)."""
    kinds = {rec["kind"] for rec in records}
    whole = {index for index, group in _rounds(records).items() if set(group) == kinds}
    return [rec for rec in records if int(rec["pair"]) in whole]


def pairs_from_records(records: Sequence[dict], skip: int = 1, kind: str = "save") -> list[Pair]:
    """Pairs of ``kind``'s block and the block without a save from the probe's JSON
    records (one per block), dropping the first ``skip`` pairs (the job's first blocks run
    while the machine settles). A pair is one index: every kind's block of one round."""
    blocks = _rounds(records)
    pairs = []
    for index in sorted(blocks):
        group = blocks[index]
        if index < skip or kind not in group or "none" not in group:
            continue
        save = group[kind]
        if save.get("commit") is None or save.get("save_at") is None:
            raise ValueError(f"pair {index}: its {kind} has no save or commit time (it failed?)")
        pairs.append(
            Pair(
                tuple(save["steps"]),
                tuple(group["none"]["steps"]),
                steps_in_flight(save["steps"], save["save_at"], save["commit"]),
                float(save.get("call") or 0.0),  # logs before the call was timed: none
            )
        )
    return pairs


def difference(records: Sequence[dict], skip: int, kind: str, other: str) -> Estimate:
    """Whole-block seconds of ``kind`` minus ``other``, round by round: two ways of saving
    compared directly, over the rounds that hold both (``whole_rounds`` first, for the
    same rounds as the pairs)."""
    blocks = _rounds(records)
    return estimate(
        [
            from_the_call(group[kind]) - from_the_call(group[other])
            for index, group in sorted(blocks.items())
            if index >= skip and kind in group and other in group
        ]
    )


def from_the_call(record: dict) -> float:
    """A block's seconds from its save call on: the call, then every later step."""
    return float(record.get("call") or 0.0) + sum(record["steps"][1:])
