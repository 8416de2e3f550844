"""The save helper's side: open the durable store, upload what the trainer names.

It lives exactly as long as the training process that started it: the kernel kills it
when that process dies (``PR_SET_PDEATHSIG``), and it leaves when the socket closes.
SIGTERM and SIGINT are the training process's to act on (a preempted job's last save
needs its helper), so a launcher that signals the whole process group does not end it.
"""

from __future__ import annotations

import os
import signal
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from unbroken._util.priority import lower_thread_priority
from unbroken._util.procs import die_with_parent
from unbroken._util.thread_names import name_native_thread
from unbroken.checkpoint.save_helper import messages
from unbroken.storage.base import Store
from unbroken.storage.spec import open_spec


def serve(fd: int, parent: int) -> None:
    """Answer the trainer's requests on the socket ``fd`` until it closes."""
    die_with_parent(parent)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    try:
        hello = messages.receive(sock)
        store = open_spec(hello["store"])
        lower = bool(hello.get("lower_priority", True))
        if lower:
            lower_thread_priority()
        messages.send(sock, {"ok": True, "pid": os.getpid()})
    except messages.PeerGone:  # the trainer closed before its first save
        return
    except Exception as e:  # a store it cannot open: the trainer says why, in the save
        messages.send(sock, {"ok": False, "error": f"{type(e).__name__}: {e}"})
        return
    while True:
        try:
            request = messages.receive(sock)
        except messages.PeerGone:
            return
        if request.get("op") == "close":
            return
        messages.send(sock, _answer(store, request, lower))


def _answer(store: Store, request: dict[str, Any], lower: bool) -> dict[str, Any]:
    op = request.get("op")
    try:
        if op == "upload":
            return {"ok": True, "etags": _upload(store, request, lower)}
        raise ValueError(f"unknown save helper request {op!r}")
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def _upload(store: Store, request: dict[str, Any], lower: bool) -> dict[str, str | None]:
    """Upload each ``[path, key]``; each key's etag right after its upload (the commit
    checks that no other writer replaced the file since)."""
    files = [(str(path), str(key)) for path, key in request["files"]]
    etags: dict[str, str | None] = {}

    def one(path: str, key: str) -> None:
        store.upload(path, key)
        etags[key] = store.info(key).etag

    def start() -> None:
        name_native_thread()
        if lower:
            lower_thread_priority()

    streams = max(1, min(int(request.get("streams", 4)), len(files)))
    with ThreadPoolExecutor(
        streams, thread_name_prefix="unbroken-upload", initializer=start
    ) as pool:
        for future in [pool.submit(one, path, key) for path, key in files]:
            future.result()
    return etags
