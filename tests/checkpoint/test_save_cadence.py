"""SaveCadence: when a save is due, and that no step is saved twice."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from unbroken.checkpoint import save_cadence
from unbroken.checkpoint.save_cadence import SaveCadence


def _cadence(every_steps=None, every_seconds=None, keep_every_steps=None) -> SaveCadence:
    config = SimpleNamespace(
        every_steps=every_steps, every_seconds=every_seconds, keep_every_steps=keep_every_steps
    )
    return SaveCadence(config, autopilot=None, goodput=None)


class _Clock:
    """time.monotonic as the test sets it: no test depends on how fast the machine is."""

    def __init__(self, monkeypatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr(save_cadence.time, "monotonic", lambda: self.now)


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


def test_every_seconds_counts_from_the_last_start_and_from_a_restore(monkeypatch):
    clock = _Clock(monkeypatch)
    cadence = _cadence(every_seconds=30.0)
    clock.now += 29.0
    assert not cadence.is_due(1)
    clock.now += 1.0
    assert cadence.is_due(1)
    cadence.restored(1, [])
    clock.now += 29.0
    assert not cadence.is_due(2) and not cadence.is_due(1)
    clock.now += 1.0
    assert cadence.is_due(2) and not cadence.is_due(1)
    cadence.started(2)
    assert not cadence.is_due(3)


def test_the_config_is_read_at_each_step_as_the_manager_reads_it():
    cadence = _cadence(every_steps=500)
    assert not cadence.is_due(2)
    cadence.config.every_steps = 2
    assert cadence.is_due(2)


def test_auto_without_an_autopilot_is_refused():
    with pytest.raises(ValueError, match="autopilot"):
        _cadence(every_seconds="auto")


def test_without_an_autopilot_step_timing_asks_nothing():
    cadence = _cadence(every_steps=5)

    def saving() -> bool:
        raise AssertionError("asked whether a save is in flight with no autopilot to tell")

    cadence.time_step(saving)
    cadence.blocked(0.5)


def test_a_milestone_is_due_whatever_the_cadence_and_only_once():
    cadence = _cadence(every_steps=3, keep_every_steps=5)
    assert [s for s in range(0, 16) if cadence.is_due(s)] == [3, 5, 6, 9, 10, 12, 15]
    assert [s for s in range(0, 16) if cadence.is_milestone(s)] == [5, 10, 15]
    cadence.last_step = 10  # being saved: neither due nor a milestone to wait for
    assert not cadence.is_due(10) and not cadence.is_milestone(10)
