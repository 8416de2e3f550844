"""The goodput event record and its crash-safe, append-only log.

Layout, in the durable tier beside the checkpoints (and ignored by the catalog, which
only reads ``step-*``)::

    <root>/_goodput/attempt-<id>/rank-<r>/<first event number>.jsonl

Each flush writes a NEW object holding the events since the previous flush (one atomic
write: a rename on a path, one PUT on an object store); nothing is ever rewritten, so a
crash loses at most the events not flushed yet. Events are also appended, every second,
to a local copy in the staging tier (``local_copy.py``; the START when the log starts, so
an attempt killed in its first second is on disk, and to the durable tier by the thread
at once); the next attempt on the same node uploads what the durable tier lacks, so a
restart there recovers the last seconds before a crash (a file is a dead process's where
its START's pid and start time are not alive).
Events are numbered per (attempt, rank): a reader merges every object and drops
duplicates by number.

A ``beat`` line (written with every flush, not numbered) says the process was alive then:
the last one bounds where a crashed attempt ended.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from unbroken.goodput.local_copy import LocalCopy
from unbroken.storage import Store

if TYPE_CHECKING:
    from unbroken.goodput.running import History

log = logging.getLogger(__name__)

MEMORY_EVENTS = 4096
"""Events not yet in the durable tier that a log holds in memory; beyond, it reads them
back from its local copy when it writes them."""

PREFIX = "_goodput"
"""Top-level folder of the event log in the durable tier (and in the staging tier)."""
START_WAIT_SECONDS = 2.0
"""How long a starting log waits for its START to reach the durable tier."""

START = "start"
"""The attempt's process started (``t`` is the OS's process start time)."""
RESTORE_BEGIN, RESTORE_END = "restore_begin", "restore_end"
STEP = "step"
"""One training step ended: the interval between two ``maybe_save`` calls."""
SAVE_BEGIN, SAVE_END = "save_begin", "save_end"
"""The training loop blocked in save/maybe_save (or in wait()/close(), ``wait=True``)."""
COMMIT = "commit"
"""A background save committed (or failed): informational."""
END = "end"
"""A clean end: the manager was closed."""
BEAT = "beat"
"""The process was alive at ``t`` (unnumbered)."""


@dataclass(frozen=True)
class Event:
    """One thing that happened to one rank of one attempt, at wall time ``t``."""

    kind: str
    t: float
    """Unix seconds; for a STEP, when it ended."""
    n: int = -1
    """Sequence number within (attempt, rank); -1 for beats."""
    step: int | None = None
    begin: float | None = None
    """A STEP's start (the previous maybe_save's return, or the end of restore)."""
    data_wait: float = 0.0
    """A STEP's seconds blocked waiting for the data loader."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything else (pid, host, world size, seconds, bytes)."""

    def to_json(self) -> str:
        doc: dict[str, Any] = {"kind": self.kind, "t": round(self.t, 6)}
        if self.n >= 0:
            doc["n"] = self.n
        if self.step is not None:
            doc["step"] = self.step
        if self.begin is not None:
            doc["begin"] = round(self.begin, 6)
        if self.data_wait:
            doc["data_wait"] = round(self.data_wait, 6)
        if self.info:
            doc["info"] = self.info
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Event:
        """The event of one log line; ValueError naming what is wrong with it."""
        try:
            doc = json.loads(line)
        except RecursionError:
            raise ValueError("nested too deeply") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str):
            raise ValueError("not an event")
        info = doc.get("info") or {}
        if not isinstance(info, dict):
            raise ValueError("info is not an object")
        return cls(
            kind=doc["kind"],
            t=_moment(doc, "t"),
            n=_integer(doc, "n", -1),
            step=None if doc.get("step") is None else _integer(doc, "step", 0),
            begin=None if doc.get("begin") is None else _moment(doc, "begin"),
            data_wait=_seconds(doc, "data_wait", 0.0),
            info=info,
        )


def _seconds(doc: dict[str, Any], key: str, default: float | None = None) -> float:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} is not a number: {value!r}"[:120])
    if not math.isfinite(value):
        raise ValueError(f"{key} is not finite: {value!r}")
    return float(value)


