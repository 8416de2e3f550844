"""Where a job's wall time went: pure arithmetic over its events.

The wall time runs from an attempt's process start to the last attempt's last event. A
run ends with an attempt that finished (closed cleanly, not preempted); an attempt after
that (the script run again) starts a new run: it is not a restart, and the idle time
between the runs is not wall time. Every second of the wall falls in exactly one
category:

- ``productive``: inside a training step (between two ``maybe_save`` calls) that no
  later attempt ran again, less its data wait and any time blocked in a save;
- ``data_wait``: the loop blocked waiting for the loader, in such a step;
- ``checkpoint_save``: the loop blocked in save/maybe_save/wait/close;
- ``checkpoint_restore``: inside ``restore()``;
- ``startup``: from the process start to the first step, restore excluded;
- ``wasted``: steps a later attempt ran again (the crash lost their work: that attempt
  restored an older checkpoint), and the partial step a crash cut short;
- ``down``: from an attempt's last event to the next attempt's process start, after a
  crash or a preemption;
- ``other``: the rest (after the last step of a clean end, gaps between steps).

Each attempt's timeline is painted with intervals in priority order (restore, then a
blocked save, then a step, then the start-up/tail background), so overlapping intervals
are never counted twice. ``goodput = productive / wall``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from unbroken.goodput import events as ev

_log = logging.getLogger(__name__)

CATEGORIES = (
    "productive",
    "data_wait",
    "checkpoint_save",
    "checkpoint_restore",
    "startup",
    "wasted",
    "down",
    "other",
)

_RESTORE, _SAVE, _STEP, _BASE = 4, 3, 2, 1
"""Painting priorities: the higher wins where intervals overlap."""


@dataclass(frozen=True)
class Segment:
    """A stretch of one category in one attempt's lane (down: the failed attempt's)."""

    begin: float
    end: float
    category: str
    attempt: str


@dataclass
class AttemptSummary:
    """One attempt of the job on one rank."""

    attempt: str
    start: float
    end: float
    """Its last event (clipped to the next attempt's start)."""
    clean: bool
    """Ended by close(); False for a crash (or a log whose tail was lost)."""
    seconds: dict[str, float]
    """By category, the down time after it included."""
    steps: int
    wasted_steps: int
    """Its steps that a later attempt ran again."""
    first_step: int | None
    last_step: int | None
    restored_step: int | None
    new_run: bool = False
    """The first attempt, or one after an attempt that finished: not a restart."""
    stand_in_rank: int | None = None
    """This rank left no event in this attempt; the rank whose events prove it."""
    preempted: bool = False
    """Ended cleanly by a preemption's save (SIGTERM), the job not done."""

    @property
    def goodput(self) -> float:
        total = sum(self.seconds.values())
        return self.seconds["productive"] / total if total > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "start": self.start,
            "end": self.end,
            "clean": self.clean,
            "goodput": self.goodput,
            "seconds": dict(self.seconds),
            "steps": self.steps,
            "wasted_steps": self.wasted_steps,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "restored_step": self.restored_step,
            "new_run": self.new_run,
            "stand_in_rank": self.stand_in_rank,
            "preempted": self.preempted,
        }


@dataclass
class Breakdown:
    """One rank's timeline over every attempt, or the job's (``rank`` None)."""

    rank: int | None
    wall_seconds: float
    seconds: dict[str, float]
    attempts: list[AttemptSummary]
    segments: list[Segment] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def restarts(self) -> int:
        """Attempts after a crash or a preemption."""
        return sum(1 for a in self.attempts if not a.new_run)

    @property
    def runs(self) -> int:
        """Runs of the job: a finished one run again is a new run, not a restart."""
        return sum(1 for a in self.attempts if a.new_run)

    @property
    def steps(self) -> int:
        return sum(a.steps for a in self.attempts)

    @property
    def wasted_steps(self) -> int:
        return sum(a.wasted_steps for a in self.attempts)

    def as_dict(self) -> dict[str, Any]:
        return {
            "goodput": self.goodput,
            "wall_seconds": self.wall_seconds,
            "restarts": self.restarts,
            "runs": self.runs,
            "steps": self.steps,
            "wasted_steps": self.wasted_steps,
            "rank": self.rank,
            "seconds": dict(self.seconds),
            "attempts": [a.as_dict() for a in self.attempts],
        }


