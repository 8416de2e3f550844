"""The peer server as its own process: replicas in, ranges out, strangers refused."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import crc32c
import pytest

from unbroken.checkpoint.format.manifest import step_dir
from unbroken.checkpoint.peers import replica_files
from unbroken.checkpoint.peers.client import PeerClient, PeerError, PeerRefused
from unbroken.checkpoint.peers.network import _start_server

TOKEN = "a" * 64


@contextlib.contextmanager
def serving(root):
    """A peer server over a new tier directory under ``root``: (tier, address, process)."""
    tier = root / "tier"
    tier.mkdir()
    proc, address = _start_server(str(tier), "127.0.0.1", TOKEN)
    try:
        yield tier, address, proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def server(tmp_path):
    with serving(tmp_path) as running:
        yield running


def write(path, data: bytes) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return crc32c.crc32c(data)


def test_a_replica_goes_in_whole_and_comes_back_by_range(tmp_path, server):
    tier, address, _ = server
    data = os.urandom(3 << 20)
    src = tmp_path / "src"
    files = {"__1_0.distcp": data, "rng/rank-00001.json": b"{}", ".metadata": b"meta"}
    client = PeerClient(address, TOKEN)
    for name, body in files.items():
        client.put_file(1, 7, name, str(src / name), write(src / name, body))
    assert client.have(7) == []  # not sealed yet: not counted
    client.seal(1, 7, b'{"step": 7}')
    (copy,) = client.have(7)
    assert copy["manifest"] == '{"step": 7}'
    assert copy["files"] == {n: len(b) for n, b in files.items()}
    assert bytes(client.read(7, "__1_0.distcp", 1000, 2 << 20)) == data[1000 : 2 << 20]
    assert bytes(client.read(7, "rng/rank-00001.json")) == b"{}"
    with pytest.raises(PeerError) as missing:
        client.read(7, "__5_0.distcp")
    assert missing.value.missing
    # a newer step sealed replaces the older one, manifest first
    client.put_file(1, 8, "__1_0.distcp", str(src / "__1_0.distcp"), crc32c.crc32c(data))
    client.seal(1, 8, b'{"step": 8}')
    assert client.have(7) == [] and len(client.have(8)) == 1
    assert not (tier / "replicas" / "rank-00001" / step_dir(7)).exists()
    client.close()


def test_bytes_that_do_not_match_their_checksum_are_refused(tmp_path, server):
    tier, address, _ = server
    client = PeerClient(address, TOKEN)
    crc = write(tmp_path / "f", b"payload")
    with pytest.raises(PeerError, match="crc32c"):
        client.put_file(0, 3, "__0_0.distcp", str(tmp_path / "f"), crc ^ 1)
    folder = tier / "replicas" / "rank-00000" / step_dir(3)
    assert os.listdir(folder) == []  # no temp file left either
    client.put_file(0, 3, "__0_0.distcp", str(tmp_path / "f"), crc)  # the connection goes on
    assert os.listdir(folder) == ["__0_0.distcp"]


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/b/c", "x.incoming", ""])
def test_names_that_leave_the_step_directory_are_refused(tmp_path, server, name):
    _, address, _ = server
    client = PeerClient(address, TOKEN)
    crc = write(tmp_path / "f", b"x")
    with pytest.raises(PeerError):
        client.put_file(0, 3, name, str(tmp_path / "f"), crc)
    with pytest.raises(PeerError):
        client.read(3, name)
    assert not (tmp_path / "escape").exists()


def test_a_forged_token_is_refused_and_told_nothing(tmp_path, server):
    _, address, _ = server
    good = PeerClient(address, TOKEN)
    write(tmp_path / "f", b"secret")
    good.put_file(0, 3, "__0_0.distcp", str(tmp_path / "f"), crc32c.crc32c(b"secret"))
    good.seal(0, 3, b"{}")
    for token in ("b" * 64, TOKEN[:-1], ""):
        forged = PeerClient(address, token)
        with pytest.raises(PeerRefused, match="not a peer of the job"):
            forged.have(3)
        with pytest.raises(PeerRefused):
            forged.read(3, "__0_0.distcp")
    assert bytes(good.read(3, "__0_0.distcp")) == b"secret"


def test_the_server_dies_with_the_rank_that_started_it(tmp_path):
    """Started by a process that is then SIGKILLed: the server ends too."""
    tier = tmp_path / "tier"
    tier.mkdir()
    code = (
        "import sys, time; from unbroken.checkpoint.peers.network import _start_server; "
        f"p, a = _start_server({str(tier)!r}, '127.0.0.1', 'x' * 64); "
        "print(p.pid, flush=True); time.sleep(600)"
    )
    rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    server_pid = int(rank.stdout.readline())
    os.kill(rank.pid, signal.SIGKILL)
    rank.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(server_pid):
        time.sleep(0.05)
    assert not _alive(server_pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_replica_room_is_refused_on_a_full_tmpfs(tmp_path, small_tmpfs):
    with serving(small_tmpfs) as (tier, address, _):
        client = PeerClient(address, TOKEN)
        big = os.urandom(60 << 20)  # past the reserve of a 64 MiB tmpfs
        crc = write(tmp_path / "big", big)
        with pytest.raises(PeerError) as refused:
            client.put_file(2, 5, "__2_0.distcp", str(tmp_path / "big"), crc)
        assert refused.value.no_room
        small = write(tmp_path / "small", b"fits")
        client.put_file(2, 5, "__2_0.distcp", str(tmp_path / "small"), small)
    assert replica_files.drop_all(str(tier)) > 0
    assert not (tier / "replicas").exists()


def test_nonsense_from_a_stranger_ends_only_its_connection(tmp_path, server):
    import socket
    import struct

    _, address, proc = server
    for junk in (struct.pack("<I", 1 << 30), b"GET / HTTP/1.1\r\n\r\n", b"\x05\x00\x00\x00{nope"):
        with socket.create_connection(address, timeout=5) as s:
            s.sendall(junk)
            try:
                s.shutdown(socket.SHUT_WR)
                answer = s.recv(100)
            except OSError as e:  # closed with our bytes unread, perhaps
                assert not isinstance(e, TimeoutError)  # before our shutdown
                answer = b""
            assert answer == b""  # closed without an answer
    assert proc.poll() is None
    write(tmp_path / "f", b"ok")
    PeerClient(address, TOKEN).put_file(
        0, 1, "__0_0.distcp", str(tmp_path / "f"), crc32c.crc32c(b"ok")
    )


def test_a_peer_that_dies_mid_read_hands_the_rest_to_the_durable_tier(tmp_path, server):
    """PeerStore: what the peer sent is kept, what it did not comes from the fallback,
    byte for byte, and the peer is not asked again."""
    from unbroken.checkpoint.peers.peer_store import PeerStore
    from unbroken.storage import LocalStore

    _, address, proc = server
    data = os.urandom(4 << 20)
    name, key = "__1_0.distcp", f"{step_dir(7)}/__1_0.distcp"
    crc = write(tmp_path / "durable" / key, data)  # the durable tier holds the same file
    client = PeerClient(address, TOKEN)
    client.put_file(1, 7, name, str(tmp_path / "durable" / key), crc)
    client.seal(1, 7, b"{}")
    store = PeerStore(PeerClient(address, TOKEN), LocalStore(str(tmp_path / "durable")))
    out = bytearray(len(data))
    view = memoryview(out)
    assert store.read_range_into(key, 0, 1 << 20, view[: 1 << 20]) == 1 << 20
    assert store.gone is None
    proc.kill()
    proc.wait()
    assert store.read_range_into(key, 1 << 20, len(data), view[1 << 20 :]) == len(data) - (1 << 20)
    assert store.gone is not None and bytes(out) == data
    assert bytes(store.read_range(key, 5, 17)) == data[5:17]  # from the durable tier now


def test_a_peer_store_lists_and_sizes_one_steps_files(tmp_path, server):
    from unbroken.checkpoint.peers.peer_store import PeerStore
    from unbroken.storage import LocalStore, StoreError

    _, address, _ = server
    client = PeerClient(address, TOKEN)
    for name, body in {"__1_0.distcp": b"abc", "rng/rank-00001.json": b"{}"}.items():
        client.put_file(1, 7, name, str(tmp_path / name), write(tmp_path / name, body))
    client.seal(1, 7, b"{}")
    store = PeerStore(PeerClient(address, TOKEN), LocalStore(str(tmp_path / "durable")))
    step = step_dir(7)
    assert [(e.key, e.size) for e in store.list(step)] == [
        (f"{step}/__1_0.distcp", 3),
        (f"{step}/rng/rank-00001.json", 2),
    ]
    assert [e.key for e in store.list(f"{step}/rng")] == [f"{step}/rng/rank-00001.json"]
    assert store.info(f"{step}/__1_0.distcp").size == 3
    assert bytes(store.read_bytes(f"{step}/__1_0.distcp")) == b"abc"
    with pytest.raises(FileNotFoundError):
        store.info(f"{step}/__9_0.distcp")
    with pytest.raises(StoreError, match="list one step's files"):
        store.list("")
    with pytest.raises(PermissionError, match="read-only"):
        store.write_bytes(f"{step}/x", b"no")


def _raw_put(address, size: int):
    """A put whose bytes are not sent yet: the server has said go and waits for them."""
    import socket

    from unbroken.checkpoint.save_helper.messages import receive, send

    sock = socket.create_connection(address, timeout=10)
    send(sock, {"op": "hello", "token": TOKEN})
    assert receive(sock)["ok"]
    send(sock, {"op": "put", "rank": 3, "step": 1, "name": "__3_0.distcp", "size": size,
                "crc32c": 0})  # fmt: skip
    assert receive(sock)["ok"]  # go
    return sock


def test_room_counts_the_bytes_still_arriving(tmp_path, small_tmpfs):
    """Two ranks' puts at once cannot both take the room one of them leaves."""
    with serving(small_tmpfs) as (_, address, _):
        pending = _raw_put(address, 20 << 20)  # 64 MiB tmpfs keeps 32 free: 20 promised
        crc = write(tmp_path / "f", os.urandom(20 << 20))
        client = PeerClient(address, TOKEN)
        with pytest.raises(PeerError) as refused:
            client.put_file(2, 5, "__2_0.distcp", str(tmp_path / "f"), crc)
        assert refused.value.no_room
        assert client.drain(0.2) is False  # a replica is still arriving
        pending.close()  # its sender gives up: its room comes back
        assert client.drain(5) is True
        client.put_file(2, 5, "__2_0.distcp", str(tmp_path / "f"), crc)


