"""``every_seconds="auto"``: keep the save interval at the Young/Daly optimum, measured.

The optimum ``sqrt(2 * C * MTBF)`` needs two figures a user rarely knows: ``C``, what a
save costs the training loop (measured: the seconds the loop was blocked per save, plus
how much longer its steps took while a save ran in the background, times the steps a
save overlaps), and the job's mean time between failures (given as ``mtbf``, or
estimated from the job's own event log: the failures its earlier attempts met over the
wall time they covered). The interval is never shorter than a save takes to commit, so
saves do not queue behind each other.

The estimate is pure arithmetic (:func:`estimate_mtbf`, :func:`auto_interval`); the
:class:`Autopilot` only keeps the running figures.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from unbroken.goodput.planner import optimal_interval_seconds
from unbroken.storage import Store

log = logging.getLogger(__name__)

PRIOR_SECONDS = 3600.0
"""Before a failure has been seen, the estimate counts one failure per this much wall
time on top of what was observed: a job starts out assuming an hourly failure, and the
estimate grows as it runs without one (a large fleet's per-job rate is of that order:
8.6 interruptions a day is one every 2.8 hours)."""

FIRST_INTERVAL = 10.0
"""Seconds to the first save, before any save has been measured."""

MIN_INTERVAL = 1.0
"""The shortest interval chosen, whatever the measured cost."""


def estimate_mtbf(observed_seconds: float, failures: int, *, prior: float = PRIOR_SECONDS) -> float:
    """Mean time between failures from ``failures`` over ``observed_seconds`` of wall time,
    with one failure per ``prior`` seconds added as a prior (never infinite, never 0)."""
    if observed_seconds < 0 or failures < 0:
        raise ValueError("observed seconds and failures must be >= 0")
    return (observed_seconds + prior) / (failures + 1)


def auto_interval(
    save_cost: float | None, commit_seconds: float | None, mtbf: float
) -> float:
    """The interval to save at: Young/Daly from ``save_cost`` (loop seconds per save) and
    ``mtbf``, never under the time a save takes to commit nor under ``MIN_INTERVAL``;
    ``FIRST_INTERVAL`` before anything was measured."""
    if save_cost is None:
        return FIRST_INTERVAL
    ideal = optimal_interval_seconds(max(save_cost, 1e-6), mtbf)
    return max(ideal, commit_seconds or 0.0, MIN_INTERVAL)


@dataclass
class Autopilot:
    """The running figures behind ``every_seconds="auto"`` for one manager."""

    mtbf: float | None = None
    """A given mean time between failures (seconds); None: estimated."""
    observed_seconds: float = 0.0
    """Wall time covered by the job's earlier attempts (from its event log)."""
    failures: int = 0
    """Crashed attempts among those."""
    started: float = field(default_factory=time.monotonic)
    saves: int = 0
    blocked_seconds: float = 0.0
    commit_seconds: float | None = None
    busy_steps: int = 0
    busy_seconds: float = 0.0
    """Steps (and their seconds) taken while a save ran in the background."""
    idle_steps: int = 0
    idle_seconds: float = 0.0
    chosen: float = FIRST_INTERVAL
    """The interval now in force."""

    def current_mtbf(self) -> float:
        if self.mtbf is not None:
            return self.mtbf
        elapsed = time.monotonic() - self.started
        return estimate_mtbf(self.observed_seconds + elapsed, self.failures)

    def step(self, seconds: float, *, saving: bool) -> None:
        """One step of the loop took ``seconds``, with a save in the background or not."""
        if saving:
            self.busy_steps += 1
            self.busy_seconds += seconds
        else:
            self.idle_steps += 1
            self.idle_seconds += seconds

    def save_cost(self) -> float | None:
        """Loop seconds per save: blocked, plus the slowdown of the steps it overlapped."""
        if not self.saves:
            return None
        cost = self.blocked_seconds / self.saves
        if self.busy_steps and self.idle_steps:
            slower = self.busy_seconds / self.busy_steps - self.idle_seconds / self.idle_steps
            cost += max(0.0, slower) * self.busy_steps / self.saves
        return cost

    def saved(self, blocked_seconds: float) -> None:
        """A save's foreground cost, measured by the manager."""
        self.saves += 1
        self.blocked_seconds += blocked_seconds

    def committed(self, seconds: float | None) -> None:
        if seconds is not None and math.isfinite(seconds):
            self.commit_seconds = seconds

    def interval(self) -> float:
        """The interval to use now (recomputed from the latest figures)."""
        self.chosen = auto_interval(self.save_cost(), self.commit_seconds, self.current_mtbf())
        return self.chosen


def past_failures(store: Store, current_attempt: str | None) -> tuple[float, int]:
    """(wall seconds covered, attempts that crashed) of the job's earlier attempts, from
    the event log beside its checkpoints; (0, 0) where it has none or cannot be read."""
    from unbroken.goodput import jobs
    from unbroken.goodput.breakdown import job_breakdown
    from unbroken.goodput.events import read_log

    try:
        ends = read_log(store, ends_only=True)  # spans and endings, not every step
        attempts = job_breakdown(jobs.of_attempt(ends, current_attempt), 0).attempts
    except Exception as exc:  # a log we cannot read must not stop the job
        log.warning("every_seconds='auto': the event log could not be read (%s)", exc)
        return 0.0, 0
    earlier = [a for a in attempts if a.attempt != current_attempt]
    return sum(a.end - a.start for a in earlier), sum(1 for a in earlier if not a.clean)


def start(store: Store, group: Any, recorder: Any, mtbf: float | None) -> Autopilot:
    """An Autopilot for a new manager: the coordinator reads the job's past failures (when
    ``mtbf`` is not given) and every rank gets the same figures."""
    observed, failures = 0.0, 0
    if mtbf is None:
        if group.is_coordinator:
            attempt = getattr(getattr(recorder, "log", None), "attempt", None)
            observed, failures = past_failures(store, attempt)
        observed, failures = group.broadcast((observed, failures))
    return Autopilot(mtbf=mtbf, observed_seconds=observed, failures=failures)
