"""File I/O with raw syscalls: whole reads we can size."""

from __future__ import annotations

import os


def pread_exactly(fd: int, size: int, offset: int = 0) -> bytes:
    """Up to ``size`` bytes of ``fd`` from ``offset`` (fewer only at end of file).

    One system call for a small file, where a buffered ``open().read()`` makes three
    and allocates a file object.
    """
    data = os.pread(fd, size, offset)
    if len(data) == size or not data:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        chunk = os.pread(fd, size - got, offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)
