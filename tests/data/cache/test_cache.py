"""LocalCache on a local path, memory:// and a real S3 server on loopback."""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.data._cache_util import FAST_RETRY, disk_bytes, put_files, slow, spawn
from unbroken import open_store
from unbroken.data.cache.cache import (
    CacheDirError,
    LocalCache,
    SourceChangedError,
    default_cache_dir,
)
from unbroken.storage import Entry, LocalStore, ObjectNotFoundError, StoreError

SHARED = ["local", "s3"]  # backends that several processes can reach


def test_hits_and_misses_are_counted(store, tmp_path):
    entries = put_files(store, 5, size=300)
    cache = LocalCache(store, str(tmp_path / "cache"))
    first = [cache.read(e) for e in entries]
    assert [cache.read(e) for e in entries] == first
    assert first == [store.read_bytes(e.key) for e in entries]
    s = cache.stats.snapshot()
    assert (s["hits"], s["misses"], s["bytes_fetched"]) == (5, 5, 1500)
    assert s["fetch_seconds"] > 0
    assert cache.used_bytes == 1500 == disk_bytes(cache.cache_dir)
    assert all(cache.contains(e) for e in entries)


def test_fetch_only_fills_and_read_then_hits(store, tmp_path):
    (entry,) = put_files(store, 1)
    cache = LocalCache(store, str(tmp_path / "cache"))
    cache.fetch(entry)
    cache.fetch(entry)
    assert cache.stats.misses == 1 and cache.stats.hits == 0
    assert cache.read(entry) == store.read_bytes(entry.key)
    assert cache.stats.hits == 1


def test_threads_reading_one_file_fetch_it_once(store, tmp_path):
    (entry,) = put_files(store, 1, size=5000)
    cache = LocalCache(slow(store, latency=0.05), str(tmp_path / "cache"))
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.read(entry))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 6
    assert cache.stats.misses == 1 and cache.stats.hits == 5


@pytest.mark.multiprocess
@pytest.mark.parametrize("store_url", SHARED, indirect=True)
def test_processes_sharing_a_cache_fetch_each_file_once(store_url, tmp_path):
    url, options = store_url
    store = open_store(url, **options)
    entries = put_files(store, 10, size=2000)
    cache = LocalCache(slow(store, latency=0.05), str(tmp_path / "cache"))
    go = tmp_path / "go"
    script = f"""
import json, os, time
cache, entries = OBJ
while not os.path.exists({str(go)!r}):
    time.sleep(0.005)
data = [cache.read(e) for e in entries]
print(json.dumps([cache.stats.snapshot(), [d.hex()[:16] for d in data]]))
"""
    orders = [entries, entries, entries[::-1], entries[3:] + entries[:3]]
    procs = [spawn(script, (cache, order), tmp_path) for order in orders]
    time.sleep(0.5)
    go.touch()
    reports = []
    for p, order in zip(procs, orders):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
        stats, digests = json.loads(out)
        assert digests == [store.read_bytes(e.key).hex()[:16] for e in order]
        reports.append(stats)
    assert sum(r["misses"] for r in reports) == len(entries)
    assert sum(r["bytes_fetched"] for r in reports) == 2000 * len(entries)
    assert sum(r["hits"] for r in reports) == 3 * len(entries)
    assert cache.used_bytes == disk_bytes(cache.cache_dir) == 2000 * len(entries)


@pytest.mark.multiprocess
@pytest.mark.parametrize("recovery", ["reopen", "takeover"])
@pytest.mark.parametrize("store_url", SHARED, indirect=True)
def test_filler_killed_midway_leaves_nothing_served_and_its_temp_is_swept(
    store_url, recovery, tmp_path
):
    url, options = store_url
    store = open_store(url, **options)
    (entry,) = put_files(store, 1, size=400_000)
    cache_dir = str(tmp_path / "cache")
    cache = LocalCache(slow(store, latency=0.0, bandwidth=200_000), cache_dir)
    # a process that was already running, reading the same remote (same URL) at full speed
    survivor = LocalCache(slow(store, latency=0.0), cache_dir)
    cache.small_file = 1000  # stream it: a temp file exists while the link is busy
    proc = spawn("cache, entry = OBJ\ncache.read(entry)\n", (cache, entry), tmp_path)
    deadline = time.monotonic() + 60
    while len(_temp_files(cache_dir)) < 2:  # its fill temp and its download's own temp
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the filler never started its temp file"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not cache.contains(entry)
    assert _temp_files(cache_dir)
    assert survivor.layout.fillers.dead_reserved() == entry.size  # the dead filler's record
    assert survivor.used_bytes == entry.size  # its reservation is still counted

    if recovery == "takeover":  # the next filler of that file cleans up after the dead one
        assert survivor.read(entry) == store.read_bytes(entry.key)
        assert not _temp_files(cache_dir) and not _dead_records(cache_dir)
        assert survivor.used_bytes == entry.size == disk_bytes(cache_dir)
        return
    again = LocalCache(store, cache_dir)
    assert again.swept >= 2  # its temp file and its record
    assert not _temp_files(cache_dir) and not _dead_records(cache_dir)
    assert again.used_bytes == 0  # its reservation died with it
    assert again.read(entry) == store.read_bytes(entry.key)
    assert again.used_bytes == entry.size == disk_bytes(cache_dir)


