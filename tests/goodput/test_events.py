"""The event log: new objects per flush, torn lines skipped, a dead attempt's local tail
uploaded by the next one."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys

import pytest

import unbroken as ub
from unbroken.goodput import events as ev
from unbroken.goodput.salvage import salvage_local_logs


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def start_event(attempt: str, pid: int) -> ev.Event:
    info = {"pid": pid, "host": socket.gethostname(), "attempt": attempt, "rank": 0}
    return ev.Event(ev.START, 100.0, 0, info=info)


def test_each_flush_writes_a_new_object_and_reading_merges_them(tmp_path):
    store = ub.open_store(tmp_path / "ck")
    log = ev.EventLog(store, str(tmp_path / "st"), "a1", 0)
    log.append(start_event("a1", os.getpid()))
    log.append(ev.Event(ev.STEP, 101.0, 1, step=1, begin=100.5))
    assert log.flush(durable=True, beat=101.5)
    first = [e.key for e in store.list(ev.PREFIX)]
    log.append(ev.Event(ev.STEP, 102.0, 2, step=2, begin=101.0))
    assert log.flush(durable=True, beat=102.5)
    keys = [e.key for e in store.list(ev.PREFIX)]
    assert len(keys) == 2 and set(first) < set(keys)  # the first object was not rewritten
    assert store.read_bytes(first[0]).count(b"\n") == 3  # start, step 1, beat
    got = ev.read_log(store)["a1"][0]
    assert [e.kind for e in got] == [ev.START, ev.STEP, ev.STEP, ev.BEAT]
    assert got[-1].t == 102.5
    log.close(beat=103.0, remove_local=True)
    assert not os.path.exists(log.local_path)


def test_a_torn_line_is_skipped():
    good = ev.Event(ev.STEP, 1.0, 3, step=7, begin=0.5, data_wait=0.1).to_json()
    events = ev.parse_lines(good + "\n" + good[:-7] + "\n{not json\n")
    assert events == [ev.Event(ev.STEP, 1.0, 3, step=7, begin=0.5, data_wait=0.1)]


def test_the_next_attempt_uploads_what_a_dead_one_left_locally(tmp_path):
    store = ub.open_store(tmp_path / "ck")
    staging = str(tmp_path / "st")
    log = ev.EventLog(store, staging, "a1", 0)
    log.append(start_event("a1", dead_pid()))
    log.flush(durable=True)  # the durable tier has the start only
    for n in range(1, 6):
        log.append(ev.Event(ev.STEP, 100.0 + n, n, step=n, begin=99.0 + n))
    log.flush(durable=False, beat=106.0)  # the seconds before the crash: local only
    assert len(ev.read_log(store)["a1"][0]) == 1
    assert salvage_local_logs(store, staging) == 1
    got = ev.read_log(store)["a1"][0]
    assert [e.n for e in got if e.n >= 0] == [0, 1, 2, 3, 4, 5]
    assert got[-1].kind == ev.BEAT and got[-1].t == 106.0
    assert not os.path.exists(log.local_path)
    assert salvage_local_logs(store, staging) == 0  # nothing twice


def test_a_live_process_log_is_left_alone(tmp_path):
    store = ub.open_store(tmp_path / "ck")
    log = ev.EventLog(store, str(tmp_path / "st"), "a1", 0)
    log.append(start_event("a1", os.getpid()))
    log.flush(durable=False)
    assert salvage_local_logs(store, str(tmp_path / "st")) == 0
    assert os.path.exists(log.local_path)


def test_flushes_are_compacted_into_a_new_object_and_nothing_is_lost(tmp_path):
    store = ub.open_store(tmp_path / "ck")
    log = ev.EventLog(store, str(tmp_path / "st"), "a1", 0, compact_every=3)
    log.append(start_event("a1", os.getpid()))
    for n in range(1, 8):
        log.append(ev.Event(ev.STEP, 100.0 + n, n, step=n, begin=99.0 + n))
        assert log.flush(durable=True, beat=100.5 + n)
    names = sorted(e.key.rsplit("/", 1)[1] for e in store.list(ev.PREFIX))
    # flushes 1-3 and 4-6 merged (events 0-3 and 4-6), flush 7 not yet
    assert names == ["000000000-000000003.jsonl", "000000004-000000006.jsonl", "000000007.jsonl"]
    got = ev.read_log(store)["a1"][0]
    assert [e.n for e in got if e.n >= 0] == list(range(8))
    assert got[-1].kind == ev.BEAT and got[-1].t == 107.5


def test_a_log_of_an_earlier_process_with_our_pid_is_salvaged(tmp_path):
    """A container restarted in place runs its processes under the same pids: a log
    whose START names our pid but another start time is a dead process's."""
    store = ub.open_store(tmp_path / "ck")
    staging = str(tmp_path / "st")
    log = ev.EventLog(store, staging, "a1", 0)
    head = start_event("a1", os.getpid())
    log.append(ev.Event(ev.START, head.t, 0, info={**head.info, "started": "1"}))
    log.flush(durable=True)
    log.append(ev.Event(ev.STEP, 101.0, 1, step=1, begin=100.5))
    log.flush(durable=False, beat=101.5)
    assert salvage_local_logs(store, staging) == 1
    assert [e.n for e in ev.read_log(store)["a1"][0] if e.n >= 0] == [0, 1]


