"""Open-file-description byte-range locks (Linux ``F_OFD_SETLK``): one lock per byte.

Unlike ``flock`` they lock a byte of a shared file, so one file holds a lock per cache
name and no lock file is created or deleted per fill; unlike classic POSIX record locks
they belong to the open file description, so closing another descriptor of the same
file does not drop them, and threads that open their own descriptions exclude each
other. The kernel drops them when their holder dies.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import struct

_FLOCK = struct.Struct("=hh4xqqi4x")  # struct flock: type, whence, start, len, pid
_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", None)
_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", None)


def require_range_locks() -> None:
    """Refuse early, with the reason, where open-file-description locks are missing."""
    if _OFD_SETLK is None:
        raise OSError(
            "unbroken's data cache needs Linux open-file-description locks (F_OFD_SETLK, "
            "Linux >= 3.15) to share one cache between processes; this platform has none"
        )


def range_lock(fd: int, offset: int, kind: int = fcntl.F_WRLCK) -> bool:
    """Take (or with F_UNLCK drop) a one-byte OFD lock without waiting; False if held."""
    try:
        fcntl.fcntl(fd, _OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def range_held(fd: int, offset: int) -> bool:
    """True if another open file description holds a lock on byte ``offset``."""
    raw = fcntl.fcntl(fd, _OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
    return _FLOCK.unpack(raw)[0] != fcntl.F_UNLCK


def lock_offset(name: str) -> int:
    """Where the fill lock of ``name`` lives in ``fill.locks``: 62 bits of its hash."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 2
