"""A rank's connection to a peer server: send a replica, ask what it holds, read ranges."""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

from unbroken.checkpoint.save_helper.messages import PeerGone, receive, send

CONNECT_SECONDS = 10.0
"""How long a connection to a peer may take: a node that is gone must not hold up a
restore that can read the durable tier instead."""
MAX_IDLE = 16
"""Idle connections kept per peer (a restore reads with up to 8 threads)."""
IO_SECONDS = 30.0
"""How long one read or write on an open connection may wait for progress: a peer
frozen or cut off is given up after this (a restore then reads the durable tier)."""


class PeerRefused(ConnectionError):
    """The peer server would not talk to us (a token of another job or attempt)."""


class PeerError(Exception):
    """The peer answered a request with an error (a file it does not hold, no room)."""

    def __init__(self, message: str, *, missing: bool = False, no_room: bool = False) -> None:
        super().__init__(message)
        self.missing = missing
        self.no_room = no_room


class PeerClient:
    """Requests to one peer server, from any thread: each takes an idle connection or
    makes one, and gives it back once its answer is read in full."""

    def __init__(self, address: tuple[str, int], token: str) -> None:
        self.address = (str(address[0]), int(address[1]))
        self.token = token
        self._idle: list[socket.socket] = []
        self._closed = False
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.address
        return f"peer://[{host}]:{port}" if ":" in host else f"peer://{host}:{port}"

    def have(self, step: int) -> list[dict[str, Any]]:
        """The committed copies of ``step`` the peer holds (manifest text, file sizes)."""
        return self._ask({"op": "have", "step": step})["copies"]

    def read(self, step: int, name: str, start: int = 0, end: int | None = None) -> bytearray:
        """Bytes [start, end) of file ``name`` of ``step`` (clamped to the file)."""
        size = self._size(step, name, start, end)
        out = bytearray(size)
        got = self.read_into(step, name, start, start + size, memoryview(out))
        return out if got == size else out[:got]

    def read_into(self, step: int, name: str, start: int, end: int, out: memoryview) -> int:
        """Bytes [start, end) of file ``name`` of ``step`` straight into ``out`` (the
        target tensor's own memory on a restore: no buffer between); how many came (fewer
        only where the file is shorter)."""
        sock = self._take()
        try:
            answer = self._request(sock, {"op": "read", "step": step, "name": name,
                                          "start": start, "end": end})  # fmt: skip
            size = int(answer["size"])
            if size > len(out):
                raise ValueError(f"{self.url} sends {size} bytes for {len(out)}")
            got = 0
            while got < size:
                n = sock.recv_into(out[got:size])
                if n == 0:
                    raise PeerGone(f"{self.url} closed the connection while sending {name}")
                got += n
        except PeerError:
            self._give(sock)  # an answer in full: the stream is in step
            raise
        except (OSError, ValueError) as e:
            sock.close()
            raise ConnectionError(f"reading {name} from {self.url}: {e}") from e
        self._give(sock)
        return got

    def _size(self, step: int, name: str, start: int, end: int | None) -> int:
        if end is not None:
            return max(0, end - start)
        files = {}
        for copy in self.have(step):
            files.update(copy["files"])
        if name not in files:
            raise PeerError(f"{name} is not here", missing=True)
        return max(0, int(files[name]) - start)

    def put_file(self, rank: int, step: int, name: str, path: str, crc: int) -> None:
        """Send one file of ``rank``'s copy of ``step``; it lands only if its bytes match
        ``crc`` on arrival. ``sendfile``: no copy through this process, no GIL held."""
        sock = self._take()
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self._request(sock, {"op": "put", "rank": rank, "step": step, "name": name,
                                     "size": size, "crc32c": crc})  # fmt: skip
                if size and sock.sendfile(f, 0, size) != size:
                    raise PeerGone(f"{path} shrank while it was sent")
            answer = receive(sock)
        except (OSError, ValueError) as e:
            sock.close()
            raise ConnectionError(f"sending {name} to {self.url}: {e}") from e
        except PeerError:
            self._give(sock)
            raise
        self._give(sock)
        self._check(answer)

    def drain(self, seconds: float) -> bool:
        """Ask the server to answer once no replica is arriving (up to ``seconds``)."""
        return bool(self._ask({"op": "drain", "seconds": seconds})["idle"])

    def seal(self, rank: int, step: int, manifest: bytes) -> None:
        self._ask({"op": "seal", "rank": rank, "step": step, "manifest": manifest.decode()})

    def close(self) -> None:
        """Close the idle connections; one in use closes when its request ends."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._closed = True
        for sock in idle:
            sock.close()

    # -- private ---------------------------------------------------------------------

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        sock = self._take()
        try:
            send(sock, request)
            answer = receive(sock)
        except (OSError, ValueError) as e:
            sock.close()
            raise ConnectionError(f"{request['op']} at {self.url}: {e}") from e
        self._give(sock)
        return self._check(answer)

    def _request(self, sock: socket.socket, request: dict[str, Any]) -> dict[str, Any]:
        send(sock, request)
        return self._check(receive(sock))

    @staticmethod
    def _check(answer: dict[str, Any]) -> dict[str, Any]:
        if answer.get("ok"):
            return answer
        raise PeerError(
            str(answer.get("error", "no reason given")),
            missing=bool(answer.get("missing")),
            no_room=bool(answer.get("no_room")),
        )

    def _take(self) -> socket.socket:
        """An idle connection, or a new one (shown the token)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        try:
            sock = socket.create_connection(self.address, timeout=CONNECT_SECONDS)
        except OSError as e:
            raise ConnectionError(f"cannot reach the peer server at {self.url}: {e}") from e
        sock.settimeout(IO_SECONDS)
        try:
            send(sock, {"op": "hello", "token": self.token})
            answer = receive(sock)
        except (OSError, ValueError) as e:
            sock.close()
            raise ConnectionError(f"the peer server at {self.url} did not answer: {e}") from e
        if not answer.get("ok"):
            sock.close()
            raise PeerRefused(f"the peer server at {self.url} refused us: {answer.get('error')}")
        return sock

    def _give(self, sock: socket.socket) -> None:
        """A connection whose last request was answered in full goes back for reuse (one
        that failed midway is closed instead: its stream may be out of step)."""
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE:
                self._idle.append(sock)
                return
        sock.close()
