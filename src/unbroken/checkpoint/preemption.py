"""Preemption: the scheduler's SIGTERM becomes one agreed, committed save.

Slurm and Kubernetes send SIGTERM some seconds before they take a node; torchrun's
agent forwards it to every worker and kills them about 30 s later. The handler only
raises a flag. Ranks receive the signal at different moments, so they must agree on
the step to save at: ``maybe_save`` calls agree on the flag with a one-integer
all_reduce on a group of the manager's own, at a cadence the ranks also agree on. Where
a step is long (a quarter second or more), every call agrees, synchronously, so the
save comes at most one step after the signal; where steps are short, every k-th call
starts an asynchronous all_reduce and reads the one before (k up to 16, about a quarter
second of steps), so the loop does not wait for it.

A signal nothing acts on is not swallowed: after ``HANDLE_WITHIN_SECONDS`` of the loop's
own time without a ``maybe_save`` (a loop that ended, a long evaluation, a manager never
closed), a second signal, or once the manager is closed, it goes on to the handler before
ours (by default: the process ends, as SIGTERM meant). Time spent inside a manager's calls
that wait for commits does not count: a save waiting for the one in flight
(``when_busy="wait"``), the last ``save``, ``wait`` and ``close`` wait for commits the
signal must not cut short. A restore has none: its time counts.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from unbroken._util import worker_sigterm
from unbroken._util.collectives import Group, keep_until_released

log = logging.getLogger(__name__)
_watches: weakref.WeakSet[PreemptionWatch] = weakref.WeakSet()
_clock: tuple[int, float, float] = (0, 0.0, 0.0)
"""The main thread's manager calls under way (of any manager), when the outermost began,
and the seconds inside finished outermost calls: one tuple, replaced whole by the main
thread, so the watchdog reads a consistent one without a lock."""

AGREE_EVERY_SECONDS = 0.25
"""Loop time between two agreements on the flag (at most ``MAX_CALLS_BETWEEN`` calls)."""

MAX_CALLS_BETWEEN = 16
"""The most maybe_save calls between two agreements, however short the steps."""

HANDLE_WITHIN_SECONDS = 10.0
"""A signal no maybe_save acted on after this long of the loop's own time (outside the
managers' waiting calls) is passed on (see the module doc)."""

REPEAT_SECONDS = 5.0
"""A repeat of the first signal within this long, before its save is done or while the
process ends after it, is the same preemption, not a second one: Slurm signals every
process of the step and torchrun forwards its own copy milliseconds later. A repeat
after this long, or another signal, goes on as usual."""

EXIT_CODE = 128 + signal.SIGTERM
"""What a preempted process exits with after its save committed (the shell's code for a
process SIGTERM ended): a scheduler that runs it directly sees a terminated job; under
torchrun the agent counts it as a failed worker, restarts the workers while it has
restarts left and still runs, and otherwise exits 1 itself."""