def test_a_live_fillers_lock_blocks_others_until_published(store, tmp_path):
    (entry,) = put_files(store, 1)
    cache = LocalCache(store, str(tmp_path / "cache"))
    name = cache._name(entry)
    fd = cache.layout.try_lock(name)  # as another filler would hold it
    assert cache.layout.try_lock(name) is None
    assert LocalCache(store, cache.cache_dir).swept == 0  # held locks are not swept
    got = []
    reader = threading.Thread(target=lambda: got.append(cache.read(entry)))
    reader.start()
    time.sleep(0.1)
    assert reader.is_alive() and not got  # it waits instead of fetching a second time
    cache.layout.unlock(name, fd)
    reader.join(10)
    assert got == [store.read_bytes(entry.key)]


def test_changed_source_is_refetched_and_the_stale_copy_goes_first(store, tmp_path):
    store.write_bytes("doc.txt", b"version one")
    old = store.info("doc.txt")
    store.write_bytes("other.txt", b"o" * 12)
    other = store.info("other.txt")
    cache = LocalCache(store, str(tmp_path / "cache"), limit=30)
    assert cache.read(old) == b"version one"
    time.sleep(0.01)  # local etags carry mtime_ns: make sure it moves
    store.write_bytes("doc.txt", b"version two!")
    new = store.info("doc.txt")
    assert new != old
    assert cache.read(new) == b"version two!"
    assert cache.stats.misses == 2
    cache.plan([new, other])
    cache.read(other)  # full: the stale version, in no plan, is the one evicted
    assert not cache.contains(old) and cache.contains(new) and cache.contains(other)
    assert cache.read(new) == b"version two!"
    assert cache.used_bytes == 24 == disk_bytes(cache.cache_dir)


def test_same_size_new_etag_is_refetched(store, tmp_path):
    store.write_bytes("x", b"aaaa")
    old = store.info("x")
    cache = LocalCache(store, str(tmp_path / "cache"))
    cache.read(old)
    time.sleep(0.01)
    store.write_bytes("x", b"bbbb")
    new = store.info("x")
    assert new.etag != old.etag, "the backend gave no new etag"
    assert cache.read(new) == b"bbbb"


def test_source_that_changed_since_indexing_is_a_clear_error(store, tmp_path):
    store.write_bytes("img/cat.jpg", b"12345")
    stale = Entry("img/cat.jpg", 3, "old-etag")
    cache = LocalCache(store, str(tmp_path / "cache"))
    with pytest.raises(SourceChangedError, match=r"img/cat\.jpg.*5 bytes.*index says 3"):
        cache.read(stale)
    assert cache.used_bytes == 0 == disk_bytes(cache.cache_dir)


def test_missing_file_names_it_and_leaves_nothing_behind(store, tmp_path):
    cache = LocalCache(store, str(tmp_path / "cache"))
    with pytest.raises(ObjectNotFoundError, match=r"train/missing\.jpg"):
        cache.read(Entry("train/missing.jpg", 10, "e"))
    with pytest.raises(FileNotFoundError, match=r"train/missing\.jpg"):
        cache.fetch(Entry("train/missing.jpg", 10, "e"))
    assert cache.used_bytes == 0 == disk_bytes(cache.cache_dir)
    assert cache.layout.fillers.reserved == 0 and not _temp_files(cache.cache_dir)


def test_bad_inputs_are_refused(store, tmp_path):
    with pytest.raises(ValueError, match="limit"):
        LocalCache(store, str(tmp_path / "c"), limit=0)
    with pytest.raises(ValueError, match="byte size"):
        LocalCache(store, str(tmp_path / "c"), limit="lots")
    cache = LocalCache(store, str(tmp_path / "c"))
    with pytest.raises(TypeError, match="Entry"):
        cache.read("a/b")
    with pytest.raises(ValueError, match=r"\.\."):
        cache.read(Entry("../../etc/passwd", 10))


def test_limit_is_respected_and_pinned_files_survive(store, tmp_path):
    entries = put_files(store, 12, size=1000)
    cache = LocalCache(store, str(tmp_path / "cache"), limit="3500")
    cache.read(entries[0])
    path = cache.layout.object_path(cache._name(entries[0]))
    with open(path, "rb") as pinned:  # a reader in the middle of reading entries[0]
        fcntl.flock(pinned, fcntl.LOCK_SH)
        for e in entries[1:]:
            assert cache.read(e) == store.read_bytes(e.key)
            assert disk_bytes(cache.cache_dir) <= 3500
            assert cache.used_bytes == disk_bytes(cache.cache_dir)
        assert os.path.exists(path)
    assert cache.stats.evictions >= 8
    cache.read(entries[1])
    assert disk_bytes(cache.cache_dir) <= 3500


