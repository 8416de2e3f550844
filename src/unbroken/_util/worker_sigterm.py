"""DataLoader workers outlive a SIGTERM meant for their rank, and end with the rank.

Schedulers do not signal one process. torchrun stops a rank with ``os.killpg`` (the rank's
whole process group: its DataLoader workers too), Slurm signals every process of the
step, and Kubernetes' SIGTERM to torchrun reaches the workers through torchrun. torch's
worker handler then re-raises SIGTERM and the worker dies; the training process's
SIGCHLD handler raises ``DataLoader worker (pid N) is killed by signal: Terminated``
from wherever it happens to be, before the preemption save can start, and the save
would need the workers' next batches anyway.

So a worker blocks SIGTERM and takes it on a thread of its own with ``sigwaitinfo``,
which names the sender: from its parent (torch's ``terminate()`` of a stuck worker, or
multiprocessing's at exit) it ends at once, as torch's handler would; from anyone else
it waits for its parent to end (the parent is saving), then ends.

A SIGTERM at a worker's very start, before that is set up, would find the parent's
handler: a multiprocessing child is forked with SIGTERM blocked (a signal then waits), and
unblocked once it is known not to be a DataLoader worker. Any other forked child meets
the preemption watch's handler, which passes the signal on as if no manager were there.

A worker forked from the main thread also dies with its parent at once (Linux's
parent-death signal): it holds copies of every socket its parent had, the gloo
connections to the other ranks among them, so a rank SIGKILLed with live workers looks
alive to its peers, whose collectives block until torch's watchdog ends the orphans (5 s)
instead of failing at once. Only from the main thread: that signal follows the thread
that forked, not the process.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import threading

from unbroken._util.procs import die_with_parent

log = logging.getLogger(__name__)

PARENT_POLL_SECONDS = 0.1
"""How often a worker holding a deferred SIGTERM looks whether its parent has ended."""


_guarded_pid: int | None = None
_watches = 0
_hook_registered = False
_lock = threading.Lock()
_watch_pid = 0
"""The process whose preemption watch started: only its forks block SIGTERM (a child's
own forks, whose grandchildren run no multiprocessing hook, must not)."""
_fork = threading.local()
"""In the thread forking a multiprocessing child, and so in that child: ``mask``, the
signal mask SIGTERM was blocked over (until the child's after-fork hook); ``from_main``,
whether the fork came from the main thread. Per thread: a mask and a parent-death signal
are a thread's, and two threads may fork at once."""


def defer_sigterm_in_this_worker() -> None:
    """Called in a DataLoader worker, before it starts threads of its own: SIGTERM from
    anyone but the parent waits for the parent's end. Idempotent."""
    global _guarded_pid
    if _guarded_pid == os.getpid() or not hasattr(signal, "sigwaitinfo"):
        return
    _guarded_pid = os.getpid()
    parent = os.getppid()
    if getattr(_fork, "from_main", False):
        die_with_parent(parent)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(
        target=_take_sigterm, args=(parent,), name="unbroken-sigterm", daemon=True
    ).start()


def _take_sigterm(parent: int) -> None:
    deferred = False
    while True:
        if deferred:  # look at the parent now and then, and still take its own signal
            info = signal.sigtimedwait({signal.SIGTERM}, PARENT_POLL_SECONDS)
        else:
            info = signal.sigwaitinfo({signal.SIGTERM})
        if os.getppid() != parent or (info is not None and info.si_pid == parent):
            os._exit(0)  # the parent asked (or is gone): what torch's own handler does
        if info is not None and not deferred:
            deferred = True
            log.debug("DataLoader worker %d: SIGTERM from pid %d deferred until its "
                      "parent ends", os.getpid(), info.si_pid)  # fmt: skip


def watch_started() -> None:
    """A preemption watch is in place in this process: from now on every DataLoader
    worker it forks (torch's own DataLoader too, not only ours) defers SIGTERM."""
    global _watches, _hook_registered, _watch_pid
    with _lock:
        _watches += 1
        _watch_pid = os.getpid()
        if not _hook_registered:
            multiprocessing.util.register_after_fork(_HOOK_OWNER, _after_fork_in_child)
            _hook_registered = True


def watch_stopped() -> None:
    global _watches
    with _lock:
        _watches = max(0, _watches - 1)


def _after_fork_in_child(_owner: object) -> None:
    """multiprocessing's after-fork hook, in every child it forks (before its target)."""
    mask, _fork.mask = getattr(_fork, "mask", None), None
    target = getattr(multiprocessing.current_process(), "_target", None)
    if _watches > 0 and getattr(target, "__module__", None) == "torch.utils.data._utils.worker":
        defer_sigterm_in_this_worker()  # a SIGTERM that came since the fork waits for it
    elif mask is not None:  # not a worker: a SIGTERM that came goes on now
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _before_fork() -> None:
    _fork.from_main = threading.current_thread() is threading.main_thread()
    _fork.mask = None
    if _watches > 0 and os.getpid() == _watch_pid and _forked_by_multiprocessing():
        _fork.mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _after_fork_in_parent() -> None:
    mask, _fork.mask = getattr(_fork, "mask", None), None
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _forked_by_multiprocessing() -> bool:
    """Whether multiprocessing itself calls this fork (its child runs the after-fork
    hook that unblocks; a plain os.fork's child or a subprocess's would stay blocked)."""
    caller = sys._getframe(2)  # 0: here, 1: _before_fork, 2: os.fork's caller (os.fork,
    # in C, has no frame)
    return caller.f_code.co_filename.endswith(_POPEN_FORK)


_POPEN_FORK = os.path.join("multiprocessing", "popen_fork.py")


class _HookOwner:
    """What register_after_fork holds (weakly) for the hook: alive as long as this module."""


_HOOK_OWNER = _HookOwner()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent)