class PreemptionWatch:
    """Turns ``signals`` into a flag the ranks agree on, chaining earlier handlers."""

    def __init__(
        self,
        group: Group,
        signals: tuple[int, ...] = (signal.SIGTERM,),
        on_give_up: Callable[[], None] | None = None,
    ) -> None:
        self.group = group
        self.on_give_up = on_give_up
        """Called before a signal that cannot be agreed on ends the process (a flush)."""
        self.received: int | None = None
        """The signal this process received, if any."""
        self._received_at = 0.0
        self.handled = False
        """The preemption save was made: later signals go on to the earlier handler."""
        self.ending = False
        """The process ends after that save: the handler stays (``saved``)."""
        self.tried: int | None = None
        """The step whose preemption save was started (and did not commit, unless handled)."""
        self.acting = False
        """A maybe_save took the signal up (its save may take a while: no watchdog then)."""
        self._closed = False
        self._forward = False
        self._exit_main = False
        self._noted_only = False
        self._previous: dict[int, Any] = {}
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._calls = 0
        self._every = 1  # calls between agreements, agreed by every rank; 1: synchronous
        self._agreed_at = (0, time.monotonic())
        self._deferring_workers = False
        self._pid = os.getpid()
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "CheckpointManager built outside the main thread: Python delivers signals "
                "to the main thread only, so preemption (SIGTERM) is not handled"
            )
            return
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        if signal.SIGTERM in signals:
            worker_sigterm.watch_started()
            self._deferring_workers = True
        _watches.add(self)

    def _on_signal(self, signum: int, frame: FrameType | None, *, chained: bool = False) -> None:
        if os.getpid() != self._pid:  # a forked child (a Pool's worker, a Process): not
            if chained:  # the watched process: as if no manager were there, or, under a
                self._chain(signum, frame)  # manager of the child's own, taking note only
            else:
                self._pass_on(signum, frame)
            return
        if self._exit_main:  # end_main_thread: the process ends here, as preempted
            self._exit_main = False
            raise SystemExit(EXIT_CODE)
        if chained:  # reached through a newer manager's handler, which took the signal up
            if not (self._closed or self.handled) and self.received is None:
                self.received = signum  # an open manager beneath saves at its next call
                self._noted_only = True  # the newer manager watches and passes it on
            self._chain(signum, frame)
            return
        if self._is_repeat(signum):
            log.info("%s again within %.0f s of the first: the same preemption (a launcher "
                     "forwarding it), not a second one", signal.Signals(signum).name,
                     REPEAT_SECONDS)  # fmt: skip
            if self.ending and _went_on_after_system_exit():
                raise SystemExit(EXIT_CODE)  # the process ends as preempted, once more
            return
        if self._closed or self._forward or self.handled or self.received is not None:
            # closed, timed out (the watchdog's copy of the first), saved, or a 2nd signal
            if (
                self.tried is not None
                and not (self.handled or self._closed or self._forward)
                and self._ends_the_process(signum)
            ):
                log.warning(  # else the log's last word says a save that never landed
                    "%s again while the preemption save of step %d is not committed: the "
                    "process ends without it (a restart loads the newest committed step)",
                    signal.Signals(signum).name, self.tried,
                )  # fmt: skip
            self._pass_on(signum, frame, chained=self._forward and signum == self.received)
            return
        self.received = signum
        self._received_at = time.monotonic()
        log.warning(
            "%s received: the next maybe_save saves the step reached and waits for its "
            "commit (the same signal again after %.0f s ends the process at once)",
            signal.Signals(signum).name,
            REPEAT_SECONDS,
        )
        threading.Thread(
            target=self._watchdog, args=(signum,), name="unbroken-preempt", daemon=True
        ).start()
        self._chain(signum, frame)

    def still_waiting(self, step: int) -> contextlib.AbstractContextManager[None]:
        """Warn every STILL_WAITING_SECONDS while the preemption save of ``step`` waits
        for its commit: a launcher's grace period (Slurm's KillWait) may end it, and the
        log should say why."""
        return _still_waiting_reports(step)

    def saved(self, *, ending: bool) -> None:
        """The preemption save committed: later signals go on to the earlier handler. But
        for a repeat of the first while the process ends (``ending``): the handler stays to
        the exit, so a launcher's copy of the signal during the teardown does not turn the
        exit code into a death by the signal (nor cuts a ``finally`` short); where the
        SystemExit was caught and the process went on, it raises SystemExit again."""
        self.handled, self.ending = True, ending

    def _is_repeat(self, signum: int) -> bool:
        """The first signal again, soon, while the save it asked for is still to come or
        the process ends after it."""
        return (
            signum == self.received
            and not self._forward
            and (self.ending or not self.handled)
            and time.monotonic() - self._received_at < REPEAT_SECONDS
        )

    def _chain(self, signum: int, frame: FrameType | None) -> None:
        """Tell the handlers installed before ours: other managers note the signal, the
        user's own handler runs; nothing here ends the process."""
        previous = self._previous.get(signum)
        inner = getattr(previous, "__self__", None)
        if isinstance(inner, PreemptionWatch):
            inner._on_signal(signum, frame, chained=True)
        elif callable(previous):
            previous(signum, frame)

    def _ends_the_process(self, signum: int) -> bool:
        """Whether passing ``signum`` on ends the process: the default action at the
        bottom of the chain, not a handler of the user's (which may only take note)."""
        previous = self._previous.get(signum, signal.SIG_DFL)
        inner = getattr(previous, "__self__", None)
        if isinstance(inner, PreemptionWatch):
            return inner._ends_the_process(signum)
        return previous in (signal.SIG_DFL, None)

    def _pass_on(self, signum: int, frame: FrameType | None, *, chained: bool = False) -> None:
        """What the signal would have done without any manager (main thread, in the
        handler): past other managers' handlers, to the one installed before them all.
        ``chained``: that handler, if the user's, already ran for this very signal."""
        previous = self._previous.get(signum, signal.SIG_DFL)
        inner = getattr(previous, "__self__", None)
        if isinstance(inner, PreemptionWatch):
            inner._pass_on(signum, frame, chained=chained)
        elif callable(previous):
            if not chained:
                previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _watchdog(self, signum: int) -> None:
        start, inside = time.monotonic(), _seconds_inside_managers()
        while True:
            if self.acting or self.handled or self._closed:
                return
            loop_seconds = time.monotonic() - start - (_seconds_inside_managers() - inside)
            if loop_seconds >= HANDLE_WITHIN_SECONDS:
                break
            time.sleep(0.1)
        log.warning(
            "%s: no maybe_save acted on it within %.0f s of the loop's time; passing it on",
            signal.Signals(signum).name,
            HANDLE_WITHIN_SECONDS,
        )
        self._forward = True
        os.kill(os.getpid(), signum)  # the main thread's handler passes it on

    def poll(self) -> bool:
        """Once per ``maybe_save`` on every rank: True when every rank must save now.

        When a signal came and the ranks cannot agree (a peer is gone: torchrun stops the
        survivors of a crash with SIGTERM), no save could commit: the signal goes on at
        once, as if no manager were there."""
        if self.handled or self.acting:
            return False
        try:
            self.acting = self._agree()
        except Exception as e:
            self._pending = None
            if self.received is None:
                raise  # a peer is gone, and nobody asked this process to end: the loop's
            self._give_up(e)
            raise
        return self.acting

    def _give_up(self, error: BaseException) -> None:
        assert self.received is not None
        log.warning(
            "%s: the ranks cannot agree on a save (%s): a peer is gone, so no save could "
            "commit; ending now",
            signal.Signals(self.received).name,
            _first_line(error),
        )
        if self.on_give_up is not None:
            self.on_give_up()
        self._forward = True
        self._pass_on(self.received, None, chained=True)  # the user's handler ran already

    def _agree(self) -> bool:
        if self.group.pg is None:
            return self.received is not None
        self._calls += 1
        calls, since = self._agreed_at
        if self._calls - calls < self._every:
            return False
        if self._calls == 1:  # no step timed yet: the manager may have been made just now,
            proposal = 1  # in this very call (Fabric's plugin), and 0 s a call means 16
        else:
            per_call = max((time.monotonic() - since) / max(self._calls - calls, 1), 1e-6)
            proposal = max(1, min(MAX_CALLS_BETWEEN, int(AGREE_EVERY_SECONDS / per_call)))
        self._agreed_at = (self._calls, time.monotonic())
        mine = torch.tensor([0 if self.received is None else 1, proposal], dtype=torch.int64)
        if self._every == 1:  # long steps: agree now
            if self._pending is not None:  # left from a faster phase: read it first
                agreed = self._read_pending()
                if agreed:
                    return True
            try:
                dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.group.pg)
            finally:
                keep_until_released(mine)
            self._every = int(mine[1])
            return bool(mine[0])
        agreed = self._read_pending()
        if not agreed:
            work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.group.pg, async_op=True)
            self._pending = (work, mine)
        return agreed

    def _read_pending(self) -> bool:
        if self._pending is None:
            return False
        work, flags = self._pending
        work.wait()
        self._pending = None
        keep_until_released(flags)
        self._every = int(flags[1])
        return bool(flags[0])

    @property
    def unhandled(self) -> int | None:
        """The signal received that no save took up (``close`` passes it on)."""
        return self.received if not (self.handled or self._noted_only) else None

    def close(self) -> None:
        """Put the earlier handlers back; finish the agreement in flight (every rank has
        issued it, so it completes unless a peer is gone). A signal received and never
        acted on goes on now."""
        if self._pending is not None:
            try:
                self._pending[0].wait()
            except Exception as e:  # a peer is gone: nothing left to agree with
                log.debug("preemption agreement in flight failed at close: %s", e)
            self._pending = None
        self._closed = True
        if self._deferring_workers:
            worker_sigterm.watch_stopped()
            self._deferring_workers = False
        unhandled = self.unhandled
        if threading.current_thread() is threading.main_thread() and not self.ending:
            self._put_back_handlers()
            if unhandled is not None:
                log.warning("closing with a %s no maybe_save acted on: passing it on",
                            signal.Signals(unhandled).name)  # fmt: skip
                self._pass_on(unhandled, None, chained=True)

    def end_main_thread(self) -> None:
        """The loop saved on another thread, where ``SystemExit`` ends that thread alone
        (the process went on, then exited 0 after a preemption): the signal again, to the
        main thread, whose handler here raises it there."""
        self._exit_main = True
        signal.pthread_kill(threading.main_thread().ident, self.received or signal.SIGTERM)

    def _put_back_handlers(self) -> None:
        """Main thread: the handlers installed before ours are the signals' again."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous)


def _went_on_after_system_exit() -> bool:
    """In the handler, after the preemption's SystemExit: whether it was caught and the
    process went on (a notebook, a trial runner), not still on its way out through
    ``finally`` blocks (where the exception is the one handled) or the interpreter's
    teardown (where the main thread has stopped)."""
    on_the_way_out = isinstance(sys.exc_info()[1], SystemExit)
    return threading.main_thread().is_alive() and not on_the_way_out


@atexit.register
def _end_by_the_signal_at_exit() -> None:
    """The interpreter is ending (an exception out of the loop: a peer's crash made a
    collective fail) with a signal no save took up: end by it now, as the process would
    have when it came, rather than through the interpreter's teardown (seconds with torch
    loaded, each one added to torchrun's restart)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for watch in list(_watches):
        if watch.handled or watch._closed or watch._noted_only:
            continue
        if watch.received is None:  # one that comes during the teardown acts at once
            watch._put_back_handlers()
            continue
        name = signal.Signals(watch.received).name
        if watch.tried is not None:
            log.warning("%s received; its save of step %d failed: ending by the signal",
                        name, watch.tried)  # fmt: skip
        else:
            log.warning("%s received and the process is ending before a save took it up: "
                        "ending by the signal", name)  # fmt: skip
        if watch.on_give_up is not None:
            watch.on_give_up()
        watch._forward = True
        watch._pass_on(watch.received, None, chained=True)
        return


