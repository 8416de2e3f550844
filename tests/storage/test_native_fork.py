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
                    and bytes(store.read_range("big", 7, 9 << 10)) == blob[7 : 9 << 10]
                    and [e.key for e in store.list()] == ["big"]
                )
                code = 0 if ok else 4
        finally:
            os._exit(code)
    assert _exit_code(pid) == 0


_OWNER_EXITS = """
import os, sys, time
import unbroken as ub
url, options, out = sys.argv[1], eval(sys.argv[2]), sys.argv[3]
store = ub.open_store(url, **options)
store.write_bytes("k", b"from the owner")
if os.fork() == 0:
    import signal
    signal.alarm(90)       # a hung child must not outlive the test run
    store.read_bytes("k")  # through the owner's relay: a connection is open
    while os.getppid() != 1 and os.path.exists(out + ".owner"):
        time.sleep(0.05)   # until the owner has exited
    time.sleep(0.2)
    try:
        result = repr(store.read_bytes("k"))
    except Exception as exc:
        result = "error: " + repr(exc)
    with open(out + ".tmp", "w") as f:
        f.write(result)
    os.replace(out + ".tmp", out)
    os._exit(0)
os.unlink(out + ".owner")
"""


@pytest.mark.s3
@pytest.mark.multiprocess
def test_a_child_outliving_the_store_owner_falls_back_instead_of_hanging(s3_server, tmp_path):
    """The owner (a fresh process, as the relay's owner) exits; its child's next read
    must be answered (through fsspec), not wait forever on a socket nobody serves."""
    import subprocess
    import sys

    out = str(tmp_path / "result")
    open(out + ".owner", "w").close()
    url = f"s3://{s3_server.new_root()}"
    subprocess.run(
        [sys.executable, "-c", _OWNER_EXITS, url, repr(s3_server.storage_options), out],
        check=True, timeout=120,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not os.path.exists(out):
        if time.monotonic() > deadline:
            pytest.fail("the child of the exited owner hung on the store")
        time.sleep(0.1)
    with open(out) as f:
        assert f.read() == repr(b"from the owner")


@pytest.mark.s3
@pytest.mark.multiprocess
def test_a_child_and_its_own_fork_never_share_a_relay_connection(s3_server):
    """A worker that forks again (multiprocessing inside a DataLoader worker): its child
    inherits the worker's open connection to the relay, and sharing it would hand one
    process the other's bytes. Each must read its own objects, intact, side by side."""
    store = ub.open_store(f"s3://{s3_server.new_root()}", **s3_server.storage_options)
    blobs = {f"k{i}": os.urandom(50_000 + i) for i in range(2)}
    for key, blob in blobs.items():
        store.write_bytes(key, blob)
    child = os.fork()
    if child == 0:
        code = 9
        try:
            import signal

            signal.alarm(60)
            store.read_bytes("k0")  # this thread's connection to the relay is now open
            grandchild = os.fork()
            key = "k1" if grandchild == 0 else "k0"
            ok = all(store.read_bytes(key) == blobs[key] for _ in range(40))
            if grandchild == 0:
                os._exit(0 if ok else 5)
            code = 0 if ok and _exit_code(grandchild) == 0 else 6
        finally:
            os._exit(code)
    assert _exit_code(child) == 0


@pytest.mark.s3
@pytest.mark.multiprocess
def test_a_dropped_copy_of_the_store_does_not_cut_its_children_off(s3_server):
    """A copy pickled and dropped in the owner (a DataLoader pickles its dataset) must
    leave the original the one its forked children are served by. obstore's own option
    names: a child that fell back to s3fs could not make its client at all."""
    import gc
    import pickle

    url = f"s3://{s3_server.new_root()}"
    store = ub.open_store(url, **s3_server.native_storage_options)
    store.write_bytes("k", b"kept")
    copy = pickle.loads(pickle.dumps(store))
    del copy
    gc.collect()
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if store.read_bytes("k") == b"kept" else 3)
        except BaseException:
            os._exit(4)
    assert _exit_code(pid) == 0
