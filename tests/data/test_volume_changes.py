"""A volume that changed between starts: seen at the next start, never served stale.

Every dataset is made with the same cache_dir (and so the same cached index and the
same cached files) as the one before the change, as a restarted job would be.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

import unbroken as ub
from tests.data.helpers import flatten
from unbroken.data.cache.cache import SourceChangedError
from unbroken.data.dataset import SampleReadError
from unbroken.data.index import EmptyVolumeError, load_or_build_index
from unbroken.data.index import _write as write_index
from unbroken.data.loader_state import LoaderStateError


def served(ds: ub.VolumeDataset) -> list[int]:
    return sorted(s for b in ub.DataLoader(ds, batch_size=1, num_workers=0) for s in flatten(b))


def rewrite_same_size(vol, key: str, data: bytes) -> None:
    """Replace a file's bytes, keeping its size; its mtime (or ETag) moves on."""
    if "://" in vol.url:  # an object store: a new object, a new ETag
        assert vol.store.info(key).size == len(data)
        vol.store.write_bytes(key, data)
        return
    path = os.path.join(vol.url, key)
    assert os.path.getsize(path) == len(data)
    before = os.stat(path).st_mtime_ns
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(before + 10**9, before + 10**9))  # coarse clocks: make sure it moves


def test_files_added_after_the_first_start_are_seen(make_volume):
    vol = make_volume(6)
    assert served(vol.dataset()) == list(range(6))
    vol.store.write_bytes("d0/s0100.txt", b"100")
    assert served(vol.dataset()) == [*range(6), 100]


def test_a_deleted_file_is_not_served_from_the_cache(make_volume):
    vol = make_volume(6)
    assert served(vol.dataset()) == list(range(6))  # every file is now in the local cache
    vol.store.delete("d1/s0004.txt")
    ds = vol.dataset()
    assert len(ds) == 5
    assert served(ds) == [0, 1, 2, 3, 5]


def test_a_same_size_rewrite_is_served_new_not_from_the_cache(make_volume, backend):
    vol = make_volume(6, backend)
    assert served(vol.dataset()) == list(range(6))
    rewrite_same_size(vol, "d0/s0003.txt", b"7")
    assert served(vol.dataset()) == [0, 1, 2, 4, 5, 7]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_rewrite_after_the_listing_is_refused_and_never_cached_as_the_listed_version(
    make_volume, backend, workers
):
    """Rewritten between the listing and its read, then put back (the same bytes: the
    same ETag on S3): the cache must not keep the other bytes under the listed version's
    name, or every later start would serve them."""
    vol = make_volume(6, backend)
    listed = vol.dataset()  # before the rewrite
    original = vol.store.read_bytes("d0/s0003.txt")
    rewrite_same_size(vol, "d0/s0003.txt", b"7")
    with pytest.raises(SampleReadError, match=r"s0003\.txt.*changed since the index") as err:
        list(ub.DataLoader(listed, batch_size=1, num_workers=workers, fill_ahead=False))
    assert workers or isinstance(err.value.__cause__, SourceChangedError)
    if "://" in vol.url:
        vol.store.write_bytes("d0/s0003.txt", original)  # the same ETag as listed
    else:  # the listed mtime back
        path = os.path.join(vol.url, "d0/s0003.txt")
        with open(path, "wb") as f:
            f.write(original)
        version = listed.index.entries[[e.key for e in listed.index.entries].index("d0/s0003.txt")]
        mtime = int(version.etag.split("-")[0], 16)
        os.utime(path, ns=(mtime, mtime))
    again = vol.dataset()
    assert again.fingerprint == listed.fingerprint
    assert served(again) == list(range(6))


@pytest.mark.parametrize("change", ["added", "deleted", "rewritten"])
def test_resuming_on_a_changed_volume_is_refused(make_volume, backend, change):
    vol = make_volume(8, backend)
    ld = vol.loader(batch_size=2)
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    if change == "added":
        vol.store.write_bytes("d0/s0100.txt", b"100")
    elif change == "deleted":
        vol.store.delete("d2/s0005.txt")
    else:
        rewrite_same_size(vol, "d2/s0005.txt", b"9")
    resumed = vol.loader(batch_size=2)
    with pytest.raises(LoaderStateError, match="another file set") as err:
        resumed.load_state_dict(state)
    assert vol.url in str(err.value)
    # an unchanged volume still resumes
    same = vol.loader(batch_size=2)
    unchanged = dict(state, fingerprint=same.state_dict()["fingerprint"])
    unchanged["num_samples"] = len(same.volume)
    same.load_state_dict(unchanged)


