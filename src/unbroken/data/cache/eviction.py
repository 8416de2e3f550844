"""Which cached files to evict: pure functions, no I/O.

Every future access of every process on the node is known in advance (each publishes
its plan), so the cache evicts what is needed furthest in the future (Belady's rule)
instead of what was used least recently. Files no plan mentions go first, oldest
first; among planned files, the one whose next use is furthest goes first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A published cache file that may be evicted."""

    name: str
    size: int
    last_used: float
    """Modification time, refreshed on every hit: the LRU tie-breaker."""


def next_use(plans: Sequence[tuple[Sequence[str], int]]) -> dict[str, int]:
    """For each name, the fewest accesses any process still makes before reading it.

    ``plans`` holds (names in access order, cursor) per process; positions before the
    cursor are already consumed. Processes advance at about the same rate, so the
    distance from each cursor is comparable across processes.
    """
    best: dict[str, int] = {}
    for names, cursor in plans:
        seen: set[str] = set()
        for distance, name in enumerate(names[max(cursor, 0) :]):
            if name in seen:
                continue
            seen.add(name)
            if distance < best.get(name, distance + 1):
                best[name] = distance
    return best


def eviction_order(candidates: Sequence[Candidate], upcoming: Mapping[str, int]) -> list[Candidate]:
    """Candidates, best victim first: unplanned (oldest first), then furthest next use."""

    def rank(c: Candidate) -> tuple[int, float, float]:
        distance = upcoming.get(c.name)
        if distance is None:
            return (0, c.last_used, 0.0)
        return (1, -float(distance), c.last_used)

    return sorted(candidates, key=rank)


def evict_until(
    candidates: Sequence[Candidate],
    upcoming: Mapping[str, int],
    need: int,
    evict: Callable[[Candidate], bool],
) -> list[Candidate]:
    """Try victims in :func:`eviction_order` until ``need`` bytes are freed.

    ``evict(c)`` removes one file and returns False when it may not (a reader pins it,
    or it is already gone); those are skipped. Returns what was evicted, which frees
    less than ``need`` only when nothing else may go.
    """
    evicted: list[Candidate] = []
    freed = 0
    for c in eviction_order(candidates, upcoming):
        if freed >= need:
            break
        if evict(c):
            evicted.append(c)
            freed += c.size
    return evicted