_Call = TypeVar("_Call", bound=Callable[..., Any])


def not_the_loops_time(method: _Call) -> _Call:
    """For a manager's calls that wait for commits (of any manager: a second one for an
    EMA): the loop is not idle meanwhile, so their time does not count against
    ``HANDLE_WITHIN_SECONDS``. Only the main thread's: the loop's, where the signal is
    handled (a thread of the user's waiting in ``wait()`` must not hold it)."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        global _clock
        if threading.current_thread() is not threading.main_thread():
            return method(*args, **kwargs)
        depth, since, total = _clock
        _clock = (depth + 1, time.monotonic() if depth == 0 else since, total)
        try:
            return method(*args, **kwargs)
        finally:
            depth, since, total = _clock
            _clock = (depth - 1, since, total + time.monotonic() - since if depth == 1 else total)

    return call  # type: ignore[return-value]


def _seconds_inside_managers() -> float:
    """The main thread's time inside managers' waiting calls so far, the one under way
    included."""
    depth, since, total = _clock
    return total + (time.monotonic() - since if depth else 0.0)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


STILL_WAITING_SECONDS = 10.0
"""How often a preemption save that has not committed says so: a launcher's grace
period (Slurm's KillWait) may end it, and the log should tell why."""


@contextlib.contextmanager
def _still_waiting_reports(step: int) -> Iterator[None]:
    """While the body waits for ``step``'s commit, warn every STILL_WAITING_SECONDS."""
    done = threading.Event()

    def report() -> None:
        began = time.monotonic()
        while not done.wait(STILL_WAITING_SECONDS):
            waited = time.monotonic() - began
            log.warning("preempted: step %d not committed after %.0f s (the durable tier "
                        "slow or not answering?); still waiting", step, waited)  # fmt: skip

    threading.Thread(target=report, name="unbroken-preempt-wait", daemon=True).start()
    try:
        yield
    finally:
        done.set()
