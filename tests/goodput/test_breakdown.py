"""The breakdown on synthetic logs: every case of a crash, and every second counted once."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.goodput import events as ev
from unbroken.goodput.breakdown import CATEGORIES, breakdown

from .synthetic import AttemptWriter


def approx(x):
    return pytest.approx(x, abs=1e-6)


def check_sums(b):
    assert sum(b.seconds.values()) == approx(b.wall_seconds)
    for a in b.attempts:
        assert set(a.seconds) == set(CATEGORIES)


def test_a_clean_run_without_failures():
    a = AttemptWriter(1000.0, setup=5.0).restore(2.0, None)
    for s in range(1, 5):
        a.step(s, 1.0, data_wait=0.25)
    a.save(0.5).idle(0.25).end()
    b = breakdown({"a": a.events})
    check_sums(b)
    assert b.wall_seconds == approx(5 + 2 + 4 + 0.75)
    assert b.seconds["startup"] == approx(5)
    assert b.seconds["checkpoint_restore"] == approx(2)
    assert b.seconds["productive"] == approx(3)
    assert b.seconds["data_wait"] == approx(1)
    assert b.seconds["checkpoint_save"] == approx(0.5)
    assert b.seconds["other"] == approx(0.25)
    assert b.restarts == 0 and b.steps == 4 and b.wasted_steps == 0
    assert b.goodput == approx(3 / 11.75)
    assert b.attempts[0].clean


def test_a_save_inside_a_step_is_not_counted_twice():
    a = AttemptWriter(0.0).restore(1.0, None)
    a.step(1, 1.0)
    a.save(0.5)  # maybe_save(1) blocked: inside step 2's interval
    a.step(2, 1.5).end()
    b = breakdown({"a": a.events})
    check_sums(b)
    assert b.seconds["checkpoint_save"] == approx(0.5)
    assert b.seconds["productive"] == approx(2.5)
    assert b.wall_seconds == approx(4.0)


def two_attempts(crash_tail, *, restored=2, redo=(3, 4, 5, 6)):
    """Attempt 1 reaches step 4 and then crashes as crash_tail says; attempt 2 restores
    ``restored`` and runs ``redo``."""
    a1 = AttemptWriter(0.0, setup=3.0).restore(1.0, None)
    for s in range(1, 5):
        a1.step(s, 1.0)
    crash_tail(a1)
    a2 = AttemptWriter(a1.t + 10.0, setup=2.0).restore(1.5, restored)
    for s in redo:
        a2.step(s, 1.0)
    a2.end()
    return a1, a2


def test_crash_mid_step_wastes_the_redone_steps_and_the_partial_one():
    a1, a2 = two_attempts(lambda a: a.idle(0.7).beat())
    b = breakdown({"x1": a1.events, "x2": a2.events})
    check_sums(b)
    assert b.restarts == 1
    assert b.wasted_steps == 2  # steps 3 and 4 ran twice
    assert b.seconds["wasted"] == approx(2 * 1.0 + 0.7)
    assert b.seconds["down"] == approx(10.0)
    assert b.seconds["productive"] == approx(4 + 2)
    assert b.seconds["startup"] == approx(3 + 2)
    assert b.seconds["checkpoint_restore"] == approx(1 + 1.5)
    assert not b.attempts[0].clean and b.attempts[1].clean
    assert b.attempts[1].restored_step == 2


def test_crash_mid_save_counts_the_blocked_time_as_saving():
    a1, a2 = two_attempts(lambda a: a.save(0.8, finish=False).beat())
    b = breakdown({"x1": a1.events, "x2": a2.events})
    check_sums(b)
    assert b.seconds["checkpoint_save"] == approx(0.8)
    assert b.seconds["wasted"] == approx(2.0)


def test_crash_mid_restore():
    a1 = AttemptWriter(0.0, setup=1.0).restore(4.0, None, finish=False).beat()
    a2 = AttemptWriter(a1.t + 3.0, setup=1.0).restore(2.0, None).step(1, 1.0).end()
    b = breakdown({"x1": a1.events, "x2": a2.events})
    check_sums(b)
    assert b.seconds["checkpoint_restore"] == approx(6.0)
    assert b.seconds["down"] == approx(3.0)
    assert b.seconds["productive"] == approx(1.0)
    assert b.wasted_steps == 0


def test_crash_during_startup():
    a1 = AttemptWriter(0.0, setup=0.0).idle(7.0).beat()
    a2 = AttemptWriter(9.0, setup=1.0).step(1, 1.0).end()
    b = breakdown({"x1": a1.events, "x2": a2.events})
    check_sums(b)
    assert b.seconds["startup"] == approx(7.0 + 1.0)
    assert b.seconds["down"] == approx(2.0)
    assert b.restarts == 1


def test_an_attempt_killed_before_its_first_flush_lived_until_its_recorder_started():
    # Only the START was written (at once, when the manager was made): the process ran
    # from its start (t) to the recorder's start (recorder_t), all of it start-up.
    head = ev.Event(ev.START, 100.0, 0, info={"recorder_t": 104.0})
    a2 = AttemptWriter(110.0, setup=1.0).step(1, 1.0).end()
    b = breakdown({"1": [head], "2": a2.events})
    check_sums(b)
    assert b.restarts == 1 and b.attempts[0].end == approx(104.0)
    assert b.seconds["startup"] == approx(4.0 + 1.0) and b.seconds["down"] == approx(6.0)


def test_two_crashes_in_a_row():
    a1 = AttemptWriter(0.0).restore(1.0, None)
    for s in range(1, 7):
        a1.step(s, 1.0)
    a1.beat()  # crash right after step 6; last commit was step 4
    a2 = AttemptWriter(a1.t + 5.0).restore(1.0, 4)
    for s in (5, 6, 7, 8):
        a2.step(s, 1.0)
    a2.beat()  # crashed again at 8, nothing newer committed than 4
    a3 = AttemptWriter(a2.t + 5.0).restore(1.0, 4)
    for s in range(5, 11):
        a3.step(s, 1.0)
    a3.end()
    b = breakdown({"1": a1.events, "2": a2.events, "3": a3.events})
    check_sums(b)
    assert b.restarts == 2
    # A step is productive unless a later attempt ran it again: attempt 1's 5 and 6 and
    # attempt 2's 5..8 were lost (both crashes restored step 4); attempt 3 kept its own.
    assert [a.wasted_steps for a in b.attempts] == [2, 4, 0]
    assert [a.seconds["productive"] for a in b.attempts] == [approx(4), approx(0), approx(6)]
    assert [a.seconds["wasted"] for a in b.attempts] == [approx(2), approx(4), approx(0)]
    assert b.wasted_steps == 6
    assert b.seconds["productive"] == approx(4 + 6)  # 1-4, then 5-10
    assert b.seconds["down"] == approx(10.0)


def test_a_finished_job_run_again_is_a_new_run_not_a_restart():
    a1 = AttemptWriter(0.0, setup=1.0).step(1, 1.0).step(2, 1.0).end()
    a2 = AttemptWriter(1000.0, setup=1.0).restore(0.5, 2).step(3, 1.0).end()
    b = breakdown({"1": a1.events, "2": a2.events})
    check_sums(b)
    assert b.restarts == 0 and b.runs == 2
    assert [a.new_run for a in b.attempts] == [True, True]
    assert b.seconds["down"] == 0  # the idle days between the runs are no one's time
    assert b.wall_seconds == approx(3.0 + 2.5)
    assert b.seconds["productive"] == approx(3.0)


def test_a_preempted_attempt_and_its_requeue_are_a_restart_with_down_time():
    a1 = AttemptWriter(0.0, setup=1.0).step(1, 1.0).step(2, 1.0)
    a1.events.append(ev.Event(ev.END, a1.t, a1.n, info={"preempted": True}))
    a2 = AttemptWriter(a1.t + 20.0, setup=1.0).restore(0.5, 2).step(3, 1.0).end()
    b = breakdown({"1": a1.events, "2": a2.events})
    check_sums(b)
    assert b.restarts == 1 and b.runs == 1
    assert b.seconds["down"] == approx(20.0)
    assert b.wall_seconds == approx(3.0 + 20.0 + 2.5)


def test_a_log_whose_tail_was_lost_counts_the_unknown_as_down():
    a1, a2 = two_attempts(lambda a: a.idle(0.7).beat())
    kept = [e for e in a1.events if e.kind != "beat" and (e.step or 0) <= 2]  # tail lost
    b = breakdown({"x1": kept, "x2": a2.events})
    check_sums(b)
    # Attempt 1's last known event is step 2: steps 3, 4 and the partial one became down.
    assert b.seconds["down"] == approx(10.0 + 2.0 + 0.7)
    assert b.wasted_steps == 0  # nobody knows step 3 and 4 ran before
    assert b.attempts[0].last_step == 2


def test_overlapping_attempts_are_clipped():
    a1 = AttemptWriter(0.0).step(1, 5.0).beat()
    a2 = AttemptWriter(3.0).step(1, 1.0).end()  # started before a1's last event
    b = breakdown({"1": a1.events, "2": a2.events})
    check_sums(b)
    assert b.wall_seconds == approx(4.0)


def test_no_events():
    b = breakdown({})
    assert b.wall_seconds == 0 and b.goodput == 0 and b.restarts == 0


@st.composite
def scripts(draw):
    attempts = {}
    t = 0.0
    seconds = st.floats(0.0, 5.0, allow_nan=False)
    for k in range(draw(st.integers(1, 4))):
        a = AttemptWriter(t, setup=draw(seconds))
        if draw(st.booleans()):
            a.restore(
                draw(seconds), draw(st.none() | st.integers(0, 5)), finish=draw(st.booleans())
            )
        for s in range(draw(st.integers(0, 6))):
            a.step(
                draw(st.integers(0, 10)) if draw(st.booleans()) else s,
                draw(seconds),
                data_wait=draw(seconds),
            )
            if draw(st.booleans()):
                a.save(draw(seconds), finish=draw(st.booleans()))
        a.idle(draw(seconds))
        if draw(st.booleans()):
            a.end()
        else:
            a.beat()
        events = a.events
        if draw(st.booleans()):  # the tail was lost
            events = events[: draw(st.integers(1, len(events)))]
        attempts[f"a{k}"] = events
        t = a.t + draw(st.floats(-3.0, 10.0, allow_nan=False))  # overlaps too
    return attempts


@settings(max_examples=300, deadline=None)
@given(scripts())
def test_every_second_falls_in_exactly_one_category(attempts):
    b = breakdown(attempts)
    assert sum(b.seconds.values()) == pytest.approx(b.wall_seconds, abs=1e-6)
    assert all(v >= -1e-9 for v in b.seconds.values())
    assert 0.0 <= b.goodput <= 1.0 + 1e-9
    # Segments tile the wall time: ordered, not overlapping, no gaps.
    segs = b.segments
    total = sum(s.end - s.begin for s in segs)
    assert total == pytest.approx(b.wall_seconds, abs=1e-6)
    for x, y in itertools.pairwise(segs):
        assert y.begin >= x.end - 1e-9