def test_eviction_takes_what_is_needed_furthest_in_the_future(store, tmp_path):
    a, b, c, d = put_files(store, 4, size=100)
    cache = LocalCache(store, str(tmp_path / "cache"), limit=350)  # room for 3
    cache.plan([a, b, c, d, b, a, c])
    for e in (a, b, c):
        cache.read(e)
    cache.read(d)  # full: of a, b, c, the next use of c is furthest (LRU would drop a)
    assert [cache.contains(e) for e in (a, b, c, d)] == [True, True, False, True]
    cache.read(b)
    cache.read(a)  # hits: nothing evicted
    assert cache.stats.evictions == 1
    cache.close()


def test_unplanned_files_go_first_oldest_first(store, tmp_path):
    a, b, c, d = put_files(store, 4, size=100)
    cache = LocalCache(store, str(tmp_path / "cache"), limit=350)
    for e in (a, b, c):
        cache.read(e)
        time.sleep(0.01)
    cache.read(a)  # a used again: b is now the least recently used
    cache.read(d)
    assert [cache.contains(e) for e in (a, b, c, d)] == [True, False, True, True]


@pytest.mark.multiprocess
def test_eviction_respects_another_processs_plan(tmp_path):
    store = open_store(str(tmp_path / "store"))
    a, b, c, d = put_files(store, 4, size=100)
    cache = LocalCache(store, str(tmp_path / "cache"), limit=350)
    for e in (a, b, c):
        cache.read(e)
    # another worker will soon need b and a, then c much later
    script = "import sys\ncache, plan = OBJ\ncache.plan(plan)\nprint('ok', flush=True)\n"
    script += "sys.stdin.read()\n"
    other = spawn(script, (cache, [b, a, d, d, d, c]), tmp_path)
    assert other.stdout.readline().strip() == b"ok"
    try:
        cache.read(d)
        assert [cache.contains(e) for e in (a, b, c, d)] == [True, True, False, True]
    finally:
        other.kill()
        other.wait()


def test_never_touches_anything_outside_the_cache_dir(store, tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"x" * 5000)
    entries = put_files(store, 6, size=1000)
    cache = LocalCache(store, str(tmp_path / "cache"), limit=2500)
    objects = os.path.join(cache.cache_dir, "objects")
    name = cache._name(entries[5])
    shard = os.path.join(objects, name[:2])
    os.makedirs(shard, exist_ok=True)
    # a symlinked shard directory, a symlink posing as a cached object, and one in the
    # place of an object about to be filled
    os.symlink(outside, os.path.join(objects, "zz"))
    decoy = name[:-1] + ("1" if name.endswith("0") else "0")
    os.symlink(outside / "keep.bin", os.path.join(shard, decoy))
    os.symlink(outside / "keep.bin", os.path.join(shard, name))
    for e in entries:
        cache.read(e)
    smaller = LocalCache(store, cache.cache_dir, limit=1000)
    smaller.read(entries[0])  # evicts down to the new limit
    assert disk_bytes(cache.cache_dir) <= 1000
    assert (outside / "keep.bin").read_bytes() == b"x" * 5000
    assert os.path.islink(os.path.join(objects, "zz"))
    assert os.path.islink(os.path.join(shard, decoy))
    assert not os.path.islink(os.path.join(shard, name))  # replaced, not followed


@pytest.mark.parametrize("store_url", SHARED, indirect=True)
def test_remote_gone_cached_files_still_served(store_url, tmp_path):
    url, options = store_url
    store = open_store(url, **options)
    entries = put_files(store, 4)
    expected = [store.read_bytes(e.key) for e in entries]
    outage = tmp_path / "outage"
    remote = slow(store, latency=0.0, retry=FAST_RETRY, outage_file=str(outage))
    cache = LocalCache(remote, str(tmp_path / "cache"))
    assert [cache.read(e) for e in entries[:3]] == expected[:3]
    outage.touch()
    assert [cache.read(e) for e in entries[:3]] == expected[:3]
    assert cache.stats.hits == 3
    with pytest.raises(StoreError, match=entries[3].key):
        cache.read(entries[3])
    assert cache.stats.retries == 1  # the storage layer retried once, then gave up
    outage.unlink()
    assert cache.read(entries[3]) == expected[3]


def test_transient_faults_are_retried_by_the_storage_layer(store, tmp_path):
    entries = put_files(store, 20, size=100)
    remote = slow(store, latency=0.0, fail_rate=0.3, seed=7)
    cache = LocalCache(remote, str(tmp_path / "cache"))
    assert [cache.read(e) for e in entries] == [store.read_bytes(e.key) for e in entries]
    assert cache.stats.retries == remote.stats.retries > 0


def test_large_files_stream_to_disk(store, tmp_path):
    (entry,) = put_files(store, 1, size=300_000)
    cache = LocalCache(store, str(tmp_path / "cache"))
    cache.small_file = 10_000
    assert cache.read(entry) == store.read_bytes(entry.key)
    assert cache.read(entry) == store.read_bytes(entry.key)
    assert cache.stats.misses == 1 and cache.used_bytes == 300_000


def test_pickled_cache_shares_the_directory_and_counts_its_own_work(store, tmp_path):
    entries = put_files(store, 3)
    cache = LocalCache(store, str(tmp_path / "cache"), limit="1MB")
    cache.read(entries[0])
    clone = pickle.loads(pickle.dumps(cache))
    assert clone.limit == 1_000_000 and clone.cache_dir == cache.cache_dir
    assert clone.stats.snapshot()["misses"] == 0
    clone.read(entries[0])
    assert clone.stats.hits == 1 and clone.stats.misses == 0


