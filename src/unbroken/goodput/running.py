"""The goodput of a job still running, kept current at a cost that does not grow with it.

A sink (MLflow) logs the job's goodput every few seconds for weeks. Recomputing the whole
timeline from every event kept since the start grew without bound: about 0.8 KB of rank
0's memory per step, and seconds of CPU per recompute (holding the GIL beside the
training loop) after a few hundred thousand steps. Two facts keep it bounded, and the
figure exact:

- A run of steps with nothing between them (no save, no restore) paints the same seconds
  as one step spanning them, its data waits summed: :class:`History` keeps it so. Only
  steps whose numbers an earlier attempt also ran must stay apart (a step an earlier
  attempt ran is wasted there once this attempt runs it again, so its number counts);
  beyond the newest step of any earlier attempt, numbers no longer matter.
- Past those, a stretch of steps and saves paints the same goodput as one step over the
  same span whose productive seconds are the stretch's (the rest its data wait): once
  :class:`History` holds ``FOLD_EVENTS``, it keeps such a stretch so. The categories of
  the stretch are lost (no caller reads them); its productive and total seconds are not.
- Earlier attempts are over: once this attempt has stepped past every step number they
  ran, nothing it does can change their seconds, which :class:`RunningGoodput` then keeps
  as two sums and stops recomputing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from unbroken.goodput import events as ev
from unbroken.goodput.breakdown import breakdown, productive_seconds

_PAINTED = frozenset(
    {ev.START, ev.RESTORE_BEGIN, ev.RESTORE_END, ev.SAVE_BEGIN, ev.SAVE_END, ev.STEP, ev.END}
)
"""Kinds that shape the timeline; the others (a commit, a new interval) only inform."""
_CLOSED_BY = {ev.SAVE_END: ev.SAVE_BEGIN, ev.RESTORE_END: ev.RESTORE_BEGIN}
"""The end of each interval; a step or the END closes any still open (an exception out
of the save or restore), at its own end."""
FOLD_EVENTS = 1024
"""Events a :class:`History` holds before it folds a stretch of them into one step."""
FOLD_KEEP = 16
"""The newest events a fold leaves as they are (the steps they may still merge with)."""


class History:
    """The current attempt's events, with each run of back-to-back steps kept as one."""

    def __init__(self, events: Iterable[ev.Event] = (), *, fold_events: int = FOLD_EVENTS) -> None:
        self.fold_events = fold_events
        self.merge_steps_above: int | None = None
        """Steps numbered above this are merged; None (the sink has not read the earlier
        attempts yet) merges none. Set it to the newest step any earlier attempt ran,
        or -1 where there is none."""
        self._events: list[ev.Event] = []
        self._beat: ev.Event | None = None
        self._open_step: int | None = None
        """Index of the last step while nothing that shapes the timeline followed it."""
        self._unclosed: set[str] = set()
        """Saves or restores begun and not ended: the next step ends them at its end, so
        it is merged with none (that would stretch them)."""
        self.extend(events)

    def extend(self, batch: Iterable[ev.Event]) -> None:
        for e in batch:
            if e.kind == ev.BEAT:  # only the newest bounds the attempt's end
                self._beat = e
            elif e.kind == ev.STEP and self._merges(e):
                last = self._events[self._open_step]  # type: ignore[index]
                self._events[self._open_step] = dataclasses.replace(  # type: ignore[index]
                    last, t=e.t, n=e.n, step=e.step, data_wait=last.data_wait + e.data_wait
                )
            else:
                self._events.append(e)
                if e.kind in (ev.STEP, ev.END):
                    ends_one = bool(self._unclosed)
                    self._unclosed.clear()
                    mergeable = e.kind == ev.STEP and not ends_one
                    self._open_step = len(self._events) - 1 if mergeable else None
                elif e.kind in _PAINTED:
                    self._open_step = None
                    if e.kind in _CLOSED_BY:
                        self._unclosed.discard(_CLOSED_BY[e.kind])
                    elif e.kind in _CLOSED_BY.values():
                        self._unclosed.add(e.kind)
        if len(self._events) > self.fold_events:
            self._fold()

    def _fold(self) -> None:
        """Saves keep steps apart: a run that saves every few steps grew by a few events
        a save. Fold the stretch after the newest step whose number counts (or the first
        step) up to a step ``FOLD_KEEP`` events from the end into one step."""
        if self.merge_steps_above is None:
            return
        steps = [i for i, e in enumerate(self._events) if e.kind == ev.STEP]
        counted = [i for i in steps if (self._events[i].step or 0) <= self.merge_steps_above]
        ends = [i for i in steps if i < len(self._events) - FOLD_KEEP]
        if not steps or not ends:
            return
        lo, hi = counted[-1] if counted else steps[0], ends[-1]
        stretch = self._events[lo + 1 : hi + 1]
        if len(stretch) < 2 or any(e.kind in (ev.START, ev.END) for e in stretch):
            return
        start, end = self._events[lo].t, self._events[hi].t
        productive = productive_seconds(start, stretch, end)
        self._events[lo + 1 : hi + 1] = [
            dataclasses.replace(
                self._events[hi], begin=start, data_wait=max(0.0, end - start - productive)
            )
        ]
        if self._open_step is not None:  # at hi or after it (hi is a step)
            self._open_step -= len(stretch) - 1

    def _merges(self, step: ev.Event) -> bool:
        if self._open_step is None or self.merge_steps_above is None or step.step is None:
            return False
        last = self._events[self._open_step]
        return (
            last.step is not None
            and last.step > self.merge_steps_above
            and step.begin == last.t  # back to back: no gap for "other" to fill
        )

    def events(self) -> list[ev.Event]:
        return [*self._events, *([self._beat] if self._beat is not None else [])]

    def __len__(self) -> int:
        return len(self._events) + (self._beat is not None)


def newest_step(attempts: Mapping[str, Sequence[ev.Event]]) -> int:
    """The highest step number any of ``attempts`` ran (-1 if none ran a step)."""
    return max(
        (e.step for events in attempts.values() for e in events
         if e.kind == ev.STEP and e.step is not None),
        default=-1,
    )  # fmt: skip


class RunningGoodput:
    """The job's goodput so far: its earlier attempts (settled once this one has stepped
    past them) and the current one's :class:`History`."""

    def __init__(self, attempt: str, earlier: Mapping[str, Sequence[ev.Event]]) -> None:
        self.attempt = attempt
        self._earlier = dict(earlier)
        self.earlier_newest_step = newest_step(self._earlier)
        self._settled: tuple[float, float] | None = None
        """(productive, total) seconds of the earlier attempts, once final."""

    def goodput(self, current: Sequence[ev.Event], last_step: int | None) -> float:
        """``current``: this attempt's events so far (a beat last, for its end)."""
        if self._settled is None:
            b = breakdown({**self._earlier, self.attempt: current})
            if last_step is not None and last_step > self.earlier_newest_step:
                before = [a.seconds for a in b.attempts if a.attempt != self.attempt]
                self._settled = (
                    sum(s["productive"] for s in before),
                    sum(sum(s.values()) for s in before),
                )
                self._earlier = {}
            return b.goodput
        productive, total = self._settled
        for a in breakdown({self.attempt: current}).attempts:
            productive += a.seconds["productive"]
            total += sum(a.seconds.values())
        return productive / total if total > 0 else 0.0
