"""The file index: sorted, filtered, fingerprinted, listed once and cached."""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest

from tests.conftest import make_store_url
from unbroken import open_store
from unbroken.data.index import EmptyVolumeError, build_index, load_or_build_index
from unbroken.storage import NO_RETRY, StoreError


def test_index_is_sorted_filtered_and_fingerprinted(make_volume, backend):
    vol = make_volume(12, backend)
    store = vol.store
    store.write_bytes("notes/readme.md", b"x")
    index = build_index(store, include=["*.txt"], exclude=["d2/*"])
    keys = [e.key for e in index.entries]
    assert keys == sorted(keys)
    assert all(k.endswith(".txt") and not k.startswith("d2/") for k in keys)
    assert len(index) == 8
    assert all(e.size > 0 and e.etag for e in index.entries)
    again = build_index(store, include=["*.txt"], exclude=["d2/*"])
    assert again.fingerprint == index.fingerprint
    store.write_bytes("d0/s0000.txt", b"changed!")
    assert build_index(store, include=["*.txt"], exclude=["d2/*"]).fingerprint != index.fingerprint


def test_a_trusted_cached_index_is_reused_without_listing_again(make_volume, tmp_path):
    vol = make_volume(6)
    index_dir = str(tmp_path / "idx")
    first = load_or_build_index(vol.store, index_dir, include="*.txt")
    assert len(os.listdir(index_dir)) == 2  # the index and its lock file
    shutil.rmtree(vol.url)  # the volume is gone: only the cached copy can answer
    second = load_or_build_index(vol.store, index_dir, include="*.txt", max_age=None)
    assert second == first and second.entries == first.entries
    assert load_or_build_index(vol.store, index_dir, include="*.txt", max_age=3600) == first
    with pytest.raises(EmptyVolumeError):  # by default every start lists
        load_or_build_index(vol.store, index_dir, include="*.txt")
    # other patterns are another index, and refresh lists again: both see the empty volume
    with pytest.raises(EmptyVolumeError, match=vol.url):
        load_or_build_index(vol.store, index_dir, include="*.jpg")
    with pytest.raises(EmptyVolumeError):
        load_or_build_index(vol.store, index_dir, include="*.txt", refresh=True, max_age=None)


def test_a_corrupt_cached_index_is_rebuilt(make_volume, tmp_path):
    vol = make_volume(5)
    index_dir = tmp_path / "idx"
    first = load_or_build_index(vol.store, str(index_dir))
    (path,) = [p for p in index_dir.iterdir() if p.suffix == ".json"]
    path.write_text('{"format": 1, "keys": ["trunc')
    assert load_or_build_index(vol.store, str(index_dir)) == first


def test_empty_and_missing_volumes_name_the_url(tmp_path, make_volume):
    (tmp_path / "empty").mkdir()
    with pytest.raises(EmptyVolumeError, match=str(tmp_path / "empty")):
        build_index(open_store(tmp_path / "empty"))
    with pytest.raises(EmptyVolumeError, match="nowhere"):
        build_index(open_store(tmp_path / "nowhere"))
    vol = make_volume(3)
    with pytest.raises(EmptyVolumeError, match=r"3 listed; include=\['\*.png'\]"):
        vol.dataset(include=["*.png"])
    (tmp_path / "one.bin").write_bytes(b"x")  # a file in place of the volume's folder
    with pytest.raises(EmptyVolumeError, match=r"one\.bin is a file, not a folder"):
        build_index(open_store(tmp_path / "one.bin"))


def test_a_file_no_store_can_read_back_is_refused_at_the_listing(tmp_path):
    """A backslash in a file name: listed, then refused at its first read, mid-epoch."""
    (tmp_path / "vol").mkdir()
    (tmp_path / "vol" / "ok.bin").write_bytes(b"x")
    (tmp_path / "vol" / "a\\b.bin").write_bytes(b"y")
    refused = r"1 file\(s\) at .*vol have a backslash.*'a\\\\b.bin'"  # repr: two
    with pytest.raises(ValueError, match=refused):
        build_index(open_store(tmp_path / "vol"))
    index = build_index(open_store(tmp_path / "vol"), exclude=["*\\*"])  # the way out named
    assert [e.key for e in index.entries] == ["ok.bin"]


