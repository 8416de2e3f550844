"""The training process fills the node cache ahead of the workers (fill_ahead.py)."""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

import numpy as np
import pytest

from tests.data.helpers import flatten
from unbroken.data import DataLoader
from unbroken.data.cache.cache import LocalCache
from unbroken.data.fill_ahead import CLOSE_SECONDS, GIVE_UP_AFTER, FillAhead


def _cached(cache: LocalCache, entries) -> int:
    return sum(cache.contains(e) for e in entries)


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _fill_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "unbroken-fill-ahead"]


@pytest.fixture(autouse=True)
def _no_fill_thread_left():
    """A fill thread still running after a test names where it waits (CI saw some stay
    for minutes once); one left by an earlier test fails that test, not this one."""
    before = set(_fill_threads())
    yield
    _wait_for(lambda: not (set(_fill_threads()) - before), timeout=5.0 + CLOSE_SECONDS)


def _where(threads: list[threading.Thread]) -> str:
    frames = sys._current_frames()
    return "\n".join(
        f"{t.name} {t.ident}:\n" + "".join(traceback.format_stack(frames[t.ident]))
        for t in threads
        if t.ident in frames
    )


def _assert_fill_ended(message: str = "the fill did not end") -> None:
    left = _fill_threads()
    assert not left, f"{message}; its threads wait here:\n{_where(left)}"


def test_fills_in_order_and_never_past_the_lead(make_volume, tmp_path):
    vol = make_volume(12)
    ds = vol.dataset()
    cache = LocalCache(vol.store, str(tmp_path / "fill-cache"))
    batches = [np.arange(k, k + 3) for k in range(0, 12, 3)]  # 4 batches of 3 files
    entries = [ds.index[i] for i in range(12)]
    fill = FillAhead(cache, batches, ds.index.__getitem__, lead=2, threads=4)
    try:
        _wait_for(lambda: _cached(cache, entries) == 6)  # batches 0 and 1
        assert all(cache.contains(e) for e in entries[:6])
        fill.advance(1)  # the loop has batch 0: batch 2 may come
        _wait_for(lambda: _cached(cache, entries) == 9)
        fill.advance(1)  # not news: nothing more
    finally:
        fill.close()
    assert _cached(cache, entries) == 9, "fetched past the lead"
    assert not any(cache.contains(e) for e in entries[9:])
    assert fill.take_stats()["misses"] == 9
    assert fill.failed == 0
    _assert_fill_ended()


def test_a_file_it_cannot_fetch_is_left_to_the_worker(make_volume, tmp_path):
    """The fill counts the failure and goes on with the files after it."""
    vol = make_volume(8)
    ds = vol.dataset(shuffle=False)
    lost = ds.index[3]
    vol.store.delete(lost.key)
    cache = LocalCache(vol.store, str(tmp_path / "fill-cache"))
    fill = FillAhead(cache, [np.arange(8)], ds.index.__getitem__, lead=1, threads=2)
    _wait_for(lambda: _cached(cache, ds.index.entries) == 7)
    fill.close()
    assert fill.failed == 1
    # the worker's own read raises it at its turn: test_errors.py's missing-file test,
    # whose worker case runs with fill_ahead on


@pytest.mark.multiprocess
@pytest.mark.parametrize("fill_ahead", [True, False])
def test_workers_read_what_the_training_process_fetched(make_volume, backend, fill_ahead):
    """Each file is fetched once on the node; with fill_ahead, by the training process."""
    vol = make_volume(64, backend)
    ds = vol.dataset(seed=3)
    loader = DataLoader(
        ds, batch_size=4, num_workers=2, fill_ahead=fill_ahead, timeout=120, collate_fn=list
    )
    assert loader.fill_ahead is fill_ahead
    got = [flatten(b) for b in loader]
    assert sorted(s for b in got for s in b) == list(range(64))
    reference = DataLoader(vol.dataset(seed=3, cache_dir=str(vol.tmp / "ref")), batch_size=4)
    assert got == [flatten(b) for b in reference], "another order than the in-process loader"
    fetched_here = ds._per_process().cache.stats.misses
    assert loader.metrics.misses == 64, "a file was fetched twice, or not counted"
    if fill_ahead:
        assert fetched_here > 0
    else:
        assert fetched_here == 0
    _assert_fill_ended("the epoch ended but its fill did not")
    # the warm epoch: every file a hit, nothing fetched again
    assert sorted(s for b in loader for s in flatten(b)) == list(range(64))
    assert loader.metrics.misses == 64


@pytest.mark.multiprocess
def test_a_loop_that_stops_early_stops_the_fill(make_volume):
    vol = make_volume(48)
    loader = vol.loader(batch_size=2, num_workers=2, fill_ahead=True, timeout=60)
    it = iter(loader)
    next(it)
    assert loader._filler is not None
    it.close()
    assert loader._filler is None
    _assert_fill_ended()


def _filler_fds(under: str) -> list[str]:
    """This process's open filler records under ``under`` (other tests' caches aside)."""
    fds = (os.path.join("/proc/self/fd", fd) for fd in os.listdir("/proc/self/fd"))
    return [t for t in map(_target, fds) if t.startswith(under) and "/fillers/" in t]


def _target(link: str) -> str:
    try:
        return os.readlink(link)
    except OSError:
        return ""