def test_default_cache_dir_is_per_user_and_per_store(store, tmp_path, monkeypatch):
    monkeypatch.setenv("UNBROKEN_CACHE_DIR", str(tmp_path / "base"))
    cache = LocalCache(store)
    assert cache.cache_dir == default_cache_dir(store)
    assert cache.cache_dir.startswith(str(tmp_path / "base"))
    other = open_store(str(tmp_path / "elsewhere"))
    assert default_cache_dir(other) != cache.cache_dir


def _temp_files(cache_dir: str) -> list[str]:
    found = []
    for dirpath, _dirs, files in os.walk(os.path.join(cache_dir, "objects")):
        found += [os.path.join(dirpath, f) for f in files if ".unbroken-tmp-" in f]
    return found


@pytest.mark.multiprocess
@pytest.mark.parametrize("store_url", SHARED, indirect=True)
def test_processes_sharing_a_small_cache_read_correct_bytes_within_the_bound(store_url, tmp_path):
    url, options = store_url
    store = open_store(url, **options)
    entries = put_files(store, 24, size=1000)
    digests = {e.key: store.read_bytes(e.key).hex()[:16] for e in entries}
    cache = LocalCache(slow(store, latency=0.005), str(tmp_path / "cache"), limit=6000)
    script = """
import json, random
cache, entries, seed = OBJ
rng = random.Random(seed)
order = entries * 2
rng.shuffle(order)
cache.plan(order)
print(json.dumps([[e.key, cache.read(e).hex()[:16]] for e in order]))
"""
    procs = [spawn(script, (cache, entries, seed), tmp_path) for seed in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
        assert all(digests[key] == digest for key, digest in json.loads(out))
    # 3 processes, each reading or filling at most one file at a time: overshoot <= 3 files
    assert disk_bytes(cache.cache_dir) <= 6000 + 3 * 1000
    assert cache.used_bytes == disk_bytes(cache.cache_dir)
    assert not _temp_files(cache.cache_dir)


@pytest.mark.multiprocess
def test_a_forked_child_does_not_move_its_parents_plan(tmp_path):
    store = open_store(str(tmp_path / "store"))
    entries = put_files(store, 3, size=10)
    cache = LocalCache(store, str(tmp_path / "cache"), limit="1MB")
    cache.plan(entries)
    cursor = cache._plan.cursor_path
    pid = os.fork()
    if pid == 0:  # the child reads everything; the parent's cursor must not move
        try:
            for e in entries:
                cache.read(e)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    with open(cursor, "rb") as f:
        assert int.from_bytes(f.read(8), "little") == 0
    cache.read(entries[0])
    with open(cursor, "rb") as f:
        assert int.from_bytes(f.read(8), "little") == 1


def test_fetch_of_a_large_file_does_not_read_it_back(store, tmp_path):
    (entry,) = put_files(store, 1, size=50_000)
    cache = LocalCache(store, str(tmp_path / "cache"))
    cache.small_file = 1000
    assert cache.fetch(entry) is None and cache.contains(entry)
    assert cache.used_bytes == entry.size == disk_bytes(cache.cache_dir)
    assert cache.read(entry) == store.read_bytes(entry.key)


def test_plans_are_published_only_with_a_limit_and_dead_ones_swept(tmp_path):
    store = open_store(str(tmp_path / "store"))
    entries = put_files(store, 3, size=10)
    plans = tmp_path / "cache" / "plans"
    LocalCache(store, str(tmp_path / "cache")).plan(entries)
    assert not os.listdir(plans)
    (plans / "999999999-dead.plan").write_text("x")  # a process that died long ago
    (plans / "999999999-dead.cursor").write_bytes(b"\0" * 8)
    limited = LocalCache(store, str(tmp_path / "cache"), limit="1MB")
    assert not os.listdir(plans)
    limited.plan(entries)
    assert len(os.listdir(plans)) == 2
    limited.close()
    assert not os.listdir(plans)


def _dead_records(cache_dir: str) -> list[str]:
    """Records of reserved bytes left by processes that died (crash evidence)."""
    from unbroken.data.cache.filler_records import FillerRecords

    records = FillerRecords(os.path.join(cache_dir, "fillers"))
    return [path for path, alive, _ in records.scan() if not alive]


def test_fills_create_only_their_published_files_and_delete_nothing(store, tmp_path):
    """No lock file per fill: on ext4 without a journal every unlinked inode makes the
    next creates slower for a minute, so a create-and-delete per fill grows quadratic."""
    entries = put_files(store, 20, size=500)
    cache = LocalCache(store, str(tmp_path / "cache"))
    before = _all_files(cache.cache_dir)
    for e in entries:
        cache.read(e)
    after = _all_files(cache.cache_dir)
    assert before <= after  # nothing deleted
    new = after - before
    published = {cache.layout.object_path(cache._name(e)) for e in entries}
    records = {p for p in new if os.path.dirname(p) == cache.layout.fillers.directory}
    assert new == published | records and len(records) == 1  # one record per process
    cache.close()
    assert not os.listdir(cache.layout.fillers.directory)  # idle: the record goes


@pytest.mark.multiprocess
def test_fill_lock_excludes_other_processes_and_dies_with_its_holder(tmp_path):
    cache, name = _one_cached_name(tmp_path)
    holder = spawn(
        "import time\ncache, name = OBJ\nassert cache.layout.try_lock(name) is not None\n"
        "print('held', flush=True)\ntime.sleep(120)\n",
        (cache, name),
        tmp_path,
    )
    assert holder.stdout.readline().strip() == b"held", holder.stderr.read().decode()
    assert cache.layout.try_lock(name) is None  # another process fills it
    other = cache.layout.try_lock(name + "x")  # other names are not blocked
    assert other is not None
    cache.layout.unlock(name + "x", other)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    fd = cache.layout.try_lock(name)  # the kernel dropped the dead holder's lock
    assert fd is not None
    cache.layout.unlock(name, fd)


@pytest.mark.multiprocess
def test_a_forked_child_does_not_keep_its_parents_fill_lock(tmp_path):
    cache, name = _one_cached_name(tmp_path)
    fd = cache.layout.try_lock(name)
    r, w = os.pipe()
    started_r, started_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child lives on while the parent releases the lock
        os.write(started_w, b"s")  # the fork hooks ran before os.fork() returned here
        os.read(r, 1)
        os._exit(0)
    try:
        assert os.read(started_r, 1) == b"s"
        cache.layout.unlock(name, fd)
        probe = LocalCache(cache.store, cache.cache_dir).layout.try_lock(name)
        assert probe is not None, "the forked child still holds the parent's fill lock"
        os.close(probe)
    finally:
        os.write(w, b"x")
        os.waitpid(pid, 0)
        for end in (r, w, started_r, started_w):
            os.close(end)


@pytest.mark.multiprocess
def test_workers_forked_while_a_thread_reads_keep_no_pin_that_blocks_eviction(tmp_path):
    """A DataLoader worker forked while another thread held a read pin shared the pin's
    file description: the file could not be evicted while the worker lived."""
    store = open_store(str(tmp_path / "store"))
    (entry,) = put_files(store, 1)
    cache = LocalCache(store, str(tmp_path / "cache"))
    cache.read(entry)
    name, size = cache._name(entry), entry.size
    stop = threading.Event()

    def read_on() -> None:
        while not stop.is_set():
            assert cache.layout.read_pinned(name, size) is not None

    reader = threading.Thread(target=read_on)
    reader.start()
    children = []
    born, told = os.pipe()  # a child writes once its after-fork hooks have run
    try:
        for _ in range(30):  # the reader holds a pin most of the time: most forks meet one
            pid = os.fork()
            if pid == 0:
                os.write(told, b"b")
                time.sleep(120)
                os._exit(0)
            children.append(pid)
            time.sleep(0.005)
        stop.set()
        reader.join()
        for _ in children:  # under load a child may not have run yet: not a kept pin
            assert select.select([born], [], [], 60)[0], "a forked child never ran"
            assert os.read(born, 1) == b"b"
        assert cache.layout.remove_if_unpinned(name) == size, "a forked child keeps a pin"
    finally:
        stop.set()
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(born)
        os.close(told)


@pytest.mark.multiprocess
def test_a_child_closes_a_lock_a_parent_thread_had_just_opened(tmp_path):
    """A descriptor opened a moment before the fork, not yet known to any object (where a
    parent thread stands between its open and its bookkeeping), is closed too."""
    cache, name = _one_cached_name(tmp_path)
    from unbroken.data.cache.range_locks import lock_offset, range_lock

    fd = os.open(cache.layout.fill_locks, os.O_RDWR | os.O_CLOEXEC)
    assert range_lock(fd, lock_offset(name))
    log = os.open(tmp_path / "beside-the-cache.log", os.O_WRONLY | os.O_CREAT)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:  # the user's own descriptor outside the cache's files stays open
            os.fstat(log)
            os.write(w, b"s")
        except OSError:
            os.write(w, b"f")
        time.sleep(60)
        os._exit(0)
    try:
        assert os.read(r, 1) == b"s", "the child lost a descriptor that is not the cache's"
        os.close(fd)
        probe = LocalCache(cache.store, cache.cache_dir).layout.try_lock(name)
        assert probe is not None, "the forked child still holds the parent's fill lock"
        os.close(probe)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for end in (r, w, log):
            os.close(end)


@pytest.mark.multiprocess
def test_a_child_keeps_no_pin_when_the_objects_link_to_another_disk(tmp_path):
    """/proc names the link's target: each directory is resolved on its own."""
    root = tmp_path / "cache"
    root.mkdir()
    for sub in ("objects", "fillers"):
        (tmp_path / "big-disk" / sub).mkdir(parents=True)
        (root / sub).symlink_to(tmp_path / "big-disk" / sub)
    store = open_store(str(tmp_path / "store"))
    (entry,) = put_files(store, 1)
    cache = LocalCache(store, str(root))
    cache.read(entry)
    name = cache._name(entry)
    pin = cache.layout.pin(cache.layout.object_path(name))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"s")
        time.sleep(60)
        os._exit(0)
    try:
        assert os.read(r, 1) == b"s"
        os.close(pin)
        assert cache.layout.remove_if_unpinned(name) == entry.size, "the child keeps a pin"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)


