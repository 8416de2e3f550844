"""Telling jobs apart in one root's event log: by the name each START records, and by
time where an attempt names none."""

from __future__ import annotations

from unbroken.goodput import events as ev
from unbroken.goodput import jobs
from unbroken.goodput.breakdown import job_breakdown

from .synthetic import AttemptWriter


def attempt(start: float, seconds: float, job: str | None = None, *, clean: bool = False):
    a = AttemptWriter(start).step(1, seconds)
    if job is not None:
        head = a.events[0]
        a.events[0] = ev.Event(ev.START, head.t, head.n, info={"job": job})
    if clean:
        a.end()
    else:
        a.beat()
    return {0: a.events}


def test_attempts_are_grouped_by_the_job_their_start_names():
    log = {"a1": attempt(0, 10, "A"), "b1": attempt(2, 10, "B"), "a2": attempt(15, 5, "A")}
    found = jobs.split(log)
    assert [(j.name, j.attempts) for j in found] == [("A", ("a1", "a2")), ("B", ("b1",))]
    assert job_breakdown(jobs.select(log, found[0])).restarts == 1


def test_unnamed_attempts_that_overlap_are_different_jobs():
    # Old logs (no names): x1 and y1 run at once; x2 follows x1 and y1 both, and joins
    # the one that ended last before it started (y1, at 14).
    log = {"x1": attempt(0, 10), "y1": attempt(4, 10), "x2": attempt(20, 5)}
    found = jobs.split(log)
    assert [(j.name, j.attempts, j.named) for j in found] == [
        ("unnamed-1", ("x1",), False),
        ("unnamed-2", ("y1", "x2"), False),
    ]


def test_unnamed_attempts_in_sequence_are_one_job():
    log = {"x1": attempt(0, 10), "x2": attempt(12, 5), "x3": attempt(20, 5, clean=True)}
    assert [j.attempts for j in jobs.split(log)] == [("x1", "x2", "x3")]


def test_of_attempt_is_the_job_of_that_attempt():
    log = {"a1": attempt(0, 10, "A"), "b1": attempt(2, 10, "B")}
    assert set(jobs.of_attempt(log, "a1")) == {"a1"}
    assert set(jobs.of_attempt(log, "gone")) == {"b1"}  # unknown: the latest job
    assert jobs.of_attempt({}, "a1") == {}


def test_an_attempt_rank_0_left_no_event_in_is_proven_by_another_rank():
    first = attempt(0, 1)[0]
    log = {"a1": {1: first}, "a2": {0: attempt(10, 5, clean=True)[0], 1: []}}
    b = job_breakdown(log, 0)
    assert b.restarts == 1 and [a.stand_in_rank for a in b.attempts] == [1, None]
    assert b.wall_seconds == 15 and b.seconds["down"] == 9
    assert job_breakdown(log, 3).attempts == []  # a rank that never ran


def test_an_attempt_whose_rank_0_log_lost_its_start_is_told_by_another_rank(caplog):
    """A hostile user's find: rank 0's first object of an attempt emptied, its later
    events were used as they were: that attempt lost its start, 5.7 s counted down and its
    redone steps productive (59.7% became 49.2%), without a word."""
    whole = attempt(0, 1)[0]
    second = attempt(10, 5, clean=True)[0]
    intact = {"a1": {0: whole, 1: whole}, "a2": {0: second, 1: second}}
    headless = [e for e in second if e.kind != ev.START]
    damaged = {"a1": {0: whole, 1: whole}, "a2": {0: headless, 1: second}}
    b = job_breakdown(damaged, 0)
    assert [a.stand_in_rank for a in b.attempts] == [None, 1]
    assert b.seconds == job_breakdown(intact, 0).seconds
    assert "attempt a2: rank 0's log has lost its start; rank 1's stands in" in caplog.text


def test_a_clock_step_between_two_attempts_of_one_job_is_told(tmp_path):
    """A hostile user's find: a wall clock 5 s behind on the restarted attempt's host
    counted 5 s of 'down' that never happened, with no word; the report now warns."""
    log = {"a1": attempt(0, 10, "J"), "a2": attempt(6, 5, "J"), "a3": attempt(12, 5, "J")}
    (job,) = jobs.split(log)
    assert jobs.clock_overlaps(log, job) == [("a1", "a2", 4.0)]
    log = {"a1": attempt(0, 10, "J"), "a2": attempt(10.5, 5, "J")}  # within SKEW: none
    assert jobs.clock_overlaps(log, jobs.split(log)[0]) == []


def test_an_attempt_no_rank_of_which_kept_its_start_is_told_by_its_own_events(caplog):
    whole = attempt(0, 1)[0]
    headless = [e for e in attempt(10, 5, clean=True)[0] if e.kind != ev.START]
    b = job_breakdown({"a1": {0: whole}, "a2": {0: headless}}, 0)
    assert [a.stand_in_rank for a in b.attempts] == [None, None]
    assert "attempt a2: no rank's log has its start" in caplog.text


def test_the_jobs_view_takes_each_attempt_from_the_rank_that_got_furthest():
    """A SIGKILLed rank loses its last second of events: told by rank 0 alone (killed at
    step 6, after a save of step 2), the crash wasted nothing. The job's view tells the
    attempt by the rank whose events reach step 6 (the one torchrun stopped)."""

    def ran(start: float, steps: range, restored: int | None = None) -> AttemptWriter:
        a = AttemptWriter(start)
        if restored is not None:
            a.restore(0.5, restored)
        for s in steps:
            a.step(s, 1.0)
        return a

    killed = ran(0, range(1, 3))  # its steps 3-6 never reached the store
    stopped = ran(0, range(1, 7))
    log = {
        "a1": {0: killed.events, 1: stopped.events},
        "a2": {r: ran(8, range(3, 9), restored=2).end().events for r in (0, 1)},
    }
    assert job_breakdown(log, 0).wasted_steps == 0
    job = job_breakdown(log)
    assert job.rank is None and job.wasted_steps == 4 and job.seconds["wasted"] == 4.0
    assert [a.last_step for a in job.attempts] == [6, 8]
