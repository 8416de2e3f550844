"""Is a process still there? Lock, claim and log owners are recorded by pid and start time.

A pid alone is not an identity: a container restarted in place runs its processes under
the same small pids, and a busy node reuses pids within minutes. The start time (clock
ticks since boot, from ``/proc/<pid>/stat``) tells the process that wrote a record from
a later one that happens to hold the same pid.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any


def start_method(multiprocessing_context: Any) -> str:
    """The start method of a DataLoader's ``multiprocessing_context`` (None: the default)."""
    if multiprocessing_context is None:
        method = multiprocessing.get_start_method(allow_none=True)
        return method or multiprocessing.get_all_start_methods()[0]  # the default
    if isinstance(multiprocessing_context, str):
        return multiprocessing_context
    return multiprocessing_context.get_start_method()


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists on this node (a zombie counts as alive until reaped)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from field 3 (the state) on; None without such a process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 19 else None


def process_start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), as /proc writes it;
    None where /proc has no such process (or no /proc)."""
    fields = _stat_fields(pid)
    return fields[19] if fields else None  # field 22: starttime


def process_activity(pid: int) -> tuple[str, int] | None:
    """(scheduler state letter, CPU ticks used so far) of ``pid`` (Linux); None where /proc
    has no such process. "S" with ticks that stop growing: asleep and staying asleep."""
    fields = _stat_fields(pid)
    if not fields:
        return None
    return fields[0], int(fields[11]) + int(fields[12])  # fields 14, 15: utime, stime


def process_alive(pid: int, started: str | None) -> bool:
    """True while the process recorded as (``pid``, ``started``) still runs on this node:
    the pid exists and, where both start times are known, it is the same process."""
    if not pid_alive(pid):
        return False
    now = process_start_ticks(pid)
    return started is None or now is None or now == str(started)


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def signal_tree(pid: int, signum: int) -> list[int]:
    """Send ``signum`` to ``pid`` and every process under it, the deepest seen first, and
    return their pids (torchrun starts each rank in a session of its own: the launcher's
    process group is not enough)."""
    tree, frontier = [], [pid]
    while frontier:
        tree.extend(frontier)
        frontier = [c for p in frontier for c in children(p)]
    for member in reversed(tree):
        try:
            os.kill(member, signum)
        except ProcessLookupError:
            pass
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it."""
    signal_tree(pid, signal.SIGKILL)


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """SIGKILL this process as soon as ``parent`` ends, and end it now if it already
    has: a helper process must never outlive the rank that started it. Linux uses the
    kernel's parent-death signal; elsewhere a thread looks at the parent every second."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it ended before the request above took hold
        os._exit(0)
    if not sys.platform.startswith("linux"):
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)