def job_breakdown(
    log: Mapping[str, Mapping[int, Sequence[ev.Event]]], rank: int | None = None
) -> Breakdown:
    """The breakdown of ``rank``'s timeline (``log`` as ``events.read_log`` returns it);
    None: the job's, each attempt as told by the rank whose log reaches its furthest
    step. A rank SIGKILLed loses its last second of events, and with them the steps a
    restart redoes: told by that rank alone, a crash wasted nothing.

    An attempt in which ``rank`` left no event (it died before its first write, on a node
    never used again), or lost its START (its first object emptied or deleted), still
    happened: the lowest rank with a START stands in for it (in data-parallel training
    every rank runs the same steps)."""
    if rank is None:
        return breakdown({a: job_events(ranks) for a, ranks in log.items() if ranks}, rank=None)
    if not any(rank in ranks for ranks in log.values()):
        return breakdown({}, rank=rank)
    chosen: dict[str, Sequence[ev.Event]] = {}
    stand_in: dict[str, int] = {}
    for attempt, ranks in log.items():
        if _has_start(ranks.get(rank)):
            chosen[attempt] = ranks[rank]
            continue
        other = min((r for r, events in ranks.items() if _has_start(events)), default=None)
        if other is None and ranks.get(rank):  # no rank has its start: its own, as it is
            _log.warning("goodput: attempt %s: no rank's log has its start", attempt)
            chosen[attempt] = ranks[rank]
            continue
        if other is None:
            other = min((r for r, events in ranks.items() if events), default=None)
        if other is not None:
            if ranks.get(rank):  # events, but not their beginning: worth a word
                _log.warning("goodput: attempt %s: rank %d's log has lost its start; rank %d's "
                             "stands in", attempt, rank, other)  # fmt: skip
            chosen[attempt], stand_in[attempt] = ranks[other], other
    return breakdown(chosen, rank=rank, stand_in=stand_in)


def job_events(ranks: Mapping[int, Sequence[ev.Event]]) -> Sequence[ev.Event]:
    """One attempt as the job saw it: the events of the rank (one with its START, where
    any has it) that reach the highest step, then the latest moment; without its END
    where a rank that started has none (that rank died: the attempt did not end clean)."""
    started = {r: e for r, e in ranks.items() if _has_start(e)} or ranks

    def reach(r: int) -> tuple[int, float, int]:
        events = started[r]
        steps = [e.step for e in events if e.kind == ev.STEP and e.step is not None]
        return (max(steps, default=-1), max((e.t for e in events), default=0.0), -r)

    told = started[max(started, key=reach)]
    if all(any(e.kind == ev.END for e in events) for events in started.values()):
        return told
    return [e for e in told if e.kind != ev.END]


def _has_start(events: Sequence[ev.Event] | None) -> bool:
    return bool(events) and any(e.kind == ev.START for e in events)  # type: ignore[union-attr]


def per_rank(log: Mapping[str, Mapping[int, Sequence[ev.Event]]]) -> dict[int, Breakdown]:
    ranks = sorted({r for by_rank in log.values() for r in by_rank})
    return {r: job_breakdown(log, r) for r in ranks}