def test_index_max_age_reuses_a_recent_listing_and_relists_an_old_one(make_volume):
    vol = make_volume(6)
    vol.dataset()
    vol.store.write_bytes("d0/s0100.txt", b"100")
    assert len(vol.dataset(index_max_age=3600)) == 6  # listed moments ago: reused
    assert len(vol.dataset(index_max_age=None)) == 6  # trusted until refresh_index
    index_dir = vol.tmp / "cache" / "index"
    (path,) = [p for p in index_dir.iterdir() if p.suffix == ".json"]
    hour_ago = time.time() - 3600
    os.utime(path, (hour_ago, hour_ago))
    assert len(vol.dataset(index_max_age=60)) == 7  # older than allowed: listed again
    vol.store.write_bytes("d0/s0101.txt", b"101")
    assert len(vol.dataset(index_max_age=None, refresh_index=True)) == 8


def test_bad_index_max_age_is_refused(make_volume):
    vol = make_volume(3)
    for bad in (-1, float("nan"), "1h"):
        with pytest.raises(ValueError, match="index_max_age"):
            vol.dataset(index_max_age=bad)


def _waiting_on(lock_path: str) -> bool:
    """True once some thread or process blocks on the flock of ``lock_path``."""
    st = os.stat(lock_path)
    me = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as f:
        return any("->" in line and line.split()[-3] == me for line in f.read().splitlines())


def test_starts_that_wait_for_a_nodes_listing_share_it(make_volume, tmp_path):
    """Ranks starting together list once: a rank that arrives while another lists
    waits, then takes that listing (it finished after the rank asked)."""
    vol = make_volume(5)
    index_dir = str(tmp_path / "idx")
    load_or_build_index(vol.store, index_dir)
    (name,) = [n for n in os.listdir(index_dir) if n.endswith(".json")]
    got: list = []
    with open(os.path.join(index_dir, name + ".lock"), "a+") as holder:  # the lister
        fcntl.flock(holder, fcntl.LOCK_EX)
        waiter = threading.Thread(
            target=lambda: got.append(load_or_build_index(vol.store, index_dir))
        )
        waiter.start()
        deadline = time.monotonic() + 60
        while not _waiting_on(holder.name):
            assert time.monotonic() < deadline, "the second start never waited for the lock"
            time.sleep(0.01)
        vol.store.write_bytes("d0/s0100.txt", b"100")
        listed = load_or_build_index(vol.store, None)  # the lister's listing, written
        write_index(os.path.join(index_dir, name), listed, vol.store.url, [], [])
        for d in ("d0", "d1", "d2"):  # a listing by the waiter would now find nothing
            vol.store.delete(d)
    waiter.join(60)
    assert got and got[0] == listed and len(got[0]) == 6
    # a start that finds the listing already finished lists again: the volume is empty now
    with pytest.raises(EmptyVolumeError):
        load_or_build_index(vol.store, index_dir)


def test_a_start_with_the_remote_down_uses_the_nodes_last_listing(make_volume, tmp_path, caplog):
    vol = make_volume(6)
    outage = tmp_path / "remote-is-down"
    vol.url, vol.options = "emulated::" + vol.url, {"latency": 0.0, "outage_file": str(outage)}
    retry = ub.RetryPolicy(max_attempts=2, base_delay=0.001, max_delay=0.002)
    assert served(vol.dataset(retry=retry)) == list(range(6))
    outage.touch()
    ds = vol.dataset(retry=retry)  # cannot list: the listing of the last start serves
    assert "cannot list the volume" in caplog.text and "(6 files)" in caplog.text
    assert served(ds) == list(range(6))  # from the local cache
    with pytest.raises(ub.StoreError, match="cannot list"):  # asked for a new listing
        vol.dataset(retry=retry, refresh_index=True)


def test_a_volume_refused_at_a_later_start_is_not_served_from_the_last_listing(make_volume, caplog):
    """The last listing bridges an outage only: a volume that now holds a path no listing
    may leave out (a link out of it) is refused naming it, as at a first start. It was
    served from the old listing with a warning, its new files never trained on."""
    vol = make_volume(4)
    assert len(vol.dataset()) == 4
    root = Path(vol.url)
    for i in range(4, 8):
        (root / f"late-{i}.bin").write_bytes(b"x" * 8)
    (root / "outside").symlink_to("/etc")
    with pytest.raises(ub.StoreError, match="outside"):
        vol.dataset()
    assert "instead" not in caplog.text


def test_a_slow_listing_says_how_to_reuse_it(make_volume, monkeypatch, caplog):
    import unbroken.data.index as index_module

    vol = make_volume(4)
    vol.dataset()
    assert "index_max_age" not in caplog.text
    monkeypatch.setattr(index_module, "SLOW_LISTING", 0.0)  # any listing is slow now
    vol.dataset()
    assert "listing 4 files of" in caplog.text and "index_max_age=SECONDS" in caplog.text