def test_a_platform_without_ofd_locks_is_refused_clearly(store, tmp_path, monkeypatch):
    from unbroken.data.cache import range_locks

    monkeypatch.setattr(range_locks, "_OFD_SETLK", None)
    with pytest.raises(OSError, match="F_OFD_SETLK"):
        LocalCache(store, str(tmp_path / "cache"))


def _all_files(root: str) -> set[str]:
    return {os.path.join(d, f) for d, _dirs, files in os.walk(root) for f in files}


def _one_cached_name(tmp_path) -> tuple[LocalCache, str]:
    """A cache over a local store of one file, and that file's cache name."""
    store = open_store(str(tmp_path / "store"))
    (entry,) = put_files(store, 1)
    cache = LocalCache(store, str(tmp_path / "cache"))
    return cache, cache._name(entry)


FULL_DISK = """
import os, resource, signal
from unbroken.data.cache.cache import CacheWriteError
cache, entries = OBJ
cache.read(entries[0])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))  # a nearly full disk
try:
    cache.read(entries[1])
except CacheWriteError as e:
    print("ERROR:", e)
print("used:", cache.used_bytes)
"""


@pytest.mark.multiprocess
def test_a_full_local_disk_names_the_file_and_the_cache_and_leaves_nothing(tmp_path):
    store = open_store(str(tmp_path / "store"))
    entries = put_files(store, 2, size=100_000)
    cache = LocalCache(store, str(tmp_path / "cache"))
    proc = spawn(FULL_DISK, (cache, entries), tmp_path)
    out, err = proc.communicate(timeout=60)
    out = out.decode()
    assert proc.returncode == 0, err.decode()
    assert f"ERROR: LocalCache: cannot store {entries[1].key!r} (100000 bytes)" in out, out
    assert str(tmp_path / "cache") in out and "File too large" in out, out
    assert "used: 100000" in out  # the failed fill's reservation was given back
    assert not _temp_files(cache.cache_dir) and disk_bytes(cache.cache_dir) == 100_000
    assert cache.read(entries[1]) == store.read_bytes(entries[1].key)  # room again: fine