LATEST_MOMENT = 1e11
"""Seconds since the epoch past which an event's time is damage (the year 5138)."""


def _moment(doc: dict[str, Any], key: str) -> float:
    """A wall-clock time: a number the report can print as a date."""
    value = _seconds(doc, key)
    if abs(value) > LATEST_MOMENT:
        raise ValueError(f"{key} is not a time: {value!r}")
    return value


def _integer(doc: dict[str, Any], key: str, default: int) -> int:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} is not an integer: {value!r}"[:120])
    return value


def parse_lines(text: str, source: str = "event log") -> list[Event]:
    """Events of a JSONL text. A bad line (torn by a crash mid-append, or damaged) is
    skipped with one warning per ``source`` naming the first such line."""
    events = []
    bad: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            events.append(Event.from_json(line))
        except (ValueError, TypeError, KeyError) as exc:
            bad.append((number, str(exc)))
    if bad:
        number, why = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        log.warning("goodput: skipped a bad line in %s: line %d: %s%s", source, number, why, more)
    return events


def merge(events: Iterable[Event]) -> list[Event]:
    """One rank's events from several objects: numbered ones once each, in order, then
    the latest beat."""
    numbered: dict[int, Event] = {}
    last_beat: Event | None = None
    for e in events:
        if e.n >= 0:
            numbered.setdefault(e.n, e)
        elif last_beat is None or e.t > last_beat.t:
            last_beat = e
    out = [numbered[n] for n in sorted(numbered)]
    return [*out, last_beat] if last_beat is not None else out


READ_STREAMS = 16
"""Objects of the log read at once (each a small GET: the round trip is the cost)."""


def rank_prefix(attempt: str, rank: int) -> str:
    return f"{PREFIX}/attempt-{attempt}/rank-{rank}"


def object_key(attempt: str, rank: int, first: int) -> str:
    return f"{rank_prefix(attempt, rank)}/{first:09d}.jsonl"


def read_log(store: Store, *, ends_only: bool = False) -> dict[str, dict[int, list[Event]]]:
    """Every attempt's events in the durable tier: ``{attempt: {rank: events}}``.

    ``ends_only``: of each rank's objects only the first (its START) and the last (its
    END, its last beat): enough for each attempt's span and ending, read in two GETs a
    rank rather than every step of a long job."""
    keys: dict[tuple[str, int], list[str]] = collections.defaultdict(list)
    for entry in store.list(PREFIX):
        parts = entry.key.split("/")
        if (
            len(parts) != 4
            or not parts[1].startswith("attempt-")
            or not parts[3].endswith(".jsonl")
        ):
            continue
        try:
            rank = int(parts[2].removeprefix("rank-"))
        except ValueError:
            continue
        keys[(parts[1].removeprefix("attempt-"), rank)].append(entry.key)
    for names in keys.values():
        names.sort()  # by first event number (zero-padded)
        if ends_only and len(names) > 2:
            names[1:-1] = []
    wanted = [key for names in keys.values() for key in names]
    # One small GET per object, thousands of them on many ranks: in flight together.
    with ThreadPoolExecutor(min(READ_STREAMS, len(wanted) or 1),
                            thread_name_prefix="unbroken-goodput-read") as pool:  # fmt: skip
        texts = dict(zip(wanted, pool.map(store.read_bytes, wanted), strict=True))
    out: dict[str, dict[int, list[Event]]] = {}
    for (attempt, rank), names in sorted(keys.items()):
        events: list[Event] = []
        for key in names:
            events.extend(parse_lines(texts[key].decode("utf-8", "replace"), store.url_for(key)))
        out.setdefault(attempt, {})[rank] = merge(events)
    return out


