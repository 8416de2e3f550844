"""Which job each attempt in a root's event log belongs to: pure, over ``read_log``'s map.

Two jobs pointed at one checkpoint root write one event log; mixed into one timeline
their attempts clip each other to nothing and count as restarts. Every attempt's START
names its job (:func:`unbroken._util.job.job_id`): attempts with one name are one job.
An attempt without a name (a launcher that names nothing, or a log written before names
were recorded) is placed by time: one job's attempts follow one another, so unnamed
attempts that overlap in time are different jobs. Each joins the unnamed job whose last
attempt ended most recently before it started, or starts one of its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from unbroken.goodput import events as ev

Log = Mapping[str, Mapping[int, Sequence[ev.Event]]]

UNNAMED = "unnamed"
"""The names of unnamed jobs: ``unnamed-1``, ``unnamed-2``, ... by their start."""

SKEW = 1.0
"""Seconds two hosts' clocks may disagree by: an overlap that short is not one."""


@dataclass(frozen=True)
class Job:
    """One job's attempts in the log, in start order."""

    name: str
    attempts: tuple[str, ...]
    start: float
    end: float
    named: bool


def attempt_name(ranks: Mapping[int, Sequence[ev.Event]]) -> str | None:
    """The job an attempt's START events name (the lowest rank's first), or None."""
    for rank in sorted(ranks):
        for e in ranks[rank]:
            if e.kind == ev.START:
                name = e.info.get("job")
                if isinstance(name, str) and name:
                    return name
    return None


def span(ranks: Mapping[int, Sequence[ev.Event]]) -> tuple[float, float]:
    """(first START or event, last event) of an attempt over all its ranks."""
    times = [e.t for events in ranks.values() for e in events]
    starts = [e.t for events in ranks.values() for e in events if e.kind == ev.START]
    return min(starts or times), max(times)


def split(log: Log) -> list[Job]:
    """The jobs of ``log``, ordered by their first start."""
    spans = {a: span(ranks) for a, ranks in log.items() if any(ranks.values())}
    named: dict[str, list[str]] = {}
    chains: list[list[str]] = []
    for attempt in sorted(spans, key=lambda a: (spans[a][0], a)):
        name = attempt_name(log[attempt])
        if name is not None:
            named.setdefault(name, []).append(attempt)
            continue
        start = spans[attempt][0]
        ended = [c for c in chains if spans[c[-1]][1] <= start + SKEW]
        if ended:
            max(ended, key=lambda c: spans[c[-1]][1]).append(attempt)
        else:
            chains.append([attempt])
    groups = [(name, atts, True) for name, atts in named.items()]
    groups += [(f"{UNNAMED}-{i}", atts, False) for i, atts in enumerate(chains, 1)]
    jobs = [
        Job(
            name,
            tuple(atts),
            min(spans[a][0] for a in atts),
            max(spans[a][1] for a in atts),
            is_named,
        )
        for name, atts, is_named in groups
    ]
    return sorted(jobs, key=lambda j: (j.start, j.name))


def clock_overlaps(log: Log, job: Job) -> list[tuple[str, str, float]]:
    """(earlier, later, seconds) where one of ``job``'s attempts starts more than ``SKEW``
    before the one before it ended: one job's attempts follow one another, so either two
    ran at once (a replacement started during the old one's grace) or the hosts' clocks
    disagree, and its figures are off by about that much."""
    spans = [(a, span(log[a])) for a in job.attempts if any(log[a].values())]
    return [
        (a, b, end - start)
        for (a, (_, end)), (b, (start, _)) in itertools.pairwise(spans)
        if start < end - SKEW
    ]


def select(log: Log, job: Job) -> dict[str, Mapping[int, Sequence[ev.Event]]]:
    """The part of ``log`` that is ``job``'s."""
    return {a: log[a] for a in job.attempts}


def of_attempt(log: Log, attempt: str | None) -> dict[str, Mapping[int, Sequence[ev.Event]]]:
    """The part of ``log`` of the job ``attempt`` belongs to (the latest job where the
    log has no such attempt); empty for an empty log."""
    found = split(log)
    if not found:
        return {}
    mine = next((j for j in found if attempt in j.attempts), found[-1])
    return select(log, mine)
