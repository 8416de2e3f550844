"""Raw-syscall file helpers: whole reads and copies that bypass the page cache."""

from __future__ import annotations

import os

import pytest

from unbroken._util.fileio import DIRECT_CHUNK, copy_file_uncached, pread_exactly
from unbroken.storage import open_store


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, DIRECT_CHUNK, DIRECT_CHUNK * 2 + 123])
def test_uncached_copy_is_byte_exact_at_every_size(tmp_path, size):
    src, dst = tmp_path / "src", tmp_path / "dst"
    data = os.urandom(size)
    src.write_bytes(data)
    dst.write_bytes(b"x" * (size + 10_000))  # an older, longer file is replaced whole
    copy_file_uncached(str(src), str(dst))
    assert dst.read_bytes() == data


def test_uncached_copy_falls_back_where_o_direct_is_refused(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    src = tmp_path / "src"
    src.write_bytes(b"abc" * 5000)
    dst = f"/dev/shm/unbroken-test-{os.getpid()}"
    try:
        copy_file_uncached(str(src), dst)  # tmpfs has no O_DIRECT
        with open(dst, "rb") as f:
            assert f.read() == src.read_bytes()
    finally:
        os.unlink(dst)


def test_uncached_copy_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        copy_file_uncached(str(tmp_path / "nope"), str(tmp_path / "dst"))
    assert not (tmp_path / "dst").exists()  # nothing created for a missing source


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


def test_the_emulated_remote_takes_uploads_uncached(tmp_path):
    store = open_store(f"emulated::{tmp_path / 'remote'}", latency=0.0)
    assert store.inner.uncached_uploads
    local = tmp_path / "big"
    data = os.urandom(3 * 4096 + 5)
    local.write_bytes(data)
    store.upload(str(local), "a/b")
    assert store.read_bytes("a/b") == data
    assert not open_store(str(tmp_path / "plain")).uncached_uploads
