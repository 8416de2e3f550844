"""The Store contract, run against every backend: local path, memory:// and S3 on loopback."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from unbroken import open_store
from unbroken.storage import Entry, ObjectExistsError, ObjectNotFoundError, Store


def test_round_trip_whole_and_ranges(store: Store):
    data = os.urandom(100_000)
    store.write_bytes("a/b/c.bin", data)
    assert store.read_bytes("a/b/c.bin") == data
    assert store.read_bytes("a/b/c.bin", 10, 20) == data[10:20]
    assert store.read_bytes("a/b/c.bin", start=99_990) == data[99_990:]
    assert store.read_bytes("a/b/c.bin", end=5) == data[:5]
    assert store.read_bytes("a/b/c.bin", 7, 7) == b""
    assert store.exists("a/b/c.bin")
    assert not store.exists("a/b/missing")
    info = store.info("a/b/c.bin")
    assert (info.key, info.size) == ("a/b/c.bin", len(data))
    assert info.etag


def test_empty_object(store: Store):
    store.write_bytes("empty", b"")
    assert store.read_bytes("empty") == b""
    assert store.list() == [Entry("empty", 0, store.info("empty").etag)]


def test_overwrite_changes_content_and_etag(store: Store):
    store.write_bytes("k", b"first version")
    first = store.info("k")
    store.write_bytes("k", b"second, longer version")
    assert store.read_bytes("k") == b"second, longer version"
    assert store.info("k").size != first.size


def test_listing_is_complete_sorted_and_recursive(store: Store):
    keys = [f"d{i % 3}/sub{i % 2}/f{i:03d}" for i in range(40)] + ["top"]
    for i, key in enumerate(reversed(keys)):
        store.write_bytes(key, b"x" * i)
    listed = store.list()
    assert [e.key for e in listed] == sorted(keys)
    sizes = {e.key: e.size for e in listed}
    assert sizes == {key: i for i, key in enumerate(reversed(keys))}
    assert [e.key for e in store.list("d1")] == sorted(k for k in keys if k.startswith("d1/"))
    assert store.list("nothing-here") == []


def test_a_listing_reports_its_pages_as_they_come(store: Store):
    for i in range(12):
        store.write_bytes(f"p/f{i:02d}", b"x")
    pages: list[int] = []
    listed = store.list(progress=pages.append)
    assert pages and sum(pages) == len(listed) == 12
    assert store.list("p", progress=pages.append) == listed


def test_a_listing_after_a_key_leaves_out_what_sorts_before(store: Store):
    """The checkpoint catalog lists from ``step-`` on: a goodput log's thousands of
    objects under ``_goodput/`` must not cost each save a listing of them."""
    for key in ["_goodput/a/r0", "_goodput/b/r1", "a-file", "step-1/m", "step-2/x/y", "z"]:
        store.write_bytes(key, b"x")
    pages: list[int] = []
    listed = [e.key for e in store.list(after="step-", progress=pages.append)]
    assert listed == ["step-1/m", "step-2/x/y", "z"]
    kind = type(store).__name__
    if kind == "LocalStore" or (kind == "NativeStore" and store.url.startswith("s3://")):
        assert sum(pages) == 3, pages  # they start listing there (S3's start-after)
    assert [e.key for e in store.list(after="step-1/m")] == ["step-2/x/y", "z"]


def test_delete_key_and_prefix(store: Store):
    for key in ["p/a", "p/b/c", "p/b/d", "q"]:
        store.write_bytes(key, b"1")
    store.delete("p/a")
    assert [e.key for e in store.list()] == ["p/b/c", "p/b/d", "q"]
    store.delete("p")
    assert [e.key for e in store.list()] == ["q"]
    store.delete("never-existed")  # absent keys are fine
    assert [e.key for e in store.list()] == ["q"]


def test_upload_and_download_stream_large_files(store: Store, tmp_path):
    src = tmp_path / "src.bin"
    block = os.urandom(1 << 20)
    with open(src, "wb") as f:
        for i in range(40):  # 40 MB: larger than one ranged part, so downloads go parallel
            f.write(bytes([i]) + block[1:])
    store.upload(src, "big/file.bin")
    assert store.info("big/file.bin").size == src.stat().st_size
    dst = tmp_path / "out" / "copy.bin"
    store.download("big/file.bin", dst)
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(dst) == digest(src)
    assert [p.name for p in dst.parent.iterdir()] == ["copy.bin"]  # no temp left behind


def test_missing_key_errors_name_operation_and_url(store: Store, tmp_path):
    for call in (
        lambda: store.read_bytes("no/such/key"),
        lambda: store.info("no/such/key"),
        lambda: store.download("no/such/key", tmp_path / "x"),
    ):
        with pytest.raises(ObjectNotFoundError) as err:
            call()
        assert "no/such/key" in str(err.value)
        assert store.url.split("://")[-1] in str(err.value)
        assert isinstance(err.value, FileNotFoundError)
    assert store.stats.retries == 0
    assert not (tmp_path / "x").exists()


def test_upload_of_missing_local_file_is_clear(store: Store, tmp_path):
    with pytest.raises(FileNotFoundError, match="no local file"):
        store.upload(tmp_path / "nope.bin", "k")
    assert store.list() == []


@pytest.mark.parametrize("bad", ["", "/", "a/../b", "../up", "a//b", "./a", "a\\b"])
def test_bad_keys_are_rejected(store: Store, bad):
    with pytest.raises(ValueError, match="key"):
        store.write_bytes(bad, b"x")


def test_temp_marker_is_reserved(store: Store):
    with pytest.raises(ValueError, match="reserved"):
        store.write_bytes("a/.x.unbroken-tmp-1-2", b"x")


def test_open_store_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="empty URL"):
        open_store("")
    with pytest.raises(TypeError, match="takes no storage options"):
        open_store(str(tmp_path), endpoint_url="http://x")
    assert open_store(f"file://{tmp_path}").url == str(tmp_path)


def test_a_prefix_is_not_an_object(store: Store):
    store.write_bytes("dir/file", b"x")
    assert not store.exists("dir")
    with pytest.raises(ObjectNotFoundError):
        store.info("dir")


def test_create_only_write_never_replaces(store: Store):
    store.write_bytes("commit/record", b"first writer", create_only=True)
    with pytest.raises(ObjectExistsError) as err:
        store.write_bytes("commit/record", b"second writer", create_only=True)
    assert "commit/record" in str(err.value)
    assert isinstance(err.value, FileExistsError)
    assert store.read_bytes("commit/record") == b"first writer"
    assert [e.key for e in store.list()] == ["commit/record"]  # no temp left behind
    assert store.stats.retries == 0


def test_create_only_between_racing_threads_has_one_winner(store: Store):
    barrier = threading.Barrier(4)
    won: list[int] = []

    def write(i: int) -> None:
        barrier.wait()
        try:
            store.write_bytes("race", str(i).encode(), create_only=True)
            won.append(i)
        except ObjectExistsError:
            pass

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    assert store.read_bytes("race") == str(won[0]).encode()


@pytest.mark.parametrize(
    "start,end", [(20, 10), (0, 101), (50, 200), (101, None), (200, 300)]
)
def test_ranges_reversed_or_past_the_end_are_refused(store: Store, start, end):
    store.write_bytes("k", bytes(100))
    with pytest.raises(ValueError, match=r"range|past the end") as info:
        store.read_bytes("k", start, end)
    if start <= (end or start):  # not reversed: past the end, and the real size said
        assert "past the end of the object (100 bytes)" in str(info.value)


def test_range_up_to_the_end_is_fine(store: Store):
    store.write_bytes("k", bytes(range(100)))
    assert store.read_bytes("k", 100) == b""
    assert store.read_bytes("k", 90, 100) == bytes(range(90, 100))
    assert store.read_bytes("k", 100, 100) == b""


def test_read_range_gives_a_buffer_of_exactly_the_range(store: Store):
    data = os.urandom(300_000)
    store.write_bytes("r/obj", data)
    for start, end in [(0, 300_000), (1, 2), (12_345, 250_000), (299_999, 300_000), (5, 5)]:
        view = memoryview(store.read_range("r/obj", start, end))
        assert view.nbytes == end - start and view.tobytes() == data[start:end]
    for start, end in [(20, 10), (-1, 5), (0, 300_001), (300_001, 300_002)]:
        with pytest.raises(ValueError, match=r"range|past the end") as info:
            store.read_range("r/obj", start, end)
        if 0 <= start <= end:
            assert "past the end of the object (300000 bytes)" in str(info.value)
    with pytest.raises(ObjectNotFoundError):
        store.read_range("r/missing", 0, 10)


@pytest.mark.parametrize("absolute", ["/etc/passwd", "/a/b"])
def test_absolute_keys_are_refused_not_rewritten(store: Store, absolute):
    with pytest.raises(ValueError, match="absolute"):
        store.write_bytes(absolute, b"x")
    with pytest.raises(ValueError, match="absolute"):
        store.read_bytes(absolute)
    assert store.list() == []


@pytest.mark.parametrize("inner", ["local", "memory"])
def test_the_emulated_remote_passes_create_only_through(tmp_path, inner):
    root = str(tmp_path / "r") if inner == "local" else "memory://emu-create"
    store = open_store(f"emulated::{root}", latency=0.0, bandwidth=None)
    store.write_bytes("k", b"one", create_only=True)
    with pytest.raises(ObjectExistsError, match="k"):
        store.write_bytes("k", b"two", create_only=True)
    assert store.read_bytes("k") == b"one"
    assert store.atomic_create
    store.delete("k")
