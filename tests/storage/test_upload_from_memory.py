"""Uploads that send a file's bytes from memory: once, given back, and never misread.

The in-memory parts in these tests hold bytes that differ from the file's (same size),
so the stored object shows which of the two a store actually sent.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tests.link_names import private_link
from unbroken import open_store
from unbroken.storage import Store
from unbroken.storage.in_memory import FileInMemory

SIZE = 3 * 4096 + 123  # a page-aligned head and an unaligned tail


def file_and_parts(tmp_path) -> tuple[str, bytes, list[object]]:
    """A local file, and parts that concatenate to other bytes of the same size."""
    path = tmp_path / "shard.bin"
    on_disk = os.urandom(SIZE)
    path.write_bytes(on_disk)
    other = bytearray(os.urandom(SIZE))
    parts = [bytes(other[:100]), memoryview(other)[100:8192], bytearray(other[8192:])]
    return str(path), bytes(other), parts


def lent(parts: list[object]) -> tuple[FileInMemory, threading.Event]:
    returned = threading.Event()
    return FileInMemory(parts, returned.set), returned


def test_every_backend_stores_the_same_bytes_and_gives_the_memory_back(store: Store, tmp_path):
    path, in_memory, parts = file_and_parts(tmp_path)
    memory, returned = lent(parts)
    store.upload(path, "a/shard", memory=memory)
    assert returned.is_set() and memory.returned
    assert memory.sent_from_memory == store.sends_from_memory
    expected = in_memory if store.sends_from_memory else Path(path).read_bytes()
    assert store.read_bytes("a/shard") == expected


def test_local_and_emulated_stores_send_from_memory(tmp_path):
    assert open_store(str(tmp_path / "plain")).sends_from_memory
    emulated = open_store(f"emulated::{tmp_path / 'remote'}", latency=0.0, bandwidth=None)
    assert emulated.sends_from_memory
    path, in_memory, parts = file_and_parts(tmp_path)
    memory, _ = lent(parts)
    emulated.upload(path, "k", memory=memory)
    assert emulated.read_bytes("k") == in_memory
    # O_DIRECT into the emulated remote's directory from unaligned parts: byte exact.
    assert (tmp_path / "remote" / "k").stat().st_size == SIZE


def test_a_retry_reads_the_file_once_the_memory_was_taken(tmp_path):
    """The memory is lent to one attempt; a second attempt must not touch it."""
    store = open_store(str(tmp_path / "store"))
    path, _, parts = file_and_parts(tmp_path)
    memory, returned = lent(parts)
    assert memory.take() is not None  # an earlier attempt took it
    assert memory.take() is None
    store.upload(path, "k", memory=memory)
    assert store.read_bytes("k") == Path(path).read_bytes()
    assert returned.is_set()


def test_the_emulated_remote_gives_the_memory_back_before_its_transfer_ends(tmp_path):
    """Its copy reads the memory at disk speed; the link takes its time afterwards, and
    the lender (the next save's staging) need not wait for it."""
    store = open_store(
        f"emulated::{tmp_path / 'remote'}",
        latency=0.0,
        bandwidth="10KB",  # SIZE bytes: about 1.2 s on the link, the copy milliseconds
        link=private_link("lend"),
    )
    path, in_memory, parts = file_and_parts(tmp_path)
    memory, returned = lent(parts)
    finished = threading.Event()
    uploader = threading.Thread(
        target=lambda: (store.upload(path, "k", memory=memory), finished.set())
    )
    uploader.start()
    assert returned.wait(30)
    assert not finished.is_set(), "the memory was held until the transfer ended"
    uploader.join()
    assert finished.is_set() and store.read_bytes("k") == in_memory


def test_a_copy_in_memory_of_the_wrong_size_is_refused(tmp_path):
    store = open_store(str(tmp_path / "store"))
    path, _, parts = file_and_parts(tmp_path)
    memory, returned = lent(parts[:-1])
    with pytest.raises(ValueError, match=r"shard\.bin.*holds 8192 bytes, the file 12411"):
        store.upload(path, "k", memory=memory)
    assert returned.is_set()  # the lender gets its buffers back on every path
    assert store.list() == []


def test_a_missing_file_still_gives_the_memory_back(tmp_path):
    store = open_store(str(tmp_path / "store"))
    memory, returned = lent([b"x" * 10])
    with pytest.raises(FileNotFoundError, match="no local file"):
        store.upload(tmp_path / "nope", "k", memory=memory)
    assert returned.is_set()
    assert store.list() == []


def test_a_failed_write_from_memory_leaves_nothing_and_gives_the_memory_back(tmp_path):
    store = open_store(str(tmp_path / "store"))
    path, _, parts = file_and_parts(tmp_path)
    store.write_bytes("k/inner", b"a prefix cannot also be an object")  # k is a directory
    memory, returned = lent(parts)
    with pytest.raises(OSError):
        store.upload(path, "k", memory=memory)
    assert returned.is_set()
    assert [e.key for e in store.list()] == ["k/inner"]


def test_file_in_memory_gives_back_once():
    calls = []
    memory = FileInMemory([b"ab", memoryview(b"cde")], lambda: calls.append(1))
    assert memory.size == 5 and not memory.returned
    assert [bytes(p) for p in memory.take() or []] == [b"ab", b"cde"]
    memory.give_back(read_all=True)
    memory.give_back()
    assert calls == [1] and memory.returned and memory.take() is None
    assert memory.sent_from_memory
    # Taken but not read to the end (the attempt failed): the file was sent, if anything.
    failed = FileInMemory([b"ab"])
    failed.take()
    failed.give_back()
    assert not failed.sent_from_memory


def test_a_store_that_is_down_gives_the_memory_back_before_it_retries(tmp_path):
    """Its retries may take minutes; the buffers belong to the next save meanwhile."""
    from unbroken.storage import RetryPolicy, StoreError

    switch = tmp_path / "outage"
    switch.write_text("down")
    store = open_store(
        f"emulated::{tmp_path / 'remote'}",
        retry=RetryPolicy(max_attempts=4, base_delay=0.001, max_delay=0.01),
        latency=0.0,
        bandwidth=None,
        outage_file=str(switch),
    )
    path, _, parts = file_and_parts(tmp_path)
    retries_when_returned = []
    memory = FileInMemory(parts, lambda: retries_when_returned.append(store.stats.retries))
    with pytest.raises(StoreError, match="outage"):
        store.upload(path, "k", memory=memory)
    assert retries_when_returned == [0]  # given back when the first attempt failed
    assert store.stats.retries == 3 and not memory.sent_from_memory
    switch.unlink()
    assert not store.exists("k")
