"""Preemption: the scheduler's SIGTERM becomes one agreed, committed save.

Slurm and Kubernetes send SIGTERM some seconds before they take a node; torchrun's
agent forwards it to every worker and kills them about 30 s later. The handler only
raises a flag. Ranks receive the signal at different moments, so they must agree on
the step to save at: every ``POLL_EVERY_CALLS``-th ``maybe_save`` call starts a tiny
asynchronous all_reduce of the flag on a group of its own and reads the result of the
one before, which has long arrived by then. The loop does not wait for it, and every
rank learns of the signal at the same call, at most ``2 * POLL_EVERY_CALLS`` calls
after the first rank raised its flag.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from unbroken.checkpoint.collectives import Group

log = logging.getLogger(__name__)

POLL_EVERY_CALLS = 4
"""Calls between two agreements: fewer collectives (each costs tens of microseconds of
launch, more on a loaded CPU), against a few more steps of the grace period."""

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
        self._previous: dict[int, Any] = {}
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._calls = 0
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "CheckpointManager built outside the main thread: Python delivers signals "
                "to the main thread only, so preemption (SIGTERM) is not handled"
            )
            return
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        first = self.received is None
        self.received = signum
        if first:
            log.warning(
                "%s received: the next maybe_save saves the step reached and waits for "
                "its commit", signal.Signals(signum).name
            )
        previous = self._previous.get(signum)
        if callable(previous):  # the user's own handler still runs
            previous(signum, frame)

    def poll(self) -> bool:
        """Once per ``maybe_save`` on every rank: True when every rank must save now."""
        if self.group.pg is None:
            return self.received is not None
        self._calls += 1
        if self._calls % POLL_EVERY_CALLS:
            return False
        agreed = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            self._pending = None
            agreed = bool(flag.item())
        if not agreed:
            flag = torch.tensor([0 if self.received is None else 1], dtype=torch.int32)
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group.pg, async_op=True)
            self._pending = (work, flag)
        return agreed

    def close(self) -> None:
        """Put the earlier handlers back; finish the agreement in flight (every rank has
        issued it, so it completes)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, previous)
        self._previous.clear()