def breakdown(
    attempts: Mapping[str, Sequence[ev.Event]],
    *,
    rank: int | None = 0,
    stand_in: Mapping[str, int] | None = None,
) -> Breakdown:
    """One rank's attempts (``{attempt id: its events}``), ordered by their start;
    ``stand_in``: the attempts whose events are another rank's (see job_breakdown)."""
    parsed = sorted(
        (_Attempt(name, events) for name, events in attempts.items() if events),
        key=lambda a: (a.start, a.name),
    )
    totals = dict.fromkeys(CATEGORIES, 0.0)
    if not parsed:
        return Breakdown(rank, 0.0, totals, [])
    # The last attempt to run each step number: an earlier attempt's run of it was lost.
    last_run = {s.step: i for i, att in enumerate(parsed) for s in att.steps}
    summaries: list[AttemptSummary] = []
    segments: list[Segment] = []
    wall = 0.0
    run_start = parsed[0].start
    for i, att in enumerate(parsed):
        nxt = parsed[i + 1] if i + 1 < len(parsed) else None
        end = max(att.start, min(att.end, nxt.start) if nxt is not None else att.end)
        redone = {s.step for s in att.steps if last_run[s.step] > i}
        pieces = att.paint(end, redone)
        if nxt is not None and nxt.start > end and not att.finished:
            pieces.append(Segment(end, nxt.start, "down", att.name))
        seconds = dict.fromkeys(CATEGORIES, 0.0)
        for p in pieces:
            seconds[p.category] += p.end - p.begin
        for k, v in seconds.items():
            totals[k] += v
        segments.extend(pieces)
        numbers = [s.step for s in att.steps]
        summaries.append(
            AttemptSummary(
                attempt=att.name,
                start=att.start,
                end=end,
                clean=att.clean,
                seconds=seconds,
                steps=len(att.steps),
                wasted_steps=sum(1 for n in numbers if n in redone),
                first_step=numbers[0] if numbers else None,
                last_step=numbers[-1] if numbers else None,
                restored_step=att.restored_step,
                new_run=i == 0 or parsed[i - 1].finished,
                stand_in_rank=(stand_in or {}).get(att.name),
                preempted=att.clean and not att.finished,
            )
        )
        if nxt is None or att.finished:  # the run ends here
            wall += end - run_start
            if nxt is not None:
                run_start = nxt.start
    return Breakdown(rank, wall, totals, summaries, segments)


