"""Is a process still there? Lock, claim and log owners are recorded by pid and start time.

A pid alone is not an identity: a container restarted in place runs its processes under
the same small pids, and a busy node reuses pids within minutes. The start time (clock
ticks since boot, from ``/proc/<pid>/stat``) tells the process that wrote a record from
a later one that happens to hold the same pid.
"""

from __future__ import annotations

import os


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


def process_start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), as /proc writes it;
    None where /proc has no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22: starttime
    except (OSError, IndexError):
        return None


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
