"""When a save is due: every N steps, every N seconds, or at the autopilot's interval.

Kept apart from the manager because it is the one piece of state every save path reads
(``maybe_save``, ``save``, a preemption's save, a restore that moves the run's step) and
the background commit updates: which step was last started, which are committed, and
when the last save began.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from unbroken.goodput.autopilot import Autopilot

log = logging.getLogger(__name__)


class SaveCadence:
    """The steps saved so far and the clock of the next save.

    ``every_seconds`` is a number, None, or ``"auto"`` (then ``autopilot`` chooses it and
    each change worth telling goes to ``goodput``'s event log).
    """

    def __init__(
        self,
        every_steps: int | None,
        every_seconds: float | str | None,
        autopilot: Autopilot | None,
        goodput: Any,
    ) -> None:
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.autopilot = autopilot
        self._goodput = goodput
        self.last_step: int | None = None
        """The step of the newest save started (or restored); None after it failed."""
        self.last_start = time.monotonic()
        self.committed: set[int] = set()
        self._last_call: float | None = None

    def has(self, step: int) -> bool:
        """Whether ``step`` was already saved (or is being saved): never twice."""
        return step == self.last_step or step in self.committed

    def is_due(self, step: int) -> bool:
        if self.has(step):
            return False
        if self.every_steps is not None and step > 0 and step % self.every_steps == 0:
            return True
        every = self._interval()
        return every is not None and time.monotonic() - self.last_start >= every

    def time_step(self, saving: Callable[[], bool]) -> None:
        """The autopilot's view of the loop: each step's length, with a save in flight or
        not (``saving()``: how much a background save slows the steps is part of its cost)."""
        if self.autopilot is None:
            return
        now = time.monotonic()
        if self._last_call is not None:
            self.autopilot.step(now - self._last_call, saving=saving())
        self._last_call = now

    def started(self, step: int) -> None:
        """A save of ``step`` is under way (handed to the background)."""
        self.last_step, self.last_start = step, time.monotonic()

    def blocked(self, seconds: float) -> None:
        """The loop was blocked ``seconds`` by the save it just made."""
        if self.autopilot is not None:
            self.autopilot.saved(seconds)

    def finished(self, step: int, *, ok: bool, seconds: float | None) -> None:
        """Background thread: the save of ``step`` committed (``ok``) or failed."""
        if not ok:
            if self.last_step == step:  # a later save of this step may try again
                self.last_step = None
            return
        self.committed.add(step)
        if self.autopilot is not None:
            self.autopilot.committed(seconds)

    def restored(self, step: int) -> None:
        """The run goes on from ``step``: it counts as saved, and the clock starts now."""
        self.committed.add(step)
        self.last_step, self.last_start = step, time.monotonic()

    def _interval(self) -> float | None:
        if self.autopilot is None:
            return self.every_seconds  # type: ignore[return-value]
        before = self.autopilot.chosen
        now = self.autopilot.interval()
        if abs(now - before) > 0.1 * before:  # a change worth telling
            cost = self.autopilot.save_cost()
            self._goodput.interval(now, save_cost=cost, mtbf=self.autopilot.current_mtbf())
            log.info("every_seconds='auto': saving every %.1f s", now)
        return now