def test_a_seal_carries_a_manifest_of_any_size_and_stale_unsealed_copies_go(tmp_path, server):
    tier, address, _ = server
    client = PeerClient(address, TOKEN)
    crc = write(tmp_path / "f", b"x")
    client.put_file(1, 4, "__1_0.distcp", str(tmp_path / "f"), crc)  # never sealed
    client.put_file(1, 5, "__1_0.distcp", str(tmp_path / "f"), crc)
    folder = tier / "replicas" / "rank-00001"
    assert sorted(os.listdir(folder)) == [step_dir(5)]  # step 4's unsealed copy went
    manifest = b'{"values": "' + b"v" * (3 << 20) + b'"}'  # plain values make it large
    client.seal(1, 5, manifest)
    assert (folder / step_dir(5) / "manifest.json").read_bytes() == manifest


def test_a_link_in_the_tier_is_not_followed(tmp_path, server):
    tier, address, _ = server
    (tmp_path / "secret").write_bytes(b"SECRET")
    step = tier / step_dir(2)
    step.mkdir()
    (step / "manifest.json").write_bytes(b"{}")
    os.symlink(tmp_path / "secret", step / "__0_0.distcp")
    with pytest.raises(PeerError) as refused:
        PeerClient(address, TOKEN).read(2, "__0_0.distcp", 0, 6)
    assert refused.value.missing


