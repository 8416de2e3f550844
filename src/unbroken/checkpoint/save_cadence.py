"""When a save is due: every N steps, every N seconds, or at the autopilot's interval.

Kept apart from the manager because it is the one piece of state every save path reads
(``maybe_save``, ``save``, a preemption's save, a restore that moves the run's step) and
the background commit updates: which step was last started, which are committed, and
when the last save began.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from unbroken.checkpoint.config import CheckpointConfig
from unbroken.checkpoint.errors import OlderStepRestoredError, StepBehindError
from unbroken.goodput.autopilot import Autopilot

log = logging.getLogger(__name__)


class SaveCadence:
    """The steps saved so far and the clock of the next save.

    ``config``'s ``every_steps`` and ``every_seconds`` are read at each step, as the
    manager reads them. ``every_seconds="auto"`` needs ``autopilot``, which then chooses
    the interval; each change worth telling goes to ``goodput``'s event log.

    The training thread starts saves and the pipeline's thread finishes them: every
    change of :attr:`last_step` holds one lock, so a failure of an older save never
    clears the newer one.
    """

    def __init__(self, config: CheckpointConfig, autopilot: Autopilot | None, goodput: Any) -> None:
        if config.every_seconds == "auto" and autopilot is None:
            raise ValueError('SaveCadence: every_seconds="auto" needs an autopilot')
        self.config = config
        self.autopilot = autopilot
        self._goodput = goodput
        self._lock = threading.Lock()
        self.last_step: int | None = None
        """The step of the newest save started (or restored); None after it failed."""
        self.last_start = time.monotonic()
        self.committed: set[int] = set()
        self.newest: tuple[int, str] | None = None
        """The newest step this run saved or restored, and which ("saved", "restored"):
        the steps it saves after only grow."""
        self.left_newer: tuple[int, list[int]] | None = None
        """After a restore of an older step than the URL's newest: it, and the newer ones."""
        self._last_call: float | None = None

    def has(self, step: int) -> bool:
        """Whether ``step`` was already saved (or is being saved): never twice."""
        return step == self.last_step or step in self.committed

    def is_milestone(self, step: int) -> bool:
        """A step retention keeps for good (``keep_every_steps``): saved whatever the
        cadence, and never skipped for a save still in flight (it would never exist)."""
        keep = self.config.keep_every_steps
        return keep is not None and step > 0 and step % keep == 0 and not self.has(step)

    def is_due(self, step: int) -> bool:
        if self.has(step):
            return False
        every_steps = self.config.every_steps
        if every_steps is not None and step > 0 and step % every_steps == 0:
            return True
        if self.is_milestone(step):
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
        """A save of ``step`` is being handed to the background: call it before the
        hand-off, so that a save failing at once can still be tried again."""
        with self._lock:
            self.last_step, self.last_start = step, time.monotonic()
        if self.newest is None or step > self.newest[0]:
            self.newest = (step, "saved")

    def refuse_going_back(self, step: int, url: str) -> None:
        """Raise if saving ``step`` would go back: behind an older step restored on
        purpose (:attr:`left_newer`), or behind a step this run saved or restored (its
        counter went back, one counted per epoch, say). Every rank reads the same here at
        the same call, unlike :attr:`committed`, which each rank's commit fills in its own
        time."""
        if self.left_newer is not None:
            raise OlderStepRestoredError(url, *self.left_newer)
        if self.newest is not None and step < self.newest[0]:
            raise StepBehindError.in_run(step, url, *self.newest)

    def blocked(self, seconds: float) -> None:
        """The loop was blocked ``seconds`` by the save it just made."""
        if self.autopilot is not None:
            self.autopilot.saved(seconds)

    def finished(self, step: int, *, ok: bool, seconds: float | None) -> None:
        """Background thread: the save of ``step`` committed (``ok``) or failed."""
        if not ok:
            with self._lock:
                if self.last_step == step:  # a later save of this step may try again
                    self.last_step = None
            return
        self.committed.add(step)
        if self.autopilot is not None:
            self.autopilot.committed(seconds)

    def restored(self, step: int, newer: list[int]) -> None:
        """The run goes on from ``step``: it counts as saved, and the clock starts now.
        ``newer``: steps committed after it, which hold back every save."""
        self.committed.add(step)
        with self._lock:
            self.last_step, self.last_start = step, time.monotonic()
        self.newest = (step, "restored")
        self.left_newer = (step, newer) if newer else None

    def _interval(self) -> float | None:
        if self.autopilot is None:
            return self.config.every_seconds
        before = self.autopilot.chosen
        now = self.autopilot.interval()
        if abs(now - before) > 0.1 * before:  # a change worth telling
            cost = self.autopilot.save_cost()
            self._goodput.interval(now, save_cost=cost, mtbf=self.autopilot.current_mtbf())
            log.info("every_seconds='auto': saving every %.1f s", now)
        return now
