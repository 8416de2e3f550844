"""Synthetic event logs: one attempt's events written as a little script of durations."""

from __future__ import annotations

from unbroken.goodput import events as ev


class AttemptWriter:
    """Builds one attempt's events on a fake clock, as the recorder would."""

    def __init__(self, start: float, *, setup: float = 0.0) -> None:
        self.t = start
        self.n = 0
        self.events: list[ev.Event] = []
        self._add(ev.START)
        self.t += setup
        self._step_begin = self.t
        self._waited = 0.0

    def _add(self, kind: str, **fields) -> None:
        self.events.append(ev.Event(kind, self.t, self.n, **fields))
        self.n += 1

    def restore(self, seconds: float, step: int | None, *, finish: bool = True) -> AttemptWriter:
        self._add(ev.RESTORE_BEGIN)
        self.t += seconds
        if finish:
            self._add(ev.RESTORE_END, step=step)
            self._step_begin, self._waited = self.t, 0.0
        return self

    def step(self, step: int, seconds: float, *, data_wait: float = 0.0) -> AttemptWriter:
        self._waited += data_wait
        self.t += seconds
        self.events.append(
            ev.Event(
                ev.STEP, self.t, self.n, step=step, begin=self._step_begin, data_wait=self._waited
            )
        )
        self.n += 1
        self._step_begin, self._waited = self.t, 0.0
        return self

    def save(self, seconds: float, *, finish: bool = True) -> AttemptWriter:
        self._add(ev.SAVE_BEGIN)
        self.t += seconds
        if finish:
            self._add(ev.SAVE_END)
        return self

    def idle(self, seconds: float) -> AttemptWriter:
        self.t += seconds
        return self

    def beat(self) -> AttemptWriter:
        self.events.append(ev.Event(ev.BEAT, self.t))
        return self

    def end(self) -> AttemptWriter:
        self._add(ev.END)
        return self
