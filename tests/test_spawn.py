"""A helper started from a background thread while another thread forks."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

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
