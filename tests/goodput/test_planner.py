"""The planner reproduces the published figures."""

from __future__ import annotations

import math

import pytest

from unbroken.goodput import planner


def test_256_gpus_for_30_days_at_1_percent_afr_fail_with_19_percent():
    assert planner.failure_probability(256, 30, 0.01) == pytest.approx(0.19, abs=0.005)


def test_1024_gpus_for_30_days_at_1_percent_afr_fail_with_57_percent():
    assert planner.failure_probability(1024, 30, 0.01) == pytest.approx(0.57, abs=0.005)


def test_8_6_interruptions_a_day_with_a_2_hour_interval_give_64_percent():
    assert planner.expected_goodput(8.6, 2 * 3600) == pytest.approx(0.64, abs=0.005)


def test_8_6_interruptions_a_day_with_30_minutes_give_91_percent():
    assert planner.expected_goodput(8.6, 30 * 60) == pytest.approx(0.91, abs=0.005)


def test_save_and_restart_costs_lower_goodput():
    base = planner.expected_goodput(8.6, 1800)
    assert planner.expected_goodput(8.6, 1800, save_seconds=60) == pytest.approx(base - 60 / 1800)
    restart = planner.expected_goodput(8.6, 1800, restart_seconds=300)
    assert restart == pytest.approx(base - 8.6 * 300 / 86400)


def test_young_daly_interval_is_optimal():
    save, rate = 60.0, 8.6
    best = planner.optimal_interval_seconds(save, planner.mtbf_seconds(rate))
    assert best == pytest.approx(math.sqrt(2 * 60 * 86400 / 8.6))
    at_best = planner.expected_goodput(rate, best, save_seconds=save)
    for factor in (0.5, 0.8, 1.25, 2.0):
        assert planner.expected_goodput(rate, best * factor, save_seconds=save) < at_best


@pytest.mark.parametrize(
    "call",
    [
        lambda: planner.failure_probability(0, 30, 0.01),
        lambda: planner.failure_probability(8, -1, 0.01),
        lambda: planner.failure_probability(8, 30, 1.5),
        lambda: planner.expected_goodput(8.6, 0),
        lambda: planner.optimal_interval_seconds(0, 100),
    ],
)
def test_bad_input_is_refused(call):
    with pytest.raises(ValueError):
        call()
