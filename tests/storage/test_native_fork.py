"""A native (obstore) store made before a fork still works in the forked child."""

from __future__ import annotations

import os
import time

import pytest

import unbroken as ub


def _exit_code(pid: int) -> int:
    """The forked child's exit code; fails the test if it hangs (as obstore calls did)."""
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the store")
        time.sleep(0.05)
    return os.waitstatus_to_exitcode(done[1])


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
    assert _exit_code(pid) == 0
    assert store.read_bytes("child") == b"from the child"  # the parent's store still works


@pytest.mark.s3
@pytest.mark.multiprocess
def test_a_forked_child_gets_the_errors_and_large_objects_the_parent_would(s3_server):
    """Through the parent's relay: a missing key is the same error, a ranged read the same
    bytes, an object larger than a socket buffer whole, and a listing the same entries."""
    store = ub.open_store(f"s3://{s3_server.new_root()}", **s3_server.storage_options)
    blob = os.urandom(3 << 20)
    store.write_bytes("big", blob)
    with pytest.raises(ub.ObjectNotFoundError) as in_parent:
        store.read_bytes("absent")
    pid = os.fork()
    if pid == 0:
        code = 9
        try:
            try:
                store.read_bytes("absent")
                code = 3
            except ub.ObjectNotFoundError as exc:
                same_error = (
                    type(exc) is type(in_parent.value)
                    and str(exc).split(" (")[0] == str(in_parent.value).split(" (")[0]
                )
                ok = (
                    same_error
                    and store.read_bytes("big") == blob
                    and store.read_bytes("big", 5, 1 << 20) == blob[5 : 1 << 20]
                    and [e.key for e in store.list()] == ["big"]
                )
                code = 0 if ok else 4
        finally:
            os._exit(code)
    assert _exit_code(pid) == 0
