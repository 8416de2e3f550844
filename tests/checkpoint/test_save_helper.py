"""The save helper: a save's uploads from a process of its own, on real processes.

The durable tier here is the emulated remote over a local directory (its link is
node-wide, so the helper's uploads pay it as the training process's would) and the
real S3 server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import unbroken as ub
from tests.checkpoint.manager_util import assert_same, make_state, snapshot, train
from unbroken._util.procs import children
from unbroken.checkpoint.errors import SaveFailedError
from unbroken.checkpoint.save_helper import messages
from unbroken.checkpoint.save_helper.client import SaveHelper
from unbroken.storage.spec import store_spec

JOB = Path(__file__).with_name("save_helper_job.py")
FAST = {"latency": 0.0}
SLOW = {"latency": 0.0, "bandwidth": "4MB"}
"""A link on which the big state uploads for about 2 s."""

pytestmark = pytest.mark.multiprocess


_EARLIER: set[int] = set()
"""Helpers of managers an earlier test of this process left open (tests run in any
order, and several to a process): not this test's."""


@pytest.fixture(autouse=True)
def _helpers_left_by_earlier_tests():
    _EARLIER.clear()
    _EARLIER.update(helpers_of(os.getpid()))


def helpers_of(pid: int) -> list[int]:
    """The live save helper processes of ``pid`` this test started, from /proc (as ps
    sees them)."""
    found = []
    for child in children(pid):
        if child in _EARLIER:
            continue
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"unbroken.checkpoint.save_helper" in f.read():
                    found.append(child)
        except OSError:
            continue
    return found