FULL_DISK_PLAN = """
import os, resource, signal
from unbroken.data.cache.cache import CacheWriteError
cache, entries = OBJ
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # room for no plan of 200 names
try:
    cache.plan(entries)
except CacheWriteError as e:
    print("ERROR:", e)
print("plans:", sorted(os.listdir(cache.layout.plans)))
"""


@pytest.mark.multiprocess
def test_a_full_disk_at_an_epochs_plan_names_the_cache_and_leaves_no_temp_plan(tmp_path):
    """An epoch's read order is written at its start: a full disk there raised a bare
    ENOSPC naming no path, and left its temp file behind for ever."""
    store = open_store(str(tmp_path / "store"))
    entries = put_files(store, 200, size=10)
    cache = LocalCache(store, str(tmp_path / "cache"), limit="1MB")
    proc = spawn(FULL_DISK_PLAN, (cache, entries), tmp_path)
    out, err = proc.communicate(timeout=60)
    out = out.decode()
    assert proc.returncode == 0, err.decode()
    assert "ERROR: LocalCache: cannot store this process's read order (200 files)" in out, out
    assert str(tmp_path / "cache") in out and "File too large" in out, out
    assert "plans: []" in out, out


def test_temp_plans_of_dead_writers_are_swept_and_live_ones_kept(tmp_path):
    """A writer killed (or refused by a full disk) mid-plan left its temp file, which
    no sweep removed: one per crash, each as long as a worker's share of an epoch."""
    from unbroken.data.cache.access_plan import PlanReader, PlanWriter
    from unbroken.storage.base import temp_name

    plans = tmp_path / "plans"
    plans.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    orphan = plans / f".{dead_pid}-0badc0de.plan.unbroken-tmp-{dead_pid}-12345678"
    orphan.write_text("a\nb")
    mine = plans / temp_name(f"{os.getpid()}-0000beef.plan")
    mine.write_text("c")
    live = PlanWriter(str(plans))
    live.publish(["x", "y"])
    assert PlanReader(str(plans)).load() == [(["x", "y"], 0)]
    assert not orphan.exists() and mine.exists()


def test_a_cache_without_its_ledger_file_is_recounted_on_open(store, tmp_path):
    entries = put_files(store, 3, size=700)
    cache = LocalCache(store, str(tmp_path / "cache"))
    for e in entries:
        cache.read(e)
    os.unlink(os.path.join(cache.cache_dir, "usage"))  # lost, or a restored directory
    again = LocalCache(store, cache.cache_dir)
    assert again.used_bytes == 2100 == disk_bytes(cache.cache_dir)


