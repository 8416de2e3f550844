"""How often a job fails and what a checkpoint interval costs it: pure arithmetic.

The figures a planner needs before a job starts: the chance that at least one of N GPUs
fails over D days at a given annual failure rate, the goodput to expect from an
interruption rate and a checkpoint interval, and the interval that maximises it
(Young/Daly: ``sqrt(2 * save_cost * MTBF)``).
"""

from __future__ import annotations

import math

SECONDS_PER_DAY = 86_400.0
DAYS_PER_YEAR = 365.0


def failure_probability(gpus: int, days: float, afr: float) -> float:
    """P(at least one of ``gpus`` fails within ``days``), each failing independently with
    annual failure rate ``afr`` (0.01 = 1% a year)."""
    _check(gpus > 0, f"gpus must be > 0, got {gpus}")
    _check(days >= 0, f"days must be >= 0, got {days}")
    _check(0 <= afr < 1, f"afr must be in [0, 1), got {afr}")
    gpu_years = gpus * days / DAYS_PER_YEAR
    return 1.0 - (1.0 - afr) ** gpu_years


def expected_failures(gpus: int, days: float, afr: float) -> float:
    """The mean number of GPU failures over the job (``gpus * days / 365 * afr``)."""
    return gpus * days / DAYS_PER_YEAR * afr


def expected_goodput(
    interruptions_per_day: float,
    interval_seconds: float,
    *,
    save_seconds: float = 0.0,
    restart_seconds: float = 0.0,
) -> float:
    """Productive fraction of wall time: each interruption loses half an interval of work
    (on average) plus ``restart_seconds``; each interval pays ``save_seconds`` blocked."""
    _check(interruptions_per_day >= 0, "interruptions per day must be >= 0")
    _check(interval_seconds > 0, f"interval must be > 0 seconds, got {interval_seconds}")
    _check(save_seconds >= 0 and restart_seconds >= 0, "save and restart seconds must be >= 0")
    lost_per_day = interruptions_per_day * (interval_seconds / 2.0 + restart_seconds)
    saving = save_seconds / interval_seconds
    return min(1.0, max(0.0, 1.0 - lost_per_day / SECONDS_PER_DAY - saving))


def optimal_interval_seconds(save_seconds: float, mtbf_seconds: float) -> float:
    """Young/Daly: the checkpoint interval that minimises save cost plus lost work."""
    _check(save_seconds > 0, f"save seconds must be > 0, got {save_seconds}")
    _check(mtbf_seconds > 0, f"MTBF must be > 0 seconds, got {mtbf_seconds}")
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


def mtbf_seconds(interruptions_per_day: float) -> float:
    """Mean time between interruptions."""
    _check(interruptions_per_day > 0, "interruptions per day must be > 0")
    return SECONDS_PER_DAY / interruptions_per_day


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