@pytest.mark.multiprocess
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists fds in /proc")
def test_a_loader_over_a_bounded_cache_leaves_no_record_open_after_its_epoch(make_volume):
    """Each loader that filled a bounded cache kept its filler record open in the
    training process (one fd and one locked file per loader, for good): a job making
    an eval loader per epoch grew without bound."""
    vol = make_volume(64)
    filled = 0
    for i in range(3):
        ds = vol.dataset(cache_limit=1 << 20, cache_dir=str(vol.tmp / f"cache{i}"))
        loader = DataLoader(ds, batch_size=2, num_workers=2, fill_ahead=True, timeout=60)
        assert sum(len(flatten(b)) for b in loader) == 64
        filled += ds._per_process().cache.stats.misses > 0  # (the workers may beat it)
        _assert_fill_ended()
        assert _filler_fds(str(vol.tmp)) == []
        mine = [
            n
            for n in os.listdir(vol.tmp / f"cache{i}" / "fillers")
            if n.startswith(f"{os.getpid()}-")
        ]
        assert mine == []  # (a worker's, left at its end, goes at the next sweep)
    assert filled, "no loader's fill fetched a file: nothing was tried"


@pytest.mark.multiprocess
def test_resume_mid_epoch_with_fill_ahead_serves_the_rest_exactly(make_volume):
    vol = make_volume(40)
    whole = vol.loader(batch_size=2, num_workers=2, timeout=60)
    expected = [s for b in whole for s in flatten(b)]
    first = vol.loader(
        batch_size=2, num_workers=2, fill_ahead=True, timeout=60, cache_dir=str(vol.tmp / "c1")
    )
    it = iter(first)
    head = [s for _ in range(7) for s in flatten(next(it))]
    state = first.state_dict()
    it.close()
    second = vol.loader(
        batch_size=2, num_workers=2, fill_ahead=True, timeout=60, cache_dir=str(vol.tmp / "c2")
    )
    second.load_state_dict(state)
    assert head + [s for b in second for s in flatten(b)] == expected


def test_a_bounded_cache_keeps_the_lead_within_the_ranks_share_of_a_quarter(
    make_volume, monkeypatch
):
    vol = make_volume(40)
    ds = vol.dataset(cache_limit=32)  # 40 files of 1-2 bytes, mean 1: 4 batches of 2

    def lead(hold: int = 0) -> int | None:
        fill = ds.fill_ahead(0, 0, batch_size=2, drop_last=True, lead=50, hold=hold)
        if fill is None:
            return None
        fill.close()
        return fill.lead

    assert lead() == 4
    assert lead(hold=4) is None, "a fill that can only evict what the workers hold"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks share the node's cache
    assert lead() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")  # not torchrun's: counted as one rank
    assert lead() == 4
    unbounded = vol.dataset(cache_dir=str(vol.tmp / "unbounded"))
    fill = unbounded.fill_ahead(0, 0, batch_size=2, drop_last=True, lead=50, hold=40)
    fill.close()
    assert fill.lead == 50


def test_a_fill_behind_the_loop_skips_what_the_loop_has_received(make_volume, tmp_path):
    vol = make_volume(12)
    ds = vol.dataset()
    cache = LocalCache(vol.store, str(tmp_path / "fill-cache"))
    batches = [np.arange(k, k + 3) for k in range(0, 12, 3)]
    entries = [ds.index[i] for i in range(12)]
    fill = FillAhead(cache, batches, ds.index.__getitem__, lead=1, threads=2)
    try:
        _wait_for(lambda: _cached(cache, entries) == 3)  # batch 0 only
        fill.advance(3)  # the loop has batches 0-2 already (the workers fetched them)
        _wait_for(lambda: _cached(cache, entries) == 6)
    finally:
        fill.close()
    assert [cache.contains(e) for e in entries] == [True] * 3 + [False] * 6 + [True] * 3


def test_the_fill_gives_up_after_failures_in_a_row(make_volume, tmp_path, caplog):
    vol = make_volume(12)
    ds = vol.dataset(shuffle=False)
    for entry in ds.index.entries:
        vol.store.delete(entry.key)  # the remote lost everything
    cache = LocalCache(vol.store, str(tmp_path / "fill-cache"))
    fill = FillAhead(cache, [np.arange(12)], ds.index.__getitem__, lead=1, threads=1)
    _wait_for(lambda: not any(t.is_alive() for t in fill._threads))
    assert fill.take_stats() == {"fill_failed": GIVE_UP_AFTER}
    assert "stopped for this epoch" in caplog.text


def test_on_by_default_only_where_workers_would_relay(make_volume, backend):
    vol = make_volume(8, backend)
    ds = vol.dataset()
    native = backend == "s3"  # the test S3 server is read natively (obstore)
    assert DataLoader(ds, batch_size=2, num_workers=2).fill_ahead is native
    spawned = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="spawn")
    assert spawned.fill_ahead is False  # spawn-started workers run obstore themselves
    assert DataLoader(ds, batch_size=2, num_workers=0).fill_ahead is False


@pytest.mark.multiprocess
def test_closing_a_superseded_iterator_leaves_the_newer_ones_fill(make_volume):
    vol = make_volume(48)
    loader = vol.loader(batch_size=2, num_workers=1, fill_ahead=True, timeout=60)
    old = iter(loader)
    next(old)
    new = iter(loader)
    next(new)
    current = loader._filler
    old.close()
    assert loader._filler is current is not None
    assert len([s for b in new for s in flatten(b)]) == 48 - 2
    assert loader._filler is None
