"""A native (obstore) store made before a fork still works in the forked child."""

from __future__ import annotations

import os
import time

import pytest

import unbroken as ub


@pytest.mark.s3
@pytest.mark.multiprocess
def test_a_forked_child_reads_and_writes_through_a_native_store(s3_server):
    store = ub.open_store(f"s3://{s3_server.new_root()}", **s3_server.storage_options)
    store.write_bytes("parent", b"from the parent")
    pid = os.fork()
    if pid == 0:  # the child: obstore's runtime threads are gone here
        try:
            ok = store.read_bytes("parent") == b"from the parent"
            store.write_bytes("child", b"from the child")
            os._exit(0 if ok else 3)
        except BaseException:
            os._exit(4)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the store")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert store.read_bytes("child") == b"from the child"  # the parent's store still works
