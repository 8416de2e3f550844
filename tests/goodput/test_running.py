"""The running goodput a sink logs: the breakdown of every event, at a bounded cost."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.goodput import events as ev
from unbroken.goodput import running as running_module
from unbroken.goodput.breakdown import breakdown
from unbroken.goodput.running import History, RunningGoodput

from .synthetic import AttemptWriter
from .test_breakdown import scripts


def _now(writer: AttemptWriter) -> ev.Event:
    return ev.Event(ev.BEAT, writer.t)


def test_back_to_back_steps_are_kept_as_one_and_a_save_keeps_them_apart():
    w = AttemptWriter(0.0, setup=1.0)
    for s in range(1, 101):
        w.step(s, 0.5, data_wait=0.1)
        if s % 25 == 0:
            w.save(0.2)
        w.beat()
    history = History()
    history.merge_steps_above = -1
    history.extend(w.events)
    kinds = [e.kind for e in history.events()]
    # START, then four runs of steps each closed by a save, then the newest beat
    assert kinds == [ev.START, *[ev.STEP, ev.SAVE_BEGIN, ev.SAVE_END] * 4, ev.BEAT]
    first = history.events()[1]
    assert (first.begin, first.t, first.step) == (1.0, 13.5, 25)
    assert first.data_wait == pytest.approx(2.5)
    assert breakdown({"a": history.events()}).seconds == pytest.approx(
        breakdown({"a": w.events}).seconds
    )


def test_steps_an_earlier_attempt_ran_stay_apart_and_nothing_merges_before_the_limit_is_set():
    w = AttemptWriter(0.0).restore(1.0, 3)
    for s in range(4, 12):
        w.step(s, 1.0)
    unset = History(w.events)
    assert [e.step for e in unset.events() if e.kind == ev.STEP] == list(range(4, 12))
    history = History()
    history.merge_steps_above = 7  # an earlier attempt ran up to step 7
    history.extend(w.events)
    steps = [e for e in history.events() if e.kind == ev.STEP]
    assert [e.step for e in steps] == [4, 5, 6, 7, 11]  # 8 apart from 7; 8..11 one
    assert (steps[-1].begin, steps[-1].t) == (steps[-2].t, w.t)


@st.composite
def running_jobs(draw):
    """Earlier attempts as the breakdown's tests draw them, then a live attempt that
    restored some step and counts on from it, saving now and then."""
    earlier = draw(scripts())
    seconds = st.floats(0.0, 5.0, allow_nan=False)
    starts = [e.t for events in earlier.values() for e in events if e.kind == ev.START]
    w = AttemptWriter(max(starts) + draw(seconds), setup=draw(seconds))
    step = draw(st.integers(0, 8))
    w.restore(draw(seconds), step)
    checks = []
    for _ in range(draw(st.integers(0, 40))):
        took = draw(seconds)
        step += 1
        w.step(step, took, data_wait=draw(st.floats(0.0, 1.0)) * took)
        if draw(st.integers(0, 5)) == 0:  # unfinished: an exception out of the save
            w.save(draw(seconds), finish=draw(st.integers(0, 3)) > 0)
        if draw(st.booleans()):
            w.beat()
        if draw(st.booleans()):
            checks.append((len(w.events), step, w.t))
    return earlier, w.events, checks


@settings(max_examples=300, deadline=None)
@given(running_jobs())
def test_the_running_goodput_is_the_breakdown_of_every_event_so_far(job):
    check_running_goodput(job, History())


def check_running_goodput(job, history: History) -> None:
    """At each check of ``job``, ``history`` fed so far gives every event's goodput."""
    earlier, current, checks = job
    running = RunningGoodput("now", earlier)
    history.merge_steps_above = running.earlier_newest_step
    fed = 0
    for upto, last_step, t in checks:
        history.extend(current[fed:upto])
        fed = upto
        beat = ev.Event(ev.BEAT, t)
        want = breakdown({**earlier, "now": [*current[:upto], beat]}).goodput
        assert running.goodput([*history.events(), beat], last_step) == pytest.approx(
            want, abs=1e-9
        )


def test_a_long_attempt_keeps_a_few_events_and_settles_its_earlier_attempts():
    before = AttemptWriter(0.0, setup=2.0)
    for s in range(1, 31):
        before.step(s, 1.0)
        if s % 10 == 0:
            before.save(0.5)
    w = AttemptWriter(40.0, setup=3.0).restore(2.0, 20)
    running = RunningGoodput("now", {"before": before.events})
    history = History(w.events)
    history.merge_steps_above = running.earlier_newest_step
    assert running.earlier_newest_step == 30
    fed = len(w.events)
    for s in range(21, 20_021):
        w.step(s, 0.01, data_wait=0.002)
        if s % 1000 == 0:
            w.save(0.3)
        w.beat()
        history.extend(w.events[fed:])
        fed = len(w.events)
        if s in (25, 31, 20_020):  # redoing the lost steps, just past them, much later
            got = running.goodput([*history.events(), _now(w)], s)
            want = breakdown({"before": before.events, "now": [*w.events, _now(w)]})
            assert got == pytest.approx(want.goodput, abs=1e-9)
    # 20,000 steps and beats: the restore, the 10 redone steps apart, one run per save
    assert len(history) < 100
    assert running._earlier == {}  # settled: the earlier attempt is two sums now


@settings(max_examples=150, deadline=None)
@given(running_jobs(), st.integers(2, 8), st.integers(0, 4))
def test_a_history_folded_often_keeps_the_running_goodput_exact(job, fold_events, keep):
    kept, running_module.FOLD_KEEP = running_module.FOLD_KEEP, keep
    try:
        check_running_goodput(job, History(fold_events=fold_events))
    finally:
        running_module.FOLD_KEEP = kept


def test_a_run_that_saves_every_step_keeps_a_bounded_history():
    # saves keep steps apart: each added a step, its save's two events and a commit
    w = AttemptWriter(0.0, setup=3.0).restore(2.0, 0)
    running = RunningGoodput("now", {})
    history = History(w.events)
    history.merge_steps_above = running.earlier_newest_step
    fed = len(w.events)
    for s in range(1, 20_001):
        w.step(s, 0.01, data_wait=0.002 * (s % 3))
        w.save(0.003 * (s % 2))
        w.events.append(ev.Event(ev.COMMIT, w.t, w.n, step=s))
        w.n += 1
        history.extend(w.events[fed:])
        fed = len(w.events)
    assert len(history) <= running_module.FOLD_EVENTS + 1
    want = breakdown({"now": [*w.events, _now(w)]}).goodput
    assert running.goodput([*history.events(), _now(w)], 20_000) == pytest.approx(want, abs=1e-9)
