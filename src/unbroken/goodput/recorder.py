"""The process-local goodput recorder: what the manager and the loader call.

The ``CheckpointManager`` owns one (its event log lives beside its checkpoints) and makes
it the process's current recorder; the ``DataLoader`` reports each batch's wait to the
current recorder, if there is one. Every call from the training loop is a few float
operations and a deque append; the log's thread does all I/O.

Off with ``CheckpointManager(goodput=False)`` or ``UNBROKEN_GOODPUT=0``.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from typing import Any

from unbroken._util.job import job_id
from unbroken._util.procs import process_start_ticks
from unbroken.goodput import events as ev
from unbroken.goodput.salvage import salvage_local_logs
from unbroken.storage import Store

log = logging.getLogger(__name__)

INTERVAL = "interval"
"""An event: ``every_seconds="auto"`` chose a save interval (info: seconds, save_cost, mtbf)."""

_open: tuple[Recorder, ...] = ()
"""The process's open records, oldest first (a tuple: the loader reads it every batch)."""
_process_start_claimed = False
_claim_lock = threading.Lock()


def note_data_wait(seconds: float, metrics: Any = None) -> None:
    """The loader's hook: the training loop waited ``seconds`` for a batch (``metrics``:
    the loader's LoaderMetrics, read by the MLflow sink for the cache hit ratio). Every
    open manager's record gets it: the loop waited in each one's timeline (a model's
    manager and an EMA's, each its own URL), not only in the newest's."""
    for rec in _open:
        rec.data_wait(seconds, metrics)


def enabled_by_env() -> bool:
    return os.environ.get("UNBROKEN_GOODPUT", "1").strip().lower() not in ("0", "false", "off")


def process_start_time() -> float | None:
    """When the OS started this process (unix seconds), so imports and set-up count;
    None where /proc is missing. Uptime, not /proc/stat's whole-second btime, gives the
    boot time to a clock tick."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22: starttime
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


class NullRecorder:
    """Recording switched off: every call (those of :class:`Recorder`) does nothing."""

    restore_begin = restore_end = step = data_wait = staticmethod(_nothing)
    save_begin = save_end = commit = close = abandon = interval = staticmethod(_nothing)


class Recorder(NullRecorder):
    """Records one rank's events of this attempt into an :class:`~events.EventLog`."""

    def __init__(self, event_log: ev.EventLog, wall0: float, mono0: float) -> None:
        self.log = event_log
        self._wall0, self._mono0 = wall0, mono0
        self._n = itertools.count()
        self._step_begin = self.now()
        self._waited = 0.0
        self._closed = False
        self._pid = os.getpid()  # a forked child that exits leaves this log alone
        self._save_t0: float | None = None
        # Running figures for a sink (MLflow); plain attributes, read by its thread.
        self.steps_seen = 0
        self.last_step: int | None = None
        self.waited_total = 0.0
        self.blocked_total = 0.0
        self.last_commit: dict[str, Any] | None = None
        self.loader_metrics: Any = None
        self.checkpoint_interval_seconds: float | None = None
        self.sink: Any = None

    def now(self) -> float:
        """Wall time on a monotonic clock (an NTP step does not bend the timeline)."""
        return self._wall0 + (time.monotonic() - self._mono0)

    def _add(self, kind: str, **fields: Any) -> None:
        self.log.append(ev.Event(kind, self.now(), next(self._n), **fields))

    def restore_begin(self) -> None:
        self._add(ev.RESTORE_BEGIN)

    def restore_end(self, step: int | None, *, tier: str | None = None) -> None:
        """``tier``: where the restored bytes came from ("memory", "staging+durable")."""
        self._add(ev.RESTORE_END, step=step, **({"info": {"tier": tier}} if tier else {}))
        self._step_begin, self._waited = self.now(), 0.0  # the loop starts here

    def step(self, step: int) -> None:
        # The hot path: a tuple, made into an Event by the log's thread.
        t = self._wall0 + (time.monotonic() - self._mono0)
        self.log.append((ev.STEP, t, next(self._n), step, self._step_begin, self._waited))
        self._step_begin, self._waited = t, 0.0
        self.steps_seen += 1
        self.last_step = step

    def data_wait(self, seconds: float, metrics: Any = None) -> None:
        self._waited += seconds
        self.waited_total += seconds
        self.loader_metrics = metrics

    def save_begin(self, step: int | None, *, wait: bool = False) -> None:
        self._save_t0 = time.monotonic()
        self._add(ev.SAVE_BEGIN, step=step, info={"wait": True} if wait else {})

    def save_end(self, step: int | None, *, wait: bool = False) -> None:
        if self._save_t0 is not None:
            self.blocked_total += time.monotonic() - self._save_t0
            self._save_t0 = None
        self._add(ev.SAVE_END, step=step, info={"wait": True} if wait else {})

    def commit(
        self,
        step: int,
        *,
        ok: bool,
        seconds: float | None,
        nbytes: int,
        upload_seconds: float | None = None,
    ) -> None:
        """Worker thread: a save finished (committed or failed)."""
        info = {"ok": ok, "seconds": seconds, "nbytes": nbytes, "upload_seconds": upload_seconds}
        self._add(ev.COMMIT, step=step, info=info)
        if ok:
            self.last_commit = info

    def interval(self, seconds: float, *, save_cost: float | None, mtbf: float) -> None:
        """``every_seconds="auto"`` chose a new save interval."""
        self.checkpoint_interval_seconds = seconds
        self._add(INTERVAL, info={"seconds": seconds, "save_cost": save_cost, "mtbf": mtbf})

    def close(self, *, preempted: bool = False) -> None:
        """A clean end: the last event, flushed to the durable tier now. ``preempted``:
        the job goes on in a later attempt (the time until then is down, not idle)."""
        if self._closed:
            return
        self._add(ev.END, info={"preempted": True} if preempted else {})
        self._finish(clean=True, preempted=preempted)

    def abandon(self) -> None:
        """The owner went away without close() (or the interpreter exits): flush, no END."""
        if not self._closed and os.getpid() == self._pid:
            self._finish(clean=False)

    def _finish(self, *, clean: bool, preempted: bool = False) -> None:
        global _open
        self._closed = True
        _open = tuple(r for r in _open if r is not self)
        self.log.close(beat=self.now(), remove_local=True)
        if self.sink is not None:
            self.sink.close(clean=clean, preempted=preempted)


