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

A signal nothing acts on is not swallowed: after ``HANDLE_WITHIN_SECONDS`` without a
``maybe_save`` (a loop that ended, a long evaluation, a manager never closed), a second
signal, or once the manager is closed, it goes on to the handler before ours (by
default: the process ends, as SIGTERM meant).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from unbroken.checkpoint.collectives import Group

log = logging.getLogger(__name__)

AGREE_EVERY_SECONDS = 0.25
"""Loop time between two agreements on the flag (at most ``MAX_CALLS_BETWEEN`` calls)."""

MAX_CALLS_BETWEEN = 16
"""The most maybe_save calls between two agreements, however short the steps."""

HANDLE_WITHIN_SECONDS = 10.0
"""A signal no maybe_save acted on after this long is passed on (see the module doc)."""

EXIT_CODE = 128 + signal.SIGTERM
"""What a preempted process exits with after its save committed (as if SIGTERM had
ended it): torchrun restarts such workers where it still runs, a scheduler sees the
usual code of a terminated job."""


class PreemptionWatch:
    """Turns ``signals`` into a flag the ranks agree on, chaining earlier handlers."""

    def __init__(self, group: Group, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.group = group
        self.received: int | None = None
        """The signal this process received, if any."""
        self.handled = False
        """The preemption save was made: later signals go on to the earlier handler."""
        self.acting = False
        """A maybe_save took the signal up (its save may take a while: no watchdog then)."""
        self._closed = False
        self._forward = False
        self._noted_only = False
        self._previous: dict[int, Any] = {}
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._calls = 0
        self._every = 1  # calls between agreements, agreed by every rank; 1: synchronous
        self._agreed_at = (0, time.monotonic())
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "CheckpointManager built outside the main thread: Python delivers signals "
                "to the main thread only, so preemption (SIGTERM) is not handled"
            )
            return
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None, *, chained: bool = False) -> None:
        if chained:  # reached through a newer manager's handler, which took the signal up
            if not (self._closed or self.handled) and self.received is None:
                self.received = signum  # an open manager beneath saves at its next call
                self._noted_only = True  # the newer manager watches and passes it on
            self._chain(signum, frame)
            return
        if self._closed or self._forward or self.handled or self.received is not None:
            self._pass_on(signum, frame)  # closed, timed out, already saved, or a 2nd signal
            return
        self.received = signum
        log.warning(
            "%s received: the next maybe_save saves the step reached and waits for its "
            "commit (a second one ends the process at once)", signal.Signals(signum).name
        )
        threading.Thread(
            target=self._watchdog, args=(signum,), name="unbroken-preempt", daemon=True
        ).start()
        self._chain(signum, frame)

    def _chain(self, signum: int, frame: FrameType | None) -> None:
        """Tell the handlers installed before ours: other managers note the signal, the
        user's own handler runs; nothing here ends the process."""
        previous = self._previous.get(signum)
        inner = getattr(previous, "__self__", None)
        if isinstance(inner, PreemptionWatch):
            inner._on_signal(signum, frame, chained=True)
        elif callable(previous):
            previous(signum, frame)

    def _pass_on(self, signum: int, frame: FrameType | None) -> None:
        """What the signal would have done without any manager (main thread, in the
        handler): past other managers' handlers, to the one installed before them all."""
        previous = self._previous.get(signum, signal.SIG_DFL)
        inner = getattr(previous, "__self__", None)
        if isinstance(inner, PreemptionWatch):
            inner._pass_on(signum, frame)
        elif callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _watchdog(self, signum: int) -> None:
        deadline = time.monotonic() + HANDLE_WITHIN_SECONDS
        while time.monotonic() < deadline:
            if self.acting or self.handled or self._closed:
                return
            time.sleep(0.1)
        log.warning(
            "%s: no maybe_save acted on it within %.0f s; passing it on",
            signal.Signals(signum).name,
            HANDLE_WITHIN_SECONDS,
        )
        self._forward = True
        os.kill(os.getpid(), signum)  # the main thread's handler passes it on

    def poll(self) -> bool:
        """Once per ``maybe_save`` on every rank: True when every rank must save now."""
        if self.handled or self.acting:
            return False
        self.acting = self._agree()
        return self.acting

    def _agree(self) -> bool:
        if self.group.pg is None:
            return self.received is not None
        self._calls += 1
        calls, since = self._agreed_at
        if self._calls - calls < self._every:
            return False
        per_call = (time.monotonic() - since) / max(self._calls - calls, 1)
        proposal = max(1, min(MAX_CALLS_BETWEEN, int(AGREE_EVERY_SECONDS / max(per_call, 1e-6))))
        self._agreed_at = (self._calls, time.monotonic())
        mine = torch.tensor([0 if self.received is None else 1, proposal], dtype=torch.int64)
        if self._every == 1:  # long steps: agree now
            if self._pending is not None:  # left from a faster phase: read it first
                agreed = self._read_pending()
                if agreed:
                    return True
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.group.pg)
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
        self._every = int(flags[1])
        return bool(flags[0])

    def close(self) -> None:
        """Put the earlier handlers back; finish the agreement in flight (every rank has
        issued it, so it completes). A signal received and never acted on goes on now."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
        self._closed = True
        unhandled = self.received if not (self.handled or self._noted_only) else None
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, previous)
            if unhandled is not None:
                log.warning("closing with a %s no maybe_save acted on: passing it on",
                            signal.Signals(unhandled).name)  # fmt: skip
                self._pass_on(unhandled, None)
