"""A network link shared by every process on the node, for the emulated remote.

Each transfer reserves its chunks on one timeline kept in a small file under a lock,
so N parallel streams (threads, DataLoader workers, ranks) share the bandwidth the way
flows share a real NIC. Clock: CLOCK_MONOTONIC, which is the same for all processes.
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
import tempfile
import time

SLICE_SECONDS = 0.02
"""Granularity of reservations in link time: streams interleave on the link in slices
this long (one standard request latency), never smaller than ``MIN_SLICE`` bytes."""
MIN_SLICE = 1 << 20

_STATE = struct.Struct("<d")


def _state_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def link_state_path(name: str) -> str:
    """The file that holds the timeline of the link called ``name``."""
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ValueError(f"link name {name!r}: use letters, digits, '.', '_' or '-'")
    return os.path.join(_state_dir(), f"unbroken-link-{name}.state")


def discard_link(name: str) -> bool:
    """Delete the timeline of link ``name``; False if it had none.

    The file outlives every process on purpose (the next job on the node shares the same
    link), so whoever made up a one-off name removes it once nobody uses that link.
    """
    try:
        os.unlink(link_state_path(name))
    except FileNotFoundError:
        return False
    return True


class SharedLink:
    """``bandwidth`` bytes/second shared node-wide by every user of the same ``name``."""

    def __init__(self, bandwidth: float, name: str = "default") -> None:
        if bandwidth <= 0:
            raise ValueError(f"link bandwidth must be positive, got {bandwidth}")
        self.path = link_state_path(name)  # checks the name
        self.bandwidth = float(bandwidth)
        self.name = name
        self.slice_bytes = max(MIN_SLICE, int(self.bandwidth * SLICE_SECONDS))
        """Bytes booked per reservation. Each costs a lock, a wake-up and a little Python
        on a thread that runs beside training; a fixed 1 MiB made a 200 MB/s link wake
        its senders 200 times a second."""
        self._fd: int | None = None
        self._fd_pid = 0

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_fd=None, _fd_pid=0)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def _file(self) -> int:
        # flock() belongs to the open file description, which a forked child shares with
        # its parent: each process must open its own, or they would not exclude each other.
        if self._fd is None or self._fd_pid != os.getpid():
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            self._fd_pid = os.getpid()
        return self._fd

    def reserve(self, nbytes: int, not_before: float = 0.0) -> float:
        """Book ``nbytes`` on the link, starting no earlier than ``not_before`` (monotonic).

        Returns the monotonic time its last byte lands.
        """
        fd = self._file()
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            raw = os.pread(fd, _STATE.size, 0)
            free_at = _STATE.unpack(raw)[0] if len(raw) == _STATE.size else 0.0
            start = max(time.monotonic(), free_at, not_before)
            done = start + nbytes / self.bandwidth
            os.pwrite(fd, _STATE.pack(done), 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return done

    def transfer(self, nbytes: int, not_before: float = 0.0) -> None:
        """Block for as long as moving ``nbytes`` takes on the shared link.

        The first byte moves no earlier than ``not_before``: a request's latency and its
        payload then cost one sleep, not two.
        """
        remaining = int(nbytes)
        done = not_before
        while remaining > 0:
            chunk = min(self.slice_bytes, remaining)
            remaining -= chunk
            done = self.reserve(chunk, not_before)
            not_before = 0.0
            if remaining:
                sleep_until(done)
        sleep_until(done)

    def close(self) -> None:
        if self._fd is not None and self._fd_pid == os.getpid():
            os.close(self._fd)
        self._fd = None


def sleep_until(deadline: float) -> None:
    """Sleep until the monotonic time ``deadline`` (not at all if it passed)."""
    delay = deadline - time.monotonic()
    if delay > 0:
        time.sleep(delay)