def test_a_drain_waits_for_a_replica_between_its_files(tmp_path, server):
    """A sender goes file by file: between two files nothing arrives, yet the replica is
    not whole. A node that ends waits for its seal (a preemption's last replica)."""
    _, address, _ = server
    client = PeerClient(address, TOKEN)
    client.put_file(1, 9, "__1_0.distcp", str(tmp_path / "f"), write(tmp_path / "f", b"x"))
    assert client.drain(0.3) is False
    client.seal(1, 9, b"{}")
    assert client.drain(5) is True


def test_a_replica_broken_off_by_a_clean_close_is_not_called_a_failure(tmp_path, server, caplog):
    """A clean end: this rank closes its replicator as the peer node's server ends too,
    under a replica still going. Nothing failed (the job and its tiers end), so nothing
    is logged as a failure."""
    from unbroken.checkpoint.peers.replicator import Replica, Replicator

    _, address, proc = server
    folder = tmp_path / "own" / step_dir(3)
    crc = write(folder / "__0_0.distcp", os.urandom(256 << 20))
    done: list[tuple[int, int, bool]] = []
    replicator = Replicator(0, [PeerClient(address, TOKEN)], on_done=lambda *a: done.append(a))
    caplog.set_level("DEBUG", logger="unbroken.checkpoint.peers.replicator")
    replicator.submit(Replica(3, str(folder), {"__0_0.distcp": crc}, b"{}"))
    deadline = time.monotonic() + 30
    while not replicator._busy and time.monotonic() < deadline:  # the send is under way
        time.sleep(0.001)
    replicator.close(timeout=0.0)
    proc.kill()  # the peer's server ends with its job
    replicator._thread.join(30)
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert done == [] and "broken off by close" in caplog.text
