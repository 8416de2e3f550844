"""A DataLoader worker stuck inside ``fork()`` is killed and the workers forked again.

The children here hang where CPython's gh-112275 hangs them: in ``os.fork()``, before any
of torch's worker code runs (an at-fork hook of this module sleeps in the child once it
is armed). The loader must notice, serve the same batches as an undisturbed loader, and
leave no stuck process behind.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time

import pytest

import unbroken.data.worker_births as worker_births
from tests.data.helpers import flatten
from unbroken._util.procs import pid_alive

_armed: dict[str, str] = {}
"""mode ("once", "always", "busy", "die") and the marker file, while a test arms the hook."""


def _in_child_after_fork() -> None:
    mode, marker = _armed.get("mode"), _armed.get("marker")
    if mode is None or marker is None:
        return
    if mode != "always":
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # only the first child forked while armed
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    if mode == "die":
        os._exit(3)
    if mode == "busy":  # slow, but running: must be waited for
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            pass
        return
    time.sleep(3600)  # asleep, no CPU: as a child holding gh-112275's lock


os.register_at_fork(after_in_child=_in_child_after_fork)


@pytest.fixture
def arm(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_births, "STILL_SECONDS", 0.3)
    marker = tmp_path / "forked"

    def arm_(mode: str):
        _armed.update(mode=mode, marker=str(marker))
        return marker

    yield arm_
    _armed.clear()


def epoch(loader) -> list:
    return [flatten(b) for b in loader]


@pytest.mark.parametrize("persistent", [True, False])
def test_a_worker_stuck_in_fork_is_replaced_and_the_batches_are_the_same(
    make_volume, arm, caplog, persistent
):
    vol = make_volume(24)
    reference = vol.loader(batch_size=2, num_workers=2, seed=3, persistent_workers=persistent)
    expected = [epoch(reference), epoch(reference)]
    loader = vol.loader(batch_size=2, num_workers=2, seed=3, persistent_workers=persistent)
    first = epoch(loader)
    # Persistent workers were forked once, in the first epoch: arm before it instead.
    if persistent:
        loader = vol.loader(batch_size=2, num_workers=2, seed=3, persistent_workers=True)
    marker = arm("once")
    with caplog.at_level(logging.WARNING, logger="unbroken.data.loader"):
        served = [epoch(loader), epoch(loader)] if persistent else [first, epoch(loader)]
    assert served == expected
    stuck_pid = int(marker.read_text())
    assert "has not started after fork()" in caplog.text and f"pid {stuck_pid}" in caplog.text
    assert not pid_alive(stuck_pid)  # killed and reaped


def test_workers_that_never_start_end_in_an_error_naming_them(make_volume, arm):
    vol = make_volume(12)
    loader = vol.loader(batch_size=2, num_workers=1)
    arm("always")
    never = r"worker 0 \(pid \d+\) never started after fork\(\), 4 times"
    with pytest.raises(RuntimeError, match=never):
        next(iter(loader))


def _write_marker(folder: str, worker_id: int) -> None:
    open(os.path.join(folder, f"init-{worker_id}"), "w").close()


def test_a_worker_init_fn_set_after_construction_still_runs_after_the_mark(
    make_volume, arm, caplog, tmp_path
):
    vol = make_volume(12)
    expected = epoch(vol.loader(batch_size=2, num_workers=2, persistent_workers=False))
    loader = vol.loader(batch_size=2, num_workers=2, persistent_workers=False)
    loader.worker_init_fn = functools.partial(_write_marker, str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="unbroken.data.loader"):
        assert epoch(loader) == expected
    assert "fork()" not in caplog.text  # marked born, not taken for stuck
    assert sorted(p.name for p in tmp_path.glob("init-*")) == ["init-0", "init-1"]


def test_after_the_error_a_persistent_loader_forks_afresh(make_volume, arm):
    vol = make_volume(12)
    loader = vol.loader(batch_size=2, num_workers=1, persistent_workers=True)
    arm("always")
    with pytest.raises(RuntimeError, match="never started after fork"):
        next(iter(loader))
    _armed.clear()
    assert len(epoch(loader)) == 6


def test_a_slow_running_start_is_waited_for_not_killed(make_volume, arm, caplog):
    vol = make_volume(12)
    expected = epoch(vol.loader(batch_size=2, num_workers=1))
    loader = vol.loader(batch_size=2, num_workers=1)
    arm("busy")
    with caplog.at_level(logging.WARNING, logger="unbroken.data.loader"):
        assert epoch(loader) == expected
    assert "fork()" not in caplog.text


def test_the_fill_runs_while_the_workers_are_being_born(make_volume, arm):
    """The training process fills the cache from the fork on: a fill started only once
    every worker was born left the first ones to fetch alone meanwhile (CI: a fill that
    fetched nothing at all)."""
    vol = make_volume(48)
    loader = vol.loader(batch_size=2, num_workers=2, fill_ahead=True, timeout=60)
    cache = loader.volume._per_process().cache
    arm("busy")  # worker 0 runs 1.5 s before its mark
    fetched_before_birth: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            births, filler = loader._births, loader._filler
            unborn = births is not None and int(births.marks[0]) != loader._generation
            if filler is not None and unborn:
                fetched_before_birth.append(cache.stats.misses)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert len(epoch(loader)) == 24
    finally:
        stop.set()
        watcher.join()
    assert max(fetched_before_birth, default=0) > 0, "the fill waited for the births"


def test_a_worker_dead_before_it_started_is_torchs_error_not_a_wait(make_volume, arm):
    vol = make_volume(12)
    loader = vol.loader(batch_size=2, num_workers=1)
    arm("die")
    with pytest.raises(RuntimeError, match=r"exited unexpectedly|killed by signal"):
        epoch(loader)


def test_a_spawned_worker_is_not_waited_for(make_volume):
    """The birth marks guard fork only: a spawned worker starts a fresh interpreter."""
    vol = make_volume(12)
    loader = vol.loader(batch_size=2, num_workers=1, multiprocessing_context="spawn")
    assert loader._births is None
    assert len(epoch(loader)) == 6
