"""Every optimizer's ``step()`` waits for a staging copy in flight, whoever holds it.

Parameters and optimizer state change in ``step()``. The optimizer that does it need not
be in the saved state (``state = {"model": model}`` with the optimizer kept apart), so the
wait is one global step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``)
rather than one per optimizer handed to the manager. Global, it reaches every optimizer of
the process; it waits only while a copy is in flight and otherwise returns after one
look at an empty set. It is registered when the first stager opens and removed when the
last one closes (a stager never closed leaves that cheap hook behind).

Registration and removal happen on the caller's thread (a stager's construction and
``close()``): torch iterates its hooks while stepping, so they must not change under a
``step()`` running on another thread.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Protocol

from torch.optim.optimizer import register_optimizer_step_pre_hook


class Waitable(Protocol):
    def _hook_wait(self) -> None:
        """On the training thread, before a step: wait for the copy and seal its verdict."""


_lock = threading.Lock()
_users = 0
_handle: Any = None
_in_flight: set[Waitable] = set()


def open_gate() -> None:
    """A stager opened: the hook is there while at least one is open."""
    global _users, _handle
    with _lock:
        _users += 1
        if _handle is None:
            _handle = register_optimizer_step_pre_hook(_before_step)


def close_gate() -> None:
    """A stager closed (call once per ``open_gate``); the last one removes the hook."""
    global _users, _handle
    with _lock:
        _users -= 1
        if _users == 0 and _handle is not None:
            _handle.remove()
            _handle = None


def hold(copy: Waitable) -> None:
    """Steps wait for ``copy`` until it is ``let_go``."""
    with _lock:
        _in_flight.add(copy)


def let_go(copy: Waitable) -> None:
    with _lock:
        _in_flight.discard(copy)


def open_stagers() -> int:
    """Stagers open now; the hook is registered while there is at least one."""
    return _users


def copies_in_flight() -> int:
    """Copies that optimizer steps wait for now."""
    return len(_in_flight)


def _forget_copies_after_fork() -> None:
    """A forked child (a ``multiprocessing`` worker fine-tuning a probe) has none of the
    parent's copy threads, and its tensors are its own: its steps wait for nothing."""
    global _lock
    _in_flight.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_copies_after_fork)


def _before_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    wait_for_copies()


def wait_for_copies() -> None:
    """Wait for the staging copies in flight, as a step does: for code that writes the
    saved tensors in place outside an optimizer's step (a ``load_state_dict``)."""
    if not _in_flight:  # the cost of every step while no copy runs
        return
    with _lock:
        waiting = list(_in_flight)
    for copy in waiting:
        copy._hook_wait()