def test_files_removed_from_outside_are_recounted_before_anything_is_evicted(store, tmp_path):
    """A tmp cleaner (or rm to free space) took the cached files: the ledger still
    counted them, so a cache under its limit evicted every file it filled, for ever."""
    entries = put_files(store, 4, size=1000)
    cache = LocalCache(store, str(tmp_path / "cache"), limit="5000")
    for e in entries:
        cache.read(e)
    objects = os.path.join(cache.cache_dir, "objects")
    for shard in os.listdir(objects):
        for name in os.listdir(os.path.join(objects, shard)):
            os.unlink(os.path.join(objects, shard, name))
    again = LocalCache(store, cache.cache_dir, limit="5000")
    for e in entries:
        assert again.read(e) == store.read_bytes(e.key)
    for e in entries:
        again.read(e)
    s = again.stats.snapshot()
    assert (s["misses"], s["hits"], s["evictions"]) == (4, 4, 0), s
    assert again.used_bytes == 4000 == disk_bytes(cache.cache_dir)


def test_a_fill_record_removed_from_outside_mid_fill_leaves_the_cache_within_its_limit(
    tmp_path,
):
    """rm of the cache's files while a job runs took a live filler's record too: every
    recount then missed its bytes in flight, they landed uncounted, and the cache stayed
    over its limit by them for the rest of the job (50% over in a soak)."""
    store = open_store(str(tmp_path / "store"))
    entries = put_files(store, 9, size=1000)
    cache_dir = str(tmp_path / "cache")
    filling = LocalCache(slow(store, latency=1.0), cache_dir, limit="4000")
    cache = LocalCache(store, cache_dir, limit="4000")  # another worker of the node
    fill = threading.Thread(target=filling.read, args=(entries[0],))
    fill.start()
    records = filling.layout.fillers
    deadline = time.monotonic() + 30
    while not any(reserved for _, _, reserved in records.scan()):
        assert time.monotonic() < deadline, "the slow fill never reserved its bytes"
        time.sleep(0.01)
    for name in os.listdir(records.directory):
        os.unlink(os.path.join(records.directory, name))
    for e in entries[1:6]:
        cache.read(e)  # evicts, recounting while the slow fill's bytes are in flight
    fill.join(timeout=60)
    for e in entries[6:]:
        assert filling.read(e) == store.read_bytes(e.key)  # its record comes back
    assert disk_bytes(cache_dir) <= 4000
    assert cache.used_bytes == disk_bytes(cache_dir)