def wait_for(predicate, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {predicate}")
        time.sleep(0.02)


def uploading(durable: Path, helper: int) -> bool:
    """Whether ``helper`` is writing a shard (its partial file, named with its pid) into
    ``durable``; the upload takes about 2 s from there."""
    return any(
        ".distcp.unbroken-tmp-" in f and f"-{helper}-" in f
        for _, _, files in os.walk(durable) for f in files
    )  # fmt: skip


def emulated(tmp_path: Path) -> str:
    return f"emulated::{tmp_path / 'durable'}"


def big_state() -> dict:
    """A state whose upload takes a while over a 4 MB/s link (about 2 s)."""
    state = make_state(0)
    state["big"] = torch.randn(2_000_000)
    return state


def restored(url: str, staging: Path, state: dict, **options) -> ub.CheckpointManager:
    mgr = ub.CheckpointManager(
        url, staging_dir=staging, storage_options={"latency": 0.0}, **options
    )
    mgr.restore(state)
    return mgr


def test_a_save_to_a_remote_uploads_from_the_helper_and_restores_bitwise(tmp_path):
    state = make_state(0)
    train(state, range(1, 3))
    mgr = ub.CheckpointManager(emulated(tmp_path), staging_dir=tmp_path / "s", storage_options=FAST)
    mgr.save(2, state)
    mgr.wait()
    helpers = helpers_of(os.getpid())
    assert len(helpers) == 1 and helpers[0] != os.getpid()
    assert mgr.stats.committed == 1
    expected = snapshot(state)
    mgr.close()
    wait_for(lambda: helpers_of(os.getpid()) == [])  # a clean close ends it

    other = make_state(7)
    restored(emulated(tmp_path), tmp_path / "elsewhere", other).close()
    assert_same(snapshot(other), expected)


def test_the_helper_killed_mid_upload_fails_that_save_and_the_next_commits(tmp_path):
    url = emulated(tmp_path)
    state = big_state()
    mgr = ub.CheckpointManager(url, staging_dir=tmp_path / "s", storage_options=SLOW)
    mgr.save(2, state)
    wait_for(lambda: helpers_of(os.getpid()))
    first = helpers_of(os.getpid())[0]
    wait_for(lambda: uploading(tmp_path / "durable", first))  # under load, it starts late
    os.kill(first, signal.SIGKILL)
    with pytest.raises(
        SaveFailedError, match=rf"save helper process \(pid {first}\) died.*SIGKILL"
    ):
        mgr.wait()
    assert mgr.stats.failed == 1 and mgr.stats.committed == 0

    train(state, range(3, 5))
    state["big"].add_(1)
    mgr.save(4, state)
    mgr.wait()
    assert mgr.stats.committed == 1
    assert helpers_of(os.getpid()) not in ([], [first])  # a new helper took the save
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    big = state["big"].clone()
    mgr.close()

    other = big_state()
    mgr = restored(url, tmp_path / "elsewhere", other)
    assert mgr.last_restore.step == 4
    mgr.close()
    assert torch.equal(other["big"], big)
    for k, v in other["model"].state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_a_sigterm_to_the_helper_is_left_to_its_trainer(tmp_path):
    """Slurm and torchrun signal every process of the job: the helper ignores it, so the
    preempted rank's last save still has its uploads."""
    state = make_state(0)
    mgr = ub.CheckpointManager(emulated(tmp_path), staging_dir=tmp_path / "s", storage_options=FAST)
    mgr.save(2, state)
    mgr.wait()
    (helper,) = helpers_of(os.getpid())
    os.kill(helper, signal.SIGTERM)
    os.kill(helper, signal.SIGINT)
    train(state, range(3, 5))
    mgr.save(4, state)
    mgr.wait()
    assert helpers_of(os.getpid()) == [helper]
    assert mgr.stats.committed == 2
    mgr.close()


def test_the_helper_ends_with_its_training_process(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(JOB), emulated(tmp_path), str(tmp_path / "s")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "committed"
        (helper,) = helpers_of(proc.pid)
        proc.kill()
        proc.wait(30)
        wait_for(lambda: not os.path.exists(f"/proc/{helper}"))
    finally:
        proc.kill()
        proc.wait()


def test_a_helper_that_cannot_start_leaves_the_uploads_to_this_process(
    tmp_path, monkeypatch, caplog
):
    """An interpreter that cannot run the helper (here one that exits at once) costs one
    warning: every save still commits, uploaded on this process's threads, and no later
    save tries another helper."""
    monkeypatch.setattr(sys, "executable", "/bin/false")
    state = make_state(0)
    url = emulated(tmp_path)
    mgr = ub.CheckpointManager(url, staging_dir=tmp_path / "s", storage_options=FAST)
    with caplog.at_level("WARNING", logger="unbroken"):
        for step in (2, 4):
            train(state, range(step - 1, step + 1))
            mgr.save(step, state)
            mgr.wait()
    assert mgr.stats.committed == 2 and mgr.stats.failed == 0
    warned = [r.getMessage() for r in caplog.records if "from now on" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert "ended as it started (exit status 1)" in warned[0]
    assert url.removeprefix("emulated::") in warned[0]
    expected = snapshot(state)
    mgr.close()
    other = make_state(3)
    restored(url, tmp_path / "elsewhere", other).close()
    assert_same(snapshot(other), expected)


def test_a_helper_killed_before_it_answered_is_replaced_once(tmp_path):
    """A kill says nothing about the next helper: the one killed before it answered its
    ``open`` is replaced, and the upload goes on from the new one."""
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_bytes(b"x" * 1000)
    helper = SaveHelper(store_spec(ub.storage.LocalStore(str(tmp_path / "d"))))
    try:
        first = helper.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        helper._greet()  # the window where poll() had not yet seen the death
        assert helper.started == 2 and helper.pid != first
        etags = helper.upload([(str(tmp_path / "f"), "k/f")], streams=1)
        assert set(etags) == {"k/f"}
        assert (tmp_path / "d" / "k" / "f").read_bytes() == b"x" * 1000
    finally:
        helper.close()


def test_save_helper_false_keeps_the_uploads_in_this_process(tmp_path):
    state = make_state(0)
    mgr = ub.CheckpointManager(
        emulated(tmp_path), staging_dir=tmp_path / "s", storage_options=FAST, save_helper=False
    )
    mgr.save(2, state)
    mgr.wait()
    assert mgr.stats.committed == 1
    assert helpers_of(os.getpid()) == []
    mgr.close()


def test_a_path_or_the_disk_tier_needs_no_helper(tmp_path):
    """A path's copy is the kernel's work, and a save on the disk tier sends from the
    host buffers: neither starts a process."""
    state = make_state(0)
    for url, memory_tier, options in (
        (tmp_path / "durable", None, None),
        (f"emulated::{tmp_path / 'remote'}", False, FAST),
    ):
        mgr = ub.CheckpointManager(
            url, staging_dir=tmp_path / f"s-{memory_tier}", memory_tier=memory_tier,
            storage_options=options,
        )  # fmt: skip
        mgr.save(2, state)
        mgr.wait()
        assert helpers_of(os.getpid()) == []
        mgr.close()


def test_save_helper_must_be_a_bool(tmp_path):
    with pytest.raises(ValueError, match="save_helper must be True or False, got 'yes'"):
        ub.CheckpointManager(tmp_path / "d", staging_dir=tmp_path / "s", save_helper="yes")


def test_a_save_on_s3_uploads_from_the_helper(tmp_path, s3_server):
    url, options = f"s3://{s3_server.new_root()}", s3_server.storage_options
    state = make_state(0)
    train(state, range(1, 3))
    mgr = ub.CheckpointManager(url, staging_dir=tmp_path / "s", storage_options=options)
    mgr.save(2, state)
    mgr.wait()
    assert len(helpers_of(os.getpid())) == 1
    expected = snapshot(state)
    mgr.close()

    other = make_state(3)
    mgr = ub.CheckpointManager(url, staging_dir=tmp_path / "t", storage_options=options)
    mgr.restore(other)
    mgr.close()
    assert_same(snapshot(other), expected)


def test_a_frame_that_is_not_an_object_or_too_large_is_refused():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"\x04\x00\x00\x00[1]\n")
        with pytest.raises(ValueError, match="holds list, not an object"):
            messages.receive(b)
        a.sendall((messages.MAX_FRAME + 1).to_bytes(4, "little"))
        with pytest.raises(ValueError, match="over"):
            messages.receive(b)
        a.close()
        with pytest.raises(messages.PeerGone):
            messages.receive(b)


def test_frames_cross_whole_from_threads():
    a, b = socket.socketpair()
    with a, b:
        big = {"files": [["/x" * 100, "k"] for _ in range(20_000)]}
        sender = threading.Thread(target=messages.send, args=(a, big))
        sender.start()
        assert messages.receive(b) == big
        sender.join()


def test_how_a_helper_ended_is_said_for_any_signal():
    from unbroken.checkpoint.save_helper.client import _how

    assert _how(0) == "exit status 0" and _how(3) == "exit status 3"
    assert _how(-signal.SIGKILL) == "killed by SIGKILL"
    assert _how(-40) == "killed by signal 40"  # a real-time signal: no name in the enum


def test_a_helper_that_cannot_be_started_again_is_unusable_not_an_os_error(tmp_path, monkeypatch):
    """After a death, no new process at all (out of pids, the interpreter gone): the
    upload says the helper is unusable, which hands the uploads to the rank's threads,
    instead of failing this save and every later one with a bare OSError."""
    from unbroken.checkpoint.save_helper.client import SaveHelperUnusable

    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_bytes(b"x")
    helper = SaveHelper(store_spec(ub.storage.LocalStore(str(tmp_path / "d"))))
    try:
        first = helper.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        helper._proc.wait()

        def no_process(*args, **kwargs):
            raise OSError(11, "Resource temporarily unavailable")

        monkeypatch.setattr(subprocess, "Popen", no_process)
        with pytest.raises(SaveHelperUnusable, match="no new save helper process"):
            helper.upload([(str(tmp_path / "f"), "k/f")], streams=1)
    finally:
        helper.close()
