"""A helper started from a background thread while another thread forks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from unbroken._util.spawn import start_module

SPAWNS = 40  # without the guard about one spawn in eight met a fork: all 40 missing ~0.4%


def test_a_helper_started_while_the_main_thread_forks_does_not_wait_for_the_forked_child():
    """Popen waits on a pipe until exec; a DataLoader worker forked at that moment kept
    its write end and Popen waited for the worker's exit (a rank hung at its first save
    after a restart, in the crash harness)."""
    done = threading.Event()
    failures: list[BaseException] = []

    def spawn_helpers() -> None:
        try:
            for _ in range(SPAWNS):
                proc = start_module("unbroken._util.spawn", stdout=subprocess.DEVNULL)
                assert proc.wait(timeout=120) == 0
        except BaseException as e:
            failures.append(e)
        finally:
            done.set()

    spawner = threading.Thread(target=spawn_helpers)
    spawner.start()
    workers = []  # stand-ins for DataLoader workers: alive until the end of the test
    deadline = time.monotonic() + 120
    try:
        while not done.wait(0.005) and time.monotonic() < deadline:
            pid = os.fork()
            if pid == 0:
                time.sleep(600)
                os._exit(0)
            workers.append(pid)
        assert done.is_set(), "a spawn waited for a forked child to exit"
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        spawner.join()
    assert not failures, failures
    assert workers, "nothing forked during the spawns: the test proved nothing"


def test_preexec_fn_is_refused_and_the_handed_socket_closed():
    """preexec_fn runs the at-fork hooks inside the guarded block: a self-deadlock."""
    ours, theirs = socket.socketpair()
    try:
        with pytest.raises(TypeError, match="preexec_fn"):
            start_module("unbroken._util.spawn", handed=[theirs], preexec_fn=os.setpgrp)
        assert theirs.fileno() == -1, "the handed socket was left open"
    finally:
        ours.close()


def test_ctrl_c_while_a_fork_waits_for_a_spawn_keeps_the_guard(monkeypatch):
    """A signal handler raising in the fork hook's wait: the fork still waits for the
    spawn, the guard stays the spawner's, and the interrupt is reported (CPython reports
    a hook's exception; it never reaches the caller of fork())."""
    from unbroken._util import spawn

    in_block, spawner_done, reported = threading.Event(), [], []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.exc_type))

    def hold_a_spawn_open() -> None:
        with spawn._forks_wait():
            in_block.set()
            time.sleep(0.5)
            spawner_done.append(time.monotonic())

    def ctrl_c(signum, frame):
        raise KeyboardInterrupt

    spawner = threading.Thread(target=hold_a_spawn_open)
    previous = signal.signal(signal.SIGALRM, ctrl_c)
    spawner.start()
    try:
        in_block.wait()
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        forked_at = time.monotonic()
        os.waitpid(pid, 0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        spawner.join()
    assert spawner_done and spawner_done[0] <= forked_at, "the fork did not wait"
    assert not spawn._spawning.locked(), "the guard was left held"
    assert reported == [KeyboardInterrupt]
