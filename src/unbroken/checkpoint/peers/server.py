"""The node's peer server: takes its peers' replicas, serves what the node holds.

``python -m unbroken.checkpoint.peers.server``, started by the node's lowest rank
(``network.py``), which writes its settings as one JSON line on stdin (the token never
appears on a command line or in the environment) and reads back the port it listens on.
It ends when that rank ends (parent-death signal); SIGTERM and SIGINT are the ranks' to
act on. One thread per connection; the first frame of each must carry the job's token,
compared in constant time, or the connection is refused and closed. Requests:

- ``have {step}``: the committed copies of the step held here (``replica_files.inventory``)
- ``read {step, name, start, end}``: a byte range of one of their files, by ``sendfile``
- ``put {rank, step, name, size, crc32c}``: answered "go" (or refused: no room, a bad
  name), then the bytes, checked against the crc32c before they are renamed into place
- ``seal {rank, step, manifest}``: the replica is whole; older ones of that rank go
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import crc32c

from unbroken._util.procs import die_with_parent
from unbroken.checkpoint.peers import replica_files
from unbroken.checkpoint.save_helper.messages import MAX_FRAME, PeerGone, receive, send

log = logging.getLogger("unbroken.peers")

MAX_HELLO = 4 << 10
"""The largest frame read before the token is checked: a stranger cannot make the
server hold more."""
MAX_REQUEST = MAX_FRAME
"""The largest request frame from a peer of the job (a seal carries the manifest, which
holds every file's record and the state's plain values); file bytes never ride in one."""
MAX_STRANGERS = 32
"""Connections that have not shown the token yet, at most: more are closed at once."""
MAX_RANK = 1 << 24
HELLO_SECONDS = 10.0
"""A connection must show the token this soon, or it is closed (strangers hold no thread)."""
IDLE_SECONDS = 300.0
"""A connection that says nothing for this long is closed."""
CHUNK = 4 << 20


class Server:
    """Serves one node's memory tier ``tier`` on ``host`` to holders of ``token``."""

    def __init__(self, tier: str, host: str, token: str, port: int = 0) -> None:
        if not token:
            raise ValueError("a peer server needs a token")
        self.tier = tier
        self.token = token.encode()
        self.sock = socket.create_server((host, port), family=_family(host), backlog=64)
        self.address = self.sock.getsockname()[:2]
        self._told_full = False
        self._strangers = threading.BoundedSemaphore(MAX_STRANGERS)
        self._lock = threading.Condition()
        self._promised = 0
        """Bytes of puts accepted and still arriving: room is checked with them counted."""
        self._receiving = 0
        self._unsealed: set[tuple[int, int]] = set()
        """(rank, step) replicas begun and not sealed yet: a drain waits for them too (a
        sender goes file by file, so between two files nothing is arriving)."""

    def serve_forever(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            if not self._strangers.acquire(blocking=False):
                conn.close()  # too many connections that have not shown the token
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(HELLO_SECONDS)
            try:
                try:
                    hello = receive(conn, max_frame=MAX_HELLO)
                finally:
                    self._strangers.release()
                token = str(hello.get("token", "")).encode()
                if hello.get("op") != "hello" or not hmac.compare_digest(token, self.token):
                    send(conn, {"ok": False, "error": "refused: this is not a peer of the job"})
                    return
                send(conn, {"ok": True, "pid": os.getpid()})
                conn.settimeout(IDLE_SECONDS)
                while True:
                    self._answer(conn, receive(conn, max_frame=MAX_REQUEST))
            except PeerGone:
                return  # the other side left
            except (OSError, ValueError) as e:  # nonsense, or a fault here: said, then closed
                log.warning("peer server: a connection ends on %s: %s", type(e).__name__, e)

    def _answer(self, conn: socket.socket, req: dict[str, Any]) -> None:
        op = req.get("op")
        try:
            if op == "have":
                copies = replica_files.inventory(self.tier, _int(req, "step"))
                send(conn, {"ok": True, "copies": copies})
            elif op == "read":
                self._read(conn, req)
            elif op == "put":
                self._put(conn, req)
            elif op == "drain":
                idle = self._drain(float(req.get("seconds", 0.0)))
                send(conn, {"ok": True, "idle": idle})
            elif op == "seal":
                manifest = str(req["manifest"]).encode()
                rank, step = _rank(req), _int(req, "step")
                replica_files.seal(self.tier, rank, step, manifest)
                with self._lock:
                    self._unsealed.discard((rank, step))
                    self._lock.notify_all()
                send(conn, {"ok": True})
            else:
                send(conn, {"ok": False, "error": f"unknown request {op!r}"})
        except (ValueError, KeyError, TypeError, FileNotFoundError) as e:  # the request's fault
            send(conn, {"ok": False, "error": f"{type(e).__name__}: {e}"})

    def _read(self, conn: socket.socket, req: dict[str, Any]) -> None:
        path = replica_files.find(self.tier, _int(req, "step"), str(req.get("name")))
        if path is None:
            send(conn, {"ok": False, "missing": True, "error": f"{req.get('name')} is not here"})
            return
        try:  # a link is never followed: what is served was written here
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except (FileNotFoundError, OSError) as e:  # gone since (a newer replica), or a link
            send(conn, {"ok": False, "missing": True, "error": f"{req.get('name')}: {e}"})
            return
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = min(_int(req, "start"), size)
            end = size if req.get("end") is None else min(_int(req, "end"), size)
            count = max(0, end - start)
            send(conn, {"ok": True, "size": count, "file_size": size})
            if count and conn.sendfile(f, start, count) != count:  # waits out a full buffer
                raise PeerGone("the file shrank while it was sent")

    def _put(self, conn: socket.socket, req: dict[str, Any]) -> None:
        rank, step, size = _rank(req), _int(req, "step"), _int(req, "size")
        with self._lock:
            try:
                tmp, final = replica_files.incoming(
                    self.tier, rank, step, str(req.get("name")), size, promised=self._promised
                )
            except replica_files.NoRoom as e:
                if not self._told_full:
                    self._told_full = True
                    log.warning("peer server: cannot hold a peer's replica: %s", e)
                send(conn, {"ok": False, "no_room": True, "error": str(e)})
                return
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            self._unsealed.add((rank, step))
            self._promised += size
            self._receiving += 1
        try:
            self._receive(conn, req, fd, tmp, final, size)
        except BaseException:
            with self._lock:  # its sender is gone: no seal will come for it
                self._unsealed.discard((rank, step))
            raise
        finally:
            with self._lock:
                self._promised -= size
                self._receiving -= 1
                self._lock.notify_all()

    def _receive(
        self, conn: socket.socket, req: dict[str, Any], fd: int, tmp: str, final: str, size: int
    ) -> None:
        send(conn, {"ok": True})  # go
        crc, left = 0, size
        buf = memoryview(bytearray(min(CHUNK, max(size, 1))))
        try:
            while left:
                n = conn.recv_into(buf, min(left, len(buf)))
                if n == 0:
                    raise PeerGone("the sender left in the middle of a file")
                crc = crc32c.crc32c(buf[:n], crc)
                view = buf[:n]
                while view:
                    view = view[os.write(fd, view) :]
                left -= n
        except BaseException as e:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, OSError) and not isinstance(e, PeerGone):
                raise PeerGone(f"receiving {req.get('name')}: {e}") from e
            raise
        os.close(fd)
        if crc != _int(req, "crc32c"):
            os.unlink(tmp)
            send(conn, {"ok": False, "error": f"crc32c {crc:#010x} of {req.get('name')} "
                        f"does not match {_int(req, 'crc32c'):#010x}"})  # fmt: skip
            return
        try:
            os.replace(tmp, final)
        except FileNotFoundError as e:  # its directory went (the node's own save needed room)
            send(conn, {"ok": False, "no_room": True, "error": f"dropped meanwhile: {e}"})
            return
        send(conn, {"ok": True})

    def _drain(self, seconds: float) -> bool:
        """Wait until every replica begun is sealed and none is arriving (up to
        ``seconds``): a node that ends lets its peers' last replicas land first. True if
        idle."""
        deadline = time.monotonic() + max(0.0, min(seconds, 60.0))
        with self._lock:
            while self._receiving or self._unsealed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True


def _rank(req: dict[str, Any]) -> int:
    rank = _int(req, "rank")
    if rank >= MAX_RANK:
        raise ValueError(f"rank {rank} is past {MAX_RANK}")
    return rank


def _int(req: dict[str, Any], key: str) -> int:
    value = req.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{key} must be an int >= 0, got {value!r}")
    return value


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def main() -> None:
    settings = json.loads(sys.stdin.readline())
    die_with_parent(int(settings["parent"]))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="[unbroken peer server] %(message)s")
    server = Server(settings["tier"], settings["host"], settings["token"])
    print(json.dumps({"port": server.address[1], "pid": os.getpid()}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
