"""How often a job fails and what a checkpoint interval costs it: pure arithmetic.

The figures a planner needs before a job starts: the chance that at least one of N GPUs
fails over D days at a given annual failure rate, the goodput to expect from an
interruption rate and a checkpoint interval, and the interval that maximises it
(Young/Daly: ``sqrt(2 * save_cost * MTBF)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

SECONDS_PER_DAY = 86_400.0
DAYS_PER_YEAR = 365.0


def failure_probability(gpus: int, days: float, afr: float) -> float:
    """P(at least one of ``gpus`` fails within ``days``), each failing independently with
    annual failure rate ``afr`` (0.01 = 1% a year)."""
    return 1.0 - (1.0 - float(afr)) ** _gpu_years(gpus, days, afr)


def expected_failures(gpus: int, days: float, afr: float) -> float:
    """The mean number of GPU failures over the job (``gpus * days / 365 * afr``)."""
    return _finite("expected failures", _gpu_years(gpus, days, afr) * float(afr))


def _gpu_years(gpus: int, days: float, afr: float) -> float:
    _need("gpus", gpus, lambda x: x > 0, "> 0")
    _need("days", days, lambda x: x >= 0, ">= 0")
    _need("afr", afr, lambda x: 0 <= x < 1, "in [0, 1)")
    return _finite("GPU-years", float(gpus) * float(days) / DAYS_PER_YEAR)


def expected_goodput(
    interruptions_per_day: float,
    interval_seconds: float,
    *,
    save_seconds: float = 0.0,
    restart_seconds: float = 0.0,
) -> float:
    """Productive fraction of wall time: each interruption loses half an interval of work
    (on average) plus ``restart_seconds``; each interval pays ``save_seconds`` blocked."""
    _need("interruptions per day", interruptions_per_day, lambda x: x >= 0, ">= 0")
    _need("interval", interval_seconds, lambda x: x > 0, "> 0 seconds")
    _need("save seconds", save_seconds, lambda x: x >= 0, ">= 0")
    _need("restart seconds", restart_seconds, lambda x: x >= 0, ">= 0")
    lost_per_day = interruptions_per_day * (interval_seconds / 2.0 + restart_seconds)
    saving = save_seconds / interval_seconds
    return min(1.0, max(0.0, 1.0 - lost_per_day / SECONDS_PER_DAY - saving))


def optimal_interval_seconds(save_seconds: float, mtbf_seconds: float) -> float:
    """Young/Daly: the checkpoint interval that minimises save cost plus lost work."""
    _need("save seconds", save_seconds, lambda x: x > 0, "> 0")
    _need("MTBF", mtbf_seconds, lambda x: x > 0, "> 0 seconds")
    return _finite("the optimal interval", math.sqrt(2.0 * save_seconds * mtbf_seconds))


def mtbf_seconds(interruptions_per_day: float) -> float:
    """Mean time between interruptions."""
    _need("interruptions per day", interruptions_per_day, lambda x: x > 0, "> 0")
    return _finite("the MTBF", SECONDS_PER_DAY / interruptions_per_day)


def _need(name: str, value: float, ok: Callable[[float], bool], what: str) -> None:
    """ValueError naming ``value`` unless it is a finite number that is ``what``: nan,
    inf and an int too large for a float are refused here, not met as an OverflowError
    or an ``inf`` figure later."""
    try:
        x = float(value)
    except OverflowError:
        raise ValueError(f"{name} is too large ({len(str(value))} digits)") from None
    if not (math.isfinite(x) and ok(x)):
        raise ValueError(f"{name} must be a finite number {what}, got {value}")


def _finite(name: str, value: float) -> float:
    """A result that overflowed is an error, never an ``inf`` handed on as a figure."""
    if not math.isfinite(value):
        raise ValueError(f"{name} overflows: an input is too large, or too small, to plan with")
    return value
