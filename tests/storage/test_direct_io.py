"""O_DIRECT writes and copies: byte-exact at every size and alignment, with fallbacks."""

from __future__ import annotations

import errno
import fcntl
import os
import random

import numpy as np
import pytest

from unbroken._util.direct_io import (
    BOUNCE_BYTES,
    DIRECT_ALIGN,
    DIRECT_CHUNK,
    DirectFileWriter,
    aligned_buffer,
    copy_file_uncached,
    open_direct,
)
from unbroken.storage import open_store


def write_all(path, pieces, *, direct: bool = True) -> DirectFileWriter:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd, on = open_direct(str(path), flags) if direct else (os.open(path, flags), False)
    try:
        writer = DirectFileWriter(fd, direct=on)
        for piece in pieces:
            writer.write(piece)
        assert writer.close() == sum(len(memoryview(p).cast("B")) for p in pieces)
    finally:
        os.close(fd)
    return writer


def aligned(data: bytes) -> memoryview:
    """``data`` in page-aligned memory (as the staging buffers are)."""
    buf = aligned_buffer(max(len(data), 1))
    buf[: len(data)] = data
    return memoryview(buf)[: len(data)]


def test_o_direct_is_available_where_the_tests_write(tmp_path):
    """Says (as a skip) when the disk under the tests does not exercise the direct path."""
    fd, on = open_direct(str(tmp_path / "probe"), os.O_WRONLY | os.O_CREAT)
    os.close(fd)
    if not on:
        pytest.skip("this file system refuses O_DIRECT: the tests cover the fallback only")


@pytest.mark.parametrize("seed", range(6))
def test_random_mixes_of_aligned_and_unaligned_writes_are_byte_exact(tmp_path, seed):
    rng = random.Random(seed)
    pieces, expected = [], bytearray()
    for _ in range(rng.randint(1, 40)):
        size = rng.choice([0, 1, 63, 4095, 4096, 4097, 3 * 4096, 100_000, BOUNCE_BYTES + 5])
        data = rng.randbytes(size)
        kind = rng.choice(["bytes", "aligned", "offset"])
        if kind == "aligned":
            piece = aligned(data)
        elif kind == "offset":  # memory one byte past a page boundary
            piece = aligned(b"\0" + data)[1:]
        else:
            piece = data
        pieces.append(piece)
        expected += data
    path = tmp_path / "f"
    write_all(path, pieces)
    assert path.read_bytes() == bytes(expected)


def test_aligned_memory_goes_out_in_place_and_the_rest_through_the_bounce(tmp_path):
    head = os.urandom(100)  # unaligned header, as a tensor record's envelope
    payload = aligned(os.urandom(5 * DIRECT_ALIGN + 17))
    pad = bytes(-(100) % DIRECT_ALIGN)  # the writer's caller pads to a block boundary
    writer = write_all(tmp_path / "f", [head, pad, payload, b"trailer"])
    if not writer.direct:
        pytest.skip("this file system refuses O_DIRECT")
    assert writer.in_place_bytes == 5 * DIRECT_ALIGN  # the tail (17 bytes) was copied
    assert writer.direct_bytes == 7 * DIRECT_ALIGN  # head + pad, payload, the padded tail
    assert (tmp_path / "f").read_bytes() == head + pad + bytes(payload) + b"trailer"


def test_numpy_memory_and_empty_files(tmp_path):
    arr = np.frombuffer(aligned(os.urandom(DIRECT_CHUNK)), dtype=np.float32)
    write_all(tmp_path / "a", [arr])
    assert (tmp_path / "a").read_bytes() == arr.tobytes()
    write_all(tmp_path / "empty", [])
    assert (tmp_path / "empty").read_bytes() == b""


def test_a_write_refused_under_o_direct_is_retried_through_the_page_cache(tmp_path, monkeypatch):
    """Some file systems open with O_DIRECT but want another alignment: the first
    refused write turns O_DIRECT off for the file, and nothing is lost."""
    path = tmp_path / "f"
    fd, on = open_direct(str(path), os.O_WRONLY | os.O_CREAT)
    if not on:
        os.close(fd)
        pytest.skip("this file system refuses O_DIRECT")
    real_pwrite, refused = os.pwrite, []

    def pwrite_refusing_once(fd_: int, data, offset: int) -> int:
        if not refused:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd_, data, offset)

    head, payload = os.urandom(100), aligned(os.urandom(2 * DIRECT_ALIGN))
    try:
        writer = DirectFileWriter(fd)
        writer.write(head)
        writer.write(bytes(DIRECT_ALIGN - 100))
        monkeypatch.setattr(os, "pwrite", pwrite_refusing_once)
        writer.write(payload)
        monkeypatch.undo()
        writer.close()
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    finally:
        os.close(fd)
    assert refused == [0] and not writer.direct and not flags & os.O_DIRECT
    assert path.read_bytes() == head + bytes(DIRECT_ALIGN - 100) + bytes(payload)


def test_buffered_mode_writes_the_same_bytes(tmp_path):
    data = [os.urandom(5000), aligned(os.urandom(3 * DIRECT_ALIGN)), b"x"]
    writer = write_all(tmp_path / "f", data, direct=False)
    assert writer.direct_bytes == 0
    assert (tmp_path / "f").read_bytes() == b"".join(bytes(d) for d in data)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, DIRECT_CHUNK, DIRECT_CHUNK * 2 + 123])
def test_uncached_copy_is_byte_exact_at_every_size(tmp_path, size):
    src, dst = tmp_path / "src", tmp_path / "dst"
    data = os.urandom(size)
    src.write_bytes(data)
    dst.write_bytes(b"x" * (size + 10_000))  # an older, longer file is replaced whole
    copy_file_uncached(str(src), str(dst))
    assert dst.read_bytes() == data


def test_uncached_copy_to_and_from_tmpfs(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    src = tmp_path / "src"
    src.write_bytes(b"abc" * 5000)
    shm = f"/dev/shm/unbroken-test-{os.getpid()}"
    try:
        copy_file_uncached(str(src), shm)  # tmpfs: O_DIRECT refused, or taken unaligned
        with open(shm, "rb") as f:
            assert f.read() == src.read_bytes()
        copy_file_uncached(shm, str(tmp_path / "back"))
        assert (tmp_path / "back").read_bytes() == src.read_bytes()
    finally:
        os.unlink(shm)


def test_uncached_copy_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        copy_file_uncached(str(tmp_path / "nope"), str(tmp_path / "dst"))
    assert not (tmp_path / "dst").exists()  # nothing created for a missing source


def test_the_emulated_remote_takes_uploads_uncached(tmp_path):
    store = open_store(f"emulated::{tmp_path / 'remote'}", latency=0.0)
    assert store.inner.uncached_uploads
    local = tmp_path / "big"
    data = os.urandom(3 * 4096 + 5)
    local.write_bytes(data)
    store.upload(str(local), "a/b")
    assert store.read_bytes("a/b") == data
    assert not open_store(str(tmp_path / "plain")).uncached_uploads
