"""SaveCadence: when a save is due, and that no step is saved twice."""

from __future__ import annotations

import time

from unbroken.checkpoint.save_cadence import SaveCadence


def _cadence(every_steps=None, every_seconds=None) -> SaveCadence:
    return SaveCadence(every_steps, every_seconds, autopilot=None, goodput=None)


def test_every_steps_is_due_on_its_multiples_but_not_at_step_0():
    cadence = _cadence(every_steps=5)
    assert [s for s in range(16) if cadence.is_due(s)] == [5, 10, 15]


def test_a_step_started_or_committed_is_never_due_again():
    cadence = _cadence(every_steps=5)
    cadence.started(5)
    assert not cadence.is_due(5) and cadence.has(5)
    cadence.finished(5, ok=True, seconds=1.0)
    cadence.started(10)
    assert not cadence.is_due(5) and not cadence.is_due(10)


def test_a_failed_save_may_be_tried_again_at_the_same_step():
    cadence = _cadence(every_steps=5)
    cadence.started(5)
    cadence.finished(5, ok=False, seconds=None)
    assert cadence.is_due(5)


def test_a_failure_of_an_older_step_keeps_the_newer_one_started():
    cadence = _cadence(every_steps=5)
    cadence.started(5)
    cadence.started(10)
    cadence.finished(5, ok=False, seconds=None)
    assert not cadence.is_due(10)


def test_every_seconds_counts_from_the_last_start_and_from_a_restore():
    cadence = _cadence(every_seconds=0.05)
    assert not cadence.is_due(1)
    time.sleep(0.06)
    assert cadence.is_due(1)
    cadence.restored(1)
    assert not cadence.is_due(2) and not cadence.is_due(1)
    time.sleep(0.06)
    assert cadence.is_due(2) and not cadence.is_due(1)


def test_without_an_autopilot_step_timing_asks_nothing():
    cadence = _cadence(every_steps=5)

    def saving() -> bool:
        raise AssertionError("asked whether a save is in flight with no autopilot to tell")

    cadence.time_step(saving)
    cadence.blocked(0.5)