class _Attempt:
    """One attempt's events, sorted, with what the painting needs."""

    def __init__(self, name: str, events: Sequence[ev.Event]) -> None:
        self.name = name
        self.events = sorted(events, key=lambda e: (e.n < 0, e.n, e.t))
        head = next((e for e in self.events if e.kind == ev.START), None)
        self.start = head.t if head is not None else min(e.t for e in self.events)
        # The START was written when the recorder started: the process lived until then.
        alive = head.info.get("recorder_t") if head is not None else None
        if isinstance(alive, bool) or not isinstance(alive, float) or not math.isfinite(alive):
            alive = self.start
        self.end = max(self.start, alive, *(e.t for e in self.events))
        ends = [e for e in self.events if e.kind == ev.END]
        self.clean = bool(ends)
        self.finished = self.clean and not any(e.info.get("preempted") for e in ends)
        """Closed cleanly and not preempted: the job was done (a later attempt is a new run)."""
        self.steps = [e for e in self.events if e.kind == ev.STEP and e.step is not None]
        restored = [e for e in self.events if e.kind == ev.RESTORE_END]
        self.restored_step = restored[-1].step if restored else None

    def intervals(self, end: float) -> list[tuple[float, float, int, Any]]:
        """(begin, end, priority, key): restores, blocked saves, steps, the background."""
        out: list[tuple[float, float, int, Any]] = []
        opened: dict[str, float] = {}
        pairs = {ev.RESTORE_BEGIN: ev.RESTORE_END, ev.SAVE_BEGIN: ev.SAVE_END}
        prio = {ev.RESTORE_BEGIN: _RESTORE, ev.SAVE_BEGIN: _SAVE}
        label = {ev.RESTORE_BEGIN: "checkpoint_restore", ev.SAVE_BEGIN: "checkpoint_save"}
        for e in self.events:
            if e.kind in pairs:
                opened.setdefault(e.kind, e.t)
                continue
            for begin_kind, end_kind in pairs.items():
                # Its end, or anything that can only happen after it (an exception
                # escaped the call): a step, a restore, the end.
                closes = e.kind == end_kind or e.kind in (ev.STEP, ev.END, ev.RESTORE_BEGIN)
                if begin_kind in opened and closes:
                    b = opened.pop(begin_kind)
                    out.append((b, e.t, prio[begin_kind], label[begin_kind]))
        for begin_kind, b in opened.items():  # open at the crash: until the last event
            out.append((b, end, prio[begin_kind], label[begin_kind]))
        previous = self.start
        for i, s in enumerate(self.steps):
            b = max(previous, s.begin if s.begin is not None else previous)
            if i == 0:
                out.append((self.start, b, _BASE, "startup"))
            elif b > previous:
                out.append((previous, b, _BASE, "other"))
            out.append((b, max(b, s.t), _STEP, i))
            previous = max(b, s.t)
        if not self.steps:
            out.append((self.start, end, _BASE, "startup"))
        else:
            out.append((previous, end, _BASE, "other" if self.clean else "wasted"))
        return out

    def paint(self, end: float, redone: set[int]) -> list[Segment]:
        """This attempt's lane from its start to ``end``, every instant in one category."""
        spans = []
        for b, e, p, key in self.intervals(end):
            b, e = max(b, self.start), min(e, end)
            if e > b:
                spans.append((b, e, p, key))
        raw = _sweep(spans)
        # A step's pieces: its data wait first (the loop fetches, then computes), the rest
        # productive, or all wasted if a later attempt ran that step again.
        waits = {i: s.data_wait for i, s in enumerate(self.steps)}
        pieces: list[Segment] = []
        for b, e, key in raw:
            if not isinstance(key, int):
                pieces.append(Segment(b, e, key, self.name))
                continue
            s = self.steps[key]
            if s.step in redone:
                pieces.append(Segment(b, e, "wasted", self.name))
                continue
            w = min(waits[key], e - b)
            if w > 0:
                pieces.append(Segment(b, b + w, "data_wait", self.name))
                waits[key] -= w
            if b + w < e:
                pieces.append(Segment(b + w, e, "productive", self.name))
        return _merge(pieces)


def productive_seconds(start: float, events: Sequence[ev.Event], end: float) -> float:
    """The productive seconds ``events`` paint between ``start`` and ``end``, as a stretch of
    one attempt that nothing later runs again (before its first step: not productive)."""
    head = ev.Event(ev.START, start, min((e.n for e in events if e.n >= 0), default=0) - 1)
    pieces = _Attempt("stretch", [head, *events]).paint(end, set())
    return sum(p.end - p.begin for p in pieces if p.category == "productive")


def _sweep(spans: list[tuple[float, float, int, Any]]) -> list[tuple[float, float, Any]]:
    """Cut overlapping spans into disjoint pieces, each taken by its highest priority."""
    marks: list[tuple[float, int, int]] = []
    for idx, (b, e, _, _) in enumerate(spans):
        marks.append((b, 1, idx))
        marks.append((e, 0, idx))
    marks.sort()
    active: set[int] = set()
    out: list[tuple[float, float, Any]] = []
    x_prev: float | None = None
    i = 0
    while i < len(marks):
        x = marks[i][0]
        if x_prev is not None and x > x_prev and active:
            win = max(active, key=lambda j: (spans[j][2], j))
            key = spans[win][3]
            if out and out[-1][2] == key and out[-1][1] == x_prev:
                out[-1] = (out[-1][0], x, key)
            else:
                out.append((x_prev, x, key))
        while i < len(marks) and marks[i][0] == x:
            _, opening, idx = marks[i]
            if opening:
                active.add(idx)
            else:
                active.discard(idx)
            i += 1
        x_prev = x
    return out


def _merge(pieces: list[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for p in pieces:
        if out and out[-1].category == p.category and out[-1].end == p.begin:
            out[-1] = Segment(out[-1].begin, p.end, p.category, p.attempt)
        else:
            out.append(p)
    return out