@pytest.mark.parametrize("durable", ["emptied", "earlier attempt only"])
def test_a_dead_attempts_local_log_is_salvaged_only_into_its_own_history(tmp_path, durable):
    """The checkpoints deleted to start over (rm -rf of the URL): the staging dir kept
    the dead run's local log, and the new run's report showed that run's crash (25%
    goodput for a clean run of 66%). Kept: an attempt whose start never reached the
    durable tier, after earlier attempts that did."""
    store = ub.open_store(tmp_path / "ck")
    staging = str(tmp_path / "st")
    if durable == "earlier attempt only":
        older = ev.EventLog(store, str(tmp_path / "other"), "20261201T000000-aaaaaa", 0)
        older.append(start_event("20261201T000000-aaaaaa", 999_999_999))
        older.flush(durable=True)
    dead = "20261202T000000-bbbbbb"
    log = ev.EventLog(store, staging, dead, 0)
    log.append(start_event(dead, 999_999_999))
    log.append(ev.Event(ev.STEP, 101.0, 1, step=1, begin=100.5))
    log.flush(durable=False, beat=101.5)
    newer = ev.EventLog(store, str(tmp_path / "new"), "20261203T000000-cccccc", 0)
    newer.append(start_event("20261203T000000-cccccc", os.getpid()))
    newer.flush(durable=True)  # the new run, started on the emptied URL
    salvaged = salvage_local_logs(store, staging)
    assert (dead in ev.read_log(store)) == (durable == "earlier attempt only") == salvaged
    assert not os.listdir(os.path.join(staging, ev.PREFIX))  # dropped or uploaded


def test_our_own_log_with_our_start_time_is_left_alone(tmp_path):
    from unbroken._util.procs import process_start_ticks

    store = ub.open_store(tmp_path / "ck")
    log = ev.EventLog(store, str(tmp_path / "st"), "a1", 0)
    head = start_event("a1", os.getpid())
    started = process_start_ticks(os.getpid())
    log.append(ev.Event(ev.START, head.t, 0, info={**head.info, "started": started}))
    log.flush(durable=False)
    assert salvage_local_logs(store, str(tmp_path / "st")) == 0


def test_the_start_is_written_when_the_log_starts(tmp_path):
    store = ub.open_store(tmp_path / "ck")
    log = ev.EventLog(store, str(tmp_path / "st"), "a1", 1, durable_seconds=float("inf"))
    log.append(start_event("a1", os.getpid()))
    log.start()  # the thread's first flush is a second away: this one is not
    try:
        assert [e.kind for e in ev.read_log(store)["a1"][1]] == [ev.START]
        with open(log.local_path) as f:
            assert [e.kind for e in ev.parse_lines(f.read())] == [ev.START]
    finally:
        log.close(beat=101.0, remove_local=True)


BAD_LINES = [
    '{"kind":"step","t":5.0,"n":1e999,"step":3}',  # int(inf): OverflowError
    "[" * 100_000 + "]" * 100_000,  # RecursionError in the parser
    '{"kind":"step","t":NaN,"n":4,"step":4}',
    '{"kind":"step","t":Infinity,"n":5,"step":5}',
    '{"kind":"step","t":6.0,"n":6,"step":6,"begin":-Infinity}',
    '{"kind":"step","t":7.0,"n":7,"step":7,"info":[1]}',
    '{"kind":"step","t":true,"n":8,"step":8}',
    '{"kind":"step","t":1e300,"n":9,"step":5}',  # no date: the report's gmtime overflowed
]


def test_bad_lines_are_skipped_with_a_warning_naming_the_source(caplog):
    good = ev.Event(ev.STEP, 9.0, 9, step=9, begin=8.0)
    text = "\n".join([*BAD_LINES, good.to_json()]) + "\n"
    with caplog.at_level("WARNING", logger="unbroken.goodput.events"):
        assert ev.parse_lines(text, "some/key.jsonl") == [good]
    [record] = caplog.records
    assert "some/key.jsonl" in record.getMessage() and "line 1" in record.getMessage()
    assert f"and {len(BAD_LINES) - 1} more" in record.getMessage()


