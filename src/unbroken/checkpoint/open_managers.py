"""The managers open in this process: closed at the interpreter's end, and an older one
on a staging dir closed when a new one opens there.

At the end, as ``with`` would have. Why: a script that ended without ``close()``
(forgotten; a notebook's kernel shut down) lost the saves still in flight, since the
interpreter's end abandons background work: a run that saved steps 5 and 10 of ten left
no checkpoint at all. The hook runs among ``threading``'s exit hooks, which run before
``concurrent.futures`` stops its pools (in reverse order of registration, and this one
registers after that module is imported), so the save's own pools still take its work.
Where an uncaught exception ended the script, a job of one process closes as ``with``
does on an exception (the save in flight lands; the run is not marked finished). A job
of several processes leaves it abandoned, as before: a peer that crashed would hold the
commit's collectives until their timeout. A preemption's signal received and not acted
on ends the process by that signal (``preemption.py``), within its grace period.

A new manager on a staging dir an open one of this process uses: a notebook cell run
again (after an exception, the old manager often out of the user's reach: inside a
Trainer's callback). Both would tidy the dir's steps; the older is closed first (its
save in flight lands), with a warning, and its saves then say it is closed.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread as pool_threads  # its exit hook first: ours runs before it
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from typing import Any

from unbroken.checkpoint.staging.owner import StagingDirInUseError
from unbroken.storage.errors import redact

log = logging.getLogger(__name__)

EXIT_SAVE_SECONDS = 300.0
"""How long the interpreter's end waits, in all, for open managers' saves in flight."""

_open: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
"""Open managers, and the process that made each (a forked child closes none of them)."""
_lock = threading.Lock()


def track(manager: Any) -> None:
    """Close ``manager`` when the interpreter ends, if it is still open then."""
    with _lock:
        _open[manager] = os.getpid()


def _crashed() -> bool:
    """An uncaught exception ended the script (its traceback was printed); in an
    interactive session (a REPL, Jupyter) one cell's traceback ended nothing."""
    if getattr(sys, "last_value", None) is None:
        return False
    ipython = sys.modules.get("IPython")
    return not (
        hasattr(sys, "ps1")
        or sys.flags.interactive
        or (ipython is not None and ipython.get_ipython() is not None)
    )


def _let_loop_threads_end() -> None:
    """The interpreter joins the non-daemon threads after these hooks: a loop still
    running on one (the main thread returned) uses its manager until it ends. Join them
    first, the pools' workers apart (their own hook, after this one, ends them)."""
    workers = getattr(pool_threads, "_threads_queues", {})  # CPython's registry of them
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.daemon or not thread.is_alive():
            continue
        if thread not in workers:
            thread.join()


def _close_open_managers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    with _lock:
        if not any(pid == os.getpid() and not m._closed for m, pid in _open.items()):
            return
    _let_loop_threads_end()
    crashed = _crashed()
    deadline = time.monotonic() + EXIT_SAVE_SECONDS
    with _lock:
        managers = [m for m, pid in _open.items() if pid == os.getpid()]
    for manager in managers:
        if manager._closed or (crashed and manager._group.world_size > 1):
            continue
        watch = manager._preemption
        if watch is not None and watch.received is not None:
            continue  # a preemption's signal: it ends the process its own way, at once
        job = manager._pipeline.in_flight
        if manager._group.world_size > 1 and not _group_alive():
            if job is not None:
                log.warning("the save of step %d is lost: the process group was destroyed "
                            "before close(); call mgr.close() before "
                            "dist.destroy_process_group()", job.step)  # fmt: skip
            continue
        if job is not None:
            log.warning(
                "the process is ending with the CheckpointManager of %s open (close() was "
                "never called): its save of step %d finishes first. Call close(), or use "
                "`with CheckpointManager(...) as mgr:`", redact(manager.store.url), job.step,
            )  # fmt: skip
            try:  # as the loop's wait: counted as saving, not as the loop's time
                manager.wait(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                log.warning("the save of step %d is still under way after %.0f s: "
                            "abandoned", job.step, EXIT_SAVE_SECONDS)  # fmt: skip
                continue
            except Exception:
                pass  # its failure is said as the manager closes
        try:
            manager._close(clean=not crashed, failed=crashed)  # crashed: no END
        except Exception as exc:  # nothing can raise to the user now
            log.warning("closing the CheckpointManager of %s at exit: %s",
                        redact(manager.store.url), exc)  # fmt: skip


def _group_alive() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def close_older_on(staging_dir: str, url: str) -> None:
    """Close this process's open manager of ``url`` on ``staging_dir`` (before a new one
    starts); one of another URL there is an error, as between processes."""
    with _lock:
        older = [m for m, pid in _open.items() if pid == os.getpid() and not m._closed]
    for manager in older:
        if manager.staging_dir != staging_dir:
            continue
        if manager.store.url != url:
            raise StagingDirInUseError(
                f"staging_dir {staging_dir} is in use by another CheckpointManager of this "
                f"process, of {redact(manager.store.url)}: two managers (a model's and "
                "its EMA's) need a staging_dir each; leave it unset (one per URL)"
            )
        warnings.warn(
            f"a CheckpointManager of this process still uses staging_dir {staging_dir} (a "
            "notebook cell run again?): closing it first, after its save in flight; close "
            "a manager you are done with (mgr.close(), or a `with` block)",
            RuntimeWarning,
            stacklevel=3,
        )
        try:  # left open, likely by an exception: its rerun is a restart (no END)
            manager._close(clean=False, failed=True)
        except Exception as exc:  # its last save failed: said, and the new one goes on
            warnings.warn(f"closing the older CheckpointManager: {exc}", RuntimeWarning,
                          stacklevel=3)  # fmt: skip


def yet_to_save_for_preemption(manager: Any, step: int) -> bool:
    """Whether another open manager of this process, which ends the process on a
    preemption too, has its save still to make: ``manager`` saved ``step`` and leaves
    the end to the last of them (a model's and its EMA's managers: the first one's exit
    left the EMA unsaved, and a restart paired the model's step with an older EMA)."""
    with _lock:
        others = [m for m, pid in _open.items() if pid == os.getpid() and m is not manager]
    waiting = [
        m for m in others
        if not m._closed and m.config.preemption == "exit" and m._preemption is not None
        and m._preemption.received is not None and not m._preemption.handled
    ]  # fmt: skip
    if waiting:
        log.warning("preempted: step %d is committed; the process ends once %s saved too, at "
                    "its next maybe_save", step,
                    ", ".join(redact(m.store.url) for m in waiting))  # fmt: skip
    return bool(waiting)


def _register() -> None:
    try:
        (getattr(threading, "_register_atexit", None) or atexit.register)(_close_open_managers)
    except RuntimeError:  # the interpreter is ending already (a manager made on a thread
        atexit.register(_close_open_managers)  # the main one left): after the threads


_register()
