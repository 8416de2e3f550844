"""One JSON message per frame on a stream socket: a 4-byte length, then UTF-8 JSON.

No pickle crosses between the training process and its save helper: a frame is plain
data, and a frame that does not parse is an error, never code.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

_LENGTH = struct.Struct("<I")
MAX_FRAME = 64 << 20
"""The largest frame either side accepts (a message lists files, never their bytes)."""


class PeerGone(ConnectionError):
    """The other end closed the socket or died: no more frames will come."""


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ValueError(f"a save helper message of {len(data)} bytes is over {MAX_FRAME}")
    try:
        sock.sendall(_LENGTH.pack(len(data)) + data)
    except (BrokenPipeError, ConnectionResetError) as e:
        raise PeerGone(str(e)) from e


def receive(sock: socket.socket, *, max_frame: int = MAX_FRAME) -> dict[str, Any]:
    """The next message; PeerGone at the end of the stream. ``max_frame``: what a side
    that listens on a network accepts before it knows who speaks is much less."""
    (length,) = _LENGTH.unpack(_read_exactly(sock, _LENGTH.size))
    if length > max_frame:
        raise ValueError(f"a frame of {length} bytes is over {max_frame}")
    message = json.loads(_read_exactly(sock, length))
    if not isinstance(message, dict):
        raise ValueError(f"a frame holds {type(message).__name__}, not an object")
    return message


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except ConnectionResetError as e:
            raise PeerGone(str(e)) from e
        if not chunk:
            raise PeerGone("the other end closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
