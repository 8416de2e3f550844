"""Raw-syscall file helpers: whole reads we can size."""

from __future__ import annotations

import os

from unbroken._util.fileio import pread_exactly


def test_pread_exactly_stops_at_end_of_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pread_exactly(fd, 4, 3) == b"3456"
        assert pread_exactly(fd, 100, 8) == b"89"
        assert pread_exactly(fd, 5, 50) == b""
    finally:
        os.close(fd)