@pytest.mark.parametrize("limit", [None, "4000"])
def test_the_caches_contents_removed_from_outside_while_it_runs_are_made_again(tmp_path, limit):
    """rm -rf CACHE/* mid-job took the folders of fill records and plans too: a record
    made again in a folder that was gone failed every later fill of the process."""
    store = open_store(str(tmp_path / "store"))
    entries = put_files(store, 8, size=1000)
    cache = LocalCache(store, str(tmp_path / "cache"), limit=limit)
    cache.plan(entries)
    for e in entries[:3]:
        cache.read(e)
    for name in os.listdir(cache.cache_dir):
        path = os.path.join(cache.cache_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    cache.plan(entries)  # the next epoch's read order
    for e in entries:
        assert cache.read(e) == store.read_bytes(e.key)
    assert cache.used_bytes == disk_bytes(cache.cache_dir) <= (4000 if limit else 8000)
    if limit:  # the plan's cursor too: kept in a file gone, evictors read 0 for ever
        from unbroken.data.cache.access_plan import PlanReader

        assert [c for _, c in PlanReader(cache.layout.plans).load()] == [len(entries)]


def test_a_lower_limit_evicts_down_to_it_when_the_cache_opens(store, tmp_path):
    """It evicted nothing until the next fill: a job that only hits kept the old size."""
    entries = put_files(store, 6, size=1000)
    cache = LocalCache(store, str(tmp_path / "cache"))
    for e in entries:
        cache.read(e)
    smaller = LocalCache(store, cache.cache_dir, limit="3000")
    assert smaller.used_bytes <= 3000 and disk_bytes(cache.cache_dir) <= 3000


def test_a_shard_folder_removed_by_a_cleaner_is_made_again(store, tmp_path):
    """An age-based cleaner removed cached files and their emptied folders: the next
    fill of that folder failed (CacheWriteError) until the process restarted."""
    entries = put_files(store, 3, size=300)
    cache = LocalCache(store, str(tmp_path / "cache"))
    for e in entries:
        cache.read(e)
    shutil.rmtree(os.path.join(cache.cache_dir, "objects"))
    os.makedirs(os.path.join(cache.cache_dir, "objects"))
    assert [cache.read(e) for e in entries] == [store.read_bytes(e.key) for e in entries]
    assert all(cache.contains(e) for e in entries)


def test_a_shard_folder_removed_during_a_fill_is_made_again_and_the_fill_redone(store, tmp_path):
    """The cleaner came while the file was being fetched: the rename into the removed
    folder failed, and the file was blamed (SampleReadError, or skipped)."""
    (entry,) = put_files(store, 1, size=300)
    cache = LocalCache(slow(store, latency=0.3), str(tmp_path / "cache"))
    shard = os.path.dirname(cache.layout.object_path(cache._name(entry)))

    def cleaner() -> None:
        deadline = time.monotonic() + 30
        while not (os.path.isdir(shard) and os.listdir(shard)) and time.monotonic() < deadline:
            time.sleep(0.002)
        shutil.rmtree(shard)  # the fill's temp file with it

    thread = threading.Thread(target=cleaner)
    thread.start()
    try:
        assert cache.read(entry) == store.read_bytes(entry.key)
    finally:
        thread.join()
    assert cache.contains(entry) and cache.stats.misses == 1


def test_a_cache_removed_under_a_running_job_is_named_not_blamed_on_a_file(store, tmp_path):
    entries = put_files(store, 2, size=300)
    cache = LocalCache(store, str(tmp_path / "cache"))
    cache.read(entries[0])
    shutil.rmtree(cache.cache_dir)
    with pytest.raises(CacheDirError, match=r"was removed while this process used it"):
        cache.read(entries[1])


def test_files_cached_before_a_restart_are_dropped(store, tmp_path, caplog):
    """Fills are not fsynced: after a power loss a file may have its size and zeroed
    blocks. A different kernel boot id means nothing cached before can be trusted."""
    entries = put_files(store, 3, size=700)
    cache = LocalCache(store, str(tmp_path / "cache"))
    for e in entries:
        cache.read(e)
    boot_file = os.path.join(cache.cache_dir, "boot_id")
    with open("/proc/sys/kernel/random/boot_id") as now, open(boot_file) as recorded:
        assert recorded.read() == now.read().strip()
    assert LocalCache(store, cache.cache_dir).swept == 0  # same boot: all kept
    assert all(cache.contains(e) for e in entries)
    with open(boot_file, "w") as f:
        f.write("00000000-0000-0000-0000-000000000000")  # as if written before a restart
    with caplog.at_level("WARNING"):
        after = LocalCache(store, cache.cache_dir)
    assert "restarted" in caplog.text and "dropped 3 cached files" in caplog.text
    assert not any(after.contains(e) for e in entries)
    assert after.used_bytes == 0 == disk_bytes(cache.cache_dir)
    assert after.read(entries[0]) == store.read_bytes(entries[0].key)  # refetched
    assert after.used_bytes == 700


def test_fills_in_flight_past_the_limit_are_evicted_back_under_it(store, tmp_path):
    """More concurrent fills than the limit holds: each reserves with nothing published
    to evict, so the bound can only be restored as they land."""
    entries = put_files(store, 6, size=1000)
    cache = LocalCache(slow(store, latency=0.2), str(tmp_path / "cache"), limit=3000)
    threads = [threading.Thread(target=cache.read, args=(e,)) for e in entries]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert disk_bytes(cache.cache_dir) <= 3000
    assert cache.used_bytes == disk_bytes(cache.cache_dir)


class _RenamingVersions(LocalStore):
    """A server that names each version one way in a listing and another in a read."""

    def __init__(self, url: str, read_name) -> None:
        super().__init__(url)
        self.read_name = read_name

    def _read_versioned(self, key: str) -> tuple[bytes, str | None]:
        data, version = super()._read_versioned(key)
        return data, self.read_name(version)


@pytest.mark.parametrize(
    "read_name", [lambda v: f'W/"{v}"', lambda v: "d41d8cd98f00b204e9800998ecf8427e"]
)
def test_versions_named_two_ways_by_one_server_are_not_taken_for_a_change(
    tmp_path, read_name, caplog
):
    store = _RenamingVersions(str(tmp_path / "store"), read_name)
    entries = put_files(store, 3)
    cache = LocalCache(store, str(tmp_path / "cache"))
    with caplog.at_level("WARNING", logger="unbroken.data.cache.cache"):
        assert [cache.read(e) for e in entries] == [store.read_bytes(e.key) for e in entries]
    quirk = "W/" not in read_name("x")  # a weak mark alone is the same name
    assert caplog.text.count("are not compared with the listing") == int(quirk)


def test_a_version_changed_under_a_server_that_names_versions_two_ways_is_refused(tmp_path):
    store = _RenamingVersions(str(tmp_path / "store"), lambda v: "some-other-name")
    (entry,) = put_files(store, 1)
    path = os.path.join(store.root, entry.key)
    os.utime(path, ns=(1, 1))  # a new version: the listing names it too
    cache = LocalCache(store, str(tmp_path / "cache"))
    with pytest.raises(SourceChangedError, match="changed since the index was built"):
        cache.read(entry)
    assert not cache.contains(entry)


@pytest.mark.parametrize("small_file", [10_000, 100])
def test_a_file_rewritten_after_the_listing_is_never_cached_as_the_listed_version(
    tmp_path, small_file
):
    """Read in one request or downloaded in ranges (a file over small_file)."""
    store = open_store(str(tmp_path / "store"))
    (entry,) = put_files(store, 1, size=1000)
    path = os.path.join(store.root, entry.key)
    with open(path, "r+b") as f:  # the same size, other bytes, a new mtime
        f.write(b"x" * 1000)
    os.utime(path, ns=(10**18, 10**18))
    cache = LocalCache(store, str(tmp_path / "cache"))
    cache.small_file = small_file
    with pytest.raises(SourceChangedError, match="changed since the index was built"):
        cache.read(entry)
    assert not cache.contains(entry)