def start(
    store: Store,
    staging_dir: str,
    group: Any,
    *,
    enabled: bool,
    owner: object,
    mlflow: bool = True,
) -> NullRecorder:
    """The recorder of a new manager (collective over ``group``: rank 0 names the
    attempt); a NullRecorder when switched off. Rank 0 also feeds MLflow when it is
    configured (see :mod:`unbroken.goodput.mlflow_sink`) and ``mlflow``."""
    global _open, _process_start_claimed
    if not (enabled and enabled_by_env()):
        return NullRecorder()
    wall0, mono0 = time.time(), time.monotonic()
    with _claim_lock:
        # A second manager in one process: its attempt starts now, not at process start.
        started = None if _process_start_claimed else process_start_time()
        _process_start_claimed = True
    started = min(started, wall0) if started is not None else wall0
    proposal = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(started))}-{secrets.token_hex(3)}"
    attempt = group.broadcast(proposal)
    rank = getattr(group, "global_rank", 0)
    _salvage_in_the_background(store, staging_dir)
    event_log = ev.EventLog(
        store, staging_dir, attempt, rank, durable_seconds=_durable_seconds(rank)
    )
    rec = Recorder(event_log, wall0, mono0)
    event_log.clock = rec.now
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "rank": rank,
        "world_size": getattr(group, "world_size", 1),
        "attempt": attempt,
        "recorder_t": wall0,
        "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
        "job": job_id(),
        "started": process_start_ticks(os.getpid()),
    }
    event_log.append(ev.Event(ev.START, started, next(rec._n), info=info))
    event_log.start()
    if rank == 0:
        from unbroken.goodput import mlflow_sink

        try:
            rec.sink = mlflow_sink.start(store, rec, attempt, enabled=mlflow)
        except Exception as exc:  # never fail the manager over a dashboard
            log.warning("goodput: MLflow logging not started: %s", exc)
    _open = (*_open, rec)
    weakref.finalize(owner, rec.abandon)
    return rec


SALVAGE_WAIT_SECONDS = 2.0
"""How long a new manager waits for the salvage of dead attempts' local logs: the
readers of the log (the autopilot, MLflow) then see those attempts' tails; a store
that is down (each upload riding out its retries) does not hold the job's start."""


def _salvage_in_the_background(store: Store, staging_dir: str) -> None:
    def run() -> None:
        try:
            salvage_local_logs(store, staging_dir)
        except Exception as exc:
            log.warning("goodput: salvaging earlier local event logs failed: %s", exc)

    thread = threading.Thread(target=run, name="unbroken-goodput-salvage", daemon=True)
    thread.start()
    thread.join(SALVAGE_WAIT_SECONDS)


def _durable_seconds(rank: int) -> float:
    """Rank 0's log (the job's figure) goes to the durable tier every minute; the other
    ranks' once at the start (``EventLog.start``'s thread, at once) and at the end
    (close or exit), their crashed tails by the next attempt on the node: a thousand
    ranks must not fill the durable tier's listings.
    ``UNBROKEN_GOODPUT_FLUSH`` (seconds) sets it for every rank."""
    default = 60.0 if rank == 0 else float("inf")
    value = os.environ.get("UNBROKEN_GOODPUT_FLUSH", "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:  # a typo must not stop a training job over its accounting
        if rank == 0:  # once per job, not once per rank
            log.warning("goodput: UNBROKEN_GOODPUT_FLUSH=%r is not a number of seconds; "
                        "using the default", value)  # fmt: skip
        return default
    return seconds  # 0: at every tick of the log's thread


@atexit.register
def _flush_at_exit() -> None:
    for rec in _open:
        try:
            rec.abandon()
        except Exception:
            pass
