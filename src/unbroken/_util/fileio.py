"""File I/O with raw syscalls: whole reads we can size, copies that bypass the page cache."""

from __future__ import annotations

import errno
import mmap
import os
import shutil


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


DIRECT_CHUNK = 8 << 20
"""Bytes per read and O_DIRECT write in :func:`copy_file_uncached` (a multiple of 4096)."""
_DIRECT_ALIGN = 4096


def copy_file_uncached(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` (created or replaced) with O_DIRECT writes: no page cache.

    For a directory that stands in for another machine's storage (the emulated remote):
    its writes must not take this machine's memory. The copy goes through one
    page-aligned buffer, reused chunk after chunk; the last block is padded for O_DIRECT,
    then the file is cut to size. Where the file system refuses O_DIRECT (tmpfs), it is
    an ordinary copy.
    """
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)  # a missing source creates nothing
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            out = os.open(dst, flags | getattr(os, "O_DIRECT", 0), 0o666)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            shutil.copyfile(src, dst)
            return
        try:
            _copy_direct(fd, out)
        finally:
            os.close(out)
    finally:
        os.close(fd)


def _copy_direct(fd: int, out: int) -> None:
    buf = mmap.mmap(-1, DIRECT_CHUNK)  # page-aligned, as O_DIRECT needs
    view = memoryview(buf)
    try:
        offset = 0
        while n := os.preadv(fd, [view], offset):
            padded = -(-n // _DIRECT_ALIGN) * _DIRECT_ALIGN
            if padded != n:
                view[n:padded] = bytes(padded - n)
            written = 0
            while written < padded:
                written += os.pwrite(out, view[written:padded], offset + written)
            offset += n
        os.ftruncate(out, offset)
    finally:
        view.release()
        buf.close()