def test_a_rank_that_writes_durably_at_its_end_holds_no_step_of_a_long_job_in_memory(tmp_path):
    """Ranks other than 0 write their log durably only at the end: every step of the
    attempt stayed in memory (about 300 bytes each: 300 MB a million steps)."""
    store = ub.open_store(tmp_path / "ck")
    log = ev.EventLog(store, str(tmp_path / "st"), "a1", 1, durable_seconds=float("inf"))
    log.append(start_event("a1", os.getpid()))
    assert log.flush(durable=True)
    steps = 3 * ev.MEMORY_EVENTS
    for n in range(1, steps + 1):
        log.append(ev.Event(ev.STEP, 100.0 + n, n, step=n, begin=99.0 + n))
        if n % 1000 == 0:
            assert log.flush(durable=False, beat=100.5 + n)
            assert len(log._unsent) <= ev.MEMORY_EVENTS
    assert log.close(beat=200000.0, remove_local=True)
    got = ev.read_log(store)["a1"][1]
    assert [e.n for e in got if e.n >= 0] == list(range(steps + 1))  # nothing lost
    assert got[-1].kind == ev.BEAT and got[-1].t == 200000.0


def test_a_spilled_log_reaches_the_durable_tier_event_for_event(tmp_path):
    """Its end sends the local copy's numbered lines as they stand (not parsed): beats
    left out, events whose info holds an "n" of its own kept whole."""
    store = ub.open_store(tmp_path / "ck")
    log = ev.EventLog(store, str(tmp_path / "st"), "a1", 1, durable_seconds=float("inf"))
    start = start_event("a1", os.getpid())
    sent = [dataclasses.replace(start, info={**start.info, "rank": 1})]
    log.append(sent[0])
    for n in range(1, ev.MEMORY_EVENTS + 50):
        info = {"n": -n, "seconds": 0.5} if n % 7 == 0 else {}
        sent.append(ev.Event(ev.COMMIT if info else ev.STEP, 100.0 + n, n, step=n, info=info))
        log.append(sent[-1])
        if n % 500 == 0:
            assert log.flush(durable=False, beat=100.5 + n)
    assert log.close(beat=9e5, remove_local=True)
    got = ev.read_log(store)["a1"][1]
    assert got[:-1] == sent and got[-1] == ev.Event(ev.BEAT, 9e5)
    [entry] = store.list(ev.rank_prefix("a1", 1))
    lines = store.read_bytes(entry.key).decode().splitlines()
    assert len(lines) == len(sent) + 1  # the local copy's beats stay there: the newest only


def test_a_damaged_line_of_a_spilled_log_is_left_out_and_the_rest_sent(tmp_path):
    store = ub.open_store(tmp_path / "ck")
    log = ev.EventLog(store, str(tmp_path / "st"), "a1", 1, durable_seconds=float("inf"))
    for n in range(ev.MEMORY_EVENTS + 10):
        log.append(ev.Event(ev.STEP, 100.0 + n, n, step=n, begin=99.0 + n))
    assert log.flush(durable=False)
    with open(log.local_path, "r+b") as f:  # the first line torn after its number
        head = f.readline()
        f.seek(head.index(b',"n":0') + 6)
        f.write(b"\0" * (len(head) - head.index(b',"n":0') - 7))
    assert log.close(beat=9e5, remove_local=True)
    got = ev.read_log(store)["a1"][1]
    assert [e.n for e in got if e.n >= 0] == list(range(1, ev.MEMORY_EVENTS + 10))


def test_a_local_copy_gone_while_it_holds_the_unsent_events_never_stops_the_job(tmp_path):
    store = ub.open_store(tmp_path / "ck")
    log = ev.EventLog(store, str(tmp_path / "st"), "a1", 1, durable_seconds=float("inf"))
    log.append(start_event("a1", os.getpid()))
    for n in range(1, ev.MEMORY_EVENTS + 10):
        log.append(ev.Event(ev.STEP, 100.0 + n, n, step=n, begin=99.0 + n))
    assert log.flush(durable=False)
    os.unlink(log.local_path)  # the staging dir wiped under the job
    assert log.close(beat=200000.0, remove_local=True)  # no exception; those events lost


def test_the_ends_of_a_long_log_are_read_in_two_objects_a_rank(tmp_path):
    """every_seconds='auto' read every step of every attempt at each start (13 s of CPU
    at a million steps) for each attempt's span and ending."""
    store = ub.open_store(tmp_path / "ck")
    log = ev.EventLog(store, str(tmp_path / "st"), "a1", 0)
    log.append(start_event("a1", os.getpid()))
    for n in range(1, 6):
        log.append(ev.Event(ev.STEP, 100.0 + n, n, step=n, begin=99.0 + n))
        assert log.flush(durable=True, beat=100.5 + n)
    log.append(ev.Event(ev.END, 106.0, 6))
    assert log.close(beat=107.0, remove_local=True)
    whole = ev.read_log(store)["a1"][0]
    ends = ev.read_log(store, ends_only=True)["a1"][0]
    steps = [e.step for e in ends if e.kind == ev.STEP]
    assert steps == [1] and ends[0].kind == ev.START  # the first object's, not the middle
    assert [e.kind for e in ends][-2:] == [ev.END, ev.BEAT]
    assert ends[0] == whole[0] and ends[-1].t == whole[-1].t == 107.0