class EventLog:
    """One rank's log of one attempt: appends are a deque push; a daemon thread does the
    rest (local copy every ``local_seconds``, a new durable object every ``durable_seconds``,
    every ``compact_every`` of those merged into one).
    """

    def __init__(
        self,
        store: Store,
        staging_dir: str,
        attempt: str,
        rank: int,
        *,
        local_seconds: float = 1.0,
        durable_seconds: float = 60.0,
        compact_every: int = 60,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.attempt = attempt
        self.rank = rank
        self.local_seconds = local_seconds
        self.durable_seconds = durable_seconds
        self.compact_every = compact_every
        self.clock = clock
        self._written: list[str] = []
        """Objects written since the last compaction (read back to compact them)."""
        self.local = LocalCopy(os.path.join(staging_dir, PREFIX), attempt, rank)
        self.local_path = self.local.path
        self._queue: collections.deque[Event | tuple] = collections.deque()
        self._unsent: list[Event] = []
        """Numbered events not in the durable tier yet, while they are few: past
        ``MEMORY_EVENTS`` they are read back from the local copy (``_unsent_at``) instead,
        so a rank that writes durably only at its end holds no step of a long job."""
        self._unsent_at: int | None = None
        """The local copy's offset where the first event not in the durable tier begins."""
        self._spilled = False
        self.history: History | None = None
        """The events so far, runs of steps merged, when a sink asked (``keep_history``)."""
        self._beat: Event | None = None
        self._last_durable = float("-inf")
        self._io = threading.Lock()
        self._stop = threading.Event()
        self._warned = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Write what is queued (the START) to the local copy now, so that an attempt
        killed in its first second is on disk; the thread sends it on at once, waited
        for ``START_WAIT_SECONDS`` at most (a store that does not answer must not hold
        the job's start for its retries, minutes)."""
        try:
            self.flush(durable=False)
        except Exception:  # never let accounting stop the job
            log.exception("goodput: the event log's first flush failed")
        sent = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(sent,), name="unbroken-goodput", daemon=True
        )
        self._thread.start()
        sent.wait(START_WAIT_SECONDS)

    def append(self, event: Event | tuple) -> None:
        """Called by the training loop: never blocks on I/O. A tuple holds an Event's
        first fields in order (cheaper to make than the Event, which the thread builds)."""
        self._queue.append(event)

    def flush(self, *, durable: bool, beat: float | None = None) -> bool:
        """Write what is queued (locally; to the durable tier too if ``durable``); False if
        the durable write failed (its events are kept for the next try)."""
        with self._io:
            batch = []
            while self._queue:
                item = self._queue.popleft()
                batch.append(item if isinstance(item, Event) else Event(*item))
            if beat is not None:
                batch.append(Event(BEAT, beat))
            at = self.local.nbytes
            if batch:
                self.local.append(_lines(batch))
            numbered = [e for e in batch if e.n >= 0]
            if numbered and not self._unsent and not self._spilled:
                self._unsent_at = at
            if self._spilled and self.local.stopped:  # the local copy stopped: in memory
                self._unsent, self._spilled = [*self._read_unsent(), *numbered], False
            elif self._spilled:
                pass  # in the local copy already
            elif len(self._unsent) + len(numbered) > MEMORY_EVENTS and not self.local.stopped:
                self._unsent, self._spilled = [], True
            else:
                self._unsent.extend(numbered)
            if self.history is not None:
                self.history.extend(batch)
            if beat is not None:
                self._beat = batch[-1]
            if not durable:
                return True
            if self._spilled:  # sent as they stand: a rank other than 0 sends its whole
                unsent = self._unsent_lines()  # attempt at its end, in a preemption's grace
                first, lines = _first_number(unsent), b"".join(x + b"\n" for x in unsent)
            else:
                first = self._unsent[0].n if self._unsent else None
                lines = _lines(self._unsent)
            if first is None:
                return True
            key = object_key(self.attempt, self.rank, first)
            if not self._write_durable(key, lines):
                return False
            self._written.append(key)
            self._unsent, self._spilled, self._unsent_at = [], False, None
            self._last_durable = time.monotonic()
            if len(self._written) >= self.compact_every:
                self._compact()
            return True

    def _read_unsent(self) -> list[Event]:
        return parse_lines(b"\n".join(self._unsent_lines()).decode("utf-8", "replace"),
                           self.local_path)  # fmt: skip

    def _unsent_lines(self) -> list[bytes]:
        """The local copy's numbered lines from ``_unsent_at`` on, as they stand (none if
        it is gone: the staging dir wiped under the job loses them, never the job)."""
        try:
            return [line for line in self.local.read(self._unsent_at or 0).split(b"\n")
                    if _numbered(line)]  # fmt: skip
        except OSError as exc:
            log.warning("goodput: events since the last durable write lost: %s", exc)
            self._spilled, self._unsent_at = False, None
            return []

    def _write_durable(self, key: str, lines: bytes) -> bool:
        """``lines`` (numbered events, each ending in a newline) and the newest beat."""
        data = lines + (_lines([self._beat]) if self._beat is not None else b"")
        try:
            self.store.write_bytes(key, data)
        except Exception as exc:
            if not self._warned:
                log.warning("goodput: event log not written to %s: %s", self.store.url, exc)
                self._warned = True
            return False
        return True

    def _compact(self) -> None:
        """Replace this log's last ``compact_every`` objects by one NEW object holding
        them all, then delete them: a long job keeps a few objects per hour in the
        durable tier, not one per flush. A crash in between leaves duplicates, which a
        reader drops by number."""
        try:
            events = [
                e
                for old in self._written
                for e in parse_lines(self.store.read_bytes(old).decode("utf-8", "replace"), old)
                if e.n >= 0
            ]
        except Exception as exc:  # tried again at the next durable flush
            log.debug("goodput: compaction put off: %s", exc)
            return
        if not events:
            return
        key = f"{rank_prefix(self.attempt, self.rank)}/{events[0].n:09d}-{events[-1].n:09d}.jsonl"
        if not self._write_durable(key, _lines(events)):
            return
        for old in self._written:
            try:
                self.store.delete(old)
            except Exception as exc:
                log.debug("goodput: %s not deleted after compaction: %s", old, exc)
        self._written = []

    def close(self, *, beat: float, remove_local: bool) -> bool:
        """Stop the thread, flush everything to the durable tier; with ``remove_local``,
        drop the local copy once the durable tier has it all."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        ok = self.flush(durable=True, beat=beat)
        self.local.close()
        if ok and remove_local:
            self.local.remove()
        return ok

    def keep_history(self) -> None:
        """From now on keep the events (as :class:`~running.History` does); those flushed
        before (the START, written at ``start`` before a sink can ask) are read back from
        the local copy, which holds the whole attempt."""
        from unbroken.goodput.running import History  # it builds on this module

        with self._io:
            if self.history is None:
                self.history = History(self._read_local() if self.local.opened else [])

    def merge_history_steps_above(self, step: int) -> None:
        """Steps numbered above ``step`` may be merged in the history from now on."""
        with self._io:
            if self.history is not None:
                self.history.merge_steps_above = step

    def drop_history(self) -> None:
        """The sink gave up: keep nothing more."""
        with self._io:
            self.history = None

    def events_so_far(self) -> list[Event]:
        """What was flushed so far (``keep_history`` first), plus what is queued."""
        with self._io:
            queued = [e if isinstance(e, Event) else Event(*e) for e in list(self._queue)]
            return [*(self.history.events() if self.history is not None else []), *queued]

    def _read_local(self) -> list[Event]:
        return parse_lines(self.local.read().decode("utf-8", "replace"), self.local.path)

    def _run(self, sent: threading.Event) -> None:
        from unbroken._util.thread_names import name_native_thread

        name_native_thread()
        wait = 0.0  # the START at once, then every local_seconds
        while not self._stop.wait(wait):
            due = time.monotonic() - self._last_durable >= self.durable_seconds
            try:
                self.flush(durable=due, beat=self.clock() if wait else None)
            except Exception:  # never let accounting kill the job
                log.exception("goodput: event log flush failed")
            sent.set()
            wait = self.local_seconds


def _lines(events: list[Event]) -> bytes:
    return "".join(e.to_json() + "\n" for e in events).encode()


def _first_number(lines: list[bytes]) -> int | None:
    """The number of the first whole line (a reader skips a damaged one)."""
    for line in lines:
        try:
            return Event.from_json(line.decode("utf-8", "replace")).n
        except ValueError:
            continue
    return None


def _numbered(line: bytes) -> bool:
    """A numbered event's line (``to_json`` writes "n" after "t", before any "info")."""
    at, info = line.find(b',"n":'), line.find(b',"info":')
    return at >= 0 and (info < 0 or at < info)