def test_a_link_out_of_the_volume_is_refused_unless_the_filters_leave_it_out(tmp_path):
    """A hostile user's find: a linked folder's files were left out without a word; a
    linked file was listed, then refused at its first read. Now both stop the dataset at
    its start, naming the link, unless include/exclude leave them out."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "x.bin").write_bytes(b"x")
    vol = tmp_path / "vol"
    (vol / "train").mkdir(parents=True)
    (vol / "train" / "a.bin").write_bytes(b"a")
    os.symlink(tmp_path / "elsewhere", vol / "train" / "more")
    os.symlink("train/a.bin", vol / "alias.bin")  # inside: an alias, skipped
    with pytest.raises(StoreError, match=r"'train/more/': a symbolic link to .*elsewhere"):
        build_index(open_store(vol))
    with pytest.raises(StoreError, match=r"exclude=\['train/more/\*'\]"):
        build_index(open_store(vol), include=["train/*"])
    with pytest.raises(StoreError, match=r"'train/more/': a symbolic link"):  # may hold .bin
        build_index(open_store(vol), include=["*.bin"])
    for kw in ({"exclude": ["train/more/*"]}, {"include": ["train/a.*"]}):
        assert [e.key for e in build_index(open_store(vol), **kw).entries] == ["train/a.bin"]


def test_the_last_listing_bridges_a_store_that_does_not_answer_not_a_refused_volume():
    import errno

    from unbroken.data.index import _unreachable
    from unbroken.storage import RetriesExhaustedError
    from unbroken.storage.errors import StorePermissionError

    def listing_failed(cause: BaseException) -> StoreError:
        try:
            raise StoreError("VolumeDataset: cannot list the volume v", op="list") from cause
        except StoreError as e:
            return e

    for cause in (
        RetriesExhaustedError("list v: still failing after 10 attempts", op="list"),
        StorePermissionError("list v: permission denied (403)", op="list"),
        OSError(errno.ENOTCONN, "Transport endpoint is not connected"),
        OSError(errno.ESTALE, "Stale file handle"),
    ):
        assert _unreachable(listing_failed(cause)), cause
    refused = StoreError("VolumeDataset: 1 path(s) at v cannot be listed", op="list")
    assert not _unreachable(refused)
    assert not _unreachable(listing_failed(ValueError("control character in a key")))


def test_a_name_that_is_not_utf8_is_refused_naming_it(tmp_path):
    """A Latin-1 name on a path crashed the start with a bare UnicodeEncodeError naming
    neither the file nor the volume."""
    vol = tmp_path / "vol"
    vol.mkdir()
    (vol / "a.bin").write_bytes(b"a")
    with open(os.path.join(os.fsencode(vol), b"caf\xe9.bin"), "wb") as f:
        f.write(b"b")
    with pytest.raises(ValueError, match=r"not UTF-8: 'caf\\udce9.bin'.*exclude"):
        build_index(open_store(vol))
    assert [e.key for e in build_index(open_store(vol), exclude=["caf*"]).entries] == ["a.bin"]


@pytest.mark.s3
def test_unreachable_volume_names_the_url(s3_server, tmp_path):
    url = "s3://no-such-bucket-here/data"
    store = open_store(url, retry=NO_RETRY, **s3_server.storage_options)
    with pytest.raises(StoreError, match="cannot list the volume s3://no-such-bucket-here/data"):
        build_index(store)
    # a server that does not answer at all
    options = dict(
        s3_server.storage_options,
        endpoint_url="http://127.0.0.1:9",
        connect_timeout="1s",
    )
    with pytest.raises(StoreError, match="no-such-bucket-here"):
        build_index(open_store(url, retry=NO_RETRY, **options))


@pytest.mark.s3
def test_index_over_s3_matches_local(tmp_path, s3_server_lazy):
    pytest.importorskip("s3fs")
    from tests.data.conftest import write_volume

    keys = {}
    for backend in ("local", "s3"):
        url, options = make_store_url(backend, tmp_path / backend, s3_server_lazy)
        write_volume(url, options, 7)
        keys[backend] = [e.key for e in build_index(open_store(url, **options)).entries]
    assert keys["local"] == keys["s3"]


def test_an_unwritable_index_dir_still_lists(make_volume, tmp_path):
    vol = make_volume(4)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the index directory should be")
    index = load_or_build_index(vol.store, str(blocker / "index"))
    assert len(index) == 4


def test_an_index_keeps_every_entry_etags_or_none_through_its_cached_copy(tmp_path):
    from unbroken.data.index import FileIndex, _read, _write, fingerprint
    from unbroken.storage import Entry

    entries = [Entry("a/é.jpg", 3, None), Entry("b", 0, '"etag-1"'), Entry("c/d", 2**40, "")]
    index = FileIndex("/v", entries, fingerprint(entries))
    assert index.entries == entries and index.columns()[2] == [None, '"etag-1"', ""]
    path = str(tmp_path / "index.json")
    _write(path, index, "/v", [], [])
    again = _read(path, "/v")
    assert again == index and again.entries == entries


@pytest.mark.parametrize(
    "key, include, exclude, selectable",
    [
        (".private/", None, None, True),  # an unreadable folder may hold any file
        (".private/", ["train/*"], None, False),  # nothing under it can be selected
        (".private/", ["*.jpg"], None, True),  # a jpg could lie under it
        (".private/", None, [".private/*"], False),  # left out by name
        ("train/cats/", ["train/*"], None, True),
        ("train/", ["train/cats/*"], None, True),
        ("README.link", None, ["*.link"], False),
        ("README.link", ["*.jpg"], None, False),
        ("log/", None, ["log?"], True),  # '?' matches the folder's '/', not a file in it
        ("sub/", None, ["sub/?*"], False),
    ],
)
def test_what_cannot_be_listed_is_refused_only_where_the_filters_would_select_it(
    key, include, exclude, selectable
):
    from unbroken.data.index import _selectable

    assert _selectable(key, include, exclude) is selectable


def test_datasets_made_and_dropped_leave_no_descriptor_open(make_volume):
    """A loop that makes a dataset per run, or per hyperparameter trial, must not run
    out of descriptors: each one's cache ledger closes when it is dropped."""
    import gc

    vol = make_volume(4)

    def ledgers() -> int:
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own, closed by now
                count += os.readlink(f"/proc/self/fd/{fd}").endswith("/usage")
        return count

    before = ledgers()
    for _ in range(20):
        ds = vol.dataset()
        assert len(list(ds)) == 4  # the ledger was opened
        del ds
    gc.collect()
    assert ledgers() - before <= 1
